"""Device memory as users see it: native and kvcached CUDA vLLM engines on the same bursts.

``python -m serving_probes.gpu_memory`` (CUDA vLLM and a GPU needed) runs one engine per
side, each in a process of its own, as users start them: ``gpu_memory_utilization`` sizes the
KV cache through vLLM's own profiling (no ``kv_cache_memory_bytes``), compiled with CUDA
graphs. Each engine runs two bursts of the same requests with an idle point after each
(prefix cache reset), while a thread samples the device every 20 ms:

* ``torch.cuda.mem_get_info`` (the device's used bytes, what a second engine sees free);
* the driver's view of this process (NVML's per-process used memory);
* kvcached's mapped KV bytes (``kvcached.stats()``).

Then, with the kvcached engine idle, a second kvcached engine starts with the same settings:
it must start (vLLM's free-memory check at start-up is not misled) and size its KV range
exactly as the first did (vLLM's profiling is not misled by the first engine's pages).

What the second burst shows (the CUDA-graph remap check, ``tests/test_gpu_engine.py`` too):
between the bursts kvcached gives the burst's pages back (unmaps counted), the second burst
maps them again (maps counted) at the same virtual addresses (the KV tensors' ``data_ptr``
never changes, which is what the captured graphs hold), the graphs replay (counted), and both
bursts give native's tokens.

The report (``memory.json``, ``memory.md``, ``memory.png``) goes to ``--out``
(default ``reports/gpu/memory``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conformance.reporting import Image, Paragraph, Provenance, Section, Table, provenance, table

#: The engine of every side: the CUDA geometry's tiny llama (4 KiB of KV per token and layer).
ARCHETYPE = "llama"
READY_FILE = "kvcached-a.idle"
#: How far kvcached's KV range may differ from native's KV tensors: both come from vLLM's own
#: profiling of its process, whose non-KV memory differs a little with kvcached's ranges there
#: (measured on the H200: 338,279 blocks against native's 338,055, +0.07%).
SIZING_TOLERANCE = 0.01
#: kvcached's default upper bound on idle pages kept mapped ahead of demand (KVCACHED_MAX_RESERVE_PAGES).
MAX_RESERVE_PAGES = 4
RELEASE_FILE = "kvcached-a.release"


@dataclass
class Workload:
    requests: int = 64
    prompt_tokens: int = 1000
    max_tokens: int = 64
    gpu_memory_utilization: float = 0.3
    compiled: bool = True
    #: vLLM's model runner (`conformance.engine_env.MODEL_RUNNER_ENV`): v1, v2, or vllm (vLLM decides).
    model_runner: str = "v1"
    seed: int = 1234

    def prompts(self) -> list[list[int]]:
        import random

        from conformance.models import FIRST_FREE_TOKEN, VOCAB_SIZE

        rng = random.Random(self.seed)
        return [[rng.randrange(FIRST_FREE_TOKEN, VOCAB_SIZE) for _ in range(self.prompt_tokens)]
                for _ in range(self.requests)]


@dataclass
class Sample:
    t: float  # seconds since the engine process started sampling
    device_used: int  # total - free, torch.cuda.mem_get_info
    process_used: int  # NVML: this process's used memory (-1 if the driver does not say)
    kv_mapped: int  # kvcached's mapped KV bytes (0 on native)


@dataclass
class EngineRun:
    side: str  # "native" | "kvcached" | "kvcached-second"
    model_runner: str = ""  # the runner class that ran, module.name (V2 lives in vllm.v1.worker.gpu)
    num_blocks: int = 0
    kv_tensor_bytes: int = 0
    startup_s: float = 0.0
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> sample at its end
    peak: dict[str, int] = field(default_factory=dict)  # per series, over the bursts
    tokens: list[list[list[int]]] = field(default_factory=list)  # per burst, per request
    kv_pointers: list[list[int]] = field(default_factory=list)  # the KV tensors' data_ptr per phase
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # kvcached counters per phase
    graph_replays: list[int] = field(default_factory=list)  # CUDA graph replays per burst
    pools: list[dict[str, Any]] = field(default_factory=list)  # kvcached.stats() at the end (empty on native)
    samples: list[Sample] = field(default_factory=list)
    error: str = ""


class Sampler:
    """Device, process and kvcached memory every ``period`` seconds, on a thread."""

    def __init__(self, period: float = 0.02) -> None:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]  # no stubs; only on a GPU host
        import torch

        self.torch, self.nvml, self.period = torch, pynvml, period
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def read(self) -> Sample:
        free, total = self.torch.cuda.mem_get_info()
        process = -1
        for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                process = int(p.usedGpuMemory)
        import kvcached

        mapped = sum(pool.mapped_bytes for pool in kvcached.stats().values())
        return Sample(round(time.monotonic() - self.t0, 3), int(total - free), process, int(mapped))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(self.read())

    def __enter__(self) -> Sampler:  # noqa: PYI034 - py3.10
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _count_graph_replays() -> list[int]:
    """Count ``torch.cuda.CUDAGraph.replay`` calls in this process (the probe's own wrapper)."""
    import torch

    counter = [0]
    original = torch.cuda.CUDAGraph.replay

    def replay(self: Any) -> Any:
        counter[0] += 1
        return original(self)

    torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    return counter


def _kv_pointers(llm: Any) -> list[int]:
    """The KV tensors' device addresses, read on the (in-process) worker."""
    return sorted({int(t.data_ptr()) for t in llm.collective_rpc(_worker_kv_pointers)[0]})


def _worker_runner(worker: Any) -> str:
    runner = type(worker.model_runner)
    return f"{runner.__module__}.{runner.__qualname__}"


def _worker_kv_pointers(worker: Any) -> list[Any]:
    caches = worker.model_runner.kv_caches
    flat: list[Any] = []
    for c in caches:
        flat += list(c) if isinstance(c, (list, tuple)) else [c]
    return flat


COUNTERS = ("maps", "unmaps", "map_failures", "mapped_bytes", "live_blocks")


def _counters() -> dict[str, int]:
    """kvcached's counters summed over this process's pools (empty on native)."""
    import kvcached

    pools = list(kvcached.stats().values())
    return {k: sum(int(getattr(p, k)) for p in pools) for k in COUNTERS} if pools else {}


def run_engine(side: str, workload: Workload, out: Path, bursts: int = 2, hold_dir: Path | None = None) -> EngineRun:
    """One engine process's whole life (called in the child; see `main`)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from conformance.models import ensure_model, model_spec

    run = EngineRun(side)
    replays = _count_graph_replays()
    spec = model_spec(ARCHETYPE, "cuda")
    with Sampler() as sampler:
        t = time.monotonic()
        llm = LLM(model=str(ensure_model(spec)), skip_tokenizer_init=True, dtype=spec.torch_dtype, seed=0,
                  enforce_eager=not workload.compiled, gpu_memory_utilization=workload.gpu_memory_utilization,
                  max_model_len=4096, enable_prefix_caching=True)
        run.startup_s = round(time.monotonic() - t, 2)
        run.model_runner = str(llm.collective_rpc(_worker_runner)[0])
        kv_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config  # in-process engine
        run.num_blocks = int(kv_config.num_blocks)
        run.kv_tensor_bytes = sum(int(x.size) for x in kv_config.kv_cache_tensors)

        def phase(name: str) -> None:
            time.sleep(0.5)  # a background refill or release in flight settles
            run.phases[name] = asdict(sampler.read())
            run.kv_pointers.append(_kv_pointers(llm))
            run.counters[name] = _counters()

        phase("startup")
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts()]
        params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True, detokenize=False)
        for burst in range(1, bursts + 1):
            before = replays[0]
            outs = llm.generate(prompts, params, use_tqdm=False)
            run.tokens.append([list(o.outputs[0].token_ids) for o in outs])
            run.graph_replays.append(replays[0] - before)
            phase(f"after burst {burst}")
            llm.reset_prefix_cache()  # nothing cached: the burst's memory may go back
            phase(f"idle after burst {burst}")
        if hold_dir is not None:  # the second engine starts beside this idle one
            (hold_dir / READY_FILE).write_text(str(os.getpid()))
            deadline = time.monotonic() + 600
            while not (hold_dir / RELEASE_FILE).exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        import kvcached

        run.pools = [asdict(p) for p in kvcached.stats().values()]
    run.samples = sampler.samples
    for key in ("device_used", "process_used", "kv_mapped"):
        run.peak[key] = max(getattr(s, key) for s in run.samples) if run.samples else 0
    out.write_text(json.dumps(asdict(run)))
    return run


# ---- the parent: one process per engine, then the report ---------------------------------------
def _child_env(side: str, model_runner: str) -> dict[str, str]:
    from conformance.engine_env import engine_env, with_model_runner, without_kvcached

    env = {**without_kvcached(dict(os.environ)), **engine_env("cuda"), "PYTHONHASHSEED": "0"}
    if side.startswith("kvcached"):
        env["KVCACHED_ENABLE"] = "1"
    return with_model_runner(env, model_runner)


def _spawn(side: str, workload: Workload, work: Path, bursts: int, hold: bool) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "serving_probes.gpu_memory", "--child", side, "--work", str(work),
            "--workload", json.dumps(asdict(workload)), "--bursts", str(bursts)] + (["--hold"] if hold else [])
    log = open(work / f"{side}.log", "wb")  # noqa: SIM115 - the child owns it until it exits
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=_child_env(side, workload.model_runner))


def _wait(proc: subprocess.Popen[bytes], side: str, work: Path, timeout: float) -> EngineRun:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = -9
    path = work / f"{side}.json"
    if rc != 0 or not path.is_file():
        return EngineRun(side, error=f"exit status {rc}: {failure_of((work / f'{side}.log').read_text(errors='replace'))}")
    data = json.loads(path.read_text())
    data["samples"] = [Sample(**x) for x in data["samples"]]
    return EngineRun(**data)


def failure_of(log: str, limit: int = 3000) -> str:
    """What ended an engine: its log's first traceback (vLLM's shutdown warnings follow it and would fill a
    tail), else the log's tail."""
    start = log.find("Traceback (most recent call last)")
    return log[start:start + limit] if start >= 0 else log[-limit:]


