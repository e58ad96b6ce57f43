"""Pool operation cost: kvcached's `ElasticBlockPool` against vLLM's native `BlockPool`, per call.

Both pools get identical call sequences (same block count, same batch of blocks per call,
same real vLLM `Request` objects and hashes) for ``get_new_blocks``, ``free_blocks``,
``touch`` (prefix hits on idle cached blocks, and on live blocks) and ``cache_full_blocks``.
The elastic pool runs on a real CPU `VirtualRange` (memfd-backed) with 32 blocks per kv
page (64 KiB pages, 2 KiB block stride), built detached and attached to a `KvSpace`.

Two modes:

* ``mapped``: every kv page is mapped before timing (allocate and free every block once,
  with ``max_reserve_pages`` = all pages so nothing is unmapped); the maps/unmaps counters
  of ``kvcached.stats()`` are read around every timed region and must not move. Target:
  kvcached/native <= 1.20x.
* ``mapping``: ``get_new_blocks`` from an unmapped pool (reserve 0; idle pages unmapped by
  ``collect`` before every repetition), so the timed calls map pages. Each such rep is
  followed by the same rep again on the same pool with those pages still mapped ("warm",
  which must map nothing). Reported: the pages mapped and the per-page cost, as timed ns /
  pages mapped (total) and as (rep ns - warm rep ns) / pages mapped (excess: the map work).
  The mapped mode's pool is no baseline here: its page choice pays for all pages mapped.

The mapped mode also times a third pool, `PassThroughPool`: vLLM's `BlockPool` with each
method kvcached overrides on these paths overridden by one that only calls ``super()``. Its ratio to native
is the floor of any Python override of these methods (the one extra call frame), whatever it
does: the share of the target that no subclass, kvcached's included, can get back.

One cell = (mode, op, blocks, batch). Each repetition times ``--window`` blocks' worth of
calls (``window // batch`` calls, fewer for small pools) with ``time.perf_counter_ns`` around
the whole loop, GC off; setup and cleanup are untimed. Per round each side runs one
warm-up and ``--reps`` timed repetitions (ns/op: median over them); the sides alternate
which goes first from round to round. Reported: the median ns/op per side over rounds, the
median of the per-round ratios with their min-max, and the verdict: "met" when the median
ratio meets the target, "inconclusive" when the per-round ratio spread crosses it,
"missed" otherwise.

    python benchmarks/bench_pool_ops.py [--rounds 5] [--blocks 1000,10000,100000] [--batches 1,16]
        [--reps 5] [--window 1024] [--out reports/bench]

Writes ``pool_ops.json`` and ``pool_ops.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcached._vmm import VirtualRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

import kvcached
from conformance.reporting import (
    Paragraph,
    Report,
    Section,
    Table,
    provenance,
    saved_environment,
    table,
    verdict,
    write_report,
)
from kvcached.config import KvcachedConfig
from kvcached.fence import StepFence
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.space import Geometry, KvSpace, plan_geometry

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.20
PAGE = 64 << 10  # kv page = one VMM page of the single backing
STRIDE = 2 << 10  # bytes per block: 32 blocks per kv page
BLOCK = 16  # tokens per block (= hash granularity)
MAPPED, MAPPING = "mapped", "mapping"

Groups = list[list[KVCacheBlock]]


class PassThroughPool(BlockPool):
    """vLLM's pool with the methods `ElasticBlockPool` overrides on the timed paths overridden
    by calls of ``super()``, nothing else: the cost of the override itself. (For
    ``cache_full_blocks`` that is the per-block ``_insert_block_hash``.)"""

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        return super().get_new_blocks(num_blocks)

    def free_blocks(self, ordered_blocks: Any) -> None:
        super().free_blocks(ordered_blocks)

    def touch(self, blocks: Any) -> None:
        super().touch(blocks)

    def _insert_block_hash(self, block_hash_with_group_id: Any, block: KVCacheBlock, num_tokens: int | None) -> None:
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)


@dataclass(frozen=True, slots=True)
class Ctx:
    """What one repetition of a cell runs: ``calls`` calls of ``batch`` blocks each."""

    batch: int
    calls: int
    requests: list[Request]


@dataclass(slots=True)
class Rig:
    """The native pool, two elastic pools (mapped, mapping) and the pass-through floor of one
    block count."""

    blocks: int
    geometry: Geometry
    native: BlockPool
    mapped: ElasticBlockPool
    mapping: ElasticBlockPool
    floor: BlockPool
    ranges: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for pool in (self.mapped, self.mapping):
            pool.close()
        for vrange in self.ranges:
            vrange.close()


@dataclass(slots=True)
class Clock:
    """Times one region; reads the pool's map counters from `kvcached.stats()` around it."""

    pool: BlockPool
    ns: int = 0
    maps: int = 0
    unmaps: int = 0
    _before: tuple[int, int] = (0, 0)
    _t0: int = 0

    def counters(self) -> tuple[int, int]:
        if not isinstance(self.pool, ElasticBlockPool) or self.pool.arena is None:
            return (0, 0)
        s = kvcached.stats()[self.pool.arena.stats_key]
        return (s.maps, s.unmaps)

    def __enter__(self) -> Clock:  # noqa: PYI034 - py3.10 has no typing.Self
        self._before = self.counters()
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ns += time.perf_counter_ns() - self._t0
        after = self.counters()
        self.maps += after[0] - self._before[0]
        self.unmaps += after[1] - self._before[1]


