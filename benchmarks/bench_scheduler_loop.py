"""Scheduler cost without a model: ``schedule`` + ``update_from_output``, kvcached / native.

`bench_scheduler.py` times the scheduler inside a real engine, where the forward pass
between steps (and other processes) moves the step times by tens of percent. This one
drives two `Scheduler` (or `AsyncScheduler`) instances directly in one process, with
model outputs made up from a seeded generator: one with vLLM's own pool, one with
kvcached's (a real CPU-backed KV range of ``--blocks`` blocks). The two run in lockstep, a
step of one then the same step of the other, which goes first alternating per step, so
both meet the same machine. kvcached's seams are installed once, for the whole run: the
native scheduler (built before they were, so its pool is vLLM's) passes through them, a
type check per wrapped call (~0.07 µs per running request per step). Installing them
around each kvcached step instead (until 12-06) kept the native steps untouched, but every
install and uninstall changes vLLM's classes, which discards CPython's specialized code
for both: measured at 128 requests, that put kvcached's extra at 1.63-1.98 µs per running
request per step against 1.07-1.15 with the seams installed once. GC is off while timing.

A run: ``--concurrency`` requests with a shared prefix, ``--max-tokens`` outputs each, all
submitted at once, stepped until done, then ``reset_prefix_cache``. The two runs of a pair
get the same requests and the same sampled tokens, so both sides take the same steps
(checked: the scheduled tokens per step must be equal). The cached-block cap is off
(``KVCACHED_MAX_CACHED_BLOCKS=-1``), so prefix hits are native.

Per configuration: the median over a run's steps of the per-step time, each side, and the
kvcached/native ratio of each pair; the verdict is judged on those ratios (target <= 1.10x).

    python benchmarks/bench_scheduler_loop.py [--pairs 9] [--blocks 1000,10000,100000]
        [--concurrency 64,256] [--schedulers sync,async] [--page-size 65536,2097152]
        [--out reports/bench] [--render]

Writes ``scheduler_loop.json`` (the results, the settings and the environment block) and the
report (``.md``, ``.html``, ``.csv``) through ``conformance.reporting``; ``--render`` writes
the report again from the JSON, running nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conformance.engine_env import without_kvcached
from conformance.reporting import (
    RULE,
    Paragraph,
    Report,
    Section,
    column,
    columns_of,
    provenance,
    saved_environment,
    table,
    verdict,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.10
STEM, STEM_JSON = "scheduler_loop", "scheduler_loop.json"
BLOCK = 16  # tokens per block
ENV = {"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "PYTHONHASHSEED": "0", "KVCACHED_BUDGET_PATH": "off", "KVCACHED_MAX_CACHED_BLOCKS": "-1"}


@dataclass(frozen=True)
class Config:
    scheduler: str  # "sync" | "async"
    blocks: int
    concurrency: int
    page_size: int


@dataclass(frozen=True)
class Result:
    config: Config
    native_ms: list[float]  # per pair: median step time
    kvcached_ms: list[float]
    steps: int
    same_schedule: bool

    @property
    def ratios(self) -> list[float]:
        return [k / n for n, k in zip(self.native_ms, self.kvcached_ms)]


# ---- in the child: two schedulers, alternating ---------------------------------------------
def _scheduler(config: Config, kvcached: bool, max_model_len: int = 1024,
               attach_space: Callable[[Any, int, Config], None] | None = None) -> Any:
    """A scheduler over ``config.blocks`` blocks of a 2-KiB-per-block full-attention layer;
    kvcached's space from ``attach_space`` (default `_attach_space`: a local CPU range)."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    from conformance.cases import ARCHETYPES
    from conformance.models import ensure_model

    model = ModelConfig(model=str(ensure_model(ARCHETYPES["llama"].model)), skip_tokenizer_init=True,
                        dtype="float32", max_model_len=max_model_len, seed=0)
    sched = SchedulerConfig(max_num_seqs=config.concurrency, max_num_batched_tokens=8192, max_model_len=max_model_len,
                            is_encoder_decoder=False, async_scheduling=config.scheduler == "async")
    vllm_config = VllmConfig(model_config=model, scheduler_config=sched, device_config=DeviceConfig("cpu"),
                             cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True))
    vllm_config.cache_config.num_gpu_blocks = config.blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=config.blocks, kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
                              kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * config.blocks,
                                                              shared_by=["layer"])])
    if kvcached:
        (attach_space or _attach_space)(kv_config, spec.page_size_bytes, config)
    cls = AsyncScheduler if config.scheduler == "async" else Scheduler
    return cls(vllm_config, kv_config, StructuredOutputManager(vllm_config), block_size=BLOCK,
               hash_block_size=BLOCK)


