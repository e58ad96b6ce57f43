"""What runs inside an engine process: the case runner, the engine handle and the
harness-only instrumentation. Nothing here is imported by the orchestrating parent
except the result model it writes (``conformance.results``)."""