# ---- requests and pools ------------------------------------------------------------------
def make_requests(count: int, batch: int) -> list[Request]:
    """``count`` real vLLM requests of ``batch`` full blocks each, with distinct hash chains."""
    hasher = get_request_block_hasher(BLOCK, sha256)
    span = batch * BLOCK
    return [
        Request(request_id=f"bench{i}", prompt_token_ids=list(range(i * span, (i + 1) * span)),
                sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=hasher)
        for i in range(count)
    ]


def elastic(geometry: Geometry, reserve: int, name: str) -> tuple[ElasticBlockPool, Any]:
    """A detached `ElasticBlockPool`, attached to a real CPU-backed `KvSpace`."""
    vrange = VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    # No cached-block cap: both pools keep every freed cached block (native caching).
    config = KvcachedConfig(page_size=PAGE, min_reserve_pages=0, max_reserve_pages=reserve, max_cached_blocks=-1,
                            capacity_ttl_s=0.0, map_retries=0)
    pool = ElasticBlockPool(geometry.num_blocks, True, BLOCK, config=config, fence=StepFence(), name=name)
    pool.attach(KvSpace(geometry, (vrange,)))
    return pool, vrange


def build_rig(blocks: int) -> Rig:
    geometry = plan_geometry([STRIDE], blocks, PAGE)
    mapped, r1 = elastic(geometry, geometry.num_kv_pages, f"bench-mapped-{blocks}")
    mapping, r2 = elastic(geometry, 0, f"bench-mapping-{blocks}")
    rig = Rig(blocks, geometry, BlockPool(blocks, True, BLOCK), mapped, mapping, PassThroughPool(blocks, True, BLOCK),
              [r1, r2])
    release(mapped, [mapped.get_new_blocks(blocks - 1)])  # maps every page; they stay in the reserve
    return rig


def pool_stats(pool: ElasticBlockPool) -> kvcached.PoolStats:
    assert pool.arena is not None
    return kvcached.stats()[pool.arena.stats_key]


# ---- operations: untimed setup and cleanup around one timed region -----------------------
def release(pool: BlockPool, groups: Groups) -> None:
    """Free each group in reverse, last group first (how vLLM frees a request)."""
    for blocks in reversed(groups):
        pool.free_blocks(reversed(blocks))


def allocate(pool: BlockPool, ctx: Ctx) -> Groups:
    return [pool.get_new_blocks(ctx.batch) for _ in range(ctx.calls)]


def cache(pool: BlockPool, ctx: Ctx, groups: Groups) -> None:
    for request, blocks in zip(ctx.requests, groups, strict=True):
        pool.cache_full_blocks(request, blocks, 0, ctx.batch, BLOCK, 0)