def measure(workload: Workload, work: Path, timeout: float = 400.0) -> list[EngineRun]:
    """Native, then kvcached, then a second kvcached engine beside the first, idle one."""
    work.mkdir(parents=True, exist_ok=True)
    for f in (READY_FILE, RELEASE_FILE):
        (work / f).unlink(missing_ok=True)
    runs = [_wait(_spawn("native", workload, work, 2, False), "native", work, timeout)]
    first = _spawn("kvcached", workload, work, 2, True)
    deadline = time.monotonic() + timeout
    while not (work / READY_FILE).exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    second = (_wait(_spawn("kvcached-second", workload, work, 1, False), "kvcached-second", work, timeout)
              if (work / READY_FILE).exists() else EngineRun("kvcached-second", error="the first engine never idled"))
    (work / RELEASE_FILE).write_text("go")
    runs += [_wait(first, "kvcached", work, timeout), second]
    return runs


GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def checks(runs: list[EngineRun]) -> dict[str, bool]:
    """What must hold; each names its evidence in the report's tables."""
    by = {r.side: r for r in runs}
    nat, kvc, second = by["native"], by["kvcached"], by["kvcached-second"]
    ok = not (nat.error or kvc.error)
    c = kvc.counters
    out = {
        "native and kvcached engines started and ran both bursts": ok,
        "kvcached gave native's tokens in both bursts": ok and kvc.tokens == nat.tokens,
        f"vLLM sized kvcached's KV range within {SIZING_TOLERANCE:.1%} of native's KV tensors":
            ok and abs(kvc.num_blocks - nat.num_blocks) <= SIZING_TOLERANCE * nat.num_blocks,
        "a second kvcached engine started beside the first, idle one": not second.error,
        "and vLLM sized it exactly as the first (not misled by the first's pages)":
            not second.error and (second.num_blocks, second.kv_tensor_bytes) == (kvc.num_blocks, kvc.kv_tensor_bytes),
    }
    if nat.model_runner or kvc.model_runner:  # runs recorded before 12-04 did not read it
        out["both ran the same model runner"] = ok and kvc.model_runner == nat.model_runner
    if ok:
        startup, idle1 = kvc.phases["startup"], kvc.phases["idle after burst 1"]
        out["kvcached uses less device memory than native after start-up"] = (
            startup["device_used"] < nat.phases["startup"]["device_used"])
        # A kv page is one VMM page in every KV backing (4 MiB for the two-layer llama).
        page = max((p["kv_page_bytes"] for p in kvc.pools), default=2 << 20)
        out["idle after a burst, kvcached's mapped KV is back within its reserve of its start-up value"] = (
            idle1["kv_mapped"] <= startup["kv_mapped"] + MAX_RESERVE_PAGES * page)
        out["pages went after burst 1 (unmaps) and came back in burst 2 (maps)"] = (
            c["idle after burst 1"]["unmaps"] > c["after burst 1"]["unmaps"]
            and c["after burst 2"]["maps"] > c["idle after burst 1"]["maps"])
        out["the KV tensors kept their addresses through unmap and remap"] = len(set(map(tuple, kvc.kv_pointers))) == 1
        out["CUDA graphs replayed in both bursts (before and after the remap)"] = all(n > 0 for n in kvc.graph_replays)
    return out


