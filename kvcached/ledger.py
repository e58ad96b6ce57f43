"""BlockLedger: fixed-size blocks on kv pages.

Block ``b`` lives on kv page ``b // blocks_per_page``. A block is *held* (its bytes
matter: live, cached, or otherwise pinned by the caller) or *free*. The ledger keeps the
page pool's view consistent with that:

* a page is in use by the pool iff it holds at least one held block;
* choice is page-aware: free blocks on mapped pages first, fullest page first, so
  mapped pages fill up before new ones are mapped and emptied pages can be returned;
* `hold`/`allocate` are all-or-nothing: if mapping a page fails in the middle, nothing
  is held and the pool has unmapped whatever the batch had mapped.

The ledger does not know *why* a block is held; policy (prefix caching, eviction) is the
caller's.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

from kvcached.errors import ConfigError, InvariantError
from kvcached.pages import PagePool
from kvcached.stats import PoolStats


class BlockLedger:
    def __init__(
        self,
        num_blocks: int,
        blocks_per_page: int,
        pool: PagePool,
        pinned: Iterable[int] = (),
    ) -> None:
        if num_blocks <= 0 or blocks_per_page <= 0:
            raise ConfigError(f"num_blocks={num_blocks} and blocks_per_page={blocks_per_page} must be > 0")
        self.num_blocks = num_blocks
        self.blocks_per_page = blocks_per_page
        self.num_pages = -(-num_blocks // blocks_per_page)
        if self.num_pages > pool.space.num_kv_pages:
            raise ConfigError(
                f"{num_blocks} blocks need {self.num_pages} kv pages; the page space has "
                f"{pool.space.num_kv_pages}"
            )
        self.pool = pool
        self._held = bytearray(num_blocks)
        self._held_per_page = [0] * self.num_pages
        self._free_per_page: list[set[int]] = [
            set(range(p * blocks_per_page, min((p + 1) * blocks_per_page, num_blocks)))
            for p in range(self.num_pages)
        ]
        self.num_held = 0
        self._admission_misses = 0
        self._generation = 0  # bumped by every hold/release: the free sets changed
        self._backed_cache: tuple[int, int, int] = (-1, -1, 0)  # (pool generation, generation, count)
        pinned = sorted(set(pinned))
        if pinned:
            self.hold(pinned, wait=True)

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_held

    def page_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_page

    def is_held(self, block_id: int) -> bool:
        return bool(self._held[block_id])

    def is_backed(self, block_id: int) -> bool:
        return self.pool.is_mapped(self.page_of(block_id))

    def backed_free_count(self) -> int:
        """Free blocks that sit on mapped pages (usable without a driver call).

        Cached until the pool's mapped set or this ledger's free sets change: admission
        asks several times per request, and the answer only moves with those.
        """
        self.pool.settle()  # refills whose replies are in join first (may bump the generation)
        pool_generation, generation, count = self._backed_cache
        if (pool_generation, generation) == (self.pool.mapped_generation, self._generation):
            return count
        count = sum(len(self._free_per_page[p]) for p in self.pool.mapped if p < self.num_pages)
        self._backed_cache = (self.pool.mapped_generation, self._generation, count)
        return count

    def _pages_best_first(self) -> Iterator[int]:
        """Pages with free blocks, best first: mapped before unmapped, fullest first.

        Lazy: an unmapped page holds no block (holding maps it), so unmapped pages are
        equal but for their index and come in ascending order without a sort.
        """
        mapped = self.pool.mapped
        free = self._free_per_page
        yield from sorted((p for p in mapped if p < self.num_pages and free[p]),
                          key=lambda p: (-self._held_per_page[p], p))
        yield from (p for p in range(self.num_pages) if free[p] and p not in mapped)

    def page_order(self) -> list[int]:
        """Pages with free blocks, best first: mapped before unmapped, fullest first."""
        return list(self._pages_best_first())

    def choose(self, n: int, among: Collection[int] | None = None) -> list[int]:
        """The ``n`` best free blocks (restricted to ``among`` if given); no state change."""
        if n < 0:
            raise InvariantError(f"choose({n})")
        chosen: list[int] = []
        for page in self._pages_best_first():
            free = self._free_per_page[page]
            candidates = sorted(free if among is None else free.intersection(among))
            chosen.extend(candidates[: n - len(chosen)])
            if len(chosen) == n:
                return chosen
        raise InvariantError(f"choose({n}): only {len(chosen)} eligible free blocks")

    # ---- state changes -------------------------------------------------------------
    def allocate(self, n: int, *, wait: bool = False) -> list[int]:
        """Hold ``n`` page-aware chosen free blocks; all-or-nothing."""
        if n > self.num_free:
            raise InvariantError(f"allocate({n}) with {self.num_free} free blocks")
        blocks = self.choose(n)
        self.hold(blocks, wait=wait)
        return blocks

    def hold(self, block_ids: Sequence[int], *, wait: bool = False) -> None:
        """Mark free blocks held, mapping the pages they need first (all-or-nothing)."""
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise InvariantError(f"hold(): duplicate block ids in {ids}")
        for b in ids:
            if not 0 <= b < self.num_blocks or self._held[b]:
                raise InvariantError(f"hold(): block {b} is out of range or already held")
        new_pages = {self.page_of(b) for b in ids if self._held_per_page[self.page_of(b)] == 0}
        self.pool.acquire(new_pages, wait=wait)  # raises with nothing changed
        for b in ids:
            page = self.page_of(b)
            self._held[b] = 1
            self._held_per_page[page] += 1
            self._free_per_page[page].discard(b)
        self.num_held += len(ids)
        self._generation += 1

    def release(self, block_ids: Iterable[int]) -> list[int]:
        """Mark held blocks free; pages left with no held block go back to the pool.

        Returns the pages given back (they stay mapped in the reserve until the fence
        and the reserve policy let the pool unmap them).
        """
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise InvariantError(f"release(): duplicate block ids in {ids}")
        for b in ids:
            if not 0 <= b < self.num_blocks or not self._held[b]:
                raise InvariantError(f"release(): block {b} is out of range or not held")
        emptied: list[int] = []
        for b in ids:
            page = self.page_of(b)
            self._held[b] = 0
            self._held_per_page[page] -= 1
            self._free_per_page[page].add(b)
            if self._held_per_page[page] == 0:
                emptied.append(page)
        self.num_held -= len(ids)
        self._generation += 1
        self.pool.release(emptied)
        return emptied

    def ensure_backed(self, n: int) -> int:
        """Try to have ``n`` free blocks on mapped pages; returns how many there are.

        Maps unmapped pages (lowest first) only as far as the cached capacity says is
        possible; running out of capacity is a normal outcome, reported by the count.
        """
        backed = self.backed_free_count()
        if backed >= n:
            return backed
        mapped = self.pool.mapped
        wanted: list[int] = []
        deficit = n - backed
        for page in range(self.num_pages):
            if deficit <= 0:
                break
            if page not in mapped and self._free_per_page[page]:
                wanted.append(page)
                deficit -= len(self._free_per_page[page])
        wanted = wanted[: self.pool.capacity_pages()]
        if wanted:
            self.pool.prefetch(wanted)
        return self.backed_free_count()

    def pool_stats(self) -> PoolStats:
        """Snapshot for `kvcached.stats()` (the ledger is the registered stats source)."""
        c = self.pool.counters()
        page_bytes = self.pool.space.kv_page_bytes
        return PoolStats(
            mapped_bytes=c.mapped_pages * page_bytes,
            peak_mapped_bytes=c.peak_mapped_pages * page_bytes,
            reserved_idle_bytes=c.reserve_pages * page_bytes,
            live_blocks=self.num_held,
            capacity_blocks=self.num_blocks,
            kv_page_bytes=page_bytes,
            vmm_page_bytes=self.pool.space.vmm_page_bytes,
            rank_round_trips=self.pool.space.round_trips,
            maps=c.maps,
            unmaps=c.unmaps,
            map_failures=c.map_failures,
            admission_misses=self._admission_misses,
        )

    def note_admission_miss(self) -> None:
        """Count an admission the caller had to refuse for lack of backed blocks (stats only)."""
        self._admission_misses += 1

    def check(self) -> None:
        """Verify internal invariants (tests and debug builds call this)."""
        held = sum(self._held)
        if held != self.num_held:
            raise InvariantError(f"num_held={self.num_held} but {held} blocks are held")
        for page in range(self.num_pages):
            lo, hi = page * self.blocks_per_page, min((page + 1) * self.blocks_per_page, self.num_blocks)
            page_held = sum(self._held[lo:hi])
            if page_held != self._held_per_page[page]:
                raise InvariantError(f"page {page}: held count {self._held_per_page[page]} != {page_held}")
            if len(self._free_per_page[page]) != (hi - lo) - page_held:
                raise InvariantError(f"page {page}: free set out of sync")
            if (page_held > 0) != (page in self.pool.in_use):
                raise InvariantError(f"page {page}: held={page_held} but in_use={page in self.pool.in_use}")