def op_get_new_blocks(pool: BlockPool, ctx: Ctx, clock: Clock) -> None:
    with clock:
        groups = [pool.get_new_blocks(ctx.batch) for _ in range(ctx.calls)]
    release(pool, groups)


def op_free_blocks(pool: BlockPool, ctx: Ctx, clock: Clock) -> None:
    groups = allocate(pool, ctx)
    with clock:
        for blocks in reversed(groups):
            pool.free_blocks(reversed(blocks))


def op_touch_cached(pool: BlockPool, ctx: Ctx, clock: Clock) -> None:
    """Prefix hits on idle cached blocks (ref_cnt 0: removed from the free queue)."""
    groups = allocate(pool, ctx)
    cache(pool, ctx, groups)
    release(pool, groups)
    with clock:
        for blocks in groups:
            pool.touch(blocks)
    release(pool, groups)
    pool.reset_prefix_cache()


def op_touch_live(pool: BlockPool, ctx: Ctx, clock: Clock) -> None:
    """Prefix hits on blocks another request holds (ref_cnt 1 -> 2)."""
    groups = allocate(pool, ctx)
    with clock:
        for blocks in groups:
            pool.touch(blocks)
    release(pool, groups)
    release(pool, groups)


def op_cache_full_blocks(pool: BlockPool, ctx: Ctx, clock: Clock) -> None:
    groups = allocate(pool, ctx)
    with clock:
        for request, blocks in zip(ctx.requests, groups, strict=True):
            pool.cache_full_blocks(request, blocks, 0, ctx.batch, BLOCK, 0)
    release(pool, groups)
    pool.reset_prefix_cache()


Op = Callable[[BlockPool, Ctx, Clock], None]
OPS: dict[str, Op] = {
    "get_new_blocks": op_get_new_blocks,
    "free_blocks": op_free_blocks,
    "touch (cached hit)": op_touch_cached,
    "touch (live hit)": op_touch_live,
    "cache_full_blocks": op_cache_full_blocks,
}


# ---- measurement ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Cell:
    mode: str
    op: str
    blocks: int
    batch: int


@dataclass(slots=True)
class Sample:
    """One side of one cell in one round: ns per call (median over reps) and map counters."""

    ns_per_op: float
    maps: int  # over all timed reps
    unmaps: int
    reps: int
    unmapped_before: bool = True  # mapping mode: every rep started with only page 0 mapped
    warm_ns_per_op: float | None = None  # mapping mode: the same rep again, its pages still mapped
    excess_ns_per_op: float | None = None  # mapping mode: median over reps of (rep - its warm rep)
    warm_maps: int = 0

    @property
    def pages_per_rep(self) -> float:
        return self.maps / self.reps


def before_rep(pool: BlockPool, mode: str) -> bool:
    """Mapping mode: unmap every idle page; True when only the null block's page is left."""
    if mode != MAPPING or not isinstance(pool, ElasticBlockPool):
        return True
    pool.collect()
    s = pool_stats(pool)
    return s.mapped_bytes == s.kv_page_bytes


def measure(pool: BlockPool, cell: Cell, ctx: Ctx, reps: int) -> Sample:
    """One warm-up, then ``reps`` timed repetitions of the cell's operation on ``pool``."""
    op = OPS[cell.op]
    paired = cell.mode == MAPPING and isinstance(pool, ElasticBlockPool)
    before_rep(pool, cell.mode)
    op(pool, ctx, Clock(pool))
    per_rep: list[float] = []
    warm: list[float] = []
    sample = Sample(0.0, 0, 0, reps)
    for _ in range(reps):
        sample.unmapped_before &= before_rep(pool, cell.mode)
        clock = Clock(pool)
        op(pool, ctx, clock)
        per_rep.append(clock.ns / ctx.calls)
        sample.maps += clock.maps
        sample.unmaps += clock.unmaps
        if paired:  # same calls, same pool, the pages just mapped still in the reserve
            again = Clock(pool)
            op(pool, ctx, again)
            warm.append(again.ns / ctx.calls)
            sample.warm_maps += again.maps
    sample.ns_per_op = statistics.median(per_rep)
    if warm:
        sample.warm_ns_per_op = statistics.median(warm)
        sample.excess_ns_per_op = statistics.median(c - w for c, w in zip(per_rep, warm, strict=True))
    return sample


