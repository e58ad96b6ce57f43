"""Harness-only instrumentation of a running engine's scheduler (identical in every engine).

It runs in the EngineCore process, on the scheduler object `EngineHandle.core` gives.

Everything here patches *instance* attributes of one engine's scheduler objects, never
classes, so a probe lives and dies with its ``LLM`` and nothing leaks into the next case.
It is installed after the engine (and therefore after kvcached, if active) has been built:
it wraps whatever ``schedule``/``allocate_slots`` the engine really uses, so kvcached's
seams run underneath and the probe only observes.

Why the copy count comes from ``SchedulerOutput.kv_cache_block_copies``: it is the one
source both engines share. Counting at the worker's copy helper would depend on which of
the (native or kvcached) helpers is installed and on patch order; the scheduler output is
what the worker is told to copy, before either helper runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conformance.results import ProbeRecord, StepRecord


@dataclass(frozen=True, slots=True)
class PoolSample:
    """The engine's physical KV side after a step: mapped bytes, and kvcached's cumulative
    blocking rank round trips, page takes and reserve hits (0 for native)."""

    mapped_bytes: int
    rank_round_trips: int = 0
    page_takes: int = 0
    reserve_hits: int = 0


@dataclass
class EngineProbe:
    """Per-engine counters, filled while the engine runs."""

    block_size: int
    memory_sampler: Callable[[], PoolSample]
    steps: list[StepRecord] = field(default_factory=list)
    # One entry per step: the schedule as (request order index, scheduled tokens) pairs.
    schedule_fingerprint: list[list[tuple[int, int]]] = field(default_factory=list)
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)
    preemptions_counted: int = 0
    partial_prefix_hits: int = 0  # admissions whose prefix hit ends inside a block
    prefix_hit_admissions: int = 0
    recording: bool = True  # off for work after the case proper (the reference's replay oracle)
    _req_order: dict[str, int] = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic)

    def order_of(self, req_id: str) -> int:
        # vLLM's internal request IDs may carry random suffixes; the submission order is
        # the engine-independent name of a request.
        return self._req_order.setdefault(req_id, len(self._req_order))

    @property
    def copies_total(self) -> int:
        return len(self.copy_pairs)

    @property
    def copy_batches(self) -> int:
        return sum(1 for s in self.steps if s.copies)

    def record(self) -> ProbeRecord:
        return ProbeRecord(
            steps=list(self.steps),
            schedule_fingerprint=[list(fp) for fp in self.schedule_fingerprint],
            copies_total=self.copies_total,
            copy_batches=self.copy_batches,
            preemptions_counted=self.preemptions_counted,
            partial_prefix_hits=self.partial_prefix_hits,
            prefix_hit_admissions=self.prefix_hit_admissions,
        )


def install_probe(sched: Any, memory_sampler: Callable[[], PoolSample]) -> EngineProbe:
    """Wrap the running engine's scheduler instance methods; return the live counters."""
    probe = EngineProbe(block_size=int(sched.block_size), memory_sampler=memory_sampler)

    orig_schedule = sched.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = orig_schedule(*args, **kwargs)
        if not probe.recording:
            return out
        # Sampled right after scheduling: allocation for this step has happened.
        pools = memory_sampler()
        copies = list(out.kv_cache_block_copies or [])
        probe.copy_pairs.extend((int(c.src_block_id), int(c.dst_block_id)) for c in copies)
        fp = sorted((probe.order_of(rid), int(n)) for rid, n in out.num_scheduled_tokens.items())
        probe.schedule_fingerprint.append(fp)
        probe.steps.append(
            StepRecord(
                step=len(probe.steps),
                t=round(time.monotonic() - probe._t0, 4),
                scheduled_tokens=int(out.total_num_scheduled_tokens),
                num_requests=len(out.num_scheduled_tokens),
                copies=len(copies),
                preempted=len(out.preempted_req_ids or ()),
                mapped_bytes=pools.mapped_bytes,
                rank_round_trips=pools.rank_round_trips,
                page_takes=pools.page_takes,
                reserve_hits=pools.reserve_hits,
            )
        )
        return out

    sched.schedule = schedule

    orig_preempt = sched._preempt_request

    def preempt(*args: Any, **kwargs: Any) -> Any:
        if probe.recording:
            probe.preemptions_counted += 1
        return orig_preempt(*args, **kwargs)

    sched._preempt_request = preempt

    kvm = sched.kv_cache_manager
    orig_gcb = kvm.get_computed_blocks

    def get_computed_blocks(request: Any) -> Any:
        res = orig_gcb(request)
        hit = int(res[1])
        if hit and probe.recording:
            probe.prefix_hit_admissions += 1
            if hit % probe.block_size:
                probe.partial_prefix_hits += 1
        return res

    kvm.get_computed_blocks = get_computed_blocks
    return probe
