"""`EngineHandle`: the one way the harness learns facts about a running engine.

A vLLM V1 engine has up to three kinds of process: the front end (where ``LLM`` lives), the
EngineCore (scheduler, block pool, and kvcached's pools with their ``kvcached.stats()``),
and one worker per rank (KV tensors, and kvcached's block-copy counters). Which of them are
one process depends on the layout: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` puts the EngineCore
in the front end; the ``UniProcExecutor`` puts the worker in the EngineCore; the
``MultiprocExecutor`` (every multiprocess engine on CPU, every TP>1) gives each rank its own.

The handle therefore reads each fact where it lives:

* **Worker facts** go through vLLM's executor, ``LLM.collective_rpc``, which every executor
  implements (in-process for ``UniProcExecutor``, over its message queues for
  ``MultiprocExecutor``, and over Ray). They come back once per rank: KV bytes per rank (each
  rank holds a shard), copy counters summed over ranks.
* **EngineCore facts** (the scheduler that ran, the prefix-cache keys, kvcached's pools) need
  the EngineCore object. Today the harness runs in-process engines, where it is
  ``llm.llm_engine.engine_core.engine_core``; `EngineHandle.core` refuses any other layout
  with `LayoutNotSupported`, naming it, rather than guessing. A multiprocess layout will
  reach the same facts through an EngineCore utility call (the channel vLLM's own
  ``collective_rpc`` utility uses), with the same return types.

kvcached facts come only from its public API: ``kvcached.stats()``, ``kvcached.copy_stats()``
and ``kvcached.integration.vllm.status()``. Nothing here imports kvcached unless the engine
was started with ``KVCACHED_ENABLE=1``; then kvcached *must* be active, and `KvcachedInactive`
is raised (the case fails) if it is not.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import numpy as np

from conformance.engine import kvsnap
from conformance.geometry import Geometry, derive_page_size
from conformance.results import CopyFacts, EngineMetrics, KvSnapshotMeta, PoolFacts, SchedulerRan


class LayoutNotSupported(RuntimeError):
    """The engine's process layout does not expose a fact the harness asked for."""


class KvcachedInactive(RuntimeError):
    """KVCACHED_ENABLE=1 but kvcached is not running inside this engine."""


def kvcached_requested() -> bool:
    return os.environ.get("KVCACHED_ENABLE") == "1"


# ---- worker-side functions (sent to every rank by collective_rpc; module level, so picklable)
def _worker_copy_stats(worker: Any) -> dict[str, int]:
    import kvcached

    return asdict(kvcached.copy_stats())


def _worker_rank(worker: Any) -> int:
    return int(worker.rank)