def cells(blocks: list[int], batches: list[int]) -> list[Cell]:
    out = [Cell(MAPPED, op, n, b) for n in blocks for op in OPS for b in batches]
    return out + [Cell(MAPPING, "get_new_blocks", n, b) for n in blocks for b in batches]


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(cell: Cell, calls: int, native: list[Sample], kvc: list[Sample], floor: list[Sample]) -> dict[str, Any]:
    """One cell's record: per-side medians over rounds, ratio spread, counters, verdict.

    Mapping mode adds the per-page cost, per round: timed ns of a rep / pages it mapped
    (``total``), and the median over reps of (rep ns - the same rep's ns with its pages
    already mapped) / pages mapped (``excess``: the map work itself).
    """
    ratios = [k.ns_per_op / n.ns_per_op for k, n in zip(kvc, native, strict=True)]
    maps, unmaps = sum(s.maps for s in kvc), sum(s.unmaps for s in kvc)
    rec: dict[str, Any] = {
        **asdict(cell), "calls_per_rep": calls,
        "native_ns_per_op": spread([s.ns_per_op for s in native]),
        "kvcached_ns_per_op": spread([s.ns_per_op for s in kvc]),
        "ratios": ratios, "ratio": spread(ratios), "maps_timed": maps, "unmaps_timed": unmaps,
    }
    if cell.mode == MAPPED:
        ok = maps == unmaps == 0
        rec.update(target=TARGET, verdict=verdict(ratios, TARGET) if ok else "invalid: mapped while timed",
                   floor_ratio=spread([f.ns_per_op / n.ns_per_op for f, n in zip(floor, native, strict=True)]))
        return rec
    rec.update(verdict="report only", unmapped_before_every_rep=all(s.unmapped_before for s in kvc),
               pages_mapped_per_rep=spread([s.pages_per_rep for s in kvc]))
    total = [s.ns_per_op * calls / s.pages_per_rep for s in kvc if s.maps]
    rec["ns_per_page_total"] = spread(total) if total else None
    warm = [s.warm_ns_per_op for s in kvc if s.warm_ns_per_op is not None]
    rec["kvcached_warm_ns_per_op"] = spread(warm) if warm else None
    rec["maps_warm"] = sum(s.warm_maps for s in kvc)
    excess = [s.excess_ns_per_op * calls / s.pages_per_rep for s in kvc if s.maps and s.excess_ns_per_op is not None]
    rec["ns_per_page_excess"] = spread(excess) if excess else None
    return rec


# ---- the run -------------------------------------------------------------------------------
@dataclass(slots=True)
class Run:
    """Everything one invocation measured (rigs stay open until `close`)."""

    rigs: dict[int, Rig]
    samples: dict[Cell, tuple[list[Sample], list[Sample], list[Sample]]] = field(default_factory=dict)
    calls: dict[Cell, int] = field(default_factory=dict)
    premap: dict[int, dict[str, int]] = field(default_factory=dict)

    def close(self) -> None:
        for rig in self.rigs.values():
            rig.close()


def mapped_state(rig: Rig) -> dict[str, int]:
    """The mapped pool's pages and map counters (mapped mode's precondition)."""
    s = pool_stats(rig.mapped)
    return {"kv_pages": rig.geometry.num_kv_pages, "pages_mapped": s.mapped_bytes // s.kv_page_bytes,
            "maps": s.maps, "unmaps": s.unmaps}


def run_cell(run: Run, cell: Cell, ctx: Ctx, reps: int, turn: int) -> list[Sample]:
    """[native, kvcached, pass-through floor (mapped mode only)], measured in an order that
    rotates with ``turn``."""
    rig = run.rigs[cell.blocks]
    pools = [rig.native, rig.mapped if cell.mode == MAPPED else rig.mapping]
    if cell.mode == MAPPED:
        pools.append(rig.floor)
    order = [(turn + i) % len(pools) for i in range(len(pools))]
    samples: dict[int, Sample] = {}
    gc.collect()
    gc.disable()
    try:
        for i in order:
            samples[i] = measure(pools[i], cell, ctx, reps)
    finally:
        gc.enable()
    return [samples[i] for i in range(len(pools))]


