"""`EngineHandle`: the one way the harness learns facts about a running engine.

A vLLM V1 engine has up to three kinds of process: the front end (where ``LLM`` lives), the
EngineCore (scheduler, block pool, and kvcached's pools with their ``kvcached.stats()``),
and one worker per rank (KV tensors, and kvcached's block-copy counters). Which of them are
one process depends on the layout: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` puts the EngineCore
in the front end; the ``UniProcExecutor`` puts the worker in the EngineCore; the
``MultiprocExecutor`` (every multiprocess engine on CPU, every TP>1) gives each rank its own.

The handle reads each fact where it lives, through vLLM's own channels
(``conformance.engine.agent``):

* **Worker facts** go through vLLM's executor, ``LLM.collective_rpc``, by method name on the
  harness's worker extension. Every executor implements it (in-process for
  ``UniProcExecutor``, over its message queues for ``MultiprocExecutor``, over Ray). They
  come back once per rank: KV bytes per rank (each rank holds a shard), copy counters
  summed over ranks.
* **EngineCore facts** (the scheduler that ran, the geometry, the schedule per step, the
  prefix-cache keys, kvcached's pools) come from the EngineCore object: directly when it
  runs in this process, else through an EngineCore utility call (the channel vLLM's own
  ``collective_rpc`` utility uses). Both run the same functions and return the same data.

kvcached facts come only from its public API: ``kvcached.stats()``, ``kvcached.copy_stats()``
and ``kvcached.integration.vllm.status()``. Nothing here imports kvcached unless the engine
was started with ``KVCACHED_ENABLE=1``; then kvcached *must* be active, and `KvcachedInactive`
is raised (the case fails) if it is not.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from conformance.device import profile
from conformance.engine import agent
from conformance.geometry import Geometry, derive_page_size
from conformance.reach import SchedulerLimits
from conformance.results import (
    POOL_FACTS,
    CopyFacts,
    EngineMetrics,
    KvSnapshotMeta,
    PoolFacts,
    ProbeRecord,
    SchedulerRan,
)


class LayoutNotSupported(RuntimeError):
    """The engine's process layout does not expose a fact the harness asked for."""


class KvcachedInactive(RuntimeError):
    """KVCACHED_ENABLE=1 but kvcached is not running inside this engine."""


def kvcached_requested() -> bool:
    return os.environ.get("KVCACHED_ENABLE") == "1"