def _attach_space(kv_config: Any, stride: int, config: Config) -> None:
    """Leave a real CPU KV space where the EngineCore seam leaves the workers' layout."""
    from kvcached._vmm import VirtualRange

    from kvcached.config import KvcachedConfig
    from kvcached.integration.vllm import engine
    from kvcached.space import KvSpace, plan_geometry

    geometry = plan_geometry([stride], config.blocks, config.page_size)
    vrange = VirtualRange("cpu", geometry.reserved_bytes[0], config.page_size)
    space = KvSpace(geometry, (vrange,), config=KvcachedConfig.resolve(page_size=config.page_size))
    setattr(kv_config, engine.SPACE_ATTRIBUTE, space)


def hashed_requests(prompts: list[list[int]], max_tokens: int, tag: str) -> list[Any]:
    """vLLM requests ``TAG-i`` of ``prompts``, greedy past EOS for ``max_tokens``, with the block
    hasher a prefix-caching engine gives them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [Request(f"{tag}-{i}", prompt, params, None, block_hasher=hasher) for i, prompt in enumerate(prompts)]


def _requests(n: int, max_tokens: int, seed: int, tag: str) -> list[Any]:
    """``n`` requests sharing prefixes of one 256-token root, each with a short suffix of its own."""
    r = random.Random(seed)
    root = [r.randrange(3, 1024) for _ in range(256)]
    prompts = [root[: r.randrange(16, 200)] + [r.randrange(3, 1024) for _ in range(r.randrange(1, 32))]
               for _ in range(n)]
    return hashed_requests(prompts, max_tokens, tag)


class _Side:
    """One scheduler of a pair and its run: its requests, its made-up tokens, its step times."""

    def __init__(self, sched: Any, requests: list[Any], seed: int) -> None:
        self.sched = sched
        self.tokens = random.Random(seed)
        self.step_s: list[float] = []
        self.scheduled: list[int] = []
        for request in requests:
            sched.add_request(request)

    @property
    def running(self) -> bool:
        return self.sched.has_unfinished_requests()

    def step(self) -> None:
        """One step: the seconds in ``schedule`` + ``update_from_output`` and the tokens scheduled."""
        from vllm.v1.outputs import ModelRunnerOutput

        t0 = time.perf_counter()
        out = self.sched.schedule()
        t1 = time.perf_counter()
        ids = list(out.num_scheduled_tokens)
        model_out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                      sampled_token_ids=[[self.tokens.randrange(3, 1024)] for _ in ids])
        t2 = time.perf_counter()
        self.sched.update_from_output(out, model_out)
        self.step_s.append(t1 - t0 + time.perf_counter() - t2)
        self.scheduled.append(out.total_num_scheduled_tokens)

    def finish(self) -> None:
        self.sched.reset_prefix_cache()


def _lockstep(native: _Side, elastic: _Side) -> None:
    """Step both sides in turn, which goes first alternating per step: a step of one and the
    same step of the other are a millisecond apart, so what slows the machine down slows
    both (on 2 shared cores, runs a minute apart differed by 0.6-1.7x)."""
    step = 0
    while native.running or elastic.running:
        for side in (native, elastic) if step % 2 == 0 else (elastic, native):
            if side.running:
                side.step()
        step += 1
    native.finish()
    elastic.finish()


def child(config: Config, pairs: int, max_tokens: int) -> Result:
    from kvcached.integration.vllm import scheduler as seams
    from kvcached.integration.vllm.capabilities import detect

    native = _scheduler(config, kvcached=False)  # before the seams: vLLM's own pool
    seams.install(detect(), enabled=True, planned=seams.plan())
    try:
        elastic = _scheduler(config, kvcached=True)
        times: dict[str, list[float]] = {"native": [], "kvcached": []}
        same, steps = True, 0
        gc.disable()
        for i in range(pairs + 1):  # pair 0 warms both up and is dropped
            sides = {"native": _Side(native, _requests(config.concurrency, max_tokens, i, f"native{i}"), i),
                     "kvcached": _Side(elastic, _requests(config.concurrency, max_tokens, i, f"kvcached{i}"), i)}
            _lockstep(sides["native"], sides["kvcached"])
            if i:
                for name, side in sides.items():
                    times[name].append(statistics.median(side.step_s) * 1e3)
            same &= sides["native"].scheduled == sides["kvcached"].scheduled
            steps = len(sides["native"].scheduled)
            gc.collect()
        gc.enable()
    finally:
        seams.uninstall()
    return Result(config, times["native"], times["kvcached"], steps, same)


# ---- parent --------------------------------------------------------------------------------
def sample(config: Config, pairs: int, max_tokens: int) -> Result:
    env = without_kvcached(dict(os.environ)) | ENV
    spec = json.dumps({"config": asdict(config), "pairs": pairs, "max_tokens": max_tokens})
    proc = subprocess.run([sys.executable, __file__, "--child", spec], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    raw = json.loads(line[len("RESULT "):])
    return Result(Config(**raw.pop("config")), **raw)


@dataclass(frozen=True)
class Row:
    """One configuration: its schedule, both sides' step times and the judged ratio."""

    scheduler: str
    blocks: int
    concurrency: int
    kv_page: str
    steps: int
    native_ms_per_step: str = field(metadata=column("native ms/step"))
    kvcached_ms_per_step: str = field(metadata=column("kvcached ms/step"))
    ratio: str
    verdict: str = field(metadata=column(f"verdict (<= {TARGET:.2f}x)"))
    same_schedule: str


