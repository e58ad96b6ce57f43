"""Served engines, as the soak, the sharing run and the serving benchmarks drive them:
`vllm serve` processes on loopback and their process trees (``server.py``), and how a token
difference from native is read, by retrial on native (``retrial.py``)."""
