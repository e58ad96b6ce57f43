"""kvcached: an elastic KV cache for vLLM V1.

The KV cache is a large *virtual* address range; physical pages are mapped into it only
while blocks use them and are given back when idle, so several engines can share one
accelerator's memory.

Importing this package is cheap and never imports vLLM or torch. The vLLM integration is a
plugin (``kvcached.integration.vllm``) that vLLM loads itself when ``KVCACHED_ENABLE=1``.

What this process's kvcached did is public here: `stats` (per elastic pool: mapped bytes,
blocks, map counters) and `copy_stats` (the worker's validated block copies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from kvcached.copy import CopyStats

__version__ = "0.1.0"


def copy_stats() -> CopyStats:
    """This process's block-copy counters: a frozen `kvcached.copy.CopyStats` snapshot.

    ``batches`` (non-empty copy batches), ``block_copies`` (``(src, dst)`` pairs) and
    ``runs_copied`` (byte runs copied, once per shared backing), counted by the worker-side
    copy helper since the process started (or since ``kvcached.copy.reset_copy_stats``).
    Module-wide, not per pool: take differences around what you measure. The copy module
    is imported on first call, so ``import kvcached`` stays cheap.
    """
    from kvcached.copy import copy_stats as _copy_stats

    return _copy_stats()

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
    "copy_stats",
    "stats",
]
