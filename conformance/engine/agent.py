"""The harness's agent inside a running engine's processes, for every process layout.

A vLLM engine may be one process or several: the front end (where ``LLM`` lives), the
EngineCore (scheduler, block pool, kvcached's pools) and one worker per rank (KV memory).
The harness reaches each through vLLM's own channels, never its own:

* **EngineCore**: vLLM loads its general plugins in the EngineCore process too; with
  ``CONFORMANCE_AGENT=1`` this module's `register` adds one method, ``conformance_call``, to
  ``EngineCore``, which the front end invokes as a utility call
  (``engine_core.call_utility("conformance_call", name, ...)``, the channel vLLM's own
  ``collective_rpc`` utility uses). In-process engines call the same functions directly.
* **Step timer** (`step_timer`): with ``CONFORMANCE_STEP_LOG=<path>`` as well, the EngineCore's
  scheduler time per step goes to that file (a served engine's front end cannot make utility calls);
  with ``CONFORMANCE_STEP_SAMPLE_US`` too, whose code its decode steps ran (`step_sampler`).
* **Workers**: `WorkerAgent` is a vLLM worker extension (``worker_extension_cls``), whose
  methods ``LLM.collective_rpc`` calls by name on every rank.

The module imports only the standard library at load time (vLLM imports every general
plugin in every process). Arguments and results are plain data (ints, strings, lists, dicts, bytes), so they cross
vLLM's msgpack channels unchanged. The agent is harness-only and is installed in native
and kvcached engines alike; it observes and never changes what an engine computes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conformance import stacks

if TYPE_CHECKING:
    from conformance.engine.probes import PoolSample

ENV = "CONFORMANCE_AGENT"
WORKER_EXTENSION = "conformance.engine.agent.WorkerAgent"


def register() -> None:
    """vLLM general plugin (entry point ``conformance_agent``); inert unless ``CONFORMANCE_AGENT=1``."""
    if os.environ.get(ENV) != "1":
        return
    stacks.enable()  # a timed-out engine's processes print where they stood (conformance.stacks)
    from vllm.v1.engine.core import EngineCore

    if "conformance_call" not in vars(EngineCore):
        EngineCore.conformance_call = conformance_call
    step_log = os.environ.get("CONFORMANCE_STEP_LOG")
    if step_log:  # a served engine's scheduler time per step (benchmarks/bench_serve_steps.py)
        from conformance.engine import step_timer

        step_timer.install(step_log, int(os.environ.get(step_timer.SAMPLE_ENV) or 0))


def conformance_call(core: Any, name: str, *args: Any) -> Any:
    """EngineCore side: run one of `CORE_CALLS` on this engine core."""
    try:
        fn = CORE_CALLS[name]
    except KeyError:
        raise ValueError(f"unknown conformance call {name!r}; known: {sorted(CORE_CALLS)}") from None
    return fn(core, *args)


# ---- EngineCore facts --------------------------------------------------------------------------
def _scheduler_that_ran(core: Any) -> dict[str, Any]:
    parallel = core.vllm_config.parallel_config
    return {
        "scheduler_type": type(core.scheduler).__name__,
        "batch_queue": core.batch_queue is not None,
        "async_scheduling": bool(core.vllm_config.scheduler_config.async_scheduling),
        "executor": type(core.model_executor).__name__,
        "world_size": int(parallel.world_size),
        "engine_core_pid": os.getpid(),
    }


def _geometry(core: Any) -> dict[str, Any]:
    """The raw KV geometry of the running scheduler (the front end plans the page size)."""
    sched = core.scheduler
    kcc = sched.kv_cache_config
    groups = kcc.kv_cache_groups
    return {
        "block_size": int(sched.block_size),
        "hash_block_size": int(sched.kv_cache_manager.block_pool.hash_block_size),
        "group_block_sizes": [int(g.kv_cache_spec.block_size) for g in groups],
        "group_kinds": [type(g.kv_cache_spec).__name__ for g in groups],
        "group_layers": [list(g.layer_names) for g in groups],
        "block_page_bytes": max(int(g.kv_cache_spec.page_size_bytes) for g in groups),
        "tensor_sizes": [int(t.size) for t in kcc.kv_cache_tensors],
        "num_blocks": int(kcc.num_blocks),
        "max_model_len": int(core.vllm_config.model_config.max_model_len),
        "device": str(core.vllm_config.device_config.device_type),
    }


def _scheduler_limits(core: Any) -> dict[str, int]:
    """What the running scheduler admits in one step (`conformance.reach.SchedulerLimits`):
    vLLM's step token budget is max_num_scheduled_tokens when set, else max_num_batched_tokens."""
    sc = core.vllm_config.scheduler_config
    scheduled = getattr(sc, "max_num_scheduled_tokens", None)
    return {
        "max_num_seqs": int(sc.max_num_seqs),
        "step_token_budget": int(min(sc.max_num_batched_tokens, scheduled or sc.max_num_batched_tokens)),
        "long_prefill_token_threshold": int(sc.long_prefill_token_threshold or 0),
    }


