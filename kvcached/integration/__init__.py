"""Engine integrations. Each subpackage is the only place that imports its engine."""