def _row(r: Result) -> Row:
    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    c, ratios = r.config, r.ratios
    return Row(c.scheduler, c.blocks, c.concurrency, f"{c.page_size >> 10} KiB", r.steps, ms(r.native_ms),
               ms(r.kvcached_ms), f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
               verdict(ratios, TARGET), "yes" if r.same_schedule else "NO")


def load(saved: dict[str, Any]) -> tuple[list[Result], dict[str, Any]]:
    """``scheduler_loop.json`` read back: the results and the run's settings."""
    results = [Result(Config(**r["config"]), r["native_ms"], r["kvcached_ms"], r["steps"], r["same_schedule"])
               for r in saved["results"]]
    return results, saved["meta"]


def build(saved: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``scheduler_loop.json``)."""
    results, meta = load(saved)
    rows = [_row(r) for r in results]
    counts = Counter(row.verdict for row in rows)
    tally = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    method = (f"{meta['pairs']} pairs per configuration (both runs of a pair in lockstep), {meta['max_tokens']} "
              f"output tokens per request, {BLOCK}-token blocks of 2 KiB. Step times: median over the run's steps, "
              "then median over pairs (min-max). Ratio: median of the pairs' kvcached/native ratios (min-max).")
    body = (Section("Method", (Paragraph(__doc__.split("\n\n")[1].replace("\n", " ")), Paragraph(method))),
            Section("Step times", (table(rows, columns_of(Row)), Paragraph(f"Verdicts: {tally}. {RULE}"))))
    return Report(subject="Scheduler cost without a model (`schedule` + `update_from_output`, per step)",
                  headline=f"kvcached/native step time, target <= {TARGET:.2f}x: {tally}.",
                  environment=saved_environment(meta), body=body,
                  overview={"configurations": len(rows), **counts})


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[2])
        result = child(Config(**spec["config"]), spec["pairs"], spec["max_tokens"])
        print("RESULT " + json.dumps(asdict(result)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--blocks", default="1000,10000,100000")
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--schedulers", default="sync,async")
    ap.add_argument("--page-size", default="65536,2097152")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    ap.add_argument("--render", action="store_true", help="render the report again from scheduler_loop.json in --out")
    args = ap.parse_args()
    if args.render:
        print(write_report(build(json.loads((args.out / STEM_JSON).read_text())), args.out, STEM))
        return 0
    configs = [Config(s, int(b), int(c), int(p)) for s in args.schedulers.split(",")
               for b in args.blocks.split(",") for c in args.concurrency.split(",")
               for p in args.page_size.split(",")]
    # Read when the run starts: the code loaded now is the code measured.
    environment = provenance(["python", "benchmarks/bench_scheduler_loop.py", *sys.argv[1:]])
    results = []
    for config in configs:
        results.append(sample(config, args.pairs, args.max_tokens))
        r = results[-1]
        print(f"{config}: ratio {statistics.median(r.ratios):.3f} ({min(r.ratios):.3f}-{max(r.ratios):.3f})",
              flush=True)
    meta = {"pairs": args.pairs, "max_tokens": args.max_tokens, "environment": environment.as_dict()}
    saved = {"meta": meta, "results": [asdict(r) | {"ratios": r.ratios} for r in results]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / STEM_JSON).write_text(json.dumps(saved, indent=1) + "\n")
    print(write_report(build(saved), args.out, STEM).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
