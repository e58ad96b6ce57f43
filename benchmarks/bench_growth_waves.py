"""Growth waves: the kv pages kvcached's scheduler maps, or waits for, on its path in a burst shaped
like the GPU serving benchmark's saturation phase. Counted, not timed.

The GPU run of 12-06 (`reports/gpu/serving/run-12-06b`, an H100) lost most of saturation's
throughput in growth waves: the random dataset's requests all have 1,024 prompt and 256 output
tokens, so at 128 in flight they start and end together, and each wave's prefill steps of 8,192
tokens take 8 or 9 kv pages of 64 blocks. 200-208 of a burst's 509 maps were made or waited for
inside `schedule`, at 2.9 ms each. This benchmark drives one kvcached `AsyncScheduler` directly
(`bench_scheduler_loop._scheduler`) through bursts of that shape: ``--requests`` requests of
random prompts, at most ``--in-flight`` of them unfinished (a new one as one ends, as the client's
``--max-concurrency`` does), outputs made up (a token once a request's prompt is done). Its pages
live on one in-process rank (`RankPages` over a real CPU range) behind the `RankedPageSpace` a
multiprocess engine uses, through `StepChannel`: a request sent without waiting is applied when
the next step starts, as a worker's replies are in by then when its maps take less than a step
(``--replies step``; how fast they are is the map-rate probe's question, this counts what the
policy leaves on the path), or only once the scheduler waits for it (``--replies waited``: maps
slower than any step, the bound on the other side). A request the scheduler waits for is applied
at once, and the pool counts it as blocking.

Per step, from the pool's own counters (`PagePool.counters`): pages taken, and pages mapped or
waited for while ``schedule`` ran (``blocking_maps``). Counts depend only on the seed and the
code, so a before/after needs no alternation: run this file against another tree's kvcached
(``PYTHONPATH=TREE:reports/bench/scheduler_loop_before_after``, whose ``sitecustomize`` drops the
editable install) with ``--label`` naming it; each label is one row of the report.

    python benchmarks/bench_growth_waves.py [--label NAME] [--replies step,waited] [--bursts 2]
        [--out reports/bench] [--render]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_scheduler_loop as loop

from conformance.reporting import (
    Bullets,
    Paragraph,
    Report,
    Section,
    provenance,
    saved_environment,
    table,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
STEM = "growth_waves"
BLOCK = loop.BLOCK
BLOCKS_PER_PAGE = 64  # the 1b model's 32 MiB kv page holds 64 blocks of 16 tokens
POOL_BLOCKS = (16 << 30) // (32 << 20) * BLOCKS_PER_PAGE  # the GPU run's 16 GiB pool: 512 pages
PROMPT, OUTPUT = 1024, 256
#: A prefill step's tokens: this many or more (of 8,192) marks a step of a wave.
PREFILL_TOKENS = 4096


@dataclass(frozen=True)
class Shape:
    requests: int = 512
    in_flight: int = 128
    seed: int = 0


#: When a request sent without waiting is applied: at the next step's start, or when waited for.
REPLIES = ("step", "waited")


class StepChannel:
    """One in-process rank, in order: a request sent without waiting is applied when its
    result is asked for, or before (``at_step``) at the next `step`, a step's start."""

    def __init__(self, rank: Any, at_step: bool) -> None:
        self.rank = rank
        self.at_step = at_step
        self.queue: list[tuple[Any, list[Any]]] = []

    def step(self) -> None:
        if self.at_step:
            self.flush()

    def call(self, request: Any) -> list[Any]:
        self.flush()  # in order: what was sent before is applied first
        return [self.rank.handle(request)]

    def call_later(self, request: Any) -> Any:
        replies: list[Any] = []
        self.queue.append((request, replies))
        channel = self

        class Later:
            def done(self) -> bool:
                return bool(replies)

            def result(self) -> list[Any]:
                if not replies:
                    channel.flush()
                return replies

        return Later()

    def flush(self) -> None:
        while self.queue:
            request, replies = self.queue.pop(0)
            replies.append(self.rank.handle(request))


