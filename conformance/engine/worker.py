"""The engine process: builds engines, runs cases, writes one typed result per case.

Usage (by ``conformance.orchestrate.runner`` only): ``python -m conformance.engine JOB.json
PROGRESS_FD``.

One process serves one side (reference, candidate or control) of one archetype and runs
its cases one after another, each on a fresh ``LLM`` that is shut down and dropped before
the next, so the ~10 s vLLM import is paid once per process. Sides never share a process:
whatever kvcached (or a harness override) patches stays inside that side.

Per case it writes ``<out>/<case_id>.json`` (a `conformance.results.CaseResult`) and
``.npz`` (the KV arrays). The result is written before the KV snapshot is taken
(``kv_status="pending"``) and rewritten after it, so a crash while reading KV is visible as
such instead of losing the case. Every fact about the engine comes through its
`EngineHandle`.

Invariants:
* The reference derives the workload and the case plan (max_model_len, budget) from the
  geometry of its running engine; candidate and control receive them and check that their
  own geometry has the same attention layout before running anything.
* Fault plans apply to the candidate only; control perturbations to the control side only.
"""

from __future__ import annotations

import gc
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance import stacks
from conformance.cases import Case, Control, PrefixPattern, Scheduling
from conformance.device import Device, DeviceProfile, profile
from conformance.engine import agent, emulated_faults, overrides, teardown_check
from conformance.engine.handle import EngineHandle, kvcached_requested
from conformance.geometry import Geometry, prompt_lengths
from conformance.reach import SchedulerLimits, plan_fault_reach
from conformance.results import (
    Budget,
    CaseResult,
    CopyFacts,
    EngineErrorRecord,
    FaultRecord,
    Job,
    JobEntry,
    KvcachedFacts,
    Plan,
    RequestRecord,
    load_job,
    write_atomic,
)
from conformance.vllm_series import native_defect_of
from conformance.workload import Prompt, Workload, build_workload, stable_seed
from kvcached.faults import read_fired, read_plan, read_triggers, write_plan
from kvcached.integration.vllm import ENGINE_CONFIG_KEY


@dataclass
class _Knobs:
    """Per-case settings of one side (see ``CaseRunner._knobs``)."""

    kv_bytes: int
    page_size: int | None
    fault_seam: str | None = None  # "kvcached" | "harness-emulated" | None
    plan_path: Path | None = None
    record_path: Path | None = None  # a budget record of the case's own (checked after teardown)
    #: kvcached's settings for this engine, by `KvcachedConfig` field name (empty: native)
    kvcached: dict[str, int | str] = field(default_factory=dict)


class Progress:
    """Progress lines to the parent (``READY``, ``START id``, ``DONE id secs ok|error``, ``EXIT``)."""

    def __init__(self, fd: int) -> None:
        self._f = os.fdopen(fd, "w", buffering=1) if fd >= 0 else None

    def say(self, *parts: object) -> None:
        if self._f is not None:
            self._f.write(" ".join(str(p) for p in parts) + "\n")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


#: The engine arguments a KV geometry (block size, bytes per block) depends on.
GEOMETRY_ARGS = ("dtype", "enable_prefix_caching", "mamba_cache_mode", "attention_backend", "block_size",
                 "kv_cache_dtype")


