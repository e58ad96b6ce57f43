"""kvcached: an elastic KV cache for vLLM V1.

The KV cache is a large *virtual* address range; physical pages are mapped into it only
while blocks use them and are given back when idle, so several engines can share one
accelerator's memory.

Importing this package is cheap and never imports vLLM or torch. The vLLM integration is a
plugin (``kvcached.integration.vllm``) that vLLM loads itself when ``KVCACHED_ENABLE=1``.
"""

from kvcached.errors import (
    ConfigError,
    CopyValidationError,
    DriverError,
    InjectedFault,
    IntegrationError,
    InvariantError,
    KvcachedError,
    PhysicalMemoryExhausted,
)
from kvcached.stats import PoolStats, stats

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CopyValidationError",
    "DriverError",
    "InjectedFault",
    "IntegrationError",
    "InvariantError",
    "KvcachedError",
    "PhysicalMemoryExhausted",
    "PoolStats",
    "__version__",
    "stats",
]
