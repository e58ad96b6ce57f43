"""Served engines, as the soak, the sharing run and the serving benchmarks drive them:
`vllm serve` processes on loopback and their process trees (``server.py``), and how a token
difference from native is read, by retrial on native (``retrial.py``)."""

from conformance.serving.server import (
    ACTIVE_LINE,
    SERVED_NAME,
    Server,
    ServerError,
    ServerSpec,
    exit_on_sigterm,
    open_descriptors,
    serving,
    settled_descriptors,
    start_server,
    with_tokenizer,
)

__all__ = [
    "ACTIVE_LINE",
    "SERVED_NAME",
    "Server",
    "ServerError",
    "ServerSpec",
    "exit_on_sigterm",
    "open_descriptors",
    "serving",
    "settled_descriptors",
    "start_server",
    "with_tokenizer",
]