class EngineHandle:
    """Facts about one running ``vllm.LLM`` (see the module docstring for where each lives)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    # ---- layout --------------------------------------------------------------------------
    @property
    def core(self) -> Any:
        """The EngineCore object (in-process engines only)."""
        client = self.llm.llm_engine.engine_core
        core = getattr(client, "engine_core", None)
        if core is None:
            raise LayoutNotSupported(
                f"the EngineCore runs in another process ({type(client).__name__}); the harness reads "
                "scheduler facts from in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        return core

    def scheduler_that_ran(self) -> SchedulerRan:
        core = self.core
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        return SchedulerRan(
            scheduler_type=type(core.scheduler).__name__,
            batch_queue=core.batch_queue is not None,
            async_scheduling=bool(self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            executor=type(core.model_executor).__name__,
            world_size=int(parallel.world_size),
        )

    def geometry(self, page_size: int | None) -> Geometry:
        """The engine's KV geometry, read once per engine (page size: configured or derived)."""
        sched = self.core.scheduler
        kcc = sched.kv_cache_config
        groups, num_blocks = kcc.kv_cache_groups, int(kcc.num_blocks)
        tensor_bytes = sum(int(t.size) for t in kcc.kv_cache_tensors)
        strides = tuple(int(t.size) // num_blocks for t in kcc.kv_cache_tensors)
        return Geometry(
            block_size=int(sched.block_size),
            hash_block_size=int(sched.kv_cache_manager.block_pool.hash_block_size),
            group_block_sizes=tuple(int(g.kv_cache_spec.block_size) for g in groups),
            group_kinds=tuple(type(g.kv_cache_spec).__name__ for g in groups),
            group_layers=tuple(tuple(g.layer_names) for g in groups),
            block_page_bytes=max(int(g.kv_cache_spec.page_size_bytes) for g in groups),
            block_bytes_all_layers=tensor_bytes // num_blocks,
            block_strides=strides,
            num_blocks=num_blocks,
            kv_tensor_bytes=tensor_bytes,
            max_model_len=int(self.llm.llm_engine.vllm_config.model_config.max_model_len),
            page_size_bytes=int(page_size) if page_size else derive_page_size(strides),
            page_size_source="configured" if page_size else "derived",
        )

    def metrics(self) -> EngineMetrics:
        """Counters from vLLM's own metrics (needs ``disable_log_stats=False``)."""
        wanted = {
            "vllm:num_preemptions": "preemptions",
            "vllm:prefix_cache_queries": "prefix_cache_queries",
            "vllm:prefix_cache_hits": "prefix_cache_hits",
        }
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if (key := wanted.get(m.name)) is not None:
                out[key] = out.get(key, 0.0) + float(m.value)
        if missing := set(wanted.values()) - set(out):
            raise RuntimeError(f"engine metrics missing {sorted(missing)}; is disable_log_stats=False?")
        return EngineMetrics(**out)

    # ---- kvcached (public API only) --------------------------------------------------------
    def kvcached_pools(self) -> dict[str, PoolFacts]:
        """``kvcached.stats()`` of the EngineCore process; raises unless kvcached is active."""
        self.core  # noqa: B018 - the pools live in the EngineCore: refuse other layouts here
        try:
            import kvcached
            from kvcached.integration.vllm import status
        except ImportError as e:
            raise KvcachedInactive(f"KVCACHED_ENABLE=1 but kvcached cannot be imported: {e}") from e
        if not status().enabled:
            raise KvcachedInactive(f"KVCACHED_ENABLE=1 but kvcached is not enabled here: {status()}")
        pools = {name: PoolFacts(**asdict(st)) for name, st in kvcached.stats().items()}
        if not pools:
            raise KvcachedInactive("kvcached.stats() is empty: no kvcached pool was created in this engine")
        return pools

    def mapped_bytes(self) -> int:
        return sum(p.mapped_bytes for p in self.kvcached_pools().values())

    def kvcached_copies(self) -> CopyFacts:
        """kvcached's copy counters, summed over every rank (module-wide: take deltas)."""
        per_rank = self.llm.collective_rpc(_worker_copy_stats)
        return CopyFacts(**{k: sum(int(r[k]) for r in per_rank) for k in per_rank[0]})

    def check_page_size(self, configured: int) -> None:
        """The page size kvcached runs with must be the one the harness configured."""
        reported = {p.vmm_page_bytes for p in self.kvcached_pools().values()}
        check_page_size(configured, reported)

    # ---- KV bytes ------------------------------------------------------------------------------
    def kv_snapshot(self) -> tuple[KvSnapshotMeta, dict[str, np.ndarray]]:
        """Every cached block's KV on every rank; arrays of rank r > 0 are named ``r<r>:...``."""
        keys, reads = kvsnap.cached_blocks(self.core.scheduler)
        ranks = self.llm.collective_rpc(_worker_rank)
        per_rank = self.llm.collective_rpc(kvsnap.read_blocks, args=(reads,))
        arrays: dict[str, np.ndarray] = {}
        for rank, part in zip(ranks, per_rank, strict=True):
            prefix = f"r{rank}:" if rank else ""
            arrays.update({prefix + name: a for name, a in part["arrays"].items()})
        meta = KvSnapshotMeta(
            keys=keys,
            token_dims=per_rank[0]["token_dims"],
            whole_block_layers=per_rank[0]["whole_block_layers"],
            num_arrays=len(arrays),
            ranks=len(per_rank),
        )
        return meta, arrays

    def corrupt_prefix_blocks(self, prefix_tokens: int) -> list[int]:
        """Negative control: add 1.0 to the cached attention blocks covering ``prefix_tokens``
        on every rank. Returns the corrupted block IDs."""
        pairs = kvsnap.prefix_blocks(self.core.scheduler, prefix_tokens)
        self.llm.collective_rpc(kvsnap.corrupt_blocks, args=(pairs,))
        return sorted({b for b, _ in pairs})

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def check_page_size(configured: int, reported: set[int]) -> None:
    """Raise unless every kvcached pool runs with the configured VMM page size."""
    if reported != {int(configured)}:
        raise RuntimeError(
            f"kvcached reports VMM page size(s) {sorted(reported)}, the harness configured {configured}: "
            "the prompt lengths were derived for another page"
        )