def execute(args: argparse.Namespace, progress: Any) -> Run:
    """Build the pools, check they are mapped, then run every cell once per round."""
    run = Run({})
    for n in args.blocks:
        t0 = time.perf_counter()
        run.rigs[n] = build_rig(n)
        run.premap[n] = mapped_state(run.rigs[n])
        progress.log(f"{n} blocks: pools built and pre-mapped in {time.perf_counter() - t0:.2f} s; "
                     f"mapped pool {run.premap[n]}")
    todo = cells(args.blocks, args.batches)
    requests: dict[tuple[int, int], list[Request]] = {}
    for r in range(args.rounds):
        for cell in todo:
            calls = max(1, min(cell.blocks - 1, args.window) // cell.batch)
            reqs = requests.setdefault((cell.batch, calls), make_requests(calls, cell.batch))
            measured = run_cell(run, cell, Ctx(cell.batch, calls, reqs), args.reps, turn=r)
            native, kvc = measured[:2]
            for side, sample in zip(run.samples.setdefault(cell, ([], [], [])), measured):
                side.append(sample)
            run.calls[cell] = calls
            progress.advance(f"round {r + 1} {cell.mode} {cell.op} n={cell.blocks} b={cell.batch}: "
                             f"{native.ns_per_op:.0f} / {kvc.ns_per_op:.0f} ns = "
                             f"{kvc.ns_per_op / native.ns_per_op:.2f}x, maps {kvc.maps}")
    return run


def records(run: Run) -> list[dict[str, Any]]:
    return [summarize(cell, run.calls[cell], *sides) for cell, sides in run.samples.items()]


# ---- report --------------------------------------------------------------------------------
def ns(d: dict[str, float]) -> str:
    return f"{d['median']:,.0f} ({d['min']:,.0f}-{d['max']:,.0f})"


def ratio(d: dict[str, float]) -> str:
    return f"{d['median']:.2f}x ({d['min']:.2f}-{d['max']:.2f})"


def _method(result: dict[str, Any]) -> str:
    a = result["args"]
    return (f"{a['rounds']} rounds (the order of the sides rotates from round to round), {a['reps']} timed reps per "
            f"side per round after one warm-up; a rep is {a['window']} blocks' worth of calls (fewer for a 1k pool), "
            "timed as one `perf_counter_ns` region, GC off. ns/op = ns per call: median over rounds (min-max); "
            "ratio = median of the per-round kvcached/native ratios (min-max). Elastic pool: real CPU memfd range, "
            f"{result['geometry']['blocks_per_page']} blocks per {PAGE >> 10} KiB kv page; prefix caching on, KV "
            "events off. Each call's ns includes the Python loop around it (tens of ns, the same on both sides). "
            "Verdict: met / inconclusive (ratio spread crosses the target) / missed.")


def _mapped_rows(result: dict[str, Any]) -> tuple[Table, Table]:
    """Mapped mode: the pools' pages before and after, and the cost per operation."""
    pages = [{"blocks": n, "kv pages": pre["kv_pages"], "pages mapped": pre["pages_mapped"],
              "maps / unmaps after pre-map": f"{pre['maps']} / {pre['unmaps']}",
              "maps / unmaps at end": f"{result['end_state'][n]['maps']} / {result['end_state'][n]['unmaps']}"}
             for n, pre in result["premap"].items()]
    ops = [{"op": rec["op"], "blocks": rec["blocks"], "batch": rec["batch"], "native ns/op": ns(rec["native_ns_per_op"]),
            "kvcached ns/op": ns(rec["kvcached_ns_per_op"]), "ratio": ratio(rec["ratio"]),
            "maps/unmaps timed": f"{rec['maps_timed']}/{rec['unmaps_timed']}", "verdict": rec["verdict"],
            "pass-through override / native": ratio(rec["floor_ratio"])}
           for rec in result["cells"] if rec["mode"] == MAPPED]
    return table(pages), table(ops)


def _mapping_rows(result: dict[str, Any]) -> Table:
    rows = []
    for rec in result["cells"]:
        if rec["mode"] == MAPPING:
            total, excess, warm = rec["ns_per_page_total"], rec["ns_per_page_excess"], rec["kvcached_warm_ns_per_op"]
            rows.append({"blocks": rec["blocks"], "batch": rec["batch"], "native ns/op": ns(rec["native_ns_per_op"]),
                         "kvcached ns/op": ns(rec["kvcached_ns_per_op"]), "ratio": ratio(rec["ratio"]),
                         "kvcached warm ns/op (maps)": f"{ns(warm) if warm else '-'} ({rec['maps_warm']})",
                         "pages mapped / rep": f"{rec['pages_mapped_per_rep']['median']:.0f}",
                         "ns/page total": ns(total) if total else "-", "ns/page excess": ns(excess) if excess else "-"})
    return table(rows)


def build(result: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``pool_ops.json``)."""
    pages, ops = _mapped_rows(result)
    per_op = (f"Per operation (target <= {TARGET:.2f}x; maps/unmaps = `kvcached.stats()` counter deltas summed over "
              "every timed region of the cell; the last column: vLLM's pool with the methods kvcached overrides "
              "there overridden by a call of `super()` only, timed in the same rounds, the floor of any Python "
              "override):")
    mapping = ("Idle pages are unmapped (`collect`) before every rep, and each rep is followed by the same rep with "
               "its pages still mapped (warm). Per-page cost = rep ns / pages mapped (total) and median over reps "
               "of (rep ns - its warm rep's ns) / pages mapped (excess, the map work itself).")
    tally = ", ".join(f"{k} {v}" for k, v in sorted(result["verdicts"].items()))
    body = (Section("Method", (Paragraph(_method(result)),)),
            Section("Mapped mode: every page mapped before timing", (pages, Paragraph(per_op), ops)),
            Section("Mapping included: `get_new_blocks` from an unmapped pool (reserve 0)",
                    (Paragraph(mapping), _mapping_rows(result))))
    return Report(subject="Pool operation cost: `ElasticBlockPool` / native `BlockPool`",
                  headline=f"Verdicts (mapped mode, target <= {TARGET:.2f}x): {tally}.",
                  environment=saved_environment(result), body=body, overview=dict(result["verdicts"]))


def ints(text: str) -> list[int]:
    """``"1000,10000"`` -> ``[1000, 10000]``."""
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=ints, default=[1000, 10000, 100000])
    ap.add_argument("--batches", type=ints, default=[1, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--window", type=int, default=1024, help="blocks per timed rep")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    ap.add_argument("--render", action="store_true", help="render the report again from pool_ops.json in --out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.render:
        print(write_report(build(json.loads((args.out / "pool_ops.json").read_text())), args.out, "pool_ops"))
        return 0
    from conformance.progress import RunProgress

    logging.getLogger("vllm").setLevel(logging.WARNING)  # reset_prefix_cache logs at INFO
    init_none_hash(sha256)
    # Read when the run starts: the code loaded now is the code measured.
    environment = provenance(["python", "benchmarks/bench_pool_ops.py", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.perf_counter()
    total = args.rounds * len(cells(args.blocks, args.batches))
    with RunProgress(total, "bench pool ops") as progress:
        run = execute(args, progress)
    try:
        recs = records(run)
        result = {
            "environment": environment.as_dict(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "geometry": {"page_size": PAGE, "block_stride": STRIDE, "block_tokens": BLOCK,
                         "blocks_per_page": run.rigs[args.blocks[0]].geometry.blocks_per_page},
            "premap": run.premap, "end_state": {n: mapped_state(rig) for n, rig in run.rigs.items()},
            "cells": recs, "seconds": round(time.perf_counter() - t0, 1),
            "verdicts": {v: sum(1 for r in recs if r["mode"] == MAPPED and r["verdict"] == v)
                         for v in {r["verdict"] for r in recs if r["mode"] == MAPPED}},
        }
    finally:
        run.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pool_ops.json").write_text(json.dumps(result, indent=1) + "\n")
    print(write_report(build(result), args.out, "pool_ops").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
