"""ElasticArena: the parts one elastic KV pool owns, assembled in exactly one place.

An arena = a `BlockLedger` over a `PagePool` over the `PageSpace` of a `KvSpace`, plus the
`StepFence` that gates unmapping, the optional `FaultInjector`, and the pool's entry in
`kvcached.stats()`. Engine adapters open one per KV cache (vLLM's `ElasticBlockPool` holds
one; the serving probes use one directly) and the core never needs to know which engine
it serves. Building these parts anywhere else would let two assemblies drift apart (which
config, which fence, whether premapped pages are adopted), so nothing else does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvcached.config import KvcachedConfig
from kvcached.errors import ConfigError
from kvcached.faults import FaultInjector
from kvcached.fence import StepFence
from kvcached.ledger import BlockLedger
from kvcached.pages import PagePool
from kvcached.policies import PoolPolicies
from kvcached.space import KvSpace
from kvcached.stats import register, unregister


@dataclass(eq=False)
class ElasticArena:
    """One elastic pool's parts. Build it with `open`; tear it down with `close`.

    Invariants: ``pool.fence is fence``, ``pool.faults is faults``, ``pool.config is
    config``, ``ledger.pool is pool``; ``config.page_size == space.geometry.page_size``;
    while open, ``stats_key`` names ``ledger`` in `kvcached.stats()`. Once closed, no page
    is mapped, ``stats_key`` is empty and the arena is not reopened.
    """

    config: KvcachedConfig
    space: KvSpace
    fence: StepFence
    faults: FaultInjector | None
    pool: PagePool
    ledger: BlockLedger
    stats_key: str = field(default="", init=False)
    closed: bool = field(default=False, init=False)

    @classmethod
    def open(
        cls,
        space: KvSpace,
        config: KvcachedConfig | None = None,
        *,
        name: str = "kv",
        fence: StepFence | None = None,
        pinned: Iterable[int] = (),
        faults: FaultInjector | None = None,
    ) -> ElasticArena:
        """Assemble a pool over ``space``; all or nothing.

        ``config``: default the config the space was published with (`KvSpace.config`); one
        of the two must exist, and its page size must be the geometry's. ``fence``: default a
        plain `StepFence` (vLLM's adapter passes an `EngineStepFence`, which skips in-flight
        steps that touch no KV).
        ``faults``: default the config's fault plan, never the environment again (no plan:
        no injector). The space's ``premapped`` pages are adopted first, so ``pinned``
        blocks on them (vLLM's null block) need no new map; other pinned blocks are mapped
        here. If this raises, nothing was mapped or registered and premapped pages are
        still the publisher's (the pinned hold is all or nothing).
        """
        if config is None:
            config = space.config
        if config is None:
            raise ConfigError("no kvcached config: the KV space carries none and none was given")
        if config.page_size != space.geometry.page_size:
            raise ConfigError(
                f"KVCACHED_PAGE_SIZE={config.page_size} disagrees with the page size the KV space "
                f"was planned with ({space.geometry.page_size})"
            )
        fence = fence if fence is not None else StepFence()
        if faults is None:
            # An empty path means "no plan": only the config decides.
            faults = FaultInjector.from_env(config.fault_plan or "")
        policies = PoolPolicies.from_config(config, space.limiter)
        pool = PagePool(space.page_space(), config, fence=fence, faults=faults, policies=policies)
        pool.adopt(space.premapped)
        ledger = BlockLedger(space.geometry.num_blocks, space.geometry.blocks_per_page, pool, pinned)
        arena = cls(config, space, fence, faults, pool, ledger)
        arena.stats_key = register(name, ledger)
        return arena

    def close(self) -> None:
        """Leave the stats registry and unmap every page. Idempotent, silent.

        Only for a stopped engine: views over the space stay reserved but unmapped.
        """
        if self.closed:
            return
        self.closed = True
        unregister(self.stats_key)
        self.stats_key = ""
        try:
            self.pool.close()
        finally:
            self._leave_budget()

    def abandon(self) -> None:
        """Leave the stats registry without unmapping: whoever held the pages is gone."""
        self.closed = True
        unregister(self.stats_key)
        self.stats_key = ""
        self._leave_budget()

    def _leave_budget(self) -> None:
        """The engine's rows in its devices' budget records go (the ranks' slots are theirs)."""
        self.pool.policies.limit.close()