def _ranked_space(channels: list[StepChannel], at_step: bool) -> Any:
    """`bench_scheduler_loop._scheduler`'s ``attach_space``: the pool's pages on one rank."""

    def attach(kv_config: Any, stride: int, config: loop.Config) -> None:
        from kvcached._vmm import VirtualRange

        from kvcached.config import KvcachedConfig, device_defaults
        from kvcached.integration.vllm import engine
        from kvcached.pages import PageSpace
        from kvcached.ranks import RankedPageSpace, RankPages, RankReply
        from kvcached.space import KvSpace, plan_geometry

        geometry = plan_geometry([stride], config.blocks, config.page_size)
        vrange = VirtualRange("cpu", geometry.reserved_bytes[0], config.page_size)
        rank = RankPages(0, PageSpace((vrange,), geometry.vmm_pages, geometry.num_kv_pages, None), geometry)
        channels.append(StepChannel(rank, at_step))
        pages = RankedPageSpace(geometry, channels[-1], 1)
        pages.note_available([RankReply(0, True, available_bytes=rank.layout().available_bytes)])
        kv = KvcachedConfig.resolve(defaults=device_defaults("cuda"), page_size=config.page_size)  # the GPU's
        setattr(kv_config, engine.SPACE_ATTRIBUTE, KvSpace(geometry, config=kv, pages=pages))

    return attach


def _requests(shape: Shape, burst: int) -> list[Any]:
    r = random.Random(shape.seed * 1000 + burst)
    prompts = [[r.randrange(3, 30000) for _ in range(PROMPT)] for _ in range(shape.requests)]
    return loop.hashed_requests(prompts, OUTPUT, f"b{burst}")


def _step(sched: Any, pool: Any, channel: StepChannel, tokens: random.Random) -> list[int]:
    """One step; returns [tokens scheduled, pages taken, blocking maps in schedule, blocking maps,
    idle mapped pages at its end (the reserve, refills in flight included)]."""
    from vllm.v1.outputs import ModelRunnerOutput

    channel.step()  # the last step's replies are in (``--replies step``)
    before = pool.counters()
    out = sched.schedule()
    mid = pool.counters()
    ids = list(out.num_scheduled_tokens)
    reqs = sched.requests
    sampled = [[tokens.randrange(3, 30000)] if reqs[r].num_computed_tokens >= reqs[r].num_prompt_tokens else []
               for r in ids]
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                    sampled_token_ids=sampled))
    after = pool.counters()
    return [out.total_num_scheduled_tokens, after.takes - before.takes, mid.blocking_maps - before.blocking_maps,
            after.blocking_maps - before.blocking_maps, after.reserve_pages]


def run(shape: Shape, bursts: int, replies: str) -> list[list[list[int]]]:
    """Every burst's steps (`_step`'s rows); the first burst starts from an empty pool."""
    from kvcached.integration.vllm import scheduler as seams
    from kvcached.integration.vllm.capabilities import detect

    channels: list[StepChannel] = []
    seams.install(detect(), enabled=True, planned=seams.plan())
    try:
        config = loop.Config("async", POOL_BLOCKS, 2 * shape.in_flight, BLOCKS_PER_PAGE * 2048)
        sched = loop._scheduler(config, kvcached=True, max_model_len=PROMPT + OUTPUT + BLOCK,
                                attach_space=_ranked_space(channels, replies == "step"))
        pool = sched.kv_cache_manager.block_pool.page_pool
        tokens = random.Random(shape.seed)
        out = []
        for burst in range(bursts):
            todo, rows = _requests(shape, burst), []
            while todo or sched.has_unfinished_requests():
                while todo and sched.get_num_unfinished_requests() < shape.in_flight:
                    sched.add_request(todo.pop(0))
                rows.append(_step(sched, pool, channels[0], tokens))
            out.append(rows)
        sched.kv_cache_manager.block_pool.close()
    finally:
        seams.uninstall()
    return out


@dataclass(frozen=True)
class Row:
    label: str
    replies: str
    burst: int
    steps: int
    pages_taken: int
    blocking_maps_in_schedule: int
    steps_that_blocked: int
    of_them_wave_starts: int
    blocking_maps_in_the_step: int
    #: What the reserve costs: idle mapped pages at a step's end, the mean over the burst's steps.
    idle_pages_mean: float
    idle_pages_max: int


