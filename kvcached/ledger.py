"""BlockLedger: fixed-size blocks on kv pages.

Block ``b`` lives on kv page ``b // blocks_per_page``. A block is *held* (its bytes
matter: live, cached, or otherwise pinned by the caller) or *free*. The ledger keeps the
page pool's view consistent with that:

* a page is in use by the pool iff it holds at least one held block;
* choice is page-aware: free blocks on mapped pages first, fullest page first, so
  mapped pages fill up before new ones are mapped and emptied pages can be returned;
* `hold`/`allocate` are all-or-nothing: if mapping a page fails in the middle, nothing
  is held and the pool has unmapped whatever the batch had mapped;
* free blocks on a quarantined page (its unmap failed somewhere: `PagePool.quarantined`)
  are free but not usable: the page is neither mapped for use nor mappable until a retry
  succeeds. Invariant: ``num_free == backed_free + (free blocks on unmapped pages) +
  (free blocks on quarantined pages)``, and `usable_free` is the first two: an allocation
  beyond it raises `PhysicalMemoryExhausted` (a scheduling miss, nothing changed), as a
  hold of a block on a quarantined page does.

The ledger does not know *why* a block is held; policy (prefix caching, eviction) is the
caller's.

Cost: the scheduler asks on every step, so nothing here scans the pool. The count of free
blocks on mapped pages and the mapped pages with free blocks, bucketed by how many blocks
they hold, change with each hold, release, map and unmap (the page pool's watcher), so a
query or a choice costs what it touches.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator, Sequence

from kvcached.budget import limiter_failure
from kvcached.errors import ConfigError, InvariantError, PhysicalMemoryExhausted
from kvcached.pages import PagePool
from kvcached.stats import PoolStats

#: A page's free-block heap is rebuilt from its free set once it would hold more than twice
#: as many entries as free blocks, plus this slack (stale entries are dropped lazily).
_FREE_HEAP_SLACK = 16


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
        # Lazy min-heaps of each page's free blocks (a sorted list is a heap): every free
        # block is on its page's heap; held ones may linger there until a choice pops them.
        self._free_heap: list[list[int]] = [sorted(free) for free in self._free_per_page]
        self.num_held = 0
        self._admission_misses = 0
        # Invariants (`check`): backed_free == free blocks on mapped pages (read-only outside); a page is in
        # _open[h] iff it is mapped, holds h blocks and has a free one.
        self.backed_free = 0
        self._open: list[set[int]] = [set() for _ in range(blocks_per_page)]
        self._open_heap: list[list[int]] = [[] for _ in range(blocks_per_page)]  # lazy min-heaps of _open
        self._top = 0  # no bucket above it is non-empty
        self._levels: set[int] = set()  # the non-empty buckets (a few: at most one per open page)
        pool.watch(self._pages_changed)
        self._pages_changed(sorted(p for p in pool.mapped if p < self.num_pages), ())
        pinned = sorted(set(pinned))
        if pinned:
            self.hold(pinned, wait=True)

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks not held, those on quarantined pages included (see `usable_free`)."""
        return self.num_blocks - self.num_held

    @property
    def every_free_backed(self) -> bool:
        """Whether every free block sits on a mapped page (then no take maps)."""
        return self.backed_free >= self.num_blocks - self.num_held

    @property
    def usable_free(self) -> int:
        """Free blocks an allocation can have: `num_free` less the free blocks of quarantined
        pages. O(quarantined pages): none while the pool is healthy."""
        quarantined = self.pool.quarantined
        if not quarantined:
            return self.num_free
        return self.num_free - self._free_on(quarantined)

    def _free_on(self, pages: Iterable[int]) -> int:
        """Free blocks on ``pages`` (pages past this ledger's count none). O(len(pages))."""
        return sum(len(self._free_per_page[p]) for p in pages if p < self.num_pages)

    def page_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_page

    def held_on_page(self, page: int) -> int:
        """Held blocks on ``page``. O(1)."""
        return self._held_per_page[page]

    def is_held(self, block_id: int) -> bool:
        return bool(self._held[block_id])

    def is_backed(self, block_id: int) -> bool:
        return self.pool.is_mapped(self.page_of(block_id))

    def backed_free_count(self) -> int:
        """Free blocks that sit on mapped pages (usable without a driver call). O(1)."""
        if self.pool.pending:  # only this thread changes it
            self.pool.settle()  # refills whose replies are in join first (the watcher counts them)
        return self.backed_free

    def _pages_changed(self, mapped: Sequence[int], unmapped: Sequence[int]) -> None:
        """The pool's watcher: keep the backed count and the open buckets."""
        for page in mapped:
            if page < self.num_pages and self._free_per_page[page]:
                self.backed_free += len(self._free_per_page[page])
                self._open_add(self._held_per_page[page], page)
        for page in unmapped:
            if page < self.num_pages and self._free_per_page[page]:
                self.backed_free -= len(self._free_per_page[page])
                self._open_remove(self._held_per_page[page], page)

    def _unmapped_pages(self) -> Iterator[int]:
        """Unmapped pages of this ledger, lowest first (a refill in flight included)."""
        done, want = 0, 8
        while True:
            pages = self.pool.lowest_unmapped(want)
            for page in pages[done:]:
                if page >= self.num_pages:
                    return
                yield page
            if len(pages) < want:
                return
            done, want = want, want * 2

    def _open_add(self, held: int, page: int) -> None:
        """Page ``page`` (mapped, with a free block) now holds ``held`` blocks."""
        bucket = self._open[held]
        if not bucket:
            self._levels.add(held)
        bucket.add(page)
        if held > self._top:  # noqa: PLR1730 - a compare, not a max() call: every hold and release runs it
            self._top = held
        heap = self._open_heap[held]
        heapq.heappush(heap, page)
        if len(heap) > 2 * len(bucket) + 64:
            heap[:] = sorted(bucket)  # drop the stale entries (amortized)

    def _open_remove(self, held: int, page: int) -> None:
        """Page ``page`` leaves the bucket of pages holding ``held`` blocks, if it is in it."""
        bucket = self._open[held]
        if page in bucket:
            bucket.remove(page)
            if not bucket:
                self._levels.remove(held)

    def _choose_in(self, held: int, n: int, among: Collection[int] | None, chosen: list[int]) -> None:
        """Extend ``chosen`` towards ``n`` blocks from the pages holding ``held`` blocks,
        lowest page first; O(pages used x log) (the bucket's heap may hold stale entries and
        duplicates, dropped here; the pages used go back on it)."""
        heap, members = self._open_heap[held], self._open[held]
        used: list[int] = []
        try:
            while heap and len(chosen) < n:
                page = heapq.heappop(heap)
                if page not in members or (used and used[-1] == page):
                    continue  # stale (left the bucket) or a duplicate (came back to it)
                used.append(page)
                self._take(page, n, among, chosen)
        finally:
            for page in used:
                heapq.heappush(heap, page)

    def _take(self, page: int, n: int, among: Collection[int] | None, chosen: list[int]) -> None:
        """Extend ``chosen`` towards ``n`` with the page's lowest eligible free blocks.

        O(blocks taken x log) off the page's heap (stale entries dropped, the blocks taken
        pushed back: choosing changes nothing), whatever the page size.
        """
        need = n - len(chosen)
        if among is not None:
            chosen.extend(sorted(self._free_per_page[page].intersection(among))[:need])
            return
        heap, free = self._free_heap[page], self._free_per_page[page]
        got: list[int] = []
        while heap and len(got) < need:
            b = heapq.heappop(heap)
            if b in free and (not got or got[-1] != b):  # duplicates pop next to each other
                got.append(b)
        for b in got:
            heapq.heappush(heap, b)
        chosen.extend(got)

    def page_order(self) -> list[int]:
        """Pages with free blocks, best first: mapped pages holding the most blocks first
        (lowest index on ties), then unmapped pages ascending (tests and debugging)."""
        mapped = [p for bucket in reversed(self._open) for p in sorted(bucket)]
        return mapped + list(self._unmapped_pages())

    def choose(self, n: int, among: Collection[int] | None = None) -> list[int]:
        """The ``n`` best free blocks (restricted to ``among`` if given); no state change.

        Best is `page_order`: mapped pages fill up before a new page is mapped, and pages
        that are nearly empty are left to empty. An unmapped page holds no block (holding
        maps it), so unmapped pages are equal but for their index.
        """
        if n < 0:
            raise InvariantError(f"choose({n})")
        chosen: list[int] = []
        if n == 0:
            return chosen
        for held in sorted(self._levels, reverse=True):  # the non-empty buckets, fullest first
            self._choose_in(held, n, among, chosen)
            if len(chosen) == n:
                return chosen
        for page in self._unmapped_pages():
            self._take(page, n, among, chosen)
            if len(chosen) == n:
                return chosen
        raise InvariantError(f"choose({n}): only {len(chosen)} eligible free blocks")

    # ---- state changes -------------------------------------------------------------
    def allocate(self, n: int, *, wait: bool = False) -> list[int]:
        """Hold ``n`` page-aware chosen free blocks; all-or-nothing.

        ``n`` beyond `num_free` is the caller's bug (`InvariantError`); beyond `usable_free`
        (free blocks on quarantined pages make up the difference) it is a shortage of
        memory: `PhysicalMemoryExhausted`, nothing changed."""
        if n > self.num_blocks - self.num_held:  # `num_free`, without a property call per decode block
            raise InvariantError(f"allocate({n}) with {self.num_free} free blocks")
        if n <= self.backed_free:
            return self._take_mapped(n, wait)  # an admission's blocks, a decode step's block: no map
        self._check_usable(n)
        draining = self.pool.draining
        if draining and n > self.usable_free - self._free_on(draining):
            # `choose` is not offered pages whose unmap is in flight: wanted now, they are
            # waited for (Hypothesis found allocate raising InvariantError here, 12-07: maps
            # failed while a busy step's unmaps were in flight).
            self.pool.drain()
            self._check_usable(n)  # a refused unmap left its page quarantined
        blocks = self.choose(n)
        self.hold(blocks, wait=wait)
        return blocks

    def _check_usable(self, n: int) -> None:
        """`PhysicalMemoryExhausted` if fewer than ``n`` free blocks are usable: the others sit
        on quarantined pages."""
        if n > (usable := self.usable_free):
            raise PhysicalMemoryExhausted(
                f"allocate({n}): {usable} usable free blocks; {self.num_free - usable} more sit on quarantined "
                f"kv pages {sorted(self.pool.quarantined)} (an unmap failed there; retried by collect)")

    def _take_mapped(self, n: int, wait: bool) -> list[int]:
        """`allocate` of ``n`` <= `backed_free` blocks: `choose`'s blocks, held in the same
        pass (popped off the heaps instead of read and put back; each page changes bucket
        once).

        Same order as `choose`: buckets from the fullest down, pages lowest first within
        one, each page's lowest free blocks. A page taken from moves up (to a bucket already
        passed) or closes, unless ``n`` is reached on it, so no page is visited twice. The
        mapped pages that hold no block (bucket 0: the reserve's) that the choice reaches
        are acquired first, in one call that changes nothing if it raises, and only they
        are taken from (acquiring may map refill pages into bucket 0).
        """
        # With no mapped page left empty, every backed free block is on a page in use.
        short = n - self._free_in_use() if self._open[0] else 0
        empty = self._lowest_empty_pages(short) if short > 0 else []
        if empty:
            self.pool.acquire(empty, wait=wait)  # raises with nothing changed
        chosen: list[int] = []
        top = self._top
        if not self._open[top]:
            top = self._top = max(self._levels, default=0)
        # The fullest bucket alone usually serves the call (always a decode step's one
        # block), so the others are sorted only when it does not; pages taken from have
        # moved above ``top``, so the buckets below it are those of the start.
        self._take_bucket(top, n, chosen)
        if len(chosen) < n:
            for held in sorted((h for h in self._levels if h < top), reverse=True):
                self._take_bucket(held, n, chosen)
                if len(chosen) == n:
                    break
        for page in empty:
            self._take_from(page, 0, n, chosen)
        if len(chosen) != n:  # the counts promised n: a broken bucket or heap, before any caller sees it
            raise InvariantError(f"allocate({n}) found {len(chosen)} free blocks on mapped pages")
        self.num_held += n
        self.backed_free -= n
        return chosen

    def _take_bucket(self, held: int, n: int, chosen: list[int]) -> None:
        """Hold free blocks towards ``n`` from the pages in use holding ``held`` blocks,
        lowest page first (bucket 0, the unused mapped pages, is `_take_mapped`'s own)."""
        if held == 0:
            return
        members, heap = self._open[held], self._open_heap[held]
        while members and len(chosen) < n:
            page = heapq.heappop(heap)
            if page in members:  # else stale, or a duplicate of a page taken from
                self._take_from(page, held, n, chosen)

    def _take_from(self, page: int, held: int, n: int, chosen: list[int]) -> None:
        """Hold the lowest free blocks of ``page`` (open, holding ``held``) towards ``n``."""
        blocks, free, is_held = self._free_heap[page], self._free_per_page[page], self._held
        got = 0
        need = n - len(chosen)
        if need >= len(free):
            # Every free block of the page (a prefill's blocks fill whole pages): sorted at
            # once instead of popped one by one; the heap, all stale then, is emptied.
            taken = sorted(free)
            free.clear()
            blocks.clear()
            for b in taken:
                is_held[b] = 1
            chosen.extend(taken)
            got = len(taken)
        while got < need and free:
            b = heapq.heappop(blocks)
            if b in free:  # else stale, or a duplicate of a block just taken
                free.remove(b)
                is_held[b] = 1
                chosen.append(b)
                got += 1
        self._open_remove(held, page)
        self._held_per_page[page] = held + got
        if free:
            self._open_add(held + got, page)

    def _free_in_use(self) -> int:
        """Free blocks on pages in use (mapped, holding a block): `backed_free` less the
        blocks of the mapped pages that hold none (all of theirs are free)."""
        empty = self._open[0]
        if not empty:
            return self.backed_free
        free = len(empty) * self.blocks_per_page
        last = self.num_pages - 1
        if last in empty:  # the last page may be short
            free -= (last + 1) * self.blocks_per_page - self.num_blocks
        return self.backed_free - free

    def _lowest_empty_pages(self, blocks: int) -> list[int]:
        """The lowest mapped pages holding no block that give ``blocks`` free blocks (there
        are enough); read off bucket 0's heap, which gets them back."""
        heap, members = self._open_heap[0], self._open[0]
        pages: list[int] = []
        try:
            while blocks > 0:
                page = heapq.heappop(heap)
                if page in members and (not pages or pages[-1] != page):
                    pages.append(page)
                    blocks -= len(self._free_per_page[page])
        finally:
            for page in pages:
                heapq.heappush(heap, page)
        return pages

    def hold(self, block_ids: Sequence[int], *, wait: bool = False) -> None:
        """Mark free blocks held, mapping the pages they need first (all-or-nothing)."""
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise InvariantError(f"hold(): duplicate block ids in {ids}")
        bpp, held_of, is_held = self.blocks_per_page, self._held_per_page, self._held
        new_pages: set[int] = set()
        for b in ids:
            if not 0 <= b < self.num_blocks or is_held[b]:
                raise InvariantError(f"hold(): block {b} is out of range or already held")
            if held_of[b // bpp] == 0:
                new_pages.add(b // bpp)
        if new_pages:
            self.pool.acquire(new_pages, wait=wait)  # raises with nothing changed
        # Every page of `ids` is mapped now (in use): each block leaves the backed count.
        for page, blocks in self._by_page(ids):
            held = held_of[page]
            free = self._free_per_page[page]
            self._open_remove(held, page)
            for b in blocks:
                is_held[b] = 1
            free.difference_update(blocks)
            held_of[page] = held + len(blocks)
            if free:
                self._open_add(held + len(blocks), page)
        self.num_held += len(ids)
        self.backed_free -= len(ids)

    def _by_page(self, ids: list[int]) -> Iterable[tuple[int, list[int]]]:
        """``ids`` grouped by page, pages in first-seen order (one bucket move per page)."""
        bpp = self.blocks_per_page
        if len(ids) == 1:  # a decode step's block: no grouping needed
            return ((ids[0] // bpp, ids),)
        groups: dict[int, list[int]] = {}
        for b in ids:
            groups.setdefault(b // bpp, []).append(b)
        return groups.items()

    def release(self, block_ids: Iterable[int]) -> list[int]:
        """Mark held blocks free; pages left with no held block go back to the pool.

        Returns the pages given back (they stay mapped in the reserve until the fence
        and the reserve policy let the pool unmap them).
        """
        ids = list(block_ids)
        held_of, is_held = self._held_per_page, self._held
        # One pass checks and frees; a bad id undoes it (a duplicate is a block no longer
        # held when it comes again).
        for i, b in enumerate(ids):
            if not 0 <= b < self.num_blocks or not is_held[b]:
                for done in ids[:i]:
                    is_held[done] = 1
                what = "is a duplicate" if b in ids[:i] else "is out of range or not held"
                raise InvariantError(f"release(): block {b} {what}")
            is_held[b] = 0
        emptied: list[int] = []
        # Every page of `ids` is mapped (in use): each block joins the backed count.
        for page, blocks in self._by_page(ids):
            held, free, heap = held_of[page], self._free_per_page[page], self._free_heap[page]
            if free:
                self._open_remove(held, page)
            free.update(blocks)
            # Onto the page's heap, or the heap rebuilt (a sorted list is a heap): once it would be
            # mostly stale, or when the page is left with no held block (a request's whole pages).
            if held == len(blocks) or len(heap) + len(blocks) > 2 * len(free) + _FREE_HEAP_SLACK:
                heap[:] = sorted(free)
            else:
                for b in blocks:
                    heapq.heappush(heap, b)
            held_of[page] = held - len(blocks)
            self._open_add(held - len(blocks), page)
            if held == len(blocks):
                emptied.append(page)
        self.num_held -= len(ids)
        self.backed_free += len(ids)
        if emptied:
            self.pool.release(emptied)
        return emptied

    def ensure_backed(self, n: int) -> int:
        """Try to have ``n`` free blocks on mapped pages; returns how many there are.

        Maps unmapped pages (lowest first), with the reserve's shortfall, in one batch, only
        as far as the cached capacity says is possible; running out of capacity is a normal
        outcome, reported by the count.
        """
        backed = self.backed_free_count()
        if backed >= n:
            return backed
        wanted: list[int] = []
        deficit = n - backed
        # The reserve's refill rides in the same batch: the takes of this admission would
        # otherwise send it right behind, and the next admission of the step would wait for
        # that round trip (measured: most of the scheduler's waits in `vllm serve`). Only
        # within the max watermark: this batch is on the step's path, and a busy reserve's
        # full step of pages is for the refill the takes send ahead.
        extra = self.pool.reserve_shortfall(inline=True)
        for page in self._unmapped_pages():
            if deficit <= 0:
                if extra <= 0:
                    break
                extra -= 1
            wanted.append(page)
            deficit -= len(self._free_per_page[page])  # an unmapped page holds no block
        wanted = wanted[: self.pool.capacity_pages()]
        if wanted:
            self.pool.prefetch(wanted)
        return self.backed_free_count()

    def pool_stats(self) -> PoolStats:
        """Snapshot for `kvcached.stats()` (the ledger is the registered stats source), of
        settled books: unmaps an idle engine's last step sent are waited for (they are off
        that step's path, `PagePool.collect`), so an idle engine reports what it maps."""
        self.pool.settle(wait=True)
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
            page_takes=c.takes,
            reserve_hits=c.reserve_hits,
            blocking_maps=c.blocking_maps,
            blocking_unmaps=c.blocking_unmaps,
            unmap_failures=c.unmap_failures,
            quarantined_pages=c.quarantined_pages,
            health=c.health,
            budget_error=limiter_failure(self.pool.limiter),
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
        mapped = self.pool.mapped
        backed = sum(len(self._free_per_page[p]) for p in mapped if p < self.num_pages)
        if backed != self.backed_free:
            raise InvariantError(f"backed free count {self.backed_free} != {backed}")
        for held, bucket in enumerate(self._open):
            expected = {p for p in mapped if p < self.num_pages and self._free_per_page[p]
                        and self._held_per_page[p] == held}
            if bucket != expected:
                raise InvariantError(f"pages open with {held} held blocks: {sorted(bucket)} != {sorted(expected)}")
            if bucket and held > self._top:
                raise InvariantError(f"pages open with {held} held blocks above the top bucket {self._top}")
            if bool(bucket) != (held in self._levels):
                raise InvariantError(f"the bucket of pages holding {held} blocks is {'non-' * bool(bucket)}empty "
                                     f"but {'not ' * bool(bucket)}listed among the non-empty ones")
            if not bucket <= set(self._open_heap[held]):
                raise InvariantError(f"pages open with {held} held blocks missing from their heap")
        for page, free in enumerate(self._free_per_page):
            if not free <= set(self._free_heap[page]):
                raise InvariantError(f"page {page}: free blocks missing from its heap")
