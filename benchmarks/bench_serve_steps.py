"""Scheduler time per step inside the EngineCore of `vllm serve`, kvcached / native.

The in-process counterpart is ``bench_scheduler.py``; this one measures where users run:
a real OpenAI server (``conformance.serving.server.serving``: multiprocess engine, the
EngineCore and its worker are processes of their own, loopback only, ``--enforce-eager``,
prefix caching on, seed 0) with a pool of ``--blocks`` KV blocks
(``--num-gpu-blocks-override``) and ``--max-num-seqs`` the largest concurrency. Inside the
EngineCore the harness's step timer (``conformance.engine.step_timer``, switched on by
``CONFORMANCE_AGENT=1`` and ``CONFORMANCE_STEP_LOG``, loaded on both sides as the only other
plugin) times ``Scheduler.schedule`` + ``update_from_output`` of every step, kvcached's seams
included.

Load: ``vllm bench serve`` (random dataset, 16 prompt / 32 output tokens, ``--ignore-eos``,
greedy, the local word-level tokenizer, the same seed on both sides) at ``--max-concurrency``
C with 3C prompts, for each C in ``--concurrency``, one after the other against the same
server. A step belongs to the phase whose client was running when it was scheduled; only
steps that scheduled exactly C requests count (the batch the phase is about; a ramp or a
tail has fewer), so both sides compare the same batch size.

Rounds alternate which side runs first; a fresh server per side, pool and round. Per pool
and concurrency the report gives each side's median ms per step (median over rounds, min-max)
and the median of the per-round ratios with the shared verdict rule (``verdicts.py``;
target <= 1.10x, issue #12).

    python benchmarks/bench_serve_steps.py [--rounds 3] [--blocks 1000,10000,100000]
        [--concurrency 64,256] [--out reports/bench]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_client import BenchClient
from bench_serving import prepare_model, run_phase

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
INPUT_LEN, OUTPUT_LEN = 16, 32
PAGE_SIZE = 64 << 10  # as bench_scheduler.py: a kv page of 32 blocks, mapped every few steps


@dataclass(frozen=True)
class Load:
    """One client phase: ``concurrency`` requests in flight, ``3 x concurrency`` prompts."""

    name: str
    concurrency: int
    seed: int

    @property
    def num_prompts(self) -> int:
        return 3 * self.concurrency


@dataclass(frozen=True)
class Steps:
    """The full-batch steps of one phase on one server."""

    side: str
    blocks: int
    concurrency: int
    round: int
    step_s: list[float]
    steps_in_phase: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


def _client_phase(client: BenchClient, port: int, tok_dir: Path, load: Load, out: Path,
                  tag: str) -> tuple[float, float]:
    """Run one client phase; returns its wall-clock window."""
    from bench_serving import PhaseConfig

    phase = PhaseConfig(load.name, float("inf"), load.concurrency, load.num_prompts, load.seed)
    t0 = time.time()
    run_phase(client, port, tok_dir, phase, out, tag, lengths=(INPUT_LEN, OUTPUT_LEN))
    return t0, time.time()


def serve_once(side: str, blocks: int, loads: list[Load], tok_dir: Path, out: Path, rnd: int) -> list[Steps]:
    """One server: every load against it; its step log split by phase."""
    from bench_serving import check_active

    from conformance.engine.step_timer import read_rows
    from conformance.serving import ServerSpec, serving

    step_log = out / f"{side}-{blocks}-r{rnd}.steps.jsonl"
    step_log.unlink(missing_ok=True)
    plugins = "kvcached,conformance_agent" if side == "kvcached" else "conformance_agent"
    env: tuple[tuple[str, str], ...] = (("VLLM_PLUGINS", plugins), ("CONFORMANCE_AGENT", "1"),
                                        ("CONFORMANCE_STEP_LOG", str(step_log)))
    if side == "kvcached":  # native-equivalent caching: the same prefix hits, the same batches
        env += (("KVCACHED_PAGE_SIZE", str(PAGE_SIZE)), ("KVCACHED_MAX_CACHED_BLOCKS", "-1"))
    largest = max(load.concurrency for load in loads)
    spec = ServerSpec(side, side == "kvcached", extra_env=env,
                      extra_args=("--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(largest)))
    windows = {}
    with BenchClient(out / f"{side}-{blocks}-r{rnd}.client.log") as client, \
            serving(spec, tok_dir, out / f"{side}-{blocks}-r{rnd}", max_model_len=256, start_timeout_s=300.0) as server:
        check_active(f"{blocks} blocks", side, server.log())
        for load in loads:
            windows[load] = _client_phase(client, server.port, tok_dir, load, out,
                                          f"{side}-{blocks}-r{rnd}-{load.name}")
    rows = read_rows(step_log) if step_log.is_file() else []
    found = []
    for load, (t0, t1) in windows.items():
        phase = [r for r in rows if t0 <= r[0] <= t1]
        full = [r[1] + r[2] for r in phase if r[3] == load.concurrency]
        if not full:
            raise RuntimeError(f"{side}, {blocks} blocks, C={load.concurrency}: no step scheduled {load.concurrency} "
                               f"requests ({len(phase)} steps in the phase, {len(rows)} in {step_log})")
        found.append(Steps(side, blocks, load.concurrency, rnd, full, len(phase)))
    return found


def summarize(steps: list[Steps], blocks: int, concurrency: int) -> dict[str, Any]:
    mine = [s for s in steps if (s.blocks, s.concurrency) == (blocks, concurrency)]
    rounds = sorted({s.round for s in mine})
    by = {(s.side, s.round): s for s in mine}
    native = [by["native", r].median_s for r in rounds]
    kvc = [by["kvcached", r].median_s for r in rounds]
    ratios = [k / n for n, k in zip(native, kvc, strict=True)]
    return {"blocks": blocks, "concurrency": concurrency, "native_s": native, "kvcached_s": kvc,
            "ratios": ratios, "verdict": verdict(ratios, TARGET),
            "steps": [len(by["native", r].step_s) for r in rounds], "kv_steps": [len(by["kvcached", r].step_s) for r in rounds]}


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.3f} ({min(xs) * 1e3:.3f}-{max(xs) * 1e3:.3f})"


def _row(r: dict[str, Any]) -> dict[str, object]:
    ratios = r["ratios"]
    return {"blocks": r["blocks"], "C": r["concurrency"], "native ms/step": _ms(r["native_s"]),
            "kvcached ms/step": _ms(r["kvcached_s"]),
            "ratio": f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})", "verdict": r["verdict"],
            "full-batch steps": f"{'/'.join(map(str, r['steps']))} vs {'/'.join(map(str, r['kv_steps']))}"}


def build(saved: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``serve_steps.json``)."""
    method = (f"{saved['rounds']} alternating rounds; tiny llama, multiprocess engine (`vllm serve`), "
              f"{INPUT_LEN} prompt / {OUTPUT_LEN} output tokens, `vllm bench serve --max-concurrency C` with 3C "
              f"prompts; kvcached with {PAGE_SIZE >> 10} KiB pages and no cached-block cap. Target: kvcached/native "
              f"<= {TARGET:.2f}x per step. Step times in ms: the median over the phase's steps that scheduled "
              "exactly C requests, then the median over rounds (min-max). Full-batch steps per round in the last "
              "column (native / kvcached).")
    tally = ", ".join(f"{k} {v}" for k, v in sorted(Counter(r["verdict"] for r in saved["rows"]).items()))
    body = (Section("Method", (Paragraph(method),)),
            Section("Step times", (table(_row(r) for r in saved["rows"]), Paragraph(RULE))))
    return Report(subject="Scheduler time per step inside `vllm serve`'s EngineCore, kvcached / native",
                  headline=f"kvcached/native per step, target <= {TARGET:.2f}x: {tally}.",
                  environment=saved_environment(saved), body=body, overview={"rows": len(saved["rows"])})


