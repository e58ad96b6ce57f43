"""The churn soak (`nox -s soak`, ``python -m conformance.soak``): `vllm serve` under random
traffic for a bounded time, its memory and descriptors against an idle baseline, and every
completed request replayed on native (``run.py``); its report (``report.py``)."""