class CaseRunner:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.device: DeviceProfile = profile(job.device)
        self.geometry_cache: dict[str, Geometry] = {}
        self._seam: Any = None  # the harness-emulated fault seam of the running case, if any

    # ----------------------------------------------------------------- engine construction
    def _engine_kwargs(
        self, case: Case, model_dir: Path, max_model_len: int, kv_bytes: int, kvcached: dict[str, int | str]
    ) -> dict[str, Any]:
        from conformance.vllm_series import adjusted

        kw: dict[str, Any] = {
            "model": str(model_dir),
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": case.archetype.model_on(self.job.device).torch_dtype,
            "enable_prefix_caching": case.prefix_caching,
            "max_model_len": max_model_len,
            "seed": 0,
            "kv_cache_memory_bytes": kv_bytes,
            "disable_log_stats": False,  # engine metrics (preemptions, prefix hits) need stats
            "async_scheduling": case.scheduling is Scheduling.ASYNC,
            # The harness's agent on every rank (observes only; the same on every side).
            "worker_extension_cls": agent.WORKER_EXTENSION,
            "tensor_parallel_size": case.layout.tensor_parallel,
            **self.device.kwargs_of(case.archetype.name),
            **dict(case.archetype.engine_kwargs),
        }
        if kvcached:
            # This engine's kvcached settings, handed to it explicitly (they reach every rank
            # with vLLM's config; `kvcached.integration.vllm.ENGINE_CONFIG_KEY`).
            kw["additional_config"] = {ENGINE_CONFIG_KEY: dict(kvcached)}
        # The case's own execution mode and attention backend come last: they are what it tests.
        if case.compiled:
            kw["enforce_eager"] = False
        if attention := case.attention or kw.get("attention_backend") or self.device.attention_backend:
            kw["attention_backend"] = attention
        if self.device.device is Device.CUDA and case.pattern is PrefixPattern.PARTIAL_COW:
            # vLLM's CUDA default Mamba cache mode ("all") keeps a state per block and copies
            # none; the partial pattern exists for the copy-on-write of "align" mode (the mode
            # the CPU runs by default), so it asks for that; every other case keeps vLLM's choice.
            kw["mamba_cache_mode"] = "align"
        if self.device.device is Device.CUDA and case.fault.reschedules:
            # A planned miss or preemption computes requests in other batches than native's. In
            # 16-bit that can flip a near-tie token (H200: nemotron_h preempted, 3 of 40 requests;
            # granitemoehybrid after two copy-on-write rejections, 1 of 17); the case is about
            # scheduling, not numerics, so both sides run it in the CPU matrix's dtype: float32,
            # except for the models that have no float32 kernel (qwen3_next's gated DeltaNet:
            # "ChunkGatedDeltaRuleFunction does not support float32", H200 12-04), which stay 16-bit.
            kw["dtype"] = case.archetype.model.torch_dtype
        # What this vLLM series' CPU kernels need (nothing on 0.28; see vllm_series): the same
        # on every side, recorded with the case's engine arguments. GPU kernels need none of it.
        return adjusted(case.archetype.name, kw) if self.device.device is Device.CPU else kw

    def _build(self, case: Case, kwargs: dict[str, Any]) -> EngineHandle:
        from vllm import LLM

        overrides.force_async(self.job.async_override and case.scheduling is Scheduling.ASYNC)
        try:
            return EngineHandle(LLM(**kwargs))
        finally:
            overrides.force_async(False)

    def _probe_geometry(self, case: Case, model_dir: Path) -> Geometry:
        key = self._geometry_key(case)
        if key not in self.geometry_cache:
            kwargs = self._engine_kwargs(case, model_dir, self.device.max_model_len, self.job.kv_cache_bytes, {})
            handle = self._build(case, kwargs)
            try:
                self.geometry_cache[key] = handle.geometry(self.job.page_size)
            finally:
                handle.shutdown()
                del handle
                gc.collect()
        return self.geometry_cache[key]

    # -------------------------------------------------------------------------- planning
    def _plan(self, case: Case, model_dir: Path) -> Plan:
        """Reference side: everything both engines must share, derived from real geometry."""
        if not case.fault.physical_budget:
            return Plan(max_model_len=self.device.max_model_len)
        geo = self._probe_geometry(case, model_dir)
        lens = prompt_lengths(geo, case.lengths, self.device.max_model_len - case.max_tokens)
        # Both engines run with a max_model_len just large enough for the longest request,
        # so "one request fits, the concurrent load does not" is a small budget.
        max_model_len = _round_up(max(n for _, n in lens) + case.max_tokens, geo.block_size)
        blocks = math.ceil(max_model_len / geo.block_size) * len(geo.group_block_sizes) + 2
        native_bytes = blocks * geo.block_bytes_all_layers
        n_tensors = max(1, geo.kv_tensor_bytes // (geo.num_blocks * geo.block_page_bytes))
        kvc_bytes = _round_up(native_bytes, geo.page_size_bytes * n_tensors)
        budget = Budget(
            blocks=blocks,
            native_kv_cache_bytes=native_bytes,
            kvcached_budget_bytes=self.job.budget_bytes_override or kvc_bytes,
        )
        return Plan(max_model_len=max_model_len, page_size=geo.page_size_bytes, budget=budget)

    def _knobs(self, case: Case, plan: Plan) -> _Knobs:
        """What this side changes for the case: fault plan file, budget, page size, kvcached's settings."""
        kn = _Knobs(kv_bytes=self.job.kv_cache_bytes, page_size=plan.page_size or self.job.page_size)
        kvcached = self.job.engine == "kvcached"
        # The candidate's plan; a control has none but the equal-pool one's budget (`Control`).
        if self.job.side in ("candidate", "control") and not case.fault.is_none:
            kn.fault_seam = "kvcached" if kvcached else "harness-emulated"
            if case.fault.rules:
                kn.plan_path = write_plan(self.job.out_dir / f"{case.case_id}.plan.json", case.fault.rules)
                if kvcached:
                    kn.kvcached["fault_plan"] = str(kn.plan_path)
            if case.fault.physical_budget and plan.budget is not None:
                if kvcached:
                    # The global limit of a record of the case's own: the host's shared
                    # record must not take one engine's limit (nor refuse the next one's).
                    kn.kvcached["budget_bytes"] = plan.budget.kvcached_budget_bytes
                    kn.record_path = self.job.out_dir / f"{case.case_id}.budget"
                else:
                    kn.kv_bytes = plan.budget.native_kv_cache_bytes
            if case.fault.ends_in_engine_error and kvcached:
                # A record of the case's own, so that after the engine error "every slot was
                # given back" is a fact about this engine alone.
                kn.record_path = self.job.out_dir / f"{case.case_id}.budget"
            if kn.record_path is not None:
                kn.kvcached["budget_path"] = str(kn.record_path)
        if kvcached:
            if kn.page_size is None:
                raise RuntimeError("a kvcached engine needs the page size planned by the reference")
            kn.kvcached["page_size"] = kn.page_size
            # Native-equivalent caching (no cap), so prefix hits are compared, unless the
            # candidate's case asks for a cap.
            cap = case.fault.cached_cap if self.job.side == "candidate" else None
            kn.kvcached["max_cached_blocks"] = -1 if cap is None else cap
        return kn

    def _workload(
        self, entry: JobEntry, case: Case, plan: Plan, geo: Geometry, limits: Callable[[], SchedulerLimits]
    ) -> Workload:
        """The reference derives the workload from its geometry and its scheduler's ``limits``
        (read only here), sized so that the fault plan's site is reached or refused by
        `conformance.reach` (a plan that fails nothing tests nothing); the others check
        their geometry matches the reference's."""
        if entry.workload is None or entry.geometry is None:
            max_prompt = plan.max_model_len - case.max_tokens
            lens = prompt_lengths(geo, case.lengths, max_prompt)
            seed = stable_seed(case.case_id)
            return plan_fault_reach(
                case, geo, limits(), max_prompt,
                lambda fill: build_workload(case.pattern, lens, geo, max_prompt, seed, fill),
            )
        if entry.geometry.same_attention_layout() != geo.same_attention_layout():
            raise RuntimeError(
                f"geometry differs from the reference: {geo.same_attention_layout()} != "
                f"{entry.geometry.same_attention_layout()}"
            )
        return entry.workload

    # ---------------------------------------------------------------------------- a case
    def run_case(self, entry: JobEntry) -> str | None:
        """Run one case; write its result; return its error text (None when it ran to the end)."""
        case = entry.case
        out_json = self.job.out_dir / f"{case.case_id}.json"
        res = CaseResult(case=case, side=self.job.side, engine=self.job.engine)
        t0 = time.monotonic()
        handle: EngineHandle | None = None
        knobs: _Knobs | None = None
        memfds_before = teardown_check.kvcached_memfds()
        try:
            model_dir = self._model(case, res)
            res.plan = entry.plan or self._plan(case, model_dir)
            knobs = self._knobs(case, res.plan)
            res.fault_seam, res.kvcached_config = knobs.fault_seam, dict(knobs.kvcached)  # type: ignore[assignment]
            res.engine_kwargs = self._engine_kwargs(case, model_dir, res.plan.max_model_len, knobs.kv_bytes,
                                                    knobs.kvcached)
            t_b = time.monotonic()
            handle = self._build(case, res.engine_kwargs)
            res.t_engine_start = round(time.monotonic() - t_b, 3)
            self._run_started(handle, case, entry, knobs, res, out_json)
        except Exception as e:  # noqa: BLE001 - recorded as the case's error (the case fails); next case runs
            res.error, res.traceback = f"{type(e).__name__}: {e}", traceback.format_exc()
            res.native_defect = native_defect_of(e)
        finally:
            self._teardown(handle, res)
            del handle
            gc.collect()
            emulated_faults.uninstall_copy_fault()
            if self._plans_engine_error(case):  # the reference runs without the plan: nothing to read
                res.teardown = teardown_check.facts(knobs.record_path if knobs else None, memfds_before)
            res.t_total = round(time.monotonic() - t0, 3)
            write_atomic(out_json, res)
        return res.error

    def _plans_engine_error(self, case: Case) -> bool:
        """Only the candidate runs the fault plan, so only it can end in the planned engine error."""
        return self.job.side == "candidate" and case.fault.ends_in_engine_error

    def _model(self, case: Case, res: CaseResult) -> Path:
        from conformance.models import ensure_model

        spec = case.archetype.model_on(self.job.device)
        if self.job.side == "control" and case.control is Control.NEG_WEIGHTS:
            spec = spec.with_weight_seed(spec.weight_seed + 1)
        model_dir = ensure_model(spec)
        res.model = {"path": str(model_dir), "weight_seed": spec.weight_seed}
        return model_dir

    @staticmethod
    def _teardown(handle: EngineHandle | None, res: CaseResult) -> None:
        if handle is None:
            return
        try:
            handle.shutdown()
        except Exception as e:  # noqa: BLE001 - a teardown failure fails the case, visibly
            res.error = res.error or f"teardown: {type(e).__name__}: {e}"
            res.traceback = (res.traceback or "") + traceback.format_exc()

    def _run_started(
        self, handle: EngineHandle, case: Case, entry: JobEntry, knobs: _Knobs, res: CaseResult, out_json: Path
    ) -> None:
        """Everything after the engine started: facts, the recorded passes, KV, replays."""
        assert res.plan is not None
        res.scheduler = handle.scheduler_that_ran()
        geo = res.geometry = handle.geometry(knobs.page_size)
        if res.plan.page_size is None:
            res.plan = res.plan.model_copy(update={"page_size": geo.page_size_bytes})
        if self.geometry_cache_fits(res.plan, knobs):
            # A later budget case of this archetype can plan from this instead of a probe engine.
            self.geometry_cache.setdefault(self._geometry_key(case), geo)
        kvc = kvcached_requested()
        if kvc:
            handle.check_page_size(geo.page_size_bytes)  # KVCACHED_ENABLE=1 without kvcached fails here
        pools_start = handle.kvcached_pools() if kvc else {}
        copies_start = handle.kvcached_copies() if kvc else None
        workload = self._workload(entry, case, res.plan, geo, handle.scheduler_limits)
        res.workload = workload
        self._instrument(handle, knobs, geo)
        res.requests, res.t_passes, res.corrupted_blocks, res.engine_error = self._run_passes(handle, case, workload)
        if res.engine_error is not None:
            # The engine failed as planned (or is broken): only the fault counts are read.
            self._record_faults(knobs, res, case.layout.tensor_parallel)
            return
        # Taken now: the reference's replays below are outside the recorded schedule.
        res.metrics, res.probe = handle.metrics(), handle.probe_record()
        self._record_memory(handle, res, geo, pools_start, copies_start)
        self._record_faults(knobs, res, case.layout.tensor_parallel)
        self._snapshot_kv(handle, case, res, out_json)
        if res.kvcached is not None:
            # What stays mapped once nothing is in use (the comparator checks it for leaks);
            # after the snapshot, which reads the cached blocks.
            if handle.llm.reset_prefix_cache():
                res.kvcached.pools_idle = handle.kvcached_pools()
            else:
                res.kvcached.idle_reset_refused = True
        if self.job.side == "reference":
            # After the snapshot (replays allocate blocks and would change the cache).
            res.replay = self._replay_uncacheable(handle, case, workload, geo)

    def _geometry_key(self, case: Case) -> str:
        """Cases whose engines have the same KV geometry share a key: the archetype and every
        engine argument a block's size depends on, as `_engine_kwargs` sets it for the case
        (a budget case runs in float32 on CUDA: a bf16 case's geometry halved its budget)."""
        kw = self._engine_kwargs(case, Path(), self.device.max_model_len, self.job.kv_cache_bytes, {})
        return repr((case.archetype.name, *(kw.get(k) for k in GEOMETRY_ARGS)))

    def geometry_cache_fits(self, plan: Plan, knobs: _Knobs) -> bool:
        return plan.max_model_len == self.device.max_model_len and knobs.kv_bytes == self.job.kv_cache_bytes

    def _instrument(self, handle: EngineHandle, knobs: _Knobs, geo: Geometry) -> None:
        # kvcached's mapped bytes per step; native vLLM commits its whole KV tensor at start.
        handle.install_probe(None if kvcached_requested() else geo.kv_tensor_bytes)
        self._seam = None
        if knobs.fault_seam == "harness-emulated" and knobs.plan_path is not None:
            handle.install_emulated_seam(str(knobs.plan_path))
            self._seam = handle
            if any(r.site == "copy" for r in read_plan(knobs.plan_path)):
                handle.rank_call("conformance_emulate_copy_fault", str(knobs.plan_path))

    def _record_memory(
        self, handle: EngineHandle, res: CaseResult, geo: Geometry, pools_start: dict[str, Any], copies_start: Any
    ) -> None:
        if not kvcached_requested():
            res.mapped_bytes_peak = res.mapped_bytes_final = geo.kv_tensor_bytes
            return
        pools_end = handle.kvcached_pools()
        copies_end = handle.kvcached_copies()
        deltas = [
            CopyFacts(**{k: getattr(end, k) - getattr(start, k) for k in CopyFacts.model_fields})
            for start, end in zip(copies_start, copies_end, strict=True)
        ]
        res.kvcached = KvcachedFacts(pools_start=pools_start, pools_end=pools_end, copies=deltas)
        res.mapped_bytes_peak = sum(p.peak_mapped_bytes for p in pools_end.values())
        res.mapped_bytes_final = sum(p.mapped_bytes for p in pools_end.values())

    def _record_faults(self, knobs: _Knobs, res: CaseResult, ranks: int) -> None:
        """What fired: the scheduler's process's counts plus every rank's (rank sites)."""
        if knobs.plan_path is None:
            return
        if self._seam is not None and res.engine_error is None:
            self._seam.flush_emulated_seam()
        files = [read_fired(knobs.plan_path)] + [read_fired(knobs.plan_path, rank=r) for r in range(ranks)]
        fired: dict[str, int] | None = None
        for counts in (f for f in files if f is not None):
            fired = fired or {}
            for site, n in counts.items():
                fired[site] = fired.get(site, 0) + n
        res.fault = FaultRecord(fired=fired, triggers=read_triggers(knobs.plan_path))

    def _snapshot_kv(self, handle: EngineHandle, case: Case, res: CaseResult, out_json: Path) -> None:
        """KV snapshot, with the results written first so a crash while reading KV shows."""
        import numpy as np

        res.kv_status = "pending"
        write_atomic(out_json, res)
        t_kv = time.monotonic()
        meta, arrays = handle.kv_snapshot()
        np.savez(self.job.out_dir / f"{case.case_id}.npz", **arrays)  # type: ignore[arg-type]
        res.kv, res.kv_status = meta, "ok"
        res.t_kv_snapshot = round(time.monotonic() - t_kv, 3)

    # ------------------------------------------------------------------------ generation
    @staticmethod
    def _sampling(case: Case, logprobs: int | None) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0, max_tokens=case.max_tokens, ignore_eos=True, detokenize=False, logprobs=logprobs
        )

    @staticmethod
    def _generate(handle: EngineHandle, prompts: tuple[Prompt, ...], sp: Any) -> list[Any]:
        from vllm.inputs import TokensPrompt

        return handle.llm.generate([TokensPrompt(prompt_token_ids=list(p.tokens)) for p in prompts], sp, use_tqdm=False)

    def _replay_uncacheable(
        self, handle: EngineHandle, case: Case, workload: Workload, geo: Geometry
    ) -> dict[str, list[list[int]]]:
        """Native self-consistency oracle for prompts too short to share a cached block.

        Such a prompt's output can depend on nothing but its tokens. Each one of the last
        pass is generated twice more, one call after the other, in this same engine; if a
        replay differs from the pass output, native vLLM is history-dependent for that
        prompt (e.g. it reads a recycled block's stale recurrent state), and a candidate
        mismatch on it is explained by the reference, not by the candidate.
        """
        short = tuple(p for p in workload.passes[-1] if len(p.tokens) < geo.hash_block_size)
        if not short:
            return {}
        sp = self._sampling(case, None)
        replays = [self._generate(handle, short, sp) for _ in range(2)]
        return {p.rid: [[int(t) for t in r[i].outputs[0].token_ids] for r in replays] for i, p in enumerate(short)}

    def _run_passes(
        self, handle: EngineHandle, case: Case, workload: Workload
    ) -> tuple[list[RequestRecord], list[float], list[int], EngineErrorRecord | None]:
        """Every pass, in order. A candidate whose plan ends in an engine error records the
        error its client saw and stops; any other error is the case's error."""
        sp = self._sampling(case, case.top_logprobs)
        rows: list[RequestRecord] = []
        times: list[float] = []
        corrupted: list[int] = []
        expect_error = self._plans_engine_error(case)
        for pi, prompts in enumerate(workload.passes):
            if pi == 1 and self.job.side == "control" and case.control is Control.NEG_KV:
                corrupted = handle.corrupt_prefix_blocks(workload.corrupt_prefix_tokens)
                if not corrupted:
                    raise RuntimeError("negative KV control: no cached block to corrupt")
            t = time.monotonic()
            try:
                outs = self._generate(handle, prompts, sp)
            except Exception as e:
                if not expect_error:
                    raise
                return rows, times, corrupted, EngineErrorRecord(
                    pass_no=pi + 1, error_type=type(e).__name__, message=str(e)[:500])
            times.append(round(time.monotonic() - t, 3))
            rows.extend(_request_record(p, o, pi + 1) for p, o in zip(prompts, outs, strict=True))
        return rows, times, corrupted, None