def main() -> int:
    import sys

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", default="1000,10000,100000")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    p.add_argument("--render", action="store_true", help="render the report again from serve_steps.json in --out")
    args = p.parse_args()
    if args.render:
        print(write_report(build(json.loads((args.out / "serve_steps.json").read_text())), args.out, "serve_steps"))
        return 0
    environment = provenance(["python", "benchmarks/bench_serve_steps.py", *sys.argv[1:]])
    blocks = [int(x) for x in args.blocks.split(",")]
    loads = [Load(f"c{c}", int(c), 200 + i) for i, c in enumerate(args.concurrency.split(","))]
    tok_dir = prepare_model(_tiny())
    steps: list[Steps] = []
    from conformance.serving import exit_on_sigterm

    with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="bench-serve-steps-") as tmp:
        for rnd in range(1, args.rounds + 1):
            for n in blocks:
                for side in (("native", "kvcached") if rnd % 2 else ("kvcached", "native")):
                    t0 = time.monotonic()
                    got = serve_once(side, n, loads, tok_dir, Path(tmp), rnd)
                    steps += got
                    print(f"r{rnd} {n} blocks {side}: " + ", ".join(
                        f"C={s.concurrency} {s.median_s * 1e3:.3f} ms ({len(s.step_s)} steps)" for s in got)
                        + f" [{time.monotonic() - t0:.0f} s]", flush=True)
    rows = [summarize(steps, n, load.concurrency) for n in blocks for load in loads]
    saved = {"environment": environment.as_dict(), "rounds": args.rounds, "target": TARGET, "rows": rows,
             "steps": [asdict(s) for s in steps]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_steps.json").write_text(json.dumps(saved, indent=1))
    print(write_report(build(saved), args.out, "serve_steps").read_text())
    return 0


def _tiny() -> Any:
    from bench_serving import MODELS

    return MODELS["tiny"]


if __name__ == "__main__":
    raise SystemExit(main())
