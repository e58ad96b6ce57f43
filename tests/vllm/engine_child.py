"""Helpers for the tests that run real vLLM engines in child processes.

Each side of a comparison (native vLLM, or vLLM with kvcached) runs in its own fresh
interpreter, started from a test file executed as a script, and runs all of its cases
one after another, each on a fresh ``LLM`` that is shut down before the next. So
kvcached's process-wide patches never reach the other side, and vLLM's ~10 s import is
paid once per side. The parent (pytest) side never imports vLLM for these engines.

Parent side: `run_side`, `shared_result`. Child side: `engine_kwargs`, `build_llm`,
`scheduler_that_ran`, `block_pool_type`, `count_block_copies`, `install_warmup_probe`,
`kvcached_pool`, `pool_stats`, `shutdown`, `collect_garbage`. Models come from the conformance harness's tiny-model factory
(`conformance.models`, read-only), which writes them once and caches them on disk.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance.engine_env import engine_env, without_kvcached

#: The native side loads no plugin at all (an empty allow-list), so it is vLLM alone.
NATIVE_ENV = {"VLLM_PLUGINS": ""}

CHILD_TIMEOUT_S = 600


# ---- parent side ---------------------------------------------------------------------------
def run_side(script: Path, job: dict[str, Any], workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``script`` as a child on ``job``; return the JSON it wrote.

    Inherited kvcached/vLLM switches are dropped so only ``env`` decides what the child is.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path = workdir / "job.json", workdir / "result.json"
    job_path.write_text(json.dumps(job))
    child_env = {
        k: v for k, v in without_kvcached(dict(os.environ)).items()
        # VLLM_CPU_KVCACHE_SPACE would override every case's kv_cache_memory_bytes
        if k not in ("VLLM_PLUGINS", "VLLM_CPU_KVCACHE_SPACE")
    }
    child_env.update(engine_env("cpu"))
    child_env.update(env)
    proc = subprocess.run([sys.executable, str(script), str(job_path), str(out_path)], env=child_env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    (workdir / "stderr.txt").write_text(proc.stderr)
    (workdir / "stdout.txt").write_text(proc.stdout)
    assert proc.returncode == 0, f"child {script.name} failed (rc={proc.returncode}):\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def shared_result(tmp_path_factory: pytest.TempPathFactory, name: str,
                  compute: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """``compute(workdir)`` once per test session, even when xdist splits a file's tests.

    Every xdist worker has its own session fixtures; the result is cached as JSON in the
    session's directory all workers share (the parent of each worker's base temp), and an
    exclusive lock makes the others wait for the first. Without xdist the base temp itself
    is the session's directory (its parent is shared by every session: never cache there).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cache = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cache.exists():
            cache.write_text(json.dumps(compute(tmp_path_factory.mktemp(name))))
    result: dict[str, Any] = json.loads(cache.read_text())
    return result


# ---- child side ----------------------------------------------------------------------------
def engine_kwargs(model: str, **overrides: Any) -> dict[str, Any]:
    """Engine arguments shared by every case (tokenizer-free, eager, fp32, deterministic).

    Last, the settings this vLLM series' CPU kernels need are applied
    (`conformance.vllm_series.engine_overrides`; nothing changes on 0.28): e.g. on 0.29
    llama's block 16 becomes 32 and Mamba2-mixer models run in bf16. Both sides of a
    comparison run in the same vLLM, so they get the same settings.
    """
    from conformance.models import MODEL_SPECS, ensure_model
    from conformance.vllm_series import adjusted

    kwargs: dict[str, Any] = {
        "model": str(ensure_model(MODEL_SPECS[model])),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 1024,
        "seed": 0,
        "kv_cache_memory_bytes": 64 << 20,
    }
    kwargs.update(overrides)
    return adjusted(model, kwargs)


def build_llm(kwargs: dict[str, Any], *, want_async: bool) -> Any:
    """An ``LLM``; with ``want_async`` the real AsyncScheduler (CPU turns it off otherwise).

    The override (`conformance.engine.overrides`) is installed in every child, native or not, so
    both sides build their engines through the same code.
    """
    from vllm import LLM

    from conformance.engine import overrides

    overrides.install_async_override()
    overrides.suppress_tokenizer_free_warmup_warning()
    overrides.force_async(want_async)
    try:
        return LLM(async_scheduling=want_async, **kwargs)
    finally:
        overrides.force_async(False)


def engine_core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def scheduler_that_ran(llm: Any) -> dict[str, Any]:
    """What really ran, read from the running engine (never from the arguments)."""
    core = engine_core(llm)
    return {
        "scheduler": type(core.scheduler).__name__,
        "batch_queue": core.batch_queue is not None,
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "num_blocks": int(core.scheduler.kv_cache_config.num_blocks),
    }


