"""A harness-only stand-in for kvcached's fault seam, for runs whose candidate is native vLLM.

When the candidate engine is native vLLM, which has no fault seam, this module reads the
same plan file (through `kvcached.faults`, the one definition of a plan), fails the same
logical sites at the scheduler's allocation boundary (``KVCacheManager.allocate_slots`` returning ``None``, which is vLLM's
own "cannot allocate" answer: the request stays waiting or a running request is preempted,
and the scheduler retries), and writes the same ``<plan>.fired.json``. That exercises the
harness end to end (plan file -> engine -> fired counts -> report) and vLLM's own
miss/retry path. Reports label these rows ``fault seam: harness-emulated``; they are not
evidence about kvcached.

How a failure is made: the allocation is refused *before* vLLM's ``allocate_slots`` runs,
so nothing has been touched and ``None`` is exactly vLLM's own "cannot allocate" answer (a
waiting request stays waiting, a running one makes the scheduler preempt and retry). An
earlier version rolled a successful admission back with ``KVCacheManager.free``; after a
partial-prefix copy-on-write admission that left vLLM's pending-copy bookkeeping
inconsistent and changed native outputs, so it is not done.

Sites:

* ``cow_admission`` with ``after_trigger=partial_prefix_hit``: the trigger is raised by the
  first admission that vLLM *accepted* with a hit ending inside a block (a real partial
  hit, copy-on-write included); afterwards the next ``fail_next`` admissions that carry such
  a hit are refused.
* ``map``: every allocation is one map check (``skip`` pass, then ``fail_next`` fail).
* ``admission``: every allocation for a waiting or preempted request.
* ``copy`` (worker side, `install_copy_fault`): each non-empty block-copy batch, on every
  rank, fails before native's ``copy_kv_cache_blocks_inplace`` runs, raising the same
  `kvcached.errors.InjectedFault` kvcached's copy raises: the engine error native vLLM gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached.faults import FaultInjector, RuleState, read_plan, write_fired


@dataclass
class EmulatedSeam:
    """The plan's rules (`kvcached.faults.RuleState`, as kvcached's injector evaluates them)
    and the fired file they publish."""

    plan_path: Path
    block_size: int
    states: list[RuleState]

    def fired(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.states:
            out[s.rule.site] = out.get(s.rule.site, 0) + s.fired
        return out

    def triggers(self) -> list[str]:
        return sorted({s.rule.after_trigger for s in self.states if s.armed and s.rule.after_trigger})

    def flush(self) -> None:
        write_fired(self.plan_path, self.fired(), self.triggers())


def install_emulated_seam(sched: Any, plan_path: Path) -> EmulatedSeam:
    """Wrap ``sched.kv_cache_manager.allocate_slots`` of one running scheduler (EngineCore side)."""
    seam = EmulatedSeam(plan_path, int(sched.block_size), [RuleState.start(r) for r in read_plan(plan_path)])
    seam.flush()
    kvm = sched.kv_cache_manager
    orig_alloc = kvm.allocate_slots

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        new_computed = int(kwargs.get("num_new_computed_tokens", args[1] if len(args) > 1 else 0))
        waiting = str(getattr(request.status, "name", request.status)) in ("WAITING", "PREEMPTED")
        partial = waiting and new_computed % seam.block_size != 0
        sites = ["map"] + (["admission"] if waiting else []) + (["cow_admission"] if partial else [])
        # Every applicable rule sees the check (no short-circuit), as kvcached's injector does.
        fired = [s.check(s.rule.site) for s in seam.states if s.rule.site in sites]
        if any(fired):
            seam.flush()
            return None
        result = orig_alloc(request, *args, **kwargs)
        if result is not None and partial:
            newly = [s for s in seam.states if not s.armed]
            for s in newly:
                s.trigger("partial_prefix_hit")
            if newly:
                seam.flush()
        return result

    kvm.allocate_slots = allocate_slots
    return seam


# ---- the worker's block copy (site ``copy``) ------------------------------------------------
#: (module, its original) for each runner module whose copy name is wrapped in this process.
_copy_originals: list[tuple[Any, Any]] = []


def _copy_modules() -> list[Any]:
    """The modules whose ``copy_kv_cache_blocks_inplace`` a runner calls: V1's, and V2's
    where vLLM has it (``vllm.v1.worker.gpu.model_runner``)."""
    from vllm.v1.worker import gpu_model_runner

    modules = [gpu_model_runner]
    try:
        from vllm.v1.worker.gpu import model_runner as model_runner_v2
    except ImportError:  # a vLLM without Model Runner V2
        return modules
    if hasattr(model_runner_v2, "copy_kv_cache_blocks_inplace"):
        modules.append(model_runner_v2)
    return modules


def install_copy_fault(plan_path: str, rank: int) -> None:
    """Wrap this worker process's ``copy_kv_cache_blocks_inplace`` (the names the V1 and V2
    runners call) with the plan's ``copy`` checks; `uninstall_copy_fault` restores them."""
    injector = FaultInjector.from_env(plan_path, rank=rank)
    assert injector is not None
    uninstall_copy_fault()
    for module in _copy_modules():
        original = module.copy_kv_cache_blocks_inplace
        module.copy_kv_cache_blocks_inplace = _failing_copy(injector, original)
        _copy_originals.append((module, original))


def _failing_copy(injector: FaultInjector, original: Any) -> Any:
    def copy_kv_cache_blocks_inplace(kv_caches: Any, num_blocks: int, copies: Any) -> None:
        if copies:
            injector.check("copy")
        original(kv_caches, num_blocks, copies)

    return copy_kv_cache_blocks_inplace


def uninstall_copy_fault() -> None:
    """Put native's copies back (a no-op when nothing is installed in this process)."""
    while _copy_originals:
        module, original = _copy_originals.pop()
        module.copy_kv_cache_blocks_inplace = original
