"""The sharing run (`nox -s sharing`, ``python -m conformance.sharing``): two `vllm serve`
engines under one budget record, their limits moved while they serve (``run.py``); its
report (``report.py``)."""
