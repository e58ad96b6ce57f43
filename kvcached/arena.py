"""ElasticArena: the parts one elastic KV pool owns, built in one place.

An arena = a `BlockLedger` over a `PagePool` over a `PageSpace`, plus the `StepFence`
that gates unmapping and the optional `FaultInjector`. Engine adapters build one per
KV cache; the core never needs to know which engine it serves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvcached.config import KvcachedConfig
from kvcached.faults import FaultInjector
from kvcached.fence import StepFence
from kvcached.ledger import BlockLedger
from kvcached.pages import PagePool
from kvcached.space import KvSpace
from kvcached.stats import register, unregister


@dataclass
class ElasticArena:
    config: KvcachedConfig
    space: KvSpace
    fence: StepFence
    faults: FaultInjector | None
    pool: PagePool
    ledger: BlockLedger
    stats_key: str = field(default="")

    @classmethod
    def open(
        cls,
        space: KvSpace,
        config: KvcachedConfig,
        *,
        name: str = "kv",
        pinned: Iterable[int] = (),
        faults: FaultInjector | None = None,
    ) -> ElasticArena:
        fence = StepFence()
        if faults is None:
            faults = FaultInjector.from_env(config.fault_plan) if config.fault_plan else None
        pool = PagePool(space.page_space(), config, fence=fence, faults=faults)
        ledger = BlockLedger(space.geometry.num_blocks, space.geometry.blocks_per_page, pool, pinned)
        arena = cls(config, space, fence, faults, pool, ledger)
        arena.stats_key = register(name, ledger)
        return arena

    def close(self) -> None:
        """Unmap every page and leave the stats registry. Idempotent."""
        if self.stats_key:
            unregister(self.stats_key)
            self.stats_key = ""
        self.pool.close()


def make_budget(config: KvcachedConfig):  # -> kvcached._vmm.Budget | None
    """The CPU physical budget described by the config (None: no budget of our own)."""
    if config.budget_bytes is None and not config.budget_path:
        return None
    from kvcached import _vmm

    limit = config.budget_bytes if config.budget_bytes is not None else 0
    return _vmm.Budget(limit, config.budget_path or "")

