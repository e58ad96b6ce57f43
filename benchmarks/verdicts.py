"""The benchmarks' verdict rule: a re-export of the project's one rule,
`conformance.reporting.verdicts.verdict` (see there), which the GPU probes use too.

Imported by the ``bench_*.py`` scripts, which run with this folder on ``sys.path`` and the
project installed (``serving_probes`` ships in its wheel).
"""

from __future__ import annotations

from conformance.reporting import RULE, verdict

__all__ = ["RULE", "verdict"]
