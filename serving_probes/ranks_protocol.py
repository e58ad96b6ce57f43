"""The scheduler↔ranks page protocol on a real device, with plain processes (no vLLM).

Two worker processes stand in for two tensor-parallel ranks: each reserves its own
`kvcached._vmm.VirtualRange`s on the device with the same geometry and answers
`kvcached.ranks.PageRequest`s through `RankPages`. The parent stands in for the scheduler: a
`PagePool` over a `RankedPageSpace` whose channel sends each request to both ranks in order
(a pipe per rank) and gathers their replies, as vLLM's ``collective_rpc`` does.

Checked, on every rank, through torch views of the ranges:

* pages the pool maps are writable and read back exactly on both ranks (a pattern per page);
* a refill sent ahead of demand is confirmed without waiting, and a take it covers sends nothing;
* a map refused on rank 1 only (``rank1_map`` injected) is undone on rank 0: both ranks hold
  exactly the pool's pages, and the pool maps again afterwards;
* after the pool closes, both ranks hold no page, and the device's free memory is back to
  its value before the ranks started.

    python -m serving_probes.ranks_protocol [--device cuda:0] [--out DIR]   # "cpu" works too
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

PAGE = 2 << 20
STRIDES = (64 << 10, 128 << 10)  # two backings per rank: 32 and 16 blocks per VMM page
NUM_BLOCKS = 4096


def _rank_main(rank: int, device: str, conn: Any, fault_plan: list[dict[str, object]]) -> None:
    """One rank: its ranges, its end of the protocol, and a checker for its bytes."""
    import torch

    from kvcached import _vmm
    from kvcached.faults import FaultInjector
    from kvcached.memory import tensor_view
    from kvcached.pages import PageSpace
    from kvcached.ranks import RankPages
    from kvcached.space import plan_geometry

    geometry = plan_geometry(STRIDES, NUM_BLOCKS, PAGE)
    ranges = tuple(_vmm.VirtualRange(device, size, PAGE) for size in geometry.reserved_bytes)
    faults = FaultInjector.from_plans(fault_plan) if fault_plan else None
    pages = RankPages(rank, PageSpace(ranges, geometry.vmm_pages, geometry.num_kv_pages), geometry, (), faults)
    conn.send(pages.layout())
    while True:
        op, arg = conn.recv()
        if op == "request":
            conn.send(pages.handle(arg))
        elif op == "check":  # write a pattern into every byte run of the pages, read it back
            ok = True
            for page in arg:
                for r, vrange in enumerate(ranges):
                    for v in pages.space.vmm_pages(r, page):
                        view = tensor_view(vrange, v * PAGE, PAGE, dtype=torch.uint8)
                        view.fill_((page * 7 + r + rank) % 251)
                        ok &= bool((view == (page * 7 + r + rank) % 251).all().item())
            conn.send(ok)
        elif op == "mapped":
            conn.send(sorted(pages.mapped))
        elif op == "stop":
            pages.close()
            for vrange in ranges:
                vrange.close()
            conn.send(True)
            return


class _Later:
    """A request's replies, read from the pipes in order (see `PipeChannel`)."""

    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns
        self.replies: list[Any] | None = None

    def done(self) -> bool:
        return self.replies is not None

    def result(self) -> list[Any]:
        if self.replies is None:
            self.replies = [c.recv() for c in self.conns]
        return self.replies


class PipeChannel:
    """Each request to every rank in order; every rank's reply, in the order sent (like
    vLLM's ``collective_rpc``, whose futures are resolved first in, first out)."""

    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns
        self.outstanding: list[_Later] = []

    def _send(self, message: object) -> _Later:
        for c in self.outstanding:  # replies come back in order: earlier ones first
            c.result()
        self.outstanding = []
        for conn in self.conns:
            conn.send(message)
        return _Later(self.conns)

    def call(self, request: Any) -> list[Any]:
        return self._send(("request", request)).result()

    def call_later(self, request: Any) -> _Later:
        later = self._send(("request", request))
        self.outstanding.append(later)
        return later

    def ask(self, op: str, arg: object = None) -> list[Any]:
        return self._send((op, arg)).result()


def _free_bytes(device: str) -> int:
    if device == "cpu":
        return 0
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def run(device: str) -> dict[str, object]:
    from kvcached.config import KvcachedConfig
    from kvcached.errors import PhysicalMemoryExhausted
    from kvcached.pages import PagePool
    from kvcached.ranks import RankedPageSpace, check_layouts

    free_before = _free_bytes(device)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    plan = [{"site": "rank1_map", "skip": 3, "fail_next": 1}]
    procs = [ctx.Process(target=_rank_main, args=(r, device, pipes[r][1], plan if r == 1 else []))
             for r in range(2)]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    geometry, _, _ = check_layouts([c.recv() for c in conns])
    channel = PipeChannel(conns)
    space = RankedPageSpace(geometry, channel, 2)
    pool = PagePool(space, KvcachedConfig(page_size=PAGE, min_reserve_pages=1, max_reserve_pages=2,
                                          map_retries=0))
    out: dict[str, object] = {"device": device, "kv_pages": geometry.num_kv_pages,
                              "kv_page_bytes": space.kv_page_bytes}
    refused = False
    for page in range(12):
        try:
            pool.acquire([page])
        except PhysicalMemoryExhausted:
            refused = True
            pool.acquire([page])  # the next request maps on both ranks
    held = sorted(pool.in_use)
    mapped = channel.ask("mapped")
    out.update(
        bytes_exact_on_both_ranks=all(channel.ask("check", held)),
        refusal_on_rank1_seen=refused or pool.counters().map_failures > 0,
        ranks_hold_the_pools_pages=mapped[0] == mapped[1] == sorted(pool.mapped | set(pool.pending)),
        blocking_round_trips=dict(space.calls), refills_sent_ahead=space.deferred,
    )
    pool.release(held)
    pool.close()
    out["ranks_empty_after_close"] = channel.ask("mapped") == [[], []]
    channel.ask("stop")
    for p in procs:
        p.join(60)
    out["free_bytes_before"], out["free_bytes_after"] = free_before, _free_bytes(device)
    out["memory_returned"] = out["free_bytes_after"] == free_before or device == "cpu"
    out["passed"] = all(out[k] for k in ("bytes_exact_on_both_ranks", "refusal_on_rank1_seen",
                                         "ranks_hold_the_pools_pages", "ranks_empty_after_close",
                                         "memory_returned"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, default=None, help="write ranks_protocol.json there")
    args = ap.parse_args(argv)
    result = run(args.device)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ranks_protocol.json").write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