def plot(runs: list[EngineRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    for run, color in ((r, c) for r, c in zip(runs, ("tab:red", "tab:blue", "tab:green"), strict=False)):
        if not run.samples:
            continue
        t = [s.t for s in run.samples]
        ax.plot(t, [s.device_used / GIB for s in run.samples], color=color, label=f"{run.side}: device used")
        ax.plot(t, [max(0, s.process_used) / GIB for s in run.samples], color=color, ls="--", lw=1,
                label=f"{run.side}: this process (driver)")
        if run.side == "kvcached":
            ax.plot(t, [s.kv_mapped / GIB for s in run.samples], color="black", lw=1.5, label="kvcached: mapped KV")
    ax.set_xlabel("seconds since the engine process started sampling")
    ax.set_ylabel("GiB")
    ax.set_title("Device memory per engine: native against kvcached (same bursts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _phase_rows(runs: list[EngineRun]) -> list[dict[str, str]]:
    rows = []
    for r in runs:
        phases = [*r.phases.items(), *([("peak (20 ms samples)", r.peak)] if r.peak else [])]
        rows += [{"engine": r.side, "phase": name, "device used GiB": _gib(s["device_used"]),
                  "this process GiB (driver)": _gib(s["process_used"]), "kvcached mapped KV GiB": _gib(s["kv_mapped"])}
                 for name, s in phases]
    return rows


def _tables(runs: list[EngineRun]) -> tuple[Table, Table, Table]:
    """Memory per phase, how each engine was sized, kvcached's counters per phase."""
    sizing = [{"engine": r.side, "start-up s": r.startup_s, "KV blocks": r.num_blocks,
               "KV range / tensors GiB": _gib(r.kv_tensor_bytes),
               "graph replays per burst": ", ".join(map(str, r.graph_replays)),
               "error": r.error[:200].replace(chr(10), " ")} for r in runs]
    kvc = next(r for r in runs if r.side == "kvcached")
    counters = [{"kvcached phase": name, "maps": c.get("maps"), "unmaps": c.get("unmaps"),
                 "mapped bytes": c.get("mapped_bytes"), "live blocks": c.get("live_blocks")}
                for name, c in kvc.counters.items()]
    return table(_phase_rows(runs)), table(sizing), table(counters)


def report(runs: list[EngineRun], workload: Workload, out: Path, environment: Provenance, save: bool = True) -> Path:
    from serving_probes.probe_report import write_probe_report

    out.mkdir(parents=True, exist_ok=True)
    if any(r.samples for r in runs):
        plot(runs, out / "memory.png")
    memory, sizing, counters = _tables(runs)
    workload_text = (
        f"Workload: {workload.requests} requests of {workload.prompt_tokens} random prompt tokens, "
        f"{workload.max_tokens} greedy output tokens, twice (the prefix cache reset after each burst); "
        f"gpu_memory_utilization={workload.gpu_memory_utilization}, "
        f"{'compiled with CUDA graphs' if workload.compiled else 'eager'}, model: the harness's CUDA llama.")
    sizing_text = (
        "How vLLM sizes kvcached's range: vLLM profiles the engine as usual and turns "
        "`gpu_memory_utilization` x device memory, less what the model, activations and graphs take, into "
        "`num_blocks`; kvcached reserves virtual address space for exactly those blocks and maps 2 MiB pages "
        "only while blocks use them. So the range is as large as native's KV tensors, and the device holds "
        "only the mapped part.")
    sections = [Section("Workload", (Paragraph(workload_text), Paragraph(sizing_text))),
                Section("Device memory", (Image("memory.png", "device memory"), memory)),
                Section("Engines", (sizing,)), Section("kvcached counters", (counters,))]
    return write_probe_report(
        out, "memory", "Device memory as users see it: native vs kvcached CUDA vLLM", environment,
        {"workload": asdict(workload), "runs": [asdict(r) for r in runs]},
        "one engine process per side (in-process EngineCore), a 20 ms sampler thread in each: "
        "torch.cuda.mem_get_info, NVML per-process used memory, kvcached.stats().", sections, checks(runs), save)


def render_saved(data: dict[str, Any], environment: Provenance, out_dir: Path) -> Path:
    """The report of a saved run (``memory.json``), rendered again."""
    runs = [EngineRun(**{**r, "samples": [Sample(**x) for x in r["samples"]]}) for r in data["runs"]]
    return report(runs, Workload(**data["workload"]), out_dir, environment, save=False)


def _environment(argv: list[str]) -> Provenance:
    import torch

    props = torch.cuda.get_device_properties(0)
    return provenance(["python -m serving_probes.gpu_memory", *argv],
                      {"device memory": f"{props.total_memory / GIB:.0f} GiB", "cuda (torch)": str(torch.version.cuda)})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m serving_probes.gpu_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("reports/gpu/memory"))
    p.add_argument("--work", type=Path, default=Path("/tmp/kvcached-gpu-memory"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="eager engines (default: compiled with CUDA graphs)")
    p.add_argument("--model-runner", choices=("v1", "v2", "vllm"), default="v1",
                   help="vLLM's model runner: v1 (the default), v2, or vllm (vLLM decides: V2 for this dense model)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--bursts", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        workload = Workload(**json.loads(args.workload))
        run_engine(args.child, workload, args.work / f"{args.child}.json", args.bursts,
                   args.work if args.hold else None)
        return 0
    workload = Workload(requests=args.requests, compiled=not args.eager, model_runner=args.model_runner)
    runs = measure(workload, args.work)
    path = report(runs, workload, args.out, _environment(argv))
    failed = [k for k, v in checks(runs).items() if not v]
    print(path.read_text())
    print(f"gpu_memory: {len(failed)} check(s) failed" + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