def _request_record(prompt: Prompt, out: Any, pass_no: int) -> RequestRecord:
    c = out.outputs[0]
    logprobs = [
        [(int(tok), float(lp.logprob), int(lp.rank)) for tok, lp in sorted(pos.items(), key=lambda kv: (kv[1].rank, kv[0]))]
        for pos in c.logprobs or []
    ]
    return RequestRecord(
        rid=prompt.rid,
        label=prompt.label,
        pass_no=pass_no,
        prompt_len=len(prompt.tokens),
        token_ids=[int(x) for x in c.token_ids],
        logprobs=logprobs,
        num_cached_tokens=int(out.num_cached_tokens or 0),
        finish_reason=c.finish_reason,
        finished=bool(out.finished),
    )


def main(argv: list[str]) -> int:
    stacks.enable()
    job = load_job(Path(argv[0]))
    progress = Progress(int(argv[1]) if len(argv) > 1 else -1)
    overrides.suppress_tokenizer_free_warmup_warning()
    if job.async_override:
        overrides.install_async_override()
    job.out_dir.mkdir(parents=True, exist_ok=True)
    runner = CaseRunner(job)
    progress.say("READY")
    for entry in job.entries:
        cid = entry.case.case_id
        progress.say("START", cid)
        t = time.monotonic()
        err = runner.run_case(entry)
        progress.say("DONE", cid, f"{time.monotonic() - t:.1f}", "ok" if err is None else "error")
    progress.say("EXIT")
    return 0