class EngineHandle:
    """Facts about one running ``vllm.LLM`` in any process layout (see the module docstring)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    # ---- the two channels --------------------------------------------------------------------
    @property
    def in_process(self) -> bool:
        """Whether the EngineCore runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        return getattr(self.llm.llm_engine.engine_core, "engine_core", None) is not None

    def core_call(self, name: str, *args: Any) -> Any:
        """Run `agent.CORE_CALLS[name]` on the EngineCore, wherever it runs."""
        client = self.llm.llm_engine.engine_core
        core = getattr(client, "engine_core", None)
        if core is not None:
            return agent.conformance_call(core, name, *args)
        if not hasattr(client, "call_utility"):
            raise LayoutNotSupported(f"no utility channel to the EngineCore through {type(client).__name__}")
        return client.call_utility("conformance_call", name, *args)

    def rank_call(self, method: str, *args: Any) -> list[Any]:
        """Call a `agent.WorkerAgent` method on every rank; one result per rank, in rank order."""
        return list(self.llm.collective_rpc(method, args=args))

    # ---- layout and geometry -------------------------------------------------------------------
    def scheduler_that_ran(self) -> SchedulerRan:
        facts = self.core_call("scheduler_that_ran")
        # vLLM's multiprocess engine puts the EngineCore in a process of its own; its executor
        # is a MultiprocExecutor on the CPU but a UniProcExecutor at TP=1 on CUDA, so the
        # process, not the executor, says which layout ran.
        facts["engine_core_separate"] = facts.pop("engine_core_pid") != os.getpid()
        facts["model_runner"] = self.rank_call("conformance_model_runner")[0]
        return SchedulerRan.model_validate(facts)

    def geometry(self, page_size: int | None) -> Geometry:
        """The engine's KV geometry, read once per engine (page size: configured or derived)."""
        g = self.core_call("geometry")
        num_blocks, sizes = int(g["num_blocks"]), [int(x) for x in g["tensor_sizes"]]
        strides = tuple(size // num_blocks for size in sizes)
        return Geometry(
            block_size=int(g["block_size"]),
            hash_block_size=int(g["hash_block_size"]),
            group_block_sizes=tuple(g["group_block_sizes"]),
            group_kinds=tuple(g["group_kinds"]),
            group_layers=tuple(tuple(x) for x in g["group_layers"]),
            block_page_bytes=int(g["block_page_bytes"]),
            block_bytes_all_layers=sum(sizes) // num_blocks,
            block_strides=strides,
            num_blocks=num_blocks,
            kv_tensor_bytes=sum(sizes),
            max_model_len=int(g["max_model_len"]),
            page_size_bytes=int(page_size) if page_size else derive_page_size(strides, profile(g["device"])),
            page_size_source="configured" if page_size else "derived",
            device=g["device"],
        )

    def scheduler_limits(self) -> SchedulerLimits:
        """What the scheduler admits in one step; requests of one ``generate`` call all reach
        it before its first step only when the EngineCore runs in this process."""
        return SchedulerLimits(**self.core_call("scheduler_limits"), requests_arrive_together=self.in_process)

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

    # ---- probes -----------------------------------------------------------------------------------
    def install_probe(self, native_bytes: int | None) -> None:
        """Record the schedule per step in the EngineCore (see ``probes``)."""
        self.core_call("install_probe", native_bytes)

    def probe_record(self, stop: bool = False) -> ProbeRecord:
        return ProbeRecord.model_validate(self.core_call("probe_record", stop))

    def install_emulated_seam(self, plan_path: str) -> None:
        self.core_call("install_emulated_seam", plan_path)

    def flush_emulated_seam(self) -> None:
        self.core_call("flush_emulated_seam")

    # ---- kvcached (public API only) --------------------------------------------------------
    def kvcached_pools(self) -> dict[str, PoolFacts]:
        """``kvcached.stats()`` of the EngineCore process; raises unless kvcached is active."""
        facts = self.core_call("kvcached_pools")
        if not facts["status"]["enabled"]:
            raise KvcachedInactive(f"KVCACHED_ENABLE=1 but kvcached is not enabled in the EngineCore: {facts['status']}")
        pools = POOL_FACTS.validate_python(facts["pools"])
        if not pools:
            raise KvcachedInactive("kvcached.stats() is empty: no kvcached pool was created in this engine")
        return pools

    def mapped_bytes(self) -> int:
        return sum(p.mapped_bytes for p in self.kvcached_pools().values())

    def kvcached_copies(self) -> list[CopyFacts]:
        """kvcached's copy counters of every rank, in rank order (module-wide: take deltas)."""
        return [CopyFacts(**r) for r in self.rank_call("conformance_copy_stats")]

    def check_page_size(self, configured: int) -> None:
        """The page size kvcached runs with must be the one the harness configured."""
        reported = {p.vmm_page_bytes for p in self.kvcached_pools().values()}
        check_page_size(configured, reported)

    # ---- KV bytes ------------------------------------------------------------------------------
    def kv_snapshot(self) -> tuple[KvSnapshotMeta, dict[str, np.ndarray]]:
        """Every cached block's KV on every rank; arrays of rank r > 0 are named ``r<r>:...``."""
        cached = self.core_call("cached_blocks")
        per_rank = self.rank_call("conformance_read_blocks", cached["reads"])
        arrays: dict[str, np.ndarray] = {}
        for part in per_rank:
            prefix = f"r{part['rank']}:" if part["rank"] else ""
            for name, (raw, shape) in part["arrays"].items():
                arrays[prefix + name] = np.frombuffer(raw, dtype=np.float32).reshape(shape).copy()
        meta = KvSnapshotMeta(
            keys=cached["keys"],
            token_dims=per_rank[0]["token_dims"],
            whole_block_layers=per_rank[0]["whole_block_layers"],
            num_arrays=len(arrays),
            ranks=len(per_rank),
        )
        return meta, arrays

    def corrupt_prefix_blocks(self, prefix_tokens: int) -> list[int]:
        """Negative control: add 1.0 to the cached attention blocks covering ``prefix_tokens``
        on every rank. Returns the corrupted block IDs."""
        pairs = self.core_call("prefix_blocks", prefix_tokens)
        self.rank_call("conformance_corrupt_blocks", pairs)
        return sorted({int(b) for b, *_ in pairs})

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def check_page_size(configured: int, reported: set[int]) -> None:
    """Raise unless every kvcached pool runs with the configured VMM page size."""
    if reported != {int(configured)}:
        raise RuntimeError(
            f"kvcached reports VMM page size(s) {sorted(reported)}, the harness configured {configured}: "
            "the prompt lengths were derived for another page"
        )