def summarize(label: str, replies: str, bursts: list[list[list[int]]]) -> list[Row]:
    rows = []
    for i, steps in enumerate(bursts, 1):
        blocked = [k for k, s in enumerate(steps) if s[2]]
        # A wave's first step: a prefill step after a step that was not one.
        starts = [k for k in blocked if steps[k][0] >= PREFILL_TOKENS and (k == 0 or steps[k - 1][0] < PREFILL_TOKENS)]
        idle = [s[4] for s in steps]
        rows.append(Row(label, replies, i, len(steps), sum(s[1] for s in steps), sum(s[2] for s in steps), len(blocked),
                        len(starts), sum(s[3] for s in steps), round(sum(idle) / len(idle), 1), max(idle)))
    return rows


def build(saved: dict[str, Any]) -> Report:
    runs = saved["runs"]
    rows = [row for r in runs for row in summarize(r["label"], r["replies"], r["bursts"])]
    shape = Shape(**runs[0]["shape"])
    method = (f"Bursts of {shape.requests} requests of {PROMPT} random prompt and {OUTPUT} output tokens, at most "
              f"{shape.in_flight} in flight, {BLOCK}-token blocks, {BLOCKS_PER_PAGE} a kv page, a pool of "
              f"{POOL_BLOCKS} blocks, vLLM's AsyncScheduler with 8,192 tokens a step; kvcached at its CUDA defaults. Burst 1 "
              "starts from an empty pool, later ones from what the burst before left. Blocking maps: pages "
              "mapped, or waited for, on the scheduler's path (the pool's `blocking_maps`), inside `schedule` "
              "and over the whole step. Idle pages: mapped pages holding no block at a step's end (the reserve and "
              "refills in flight, `reserve_pages`), what keeping pages ahead of demand costs.")
    commands = {f"{r['label']}: `{r['environment']['command']}` (kvcached and harness at git "
                f"{r['environment']['git']})": None for r in runs}  # one line per label, in order
    body = (Section("Method", (Paragraph(__doc__.split("\n\n")[1].replace("\n", " ").replace("``", "`")), Paragraph(method),
                               Paragraph("Runs:"), Bullets(tuple(commands)))),
            Section("Pages on the scheduler's path", (table(rows),)))
    said = {"step": "replies in by the next step", "waited": "replies only when waited for"}
    last = {f"{r.label}, {said[r.replies]}": r.blocking_maps_in_schedule for r in rows
            if r.burst == len(runs[0]["bursts"])}
    return Report(subject="Growth waves: kv pages mapped on the scheduler's path in a saturation burst (counted)",
                  headline="Blocking maps inside `schedule` in the last burst: "
                           + "; ".join(f"{k}: {v}" for k, v in last.items()) + ".",
                  environment=saved_environment(runs[-1]), body=body, overview={"runs": len(runs)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="this tree", help="the row's name (a tree, a setting)")
    ap.add_argument("--replies", default=",".join(REPLIES), help=f"comma-separated, of {','.join(REPLIES)}")
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--requests", type=int, default=Shape.requests)
    ap.add_argument("--in-flight", type=int, default=Shape.in_flight)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    ap.add_argument("--render", action="store_true", help=f"render the report again from {STEM}.json in --out")
    args = ap.parse_args()
    path = args.out / f"{STEM}.json"
    if args.render:
        print(write_report(build(json.loads(path.read_text())), args.out, STEM))
        return 0
    if args.bursts < 1 or args.requests < 1 or args.in_flight < 1:
        ap.error("--bursts, --requests and --in-flight must be positive")
    modes = args.replies.split(",")
    if unknown := sorted(set(modes) - set(REPLIES)):
        ap.error(f"--replies: unknown {unknown}; of {','.join(REPLIES)}")
    shape = Shape(args.requests, args.in_flight)
    # Another tree's kvcached comes through PYTHONPATH: the command names it.
    via = [f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
    environment = provenance([*via, "python", "benchmarks/bench_growth_waves.py", *sys.argv[1:]])
    saved = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    for replies in modes:
        t0 = time.monotonic()
        bursts = run(shape, args.bursts, replies)
        for row in summarize(args.label, replies, bursts):
            print(row, flush=True)
        print(f"{time.monotonic() - t0:.0f} s", flush=True)
        saved["runs"] = [r for r in saved["runs"] if (r["label"], r["replies"]) != (args.label, replies)] + [
            {"label": args.label, "replies": replies, "shape": asdict(shape), "bursts": bursts,
             "environment": environment.as_dict()}]
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved) + "\n")
    print(write_report(build(saved), args.out, STEM).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
