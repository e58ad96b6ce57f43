"""`ElasticBlockPool`: vLLM's `BlockPool` with physical memory owned by kvcached.

The subclass keeps *all* of vLLM's prefix-cache metadata: the hash map, alias keys,
partial entries and their promotion, ``move_block_hashes``, KV events, metrics and
``reset_prefix_cache`` are the inherited methods, unchanged. kvcached adds the physical
side: which block ids are handed out (page-aware), which kv pages are mapped, a cap on
free-but-cached blocks, and giving pages back.

Block states (every non-null block is in exactly one)::

    LIVE      ref_cnt > 0                               ledger: held
    CACHED    ref_cnt == 0, hashed                      ledger: held  (bytes must survive)
    STRANDED  ref_cnt == 0, unhashed, but in the hashed  ledger: held  (page kept mapped)
              region of the free queue (it lost its hash while free: ``evict_blocks``)
    CLEAN     ref_cnt == 0, unhashed, in the leading     ledger: free  (may be unbacked)
              region of the free queue

The null block is pinned (held forever). The ledger's free set is exactly the CLEAN set.

Free-queue invariant (vLLM 0.26-0.29 keep it: with caching on, native ``free_blocks``
queues unhashed blocks first and hashed ones last): the queue is
``[all CLEAN blocks][CACHED and STRANDED blocks in native order]``. Native
``get_new_blocks(n)`` pops the first ``n``; this pool takes ``n`` CLEAN blocks chosen
page-aware when ``n <= #CLEAN``, else all CLEAN blocks and then the next ``n - #CLEAN``
positionally. Hits, misses, evictions, ref counts, free counts and events are therefore
those of the native pool; only the identities of CLEAN blocks differ.

Physical promise: `get_num_free_blocks` reports only what `get_new_blocks` can hand out
without mapping: the native count once every CLEAN block sits on a mapped page, else the
number of CLEAN blocks on mapped pages. Admission (the scheduler seam) notes its demand
first, so the next `get_num_free_blocks` maps pages for it in one batch and, only when
physical memory is short, turns free CACHED/STRANDED blocks into backed CLEAN ones
(*reclaim*: evicting cache is better than failing admission forever while idle cache
holds the memory). Exhaustion therefore shows up as a smaller free count, i.e. a
scheduling miss; `get_new_blocks` only maps when called without admission, and raises
`PhysicalMemoryExhausted` before changing anything if it cannot.

Cap: ``KvcachedConfig.max_cached_blocks`` (default 10% of the pool; -1: none, vLLM's own
caching) bounds the free blocks that keep memory mapped, CACHED and STRANDED alike, *once the
engine goes idle*: `collect` with ``busy=False`` (the step that leaves no request unfinished)
cleans the excess, page by page (pages whose held blocks are all idle first, fewest first),
evicting through ``_maybe_evict_cached_block`` so events and metrics stay native. While requests
run, free cached blocks stay as native keeps them: a busy engine serves the prefix hits native
serves (measured on the GPU, 12-05: a cap applied on every free served 7-16% of prompt tokens
from the cache against native's 17-43%), and memory it needs comes from reclaim (above) or, over
its limit, from `collect`. Memory other engines may want goes back when the engine idles, or
when a limit (``kvctl``, or a device over its global budget) makes it give pages back. The cap,
reclaim and the limit are the only places this pool departs from native eviction order, by
design. A served engine may wait before applying the cap (``KvcachedConfig.idle_grace_s``, the
CUDA default 1 s, `set_idle_post`): the idle step then arms a `kvcached.idle.IdleGrace`, the
next busy step cancels it, and if none comes the cap and the give-back run on the engine's
thread while it idles. Served traffic runs out of requests for milliseconds between waves, and
each such gap cost the cache its prefix hits (reports/gpu/serving/run-12-07).

Fault injection (`kvcached.faults`): the admission check runs site ``"admission"`` or
``"cow_admission"``; an injected failure maps and reclaims nothing and reports fewer
free blocks than the demand, so that admission attempt is a scheduling miss.

Pages whose blocks are all CLEAN go back to the `PagePool`, ticketed by the step fence
(a `kvcached.fence.EngineStepFence`: steps that touch no KV hold no ticket); they are unmapped by
`collect` once every step that may still touch them has executed.

Start and teardown. The physical parts (config, fence, fault injector, `PagePool`,
`BlockLedger`, stats entry) are one `kvcached.arena.ElasticArena`, assembled there and
nowhere else; the config is the one the worker resolved and carried with the space.
vLLM builds the pool before anything can reach the workers, so an engine's pool is built
*detached* and attached once (`attach`) by the EngineCore seam
(``kvcached.integration.vllm.engine``), before the first step, to a space whose pages
are mapped on every rank. The worker maps the null block's kv page when it allocates the
KV tensors (warm-up runs may read block 0 before this pool exists); the arena adopts that
page and pins the null block on it. `close` closes the arena: every page unmapped on every
rank, the stats entry gone; ``EngineCore.shutdown`` calls it while the executor still runs,
and a finalizer calls it when a pool that was never shut down is collected. `abandon`
closes the books without unmapping, when the ranks are gone. Both are idempotent and log
nothing.

``take_events``, ``get_cached_block``, ``cache_full_blocks``, ``cache_partial_block``,
``move_block_hashes``, ``emit_cached_block_events`` and ``evict_blocks`` are vLLM's,
inherited unchanged (``evict_blocks`` drops hashes through the removal hook below, which
turns a free CACHED block into a STRANDED one in place).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock

from kvcached.arena import ElasticArena
from kvcached.config import KvcachedConfig
from kvcached.errors import InjectedFault, IntegrationError, InvariantError
from kvcached.faults import FaultInjector
from kvcached.fence import EngineStepFence, StepFence
from kvcached.idle import IdleGrace, Post
from kvcached.ledger import BlockLedger
from kvcached.pages import PagePool
from kvcached.space import KvSpace

ADMISSION_SITES = frozenset({"admission", "cow_admission"})


@dataclass(frozen=True, slots=True)
class _Demand:
    """Blocks one admission check asks for, and the prefix hits it is about to touch."""

    blocks: int
    protected: frozenset[int]


#: A check that allocates nothing and touches no prefix hit (a decode step inside a block),
#: or a running request's that free blocks on mapped pages cover (`admit_running`, asked by
#: the scheduler seam): the next free count is the native one, at no cost.
NO_DEMAND = _Demand(0, frozenset())


#: Context of one ``allocate_slots`` call (set by the scheduler seam): watermark, reserved
#: blocks, fault site, and whether the request is new (not running). A plain tuple: it is
#: built for every request that needs admission work.
_Admission = tuple[int, int, str, bool]


class ElasticBlockPool(BlockPool):
    """vLLM ``BlockPool`` whose blocks live on elastically mapped kv pages.

    The first five parameters are the native constructor's, passed to it unchanged.
    ``kv_space``: the KV space to map into now (tests, probes); an engine's pool is built
    without one and attached later (`attach`).
    The physical side is one `ElasticArena` over that space (``arena``), opened with the
    null block pinned: ``config`` defaults to the config the worker carried with the
    space (resolved once, by the worker), ``faults`` to that config's fault plan and
    ``fence`` to a fresh `EngineStepFence`. ``config``, ``fence``, ``faults``,
    ``page_pool`` and ``ledger`` are the arena's parts, as plain attributes.
    """

    # kvcached's own state lives in slots, so the instance ``__dict__`` holds only vLLM's
    # attributes. With all of them in the dict (32 on vLLM 0.28) CPython 3.11 exceeds its
    # 30 shared keys and materializes the dict: every ``pool.x`` and ``pool.method()`` in
    # vLLM's code and ours then loses its specialized fast path (measured on the decode
    # path: ~0.1-0.2 us per running request per step, spread over vLLM's own functions).
    __slots__ = (
        "_admission", "_aliases", "_cached", "_cap", "_closed_detached", "_config", "_demand",
        "_faults", "_fence", "_finalizer", "_idle_grace", "_logical_view", "_name", "_running_block_sizes",
        "_step_tokens", "_stranded", "arena", "config", "faults", "fence", "ledger", "page_pool", "running_gate",
        "running_open",
    )

    config: KvcachedConfig
    fence: StepFence
    faults: FaultInjector | None
    page_pool: PagePool
    ledger: BlockLedger

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
        *,
        kv_space: KvSpace | None = None,
        config: KvcachedConfig | None = None,
        faults: FaultInjector | None = None,
        fence: StepFence | None = None,
        name: str = "vllm",
    ) -> None:
        super().__init__(
            num_gpu_blocks=num_gpu_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=metrics_collector,
        )
        self._name, self._config, self._faults, self._fence = name, config, faults, fence
        self._cached: set[int] = set()
        self._stranded: set[int] = set()
        #: vLLM's alias keys by block id (0.28: ``cached_block_hashes_by_block``), where present.
        self._aliases: dict[int, object] = getattr(self, "cached_block_hashes_by_block", {})
        self._demand: _Demand | None = None
        self._cap = -1  # the cap in blocks (`KvcachedConfig.cached_cap`), set at attach
        self._admission: _Admission | None = None
        self._running_block_sizes: tuple[int, ...] = ()
        self._step_tokens = 0  # `set_step_tokens`; 0: unknown
        #: ``(groups, smallest block size)`` while `admit_running` may say yes, else None.
        self.running_gate: tuple[int, int] | None = None
        #: True while one ``schedule`` call runs with the gate open to every running request
        #: (`begin_schedule`).
        self.running_open = False
        self._logical_view = False
        self._idle_grace: IdleGrace | None = None  # `set_idle_post`
        self.arena: ElasticArena | None = None
        self._finalizer: weakref.finalize | None = None
        self._closed_detached = False
        if kv_space is not None:
            self.attach(kv_space)

    def attach(self, space: KvSpace) -> None:
        """Give the pool its physical side: one `ElasticArena` over ``space``.

        An engine's pool is built detached (vLLM builds it before anything can reach the
        workers) and attached once, by ``kvcached.integration.vllm.engine.connect``, before
        the first step. The null block's page was mapped by the worker before warm-up
        (``space.premapped``): the arena adopts it, then pins the null block on it.
        """
        if self.arena is not None or self.closed:
            raise InvariantError("the elastic pool is already attached (or closed)")
        if space.geometry.num_blocks != self.num_gpu_blocks:
            raise IntegrationError(
                f"KV space holds {space.geometry.num_blocks} blocks but the pool has {self.num_gpu_blocks}"
            )
        arena = ElasticArena.open(
            space,
            self._config,
            name=self._name,
            fence=self._fence if self._fence is not None else EngineStepFence(),
            pinned=(self.null_block.block_id,),
            faults=self._faults,
        )
        self.arena = arena
        self.config = arena.config
        self._cap = arena.config.cached_cap(self.num_gpu_blocks)
        self.fence = arena.fence
        self.faults = arena.faults
        self.page_pool = arena.pool
        self.ledger = arena.ledger
        self._set_running_gate()
        self._set_step_pages()
        # Runs at most once: from `close`, or when a pool that was never closed is collected.
        # It holds the arena, never the pool (a reference to the pool would keep it alive).
        # Not at interpreter exit, where the process returns its memory anyway.
        self._finalizer = weakref.finalize(self, arena.close)
        self._finalizer.atexit = False

    @property
    def attached(self) -> bool:
        return self.arena is not None

    # ---- admission (driven by the scheduler seam) ------------------------------------
    @property
    def running_block_sizes(self) -> tuple[int, ...]:
        """Allocation block size of each KV cache group when every group is full attention
        (set by the engine seam at attach), else empty: see `admit_running`."""
        return self._running_block_sizes

    @running_block_sizes.setter
    def running_block_sizes(self, sizes: tuple[int, ...]) -> None:
        self._running_block_sizes = tuple(sizes)
        self._set_running_gate()
        self._set_step_pages()

    def set_step_tokens(self, tokens: int) -> None:
        """The most tokens one step schedules (vLLM's ``max_num_batched_tokens``; 0: unknown):
        while the engine is busy, its page reserve may refill up to the kv pages such a step's
        new blocks can fill (`kvcached.policies.ReservePolicy.step_pages`), each group's
        blocks plus one for a boundary, and one page more for blocks that straddle pages.
        Only where every group is full attention (`running_block_sizes`): there a step's new
        blocks are bounded by its tokens. Elsewhere the reserve keeps its watermarks.

        The pages follow this and `running_block_sizes` whichever is set first, before the
        pool is attached or after."""
        if tokens < 0:
            raise ValueError(f"step tokens must be >= 0, got {tokens}")
        self._step_tokens = tokens
        self._set_step_pages()

    def _set_step_pages(self) -> None:
        if self.arena is None:
            return  # `attach` sets them
        pages, tokens = 0, self._step_tokens
        if self._running_block_sizes and tokens > 0:
            blocks = sum(-(-tokens // size) + 1 for size in self._running_block_sizes)
            pages = min(-(-blocks // self.ledger.blocks_per_page) + 1, self.page_pool.space.num_kv_pages)
        self.page_pool.set_step_pages(pages)

    def _set_running_gate(self) -> None:
        sizes = self._running_block_sizes
        faults = getattr(self, "faults", None)  # the arena's, once attached
        self.running_gate = (len(sizes), min(sizes)) if sizes and faults is None else None

    def admit_running(self, num_tokens: int) -> bool:
        """Admission of a running request's ``num_tokens`` new tokens (lookahead included)
        without admission work, if the blocks it can ask for already sit on mapped pages:
        then the next free count is the native one, so vLLM decides exactly as native and
        whatever it allocates is backed. False (nothing changed) otherwise.

        Full attention needs at most ``ceil(n / block_size) + 1`` new blocks per group for
        ``n`` new tokens (the +1 covers an optimistic async boundary); with ``g`` groups,
        ``g * (n // smallest block size + 2)`` covers them all (``running_gate``). When every
        CLEAN block is backed, any count vLLM can take is on mapped pages (CLEAN blocks first,
        then free cached ones, which are held and so mapped): `_backable` gives the native
        count then, so the gate says yes too. That is the steady state of a busy engine
        whose pool has filled with cached blocks (the GPU run of 12-06: backed CLEAN blocks
        were too few for the first test on most decode calls, each then paying admission
        work, +0.29 ms a step at 128 requests). Only set
        up (`running_block_sizes`) when every group is full attention, and off while faults
        are injected (a fault site counts admission checks; skipping some would shift them).
        The marker is consumed by the free count vLLM asks for next in ``allocate_slots``
        (nothing else asks for one without noting a demand first).

        The one definition of the decode path's gate: the scheduler seam asks it on every
        running request's plain call (no prefix hit, no reservation) and skips admission
        work exactly when it says yes.
        """
        gate = self.running_gate
        if gate is None:
            return False
        ledger = self.ledger
        backed = ledger.backed_free
        if backed < gate[0] * (num_tokens // gate[1] + 2) and not ledger.every_free_backed:
            return False
        self._demand = NO_DEMAND
        return True

    def begin_schedule(self) -> None:
        """Open the gate to every running request for one ``schedule`` call if its second
        test holds as the call begins: every CLEAN block is backed (a busy engine's steady
        state, its pool full of cached blocks). Nothing a schedule call does makes that
        false: only a step's end (``collect``), a limit's ``shed`` and the idle grace unmap
        pages; a block freed while scheduling (a preemption) was in use, so its page is
        mapped; reclaim makes CLEAN blocks of cached ones, which are held. The seam then
        skips `admit_running`'s call on the decode path, and `get_num_free_blocks` answers
        the native count without a demand, which is `_backable`'s answer then. Off while
        faults are injected, as the gate is; `end_schedule` closes it."""
        self.running_open = self.running_gate is not None and self.ledger.every_free_backed

    def end_schedule(self) -> None:
        self.running_open = False

    def note_demand(self, num_blocks: int, new_computed_blocks: Iterable[Sequence[KVCacheBlock]] = ()) -> None:
        """Record what the next `get_num_free_blocks` call is asked to cover.

        ``new_computed_blocks`` are the prefix hits the admission will touch; reclaim
        never evicts them.
        """
        if not num_blocks and not any(new_computed_blocks):
            self._demand = NO_DEMAND  # a decode step inside a block: every request, every step
            return
        protected = frozenset(
            b.block_id for group in new_computed_blocks for b in group if b.ref_cnt == 0 and not b.is_null
        )
        self._demand = _Demand(num_blocks, protected) if num_blocks or protected else NO_DEMAND

    def begin_admission(self, watermark: int, reserved: int, site: str, new: bool = False) -> _Admission | None:
        """Enter one ``allocate_slots`` call: headroom for mapping, the fault site, and whether
        the request is new (waiting or preempted: refused while the pool is over its limit).

        Returns the enclosing admission, to be handed back to `end_admission` (the scheduler
        seam pairs them in ``try``/``finally``; `admission` is the same as a context manager).
        """
        if site not in ADMISSION_SITES:
            raise InvariantError(f"unknown admission site {site!r}")
        previous = self._admission
        self._admission = (watermark, reserved, site, new)
        return previous

    def end_admission(self, previous: _Admission | None) -> None:
        self._admission = previous
        self._demand = None

    @contextlib.contextmanager
    def admission(self, *, watermark: int, reserved: int, site: str, new: bool = False) -> Iterator[None]:
        """Scope of one ``allocate_slots`` call (`begin_admission` .. `end_admission`)."""
        previous = self.begin_admission(watermark, reserved, site, new)
        try:
            yield
        finally:
            self.end_admission(previous)

    def trigger(self, name: str) -> None:
        """Forward a fault-injection trigger (no-op when injection is off)."""
        if self.faults is not None:
            self.faults.trigger(name)

    def set_idle_post(self, post: Post | None) -> None:
        """Give the pool its engine's way to run a callable on the engine's thread while it
        idles (`kvcached.integration.vllm.engine.idle_post`; None: an in-process engine, whose
        thread is its caller's). With ``config.idle_grace_s`` > 0 and a ``post``, the cap
        waits for the engine to stay idle that long (`collect`); otherwise it applies at the
        idle step. Call after `attach`, before the first step."""
        if self.arena is None:
            raise InvariantError("set_idle_post needs an attached pool")
        if self._idle_grace is not None:
            self._idle_grace.close()
        seconds = self.config.idle_grace_s
        self._idle_grace = IdleGrace(seconds, post) if seconds > 0 and post is not None else None

    @property
    def idle_grace(self) -> IdleGrace | None:
        """The pool's idle grace, or None where the cap applies at the idle step."""
        return self._idle_grace

    def collect(self, *, busy: bool = False) -> int:
        """Unmap idle pages the fence allows (called after each executed step; ``busy``: the
        engine still has requests, so the reserve policy may hold pages, `PagePool.collect`).

        An idle engine (``busy`` False) first keeps its free cached blocks within the cap
        (`_enforce_cap`), so the pages that empties go back in the same pass; with an idle
        grace, the cap and that give-back wait for it (`_grace_over`), and a busy step cancels
        it. Over its limit (`PagePool.limit_pages`), the pool gives back idle reserve pages
        first, then empties pages whose every held block is free but cached (fewest such
        blocks first; they go out as the fence allows). Live blocks are never taken.
        """
        grace = self._idle_grace
        if grace is not None:
            if busy:
                grace.cancel()
            elif not grace.armed:  # counted from the first idle step (an async engine takes two)
                grace.arm(self._grace_over)
        elif not busy:
            self._enforce_cap()
        return self._give_back(busy)

    def _grace_over(self) -> None:
        """The engine stayed idle through its grace (on the engine's thread): apply the cap
        and give back what it empties. Never after `close` or `abandon`: both close the grace
        first, which makes a give-back already posted a no-op."""
        self._enforce_cap()
        self._give_back(busy=False)

    def _give_back(self, busy: bool) -> int:
        """`collect`'s unmaps: idle pages per the reserve policy, then what a limit takes."""
        unmapped = self.page_pool.collect(busy=busy)
        over = self.page_pool.over_limit()
        if over > 0 and self._clean_idle_pages(over):
            unmapped += self.page_pool.shed()
        return unmapped

    def _clean_idle_pages(self, pages: int) -> int:
        """Make every free cached block of up to ``pages`` pages CLEAN, choosing pages none of
        whose held blocks is live (cleaning them empties them), fewest blocks first."""
        by_page: dict[int, list[int]] = {}
        bpp = self.ledger.blocks_per_page
        for idle in (self._cached, self._stranded):
            for bid in idle:
                by_page.setdefault(bid // bpp, []).append(bid)
        held_on = self.ledger.held_on_page
        idle_pages = sorted((p for p, blocks in by_page.items() if held_on(p) == len(blocks)),
                            key=lambda p: (len(by_page[p]), p))[:pages]
        self._clean([b for p in idle_pages for b in sorted(by_page[p])])
        return len(idle_pages)

    def _over_limit(self) -> bool:
        limit = self.page_pool.limit_pages
        return limit is not None and self.page_pool.num_mapped > limit

    # ---- counts ----------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Free blocks `get_new_blocks` can hand out now without mapping; <= the native count."""
        native = self.free_block_queue.num_free_blocks
        demand, self._demand = self._demand, None
        if demand is NO_DEMAND or self._logical_view or (demand is None and self.running_open):
            # Nothing it allocates needs a map (or it allocates nothing, or every CLEAN
            # block is backed: `begin_schedule`): the native count gives the native answer.
            return native
        self._adopt_external_pops()
        if demand is not None:
            return self._admit(native, demand)
        return self._backable(native, self.ledger.backed_free_count())

    def get_usage(self) -> float:
        """Logical usage, as native: the fraction of blocks not in the free queue."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0
        return 1.0 - (self.free_block_queue.num_free_blocks / total)

    def _backable(self, native: int, backed_clean: int) -> int:
        # ``backed_clean``: the ledger's backed count, settled (`backed_free_count`).
        # With every CLEAN block backed, any n <= native is served by CLEAN blocks and then
        # mapped CACHED/STRANDED ones. Otherwise n must stay within the backed CLEAN ones,
        # because n <= #CLEAN takes CLEAN blocks only (native order).
        return native if self.ledger.every_free_backed else backed_clean

    def _admit(self, native: int, demand: _Demand) -> int:
        """The free count for one admission check, mapping (or reclaiming) what it needs."""
        adm = self._admission
        watermark, reserved, site, new = adm if adm is not None else (0, 0, "", False)
        idle = self._backable(native, self.ledger.backed_free_count())
        # Hopeless checks map nothing: above num_gpu_blocks is MambaManager's "not this
        # step" sentinel, and beyond the native free count vLLM refuses anyway.
        if demand.blocks > self.num_gpu_blocks or demand.blocks + reserved > native:
            return idle
        if new and demand.blocks > 0 and self._over_limit():
            # Over its limit the engine admits nothing new until its usage is under it
            # (running requests go on, on pages it has): a scheduling miss.
            self.ledger.note_admission_miss()
            return min(idle, demand.blocks + reserved - 1)
        if demand.blocks > 0 and adm is not None and self.faults is not None:
            try:
                self.faults.check(site)
            except InjectedFault:
                # Injected failure: nothing is mapped or reclaimed, and the count is held
                # below the demand so this attempt is a scheduling miss
                # (available = count - reserved < demand).
                self.ledger.note_admission_miss()
                return min(idle, demand.blocks + reserved - 1)
        # The watermark is headroom vLLM applies to waiting requests only; mapping for it
        # anyway keeps this side simple and costs at most `watermark` idle blocks.
        target = min(demand.blocks + watermark + reserved, native)
        backed = self.ledger.ensure_backed(min(target, self.ledger.num_free))
        if backed < self.ledger.num_free and backed < target:
            # Memory is short: make idle cached blocks CLEAN (and backed) rather than fail.
            self._clean(self._victims(target - backed, exclude=demand.protected))
            backed = self.ledger.backed_free_count()
        count = self._backable(native, backed)
        if adm is not None and count < demand.blocks + reserved:
            self.ledger.note_admission_miss()  # native had room: memory made this a miss
        return count

    # ---- allocation --------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Native semantics; CLEAN blocks are chosen page-aware (see the module docstring)."""
        self._adopt_external_pops()
        ret = self._take_free_blocks(num_blocks)
        # Native eviction of a block without hash, alias key or metrics is a no-op: CLEAN
        # blocks (most of them) skip the call.
        evict = self.enable_caching
        aliases = self._aliases
        metrics = self.metrics_collector
        for block in ret:
            if evict and (block.block_hash is not None or metrics or block.block_id in aliases):
                self._maybe_evict_cached_block(block)
            if block.ref_cnt != 0:
                raise InvariantError(f"free block {block.block_id} has ref_cnt={block.ref_cnt}")
            block.ref_cnt += 1
            if metrics:
                metrics.on_block_allocated(block)
        return ret

    def _take_free_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` free blocks out of the queue: CLEAN ones page-aware first, then the
        head of the hashed region (native order)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        num_clean = min(num_blocks, self.ledger.num_free)
        # Maps pages only if admission did not; raises PhysicalMemoryExhausted before any
        # state changes.
        clean_ids = self.ledger.allocate(num_clean) if num_clean else []
        ret = [self.blocks[b] for b in clean_ids]
        for block in ret:
            self.free_block_queue.remove(block)
        if num_blocks > num_clean:
            # Every CLEAN block is taken; the head of the queue is the hashed region.
            positional = self.free_block_queue.popleft_n(num_blocks - num_clean)
            for block in positional:
                bid = block.block_id
                if bid in self._cached:
                    self._cached.remove(bid)
                elif bid in self._stranded:
                    self._stranded.remove(bid)
                else:
                    raise InvariantError(f"block {bid} popped from the hashed region is not cached")
            ret.extend(positional)
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Native touch; a touched free block becomes LIVE (a CLEAN one is held first)."""
        self._adopt_external_pops()
        woken: dict[int, None] = {}
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                woken[block.block_id] = None
        if not woken:  # hits on live blocks only: no state of ours changes
            super().touch(blocks)
            return
        clean = [b for b in woken if b not in self._cached and b not in self._stranded]
        if clean:
            self.ledger.hold(clean)  # raises before any change if a page cannot be mapped
        super().touch(blocks)
        for bid in woken:
            self._cached.discard(bid)
            self._stranded.discard(bid)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Native free (native queue order), then ledger release. Freed hashed blocks stay
        CACHED (the cap applies when the engine goes idle: `collect`)."""
        self._adopt_external_pops()
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        released: dict[int, None] = {}
        for block in blocks:
            if block.ref_cnt != 0 or block.is_null:
                continue
            bid = block.block_id
            if block.block_hash is None:
                released[bid] = None
            elif self.enable_caching:
                self._cached.add(bid)
            else:
                raise InvariantError(f"block {bid} is hashed while prefix caching is off")
        if released:
            self.ledger.release(released)

    def unpin_blocks(self, *args: Any, **kwargs: Any) -> None:
        """Refused (vLLM 0.30+): it queues possibly unhashed blocks at the tail of the free
        queue and registers reuse watchers, outside the states this pool keeps. Its only
        caller is HiSparse (0.30+), which vLLM runs on Model Runner V2, which kvcached refuses
        at start-up from 0.29; should any other path call it, the engine stops here, naming it."""
        raise IntegrationError("BlockPool.unpin_blocks (vLLM's HiSparse) is not served by kvcached's elastic pool")

    def reset_prefix_cache(self) -> bool:
        """Native reset; on success every free block is CLEAN and empty pages go back."""
        self._adopt_external_pops()
        self._logical_view = True  # the native check compares against the logical count
        try:
            ok = super().reset_prefix_cache()
        finally:
            self._logical_view = False
        if ok:
            idle = sorted(self._cached | self._stranded)
            self._cached.clear()
            self._stranded.clear()
            if idle:
                self.ledger.release(idle)
            # Callers reset to get memory back (sleep mode, weight updates): unmap what the
            # fence allows now instead of waiting for the next executed step.
            self.collect()
        return ok

    # ---- hash hooks: ledger state only, native behaviour via super --------------------
    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        removed = super()._remove_cached_block_hashes(block)
        if block.block_id in self._cached and block.block_hash is None:
            # Lost its hash while free: it keeps its queue position, hence its page.
            self._cached.remove(block.block_id)
            self._stranded.add(block.block_id)
        return removed

    def _insert_block_hash(
        self,
        block_hash_with_group_id: BlockHashWithGroupId,
        block: KVCacheBlock,
        num_tokens: int | None,
    ) -> None:
        bid = block.block_id
        free_unhashed = block.ref_cnt == 0 and not block.is_null and block.block_hash is None
        if free_unhashed and bid not in self._stranded:
            # vLLM 0.26-0.29 only hashes referenced blocks; a CLEAN block sits in the
            # leading queue region, where a hashed block would break the order invariant.
            raise InvariantError(f"vLLM hashed free block {bid}, which kvcached does not support")
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        if free_unhashed and block.block_hash is not None:
            self._stranded.remove(bid)
            self._cached.add(bid)

    # ---- cap, reclaim ------------------------------------------------------------------
    def _enforce_cap(self) -> None:
        """Keep free CACHED + STRANDED blocks within the cap (-1: no cap), page-aware.

        Runs when the engine goes idle (`collect`), once per idle step: O(1) when within the
        cap, which it is after the first.
        """
        cap = self._cap
        if cap < 0:
            return
        excess = len(self._cached) + len(self._stranded) - cap
        if excess > 0:
            self._clean(self._victims(excess))

    def _victims(self, n: int, exclude: frozenset[int] = frozenset()) -> list[int]:
        """Up to ``n`` free CACHED/STRANDED blocks to make CLEAN, page-aware.

        Pages all of whose held blocks are free (so cleaning them empties the page) come
        first, fewest such blocks first; then the other pages, fewest first.
        """
        if n <= 0:
            return []
        by_page: dict[int, list[int]] = {}
        bpp = self.ledger.blocks_per_page
        for idle in (self._cached, self._stranded):
            for bid in idle:
                if bid not in exclude:
                    by_page.setdefault(bid // bpp, []).append(bid)

        held_on = self.ledger.held_on_page

        def rank(page: int) -> tuple[bool, int, int]:
            return (held_on(page) != len(by_page[page]), len(by_page[page]), page)

        victims: list[int] = []
        for page in sorted(by_page, key=rank):
            victims.extend(sorted(by_page[page])[: n - len(victims)])
            if len(victims) == n:
                break
        return victims

    def _clean(self, victims: Sequence[int]) -> None:
        """Make free CACHED/STRANDED blocks CLEAN: evict natively, move to the queue front."""
        if not victims:
            return
        moved: list[KVCacheBlock] = []
        for bid in victims:
            block = self.blocks[bid]
            if bid in self._cached:
                self._cached.remove(bid)  # first, so the removal hook leaves it alone
                self._maybe_evict_cached_block(block)
            else:
                self._stranded.remove(bid)
            self.free_block_queue.remove(block)
            moved.append(block)
        self.free_block_queue.prepend_n(moved)
        self.ledger.release(victims)

    # ---- foreign queue users -----------------------------------------------------------
    def _adopt_external_pops(self) -> None:
        """Hold blocks popped from the free queue behind the pool's back.

        ``SinkFullAttentionManager`` pops its sink blocks straight from the queue when it
        is built; they are LIVE forever with ``ref_cnt == 0``. Detected by count (O(1));
        the scan runs only when the counts disagree.
        """
        ledger = self.ledger
        expected = ledger.num_blocks - ledger.num_held + len(self._cached) + len(self._stranded)
        actual = self.free_block_queue.num_free_blocks
        if actual == expected:
            return
        popped = [
            b.block_id
            for b in self.blocks
            if not b.is_null
            and b.ref_cnt == 0
            and b.prev_free_block is None
            and not self.ledger.is_held(b.block_id)
        ]
        if actual > expected or len(popped) != expected - actual:
            raise InvariantError(
                f"free queue holds {actual} blocks, kvcached expects {expected} "
                f"({len(popped)} CLEAN blocks are outside the queue)"
            )
        self.ledger.hold(popped, wait=True)

    # ---- diagnostics -------------------------------------------------------------------
    def state_of(self, block_id: int) -> str:
        """``"null" | "live" | "cached" | "stranded" | "clean"`` (for tests and debugging)."""
        block = self.blocks[block_id]
        if block.is_null:
            return "null"
        if block_id in self._cached:
            return "cached"
        if block_id in self._stranded:
            return "stranded"
        return "live" if self.ledger.is_held(block_id) else "clean"

    def check(self) -> None:
        """Verify every invariant in the module docstring (tests call this)."""
        self.ledger.check()
        if not self.ledger.is_held(self.null_block.block_id):
            raise InvariantError("null block is not pinned")
        in_queue: list[int] = []
        node = self.free_block_queue.fake_free_list_head.next_free_block
        while node is not None and node is not self.free_block_queue.fake_free_list_tail:
            in_queue.append(node.block_id)
            node = node.next_free_block
        if len(in_queue) != self.free_block_queue.num_free_blocks:
            raise InvariantError("free queue length disagrees with num_free_blocks")
        seen_hashed_region = False
        for bid in in_queue:
            clean = bid not in self._cached and bid not in self._stranded
            if clean and seen_hashed_region:
                raise InvariantError(f"CLEAN block {bid} after the hashed region of the free queue")
            seen_hashed_region |= not clean
        queued = set(in_queue)
        for block in self.blocks:
            bid = block.block_id
            if block.is_null:
                continue
            state = self.state_of(bid)
            hashed = block.block_hash is not None
            ok = {
                "cached": block.ref_cnt == 0 and hashed and bid in queued,
                "stranded": block.ref_cnt == 0 and not hashed and bid in queued,
                "clean": block.ref_cnt == 0 and not hashed and bid in queued,
                "live": block.ref_cnt > 0 or bid not in queued,
            }[state]
            if not ok:
                raise InvariantError(f"block {bid} state {state} disagrees with {block!r}")
            if state != "clean" and not self.ledger.is_backed(bid):
                raise InvariantError(f"{state} block {bid} sits on an unmapped page")

    def close(self) -> None:
        """Engine teardown: close the arena (leave the stats registry, unmap every page).

        Idempotent and silent. Only for a stopped engine: the worker's KV views stay
        reserved but unmapped, so a step after this would fault.
        """
        if self._idle_grace is not None:
            self._idle_grace.close()
        if self._finalizer is None:
            self._closed_detached = True
        else:
            self._finalizer()

    def abandon(self) -> None:
        """Close the books without unmapping: the ranks holding the pages are gone (their
        memory went with their processes). Idempotent."""
        if self._idle_grace is not None:
            self._idle_grace.close()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self.arena is not None:
            self.arena.abandon()
        self._closed_detached = True

    @property
    def closed(self) -> bool:
        """Whether `close` (or `abandon`) ran, or the finalizer did."""
        if self._finalizer is None or self._closed_detached:
            return self._closed_detached
        return not self._finalizer.alive