def _kvcached_pools(core: Any) -> dict[str, Any]:
    """``kvcached.stats()`` and ``status()`` of the EngineCore process (public API only)."""
    import kvcached
    from kvcached.integration.vllm import status

    st = status()
    return {
        "status": dataclasses.asdict(st),
        "pools": {name: dataclasses.asdict(p) for name, p in kvcached.stats().items()},
    }


def _mapped_bytes_sampler(native_bytes: int | None) -> Callable[[], PoolSample]:
    """The engine's physical KV side after each step (`probes.PoolSample`)."""
    from conformance.engine.probes import PoolSample

    if native_bytes is not None:
        return lambda: PoolSample(native_bytes)

    def kvcached_pools() -> PoolSample:
        import kvcached

        pools = kvcached.stats().values()
        return PoolSample(sum(p.mapped_bytes for p in pools), sum(p.rank_round_trips for p in pools),
                          sum(p.page_takes for p in pools), sum(p.reserve_hits for p in pools))

    return kvcached_pools


def _install_probe(core: Any, native_bytes: int | None) -> None:
    """Wrap this scheduler's methods (instance attributes only); ``native_bytes`` None: sample
    kvcached's mapped bytes, else that constant (native vLLM commits its KV tensor at start)."""
    from conformance.engine import probes

    core._conformance_probe = probes.install_probe(core.scheduler, _mapped_bytes_sampler(native_bytes))


def _probe_record(core: Any, stop: bool) -> dict[str, Any]:
    probe = core._conformance_probe
    if stop:
        probe.recording = False
    return probe.record().model_dump()


def _cached_blocks(core: Any) -> dict[str, Any]:
    from conformance.engine import kvsnap

    keys, reads = kvsnap.cached_blocks(core.scheduler)
    return {"keys": keys, "reads": [dataclasses.astuple(r) for r in reads]}


def _prefix_blocks(core: Any, prefix_tokens: int) -> list[list[Any]]:
    from conformance.engine import kvsnap

    return [list(p) for p in kvsnap.prefix_blocks(core.scheduler, int(prefix_tokens))]


def _install_emulated_seam(core: Any, plan_path: str) -> None:
    from pathlib import Path

    from conformance.engine.emulated_faults import install_emulated_seam

    core._conformance_seam = install_emulated_seam(core.scheduler, Path(plan_path))


def _flush_emulated_seam(core: Any) -> None:
    seam = getattr(core, "_conformance_seam", None)
    if seam is not None:
        seam.flush()


CORE_CALLS: dict[str, Callable[..., Any]] = {
    "scheduler_that_ran": _scheduler_that_ran,
    "geometry": _geometry,
    "scheduler_limits": _scheduler_limits,
    "kvcached_pools": _kvcached_pools,
    "install_probe": _install_probe,
    "probe_record": _probe_record,
    "cached_blocks": _cached_blocks,
    "prefix_blocks": _prefix_blocks,
    "install_emulated_seam": _install_emulated_seam,
    "flush_emulated_seam": _flush_emulated_seam,
}


# ---- worker facts (vLLM worker extension: methods called by name on every rank) -----------------
class WorkerAgent:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; ``self`` is the worker."""

    def conformance_rank(self) -> int:
        return int(self.rank)  # type: ignore[attr-defined]

    def conformance_read_blocks(self, reads: list[list[Any]]) -> dict[str, Any]:
        """This rank's KV arrays of the given (block, layer, kind, block size, tokens) reads,
        as raw float32 bytes with their shapes."""
        from conformance.engine import kvsnap

        got = kvsnap.read_blocks(self, [kvsnap.BlockRead(*r) for r in reads])
        arrays = {name: [a.tobytes(), list(a.shape)] for name, a in got["arrays"].items()}
        return {"rank": int(self.rank), "arrays": arrays, "token_dims": got["token_dims"],  # type: ignore[attr-defined]
                "whole_block_layers": got["whole_block_layers"]}

    def conformance_corrupt_blocks(self, pairs: list[list[Any]]) -> None:
        from conformance.engine import kvsnap

        kvsnap.corrupt_blocks(self, [(int(b), str(layer), int(bs)) for b, layer, bs in pairs])

    def conformance_emulate_copy_fault(self, plan_path: str) -> None:
        """Native candidates: fail this rank's block copies as the plan says (site ``copy``)."""
        from conformance.engine.emulated_faults import install_copy_fault

        install_copy_fault(plan_path, int(self.rank))  # type: ignore[attr-defined]

    def conformance_model_runner(self) -> str:
        """This rank's model runner class, ``module.name`` (V1 and V2 live in different modules)."""
        runner = type(self.model_runner)  # type: ignore[attr-defined]
        return f"{runner.__module__}.{runner.__qualname__}"

    def conformance_copy_stats(self) -> dict[str, int]:
        import kvcached

        return dataclasses.asdict(kvcached.copy_stats())