def block_pool_type(llm: Any) -> str:
    """``BlockPool`` natively, ``ElasticBlockPool`` when kvcached is really active."""
    return type(engine_core(llm).scheduler.kv_cache_manager.block_pool).__name__


def count_block_copies(llm: Any) -> list[int]:
    """Wrap this engine's ``schedule`` (instance only); the list gets each step's copy count.

    ``SchedulerOutput.kv_cache_block_copies`` is what the worker is told to copy, the same
    in both engines whichever copy helper runs underneath.
    """
    scheduler = engine_core(llm).scheduler
    original = scheduler.schedule
    counts: list[int] = []

    def schedule(*args: Any, **kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        counts.append(len(output.kv_cache_block_copies or ()))
        return output

    scheduler.schedule = schedule
    return counts


def install_warmup_probe() -> list[dict[str, Any]]:
    """Read block 0 of every KV view when the worker warms up (once per engine).

    vLLM on a GPU runs dummy batches and captures CUDA graphs there, with zeroed block
    tables: they read the null block before the scheduler (and kvcached's pool) exists.
    The CPU worker does not, so the probe does it; on a page kvcached had not mapped the
    read would be a SIGSEGV. Each entry: KV views read, and kvcached pools alive then.
    """
    from vllm.v1.worker.cpu_worker import CPUWorker

    records: list[dict[str, Any]] = []
    original = CPUWorker.compile_or_warm_up_model

    def compile_or_warm_up_model(self: Any) -> Any:
        views = [t for t in self.model_runner.kv_caches if hasattr(t, "shape")]
        for view in views:
            view[0].float().sum().item()  # block dimension is 0 for CPU attention and Mamba pages
        records.append({"views_read": len(views), "pools_alive": len(_kvcached_stats())})
        return original(self)

    CPUWorker.compile_or_warm_up_model = compile_or_warm_up_model  # type: ignore[method-assign]
    return records


def install_zeroing_probe() -> dict[str, Any]:
    """Record every block vLLM zeroes as fresh (``new_block_ids_to_zero``) and read it back.

    vLLM zeroes newly allocated full-attention blocks of engines with Mamba layers
    (``KVCacheConfig.needs_kv_cache_zeroing``) through ``CPUModelRunner._zero_block_ids``.
    The probe wraps it: per call it records the block IDs, counts the blocks that held
    non-zero bytes before (stale data of an earlier request: the reader sees real bytes),
    runs vLLM's zeroing, and counts the blocks that still read non-zero in any
    full-attention layer after it (a block that does not read as vLLM expects).
    """
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    record: dict[str, Any] = {"calls": [], "stale_before": 0, "nonzero_after": 0}
    original = CPUModelRunner._zero_block_ids

    def views(runner: Any) -> list[Any]:
        ctx = runner.compilation_config.static_forward_context
        return [ctx[name].kv_cache for g in runner.kv_cache_config.kv_cache_groups
                if isinstance(g.kv_cache_spec, FullAttentionSpec) for name in g.layer_names
                if name in ctx and isinstance(ctx[name].kv_cache, torch.Tensor)]

    def nonzero(runner: Any, block_ids: list[int]) -> int:
        return sum(any(bool(kv[b].count_nonzero()) for kv in views(runner)) for b in block_ids)

    def _zero_block_ids(self: Any, block_ids: list[int]) -> None:
        record["calls"].append(list(block_ids))
        record["stale_before"] += nonzero(self, block_ids)
        original(self, block_ids)
        record["nonzero_after"] += nonzero(self, block_ids)

    CPUModelRunner._zero_block_ids = _zero_block_ids  # type: ignore[method-assign]
    return record


def _kvcached_stats() -> dict[str, Any]:
    if os.environ.get("KVCACHED_ENABLE") != "1":
        return {}
    import kvcached

    return dict(kvcached.stats())


def kvcached_pool(llm: Any) -> Any:
    """The engine's `ElasticBlockPool` (the child fails if kvcached is not really active)."""
    from kvcached.integration.vllm.block_pool import ElasticBlockPool

    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, ElasticBlockPool), f"kvcached is not active: the pool is a {type(pool).__name__}"
    return pool


def pool_stats() -> dict[str, dict[str, int | str]]:
    """``kvcached.stats()`` as plain data."""
    return {name: {k: _plain(v) for k, v in dataclasses.asdict(st).items()} for name, st in _kvcached_stats().items()}


def _plain(value: object) -> int | str:
    """A stats field as plain data: text fields (health, budget_error) as text, counts as int."""
    if isinstance(value, str):
        return str(getattr(value, "value", value))  # an enum member's value, not its repr
    return int(value)  # type: ignore[call-overload]


def shutdown(llm: Any) -> None:
    """Shut the engine down the way vLLM's own teardown does (the caller drops ``llm``)."""
    llm.llm_engine.engine_core.shutdown()


def collect_garbage() -> None:
    """After the caller dropped its engine: free it before the next case builds one."""
    gc.collect()
