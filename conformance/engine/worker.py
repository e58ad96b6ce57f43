"""The per-engine child process: builds engines in-process, runs cases, dumps results.

Usage (by ``runner.py`` only): ``python -m conformance.engine.worker JOB.json PROGRESS_FD``.

One process serves one side (reference, candidate or control) of one archetype and runs
its cases one after another, each on a fresh ``LLM`` that is shut down and dropped before
the next, so the ~10 s vLLM import is paid once per process. Sides never share a process:
whatever kvcached (or a harness override) patches stays inside that side.

Per case it writes ``<out>/<case_id>.json`` (and ``.npz`` with the KV snapshot): request
token IDs, top-k logprobs, prefix-hit tokens, per-step memory samples, copies, preemptions,
the scheduler that really ran, geometry, fault counts and kvcached stats. The JSON is
written before the KV snapshot is taken (``kv_status: "pending"``) and rewritten after it,
so a crash while reading KV is visible as such instead of losing the case.

Invariants:
* The reference derives the workload and the case plan (max_model_len, budget) from the
  geometry of its running engine; candidate and control receive them and check that their
  own geometry has the same attention layout before running anything.
* Fault plans apply to the candidate only; control perturbations to the control side only.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.engine import kvcached_probe, overrides
from conformance.cases import Case, Control, Scheduling
from conformance.faultplan import read_fired, read_triggers, write_plan
from conformance.geometry import Geometry, prompt_lengths, read_geometry
from conformance.workload import Workload, build_workload, stable_seed

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass
class Job:
    side: str  # reference | candidate | control
    engine: str  # native | kvcached
    out_dir: Path
    page_size: int | None  # explicit KVCACHED_PAGE_SIZE; None: derived from the reference geometry
    kv_cache_bytes: int
    async_override: bool
    budget_bytes_override: int | None
    entries: list[dict[str, Any]]

    @classmethod
    def load(cls, path: Path) -> Job:
        d = json.loads(path.read_text())
        return cls(
            side=d["side"],
            engine=d["engine"],
            out_dir=Path(d["out_dir"]),
            page_size=d.get("page_size"),
            kv_cache_bytes=int(d["kv_cache_bytes"]),
            async_override=bool(d["async_override"]),
            budget_bytes_override=d.get("budget_bytes_override"),
            entries=list(d["entries"]),
        )


@dataclass
class _Knobs:
    """Per-case settings of one side (see ``CaseRunner._knobs``)."""

    kv_bytes: int
    page_size: int | None
    fault_seam: str | None = None  # "kvcached" | "harness-emulated" | None
    plan_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def _memory_sampler(geo: Geometry) -> Callable[[], int]:
    """Physical KV bytes now: kvcached's mapped bytes, or native vLLM's whole KV tensor bytes
    (committed when the engine starts, constant afterwards)."""
    if kvcached_probe.enabled():
        return kvcached_probe.mapped_bytes
    native_bytes = geo.kv_tensor_bytes
    return lambda: native_bytes


class Progress:
    def __init__(self, fd: int) -> None:
        self._f = os.fdopen(fd, "w", buffering=1) if fd >= 0 else None

    def say(self, *parts: object) -> None:
        if self._f is not None:
            self._f.write(" ".join(str(p) for p in parts) + "\n")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.rename(path)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class CaseRunner:
    def __init__(self, job: Job) -> None:
        self.job = job
        self.geometry_cache: dict[str, Geometry] = {}

    # ----------------------------------------------------------------- engine construction
    def _engine_kwargs(self, case: Case, model_dir: Path, max_model_len: int, kv_bytes: int) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model": str(model_dir),
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": case.archetype.dtype,
            "enable_prefix_caching": case.prefix_caching,
            "max_model_len": max_model_len,
            "seed": 0,
            "kv_cache_memory_bytes": kv_bytes,
            "disable_log_stats": False,  # engine metrics (preemptions, prefix hits) need stats
            "async_scheduling": case.scheduling is Scheduling.ASYNC,
        }
        kw.update(dict(case.archetype.engine_kwargs))
        # What this vLLM series' CPU kernels need (nothing on 0.28; see vllm_series): the same
        # on every side, and recorded with the case's engine arguments.
        from conformance.vllm_series import adjusted

        return adjusted(case.archetype.name, kw)

    def _build(self, case: Case, kwargs: dict[str, Any]) -> Any:
        from vllm import LLM

        overrides.force_async(self.job.async_override and case.scheduling is Scheduling.ASYNC)
        try:
            return LLM(**kwargs)
        finally:
            overrides.force_async(False)

    @staticmethod
    def _shutdown(llm: Any) -> None:
        llm.llm_engine.engine_core.shutdown()

    def _geometry(self, llm: Any, page_size: int | None) -> Geometry:
        kv_page = kvcached_probe.page_size() if kvcached_probe.enabled() else None
        return read_geometry(llm, page_size, kv_page)

    def _probe_geometry(self, case: Case, model_dir: Path) -> Geometry:
        key = f"{case.archetype.name}|{case.prefix_caching}"
        if key not in self.geometry_cache:
            llm = self._build(
                case, self._engine_kwargs(case, model_dir, DEFAULT_MAX_MODEL_LEN, self.job.kv_cache_bytes)
            )
            try:
                self.geometry_cache[key] = self._geometry(llm, self.job.page_size)
            finally:
                self._shutdown(llm)
                del llm
                gc.collect()
        return self.geometry_cache[key]

    # -------------------------------------------------------------------------- planning
    def _plan(self, case: Case, model_dir: Path) -> dict[str, Any]:
        """Reference side: everything both engines must share, derived from real geometry."""
        max_model_len = DEFAULT_MAX_MODEL_LEN
        plan: dict[str, Any] = {}
        if case.fault.physical_budget:
            geo = self._probe_geometry(case, model_dir)
            plan["page_size"] = geo.page_size_bytes
            lens = prompt_lengths(geo, case.lengths, DEFAULT_MAX_MODEL_LEN - case.max_tokens)
            # Both engines run with a max_model_len just large enough for the longest
            # request, so "one request fits, the concurrent load does not" is a small budget.
            max_model_len = _round_up(max(n for _, n in lens) + case.max_tokens, geo.block_size)
            blocks = math.ceil(max_model_len / geo.block_size) * len(geo.group_block_sizes) + 2
            native_bytes = blocks * geo.block_bytes_all_layers
            n_tensors = max(1, geo.kv_tensor_bytes // (geo.num_blocks * geo.block_page_bytes))
            kvc_bytes = _round_up(native_bytes, geo.page_size_bytes * n_tensors)
            plan["budget"] = {
                "blocks": blocks,
                "native_kv_cache_bytes": native_bytes,
                "kvcached_budget_bytes": self.job.budget_bytes_override or kvc_bytes,
            }
        plan["max_model_len"] = max_model_len
        return plan

    # ---------------------------------------------------------------------------- a case
    def _knobs(self, case: Case, plan: dict[str, Any]) -> _Knobs:
        """What this side changes for the case: fault plan file, budget, page size, env."""
        kn = _Knobs(kv_bytes=self.job.kv_cache_bytes, page_size=plan.get("page_size") or self.job.page_size)
        kvcached = self.job.engine == "kvcached"
        if self.job.side == "candidate" and not case.fault.is_none:
            kn.fault_seam = "kvcached" if kvcached else "harness-emulated"
            if case.fault.rules:
                kn.plan_path = write_plan(self.job.out_dir / f"{case.case_id}.plan.json", case.fault.rules)
                if kvcached:
                    kn.env["KVCACHED_FAULT_PLAN"] = str(kn.plan_path)
            if case.fault.physical_budget:
                if kvcached:
                    kn.env["KVCACHED_BUDGET_BYTES"] = str(plan["budget"]["kvcached_budget_bytes"])
                else:
                    kn.kv_bytes = int(plan["budget"]["native_kv_cache_bytes"])
        if kvcached:
            if kn.page_size is None:
                raise RuntimeError("a kvcached engine needs the page size planned by the reference")
            kn.env["KVCACHED_PAGE_SIZE"] = str(kn.page_size)
        return kn

    def _workload(self, entry: dict[str, Any], case: Case, plan: dict[str, Any], geo: Geometry) -> Workload:
        """The reference derives the workload from its geometry; the others check theirs matches."""
        if entry.get("workload") is None:
            max_prompt = int(plan["max_model_len"]) - case.max_tokens
            lens = prompt_lengths(geo, case.lengths, max_prompt)
            return build_workload(case.pattern, lens, geo, max_prompt, stable_seed(case.case_id))
        ref_geo = Geometry.from_json(entry["geometry"])
        if ref_geo.same_attention_layout() != geo.same_attention_layout():
            raise RuntimeError(
                f"geometry differs from the reference: {geo.same_attention_layout()} != {ref_geo.same_attention_layout()}"
            )
        return Workload.from_json(entry["workload"])

    def run_case(self, entry: dict[str, Any]) -> str | None:
        """Run one case; return its error text (None when it ran to the end)."""
        case = Case.from_json(entry["case"])
        out_json = self.job.out_dir / f"{case.case_id}.json"
        res: dict[str, Any] = {
            "case": case.to_json(),
            "side": self.job.side,
            "engine": self.job.engine,
            "error": None,
            "kv_status": "not-run",
        }
        t0 = time.monotonic()
        llm = None
        knobs: _Knobs | None = None
        try:
            model_spec = case.archetype.model
            if self.job.side == "control" and case.control is Control.NEG_WEIGHTS:
                model_spec = model_spec.with_weight_seed(model_spec.weight_seed + 1)
            from conformance.models import ensure_model

            model_dir = ensure_model(model_spec)
            res["model"] = {"path": str(model_dir), "weight_seed": model_spec.weight_seed}
            plan = entry.get("plan") or self._plan(case, model_dir)
            res["plan"] = plan
            knobs = self._knobs(case, plan)
            res["fault_seam"] = knobs.fault_seam
            res["kvcached_env"] = dict(knobs.env)
            # kvcached resolves its configuration when the engine's pool is built: set the
            # knobs just for this engine, removed again in `finally`.
            os.environ.update(knobs.env)

            kwargs = self._engine_kwargs(case, model_dir, int(plan["max_model_len"]), knobs.kv_bytes)
            res["engine_kwargs"] = kwargs
            t_b = time.monotonic()
            llm = self._build(case, kwargs)
            res["t_engine_start"] = round(time.monotonic() - t_b, 3)

            from conformance.engine import probes

            res["scheduler"] = probes.scheduler_that_ran(llm)
            geo = self._geometry(llm, knobs.page_size)
            res["geometry"] = geo.to_json()
            if knobs.page_size is not None and geo.page_size_bytes != int(knobs.page_size):
                raise RuntimeError(f"kvcached reports page size {geo.page_size_bytes}, given {knobs.page_size}")
            plan.setdefault("page_size", geo.page_size_bytes)
            if int(plan["max_model_len"]) == DEFAULT_MAX_MODEL_LEN and knobs.kv_bytes == self.job.kv_cache_bytes:
                # A later budget case of this archetype can plan from this instead of a probe engine.
                self.geometry_cache.setdefault(f"{case.archetype.name}|{case.prefix_caching}", geo)
            copies_before: dict[str, int] = {}
            if kvcached_probe.enabled():
                kvcached_probe.assert_active()  # KVCACHED_ENABLE=1 without kvcached is a case error
                res["kvcached_stats_start"] = kvcached_probe.stats()
                copies_before = kvcached_probe.copy_stats()
            workload = self._workload(entry, case, plan, geo)
            res["workload"] = workload.to_json()

            probe = probes.install_probe(llm, _memory_sampler(geo))
            seam = None
            if knobs.fault_seam == "harness-emulated" and knobs.plan_path is not None:
                from conformance.engine.emulated_faults import install_emulated_seam

                seam = install_emulated_seam(llm, knobs.plan_path)

            res["requests"], res["t_passes"], res["corrupted_blocks"] = self._run_passes(llm, case, workload)
            res["metrics"] = probes.engine_metrics(llm)
            res["probe"] = probe.to_json()
            if kvcached_probe.enabled():
                res["kvcached_stats_end"] = kvcached_probe.stats()
                res["kvcached_copy_stats"] = kvcached_probe.delta(kvcached_probe.copy_stats(), copies_before)
                res["mapped_bytes_peak"] = kvcached_probe.peak_mapped_bytes()
                res["mapped_bytes_final"] = kvcached_probe.mapped_bytes()
            else:
                res["mapped_bytes_peak"] = res["mapped_bytes_final"] = geo.kv_tensor_bytes
            if knobs.plan_path is not None:
                if seam is not None:
                    seam.flush()
                res["fault_fired"] = read_fired(knobs.plan_path)
                res["fault_triggers"] = read_triggers(knobs.plan_path)

            self._snapshot_kv(llm, case, res, out_json)
            if self.job.side == "reference":
                # After the snapshot (replays allocate blocks and would change the cache) and
                # outside the recorded schedule.
                probe.recording = False
                res["replay"] = self._replay_uncacheable(llm, case, workload, geo)
        except Exception as e:  # noqa: BLE001 - recorded as the case's error (the case fails); next case runs
            res["error"] = f"{type(e).__name__}: {e}"
            res["traceback"] = traceback.format_exc()
        finally:
            for k in knobs.env if knobs else ():
                os.environ.pop(k, None)
            if llm is not None:
                try:
                    self._shutdown(llm)
                except Exception as e:  # noqa: BLE001 - a teardown failure fails the case, visibly
                    res["error"] = res["error"] or f"teardown: {type(e).__name__}: {e}"
                    res["teardown_traceback"] = traceback.format_exc()
                del llm
                gc.collect()
            res["t_total"] = round(time.monotonic() - t0, 3)
            _write_json(out_json, res)
        return res["error"]

    def _snapshot_kv(self, llm: Any, case: Case, res: dict[str, Any], out_json: Path) -> None:
        """KV snapshot, with the results written first so a crash while reading KV shows."""
        import numpy as np

        from conformance.engine.kvsnap import snapshot

        res["kv_status"] = "pending"
        _write_json(out_json, res)
        t_kv = time.monotonic()
        meta, arrays = snapshot(llm)
        np.savez(self.job.out_dir / f"{case.case_id}.npz", **arrays)  # type: ignore[arg-type]
        res["kv"] = meta
        res["kv_status"] = "ok"
        res["t_kv_snapshot"] = round(time.monotonic() - t_kv, 3)

    def _replay_uncacheable(self, llm: Any, case: Case, workload: Workload, geo: Geometry) -> dict[str, Any]:
        """Native self-consistency oracle for prompts too short to share a cached block.

        Such a prompt's output can depend on nothing but its tokens. Each one of the last
        pass is generated twice more, one call after the other, in this same engine; if a
        replay differs from the pass output, native vLLM is history-dependent for that
        prompt (e.g. it reads a recycled block's stale recurrent state), and a candidate
        mismatch on it is explained by the reference, not by the candidate.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=case.max_tokens, ignore_eos=True, detokenize=False)
        short = [p for p in workload.passes[-1] if len(p.tokens) < geo.hash_block_size]
        out: dict[str, Any] = {}
        if not short:
            return out
        replays = [
            llm.generate([TokensPrompt(prompt_token_ids=list(p.tokens)) for p in short], sp, use_tqdm=False)
            for _ in range(2)
        ]
        for i, p in enumerate(short):
            out[p.rid] = [[int(t) for t in r[i].outputs[0].token_ids] for r in replays]
        return out

    def _run_passes(
        self, llm: Any, case: Case, workload: Workload
    ) -> tuple[list[dict[str, Any]], list[float], list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(
            temperature=0.0,
            max_tokens=case.max_tokens,
            ignore_eos=True,
            detokenize=False,
            logprobs=case.top_logprobs,
        )
        rows: list[dict[str, Any]] = []
        times: list[float] = []
        corrupted: list[int] = []
        for pi, prompts in enumerate(workload.passes):
            if pi == 1 and self.job.side == "control" and case.control is Control.NEG_KV:
                from conformance.engine.kvsnap import corrupt_prefix_blocks

                corrupted = corrupt_prefix_blocks(llm, workload.corrupt_prefix_tokens)
                if not corrupted:
                    raise RuntimeError("negative KV control: no cached block to corrupt")
            t = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(p.tokens)) for p in prompts], sp, use_tqdm=False)
            times.append(round(time.monotonic() - t, 3))
            for p, o in zip(prompts, outs, strict=True):
                c = o.outputs[0]
                lps = []
                for pos in c.logprobs or []:
                    ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank, kv[0]))
                    lps.append([[int(tok), float(lp.logprob), int(lp.rank)] for tok, lp in ranked])
                rows.append(
                    {
                        "rid": p.rid,
                        "label": p.label,
                        "pass": pi + 1,
                        "prompt_len": len(p.tokens),
                        "token_ids": [int(x) for x in c.token_ids],
                        "logprobs": lps,
                        "num_cached_tokens": int(o.num_cached_tokens or 0),
                        "finish_reason": c.finish_reason,
                        "finished": bool(o.finished),
                    }
                )
        return rows, times, corrupted


def main(argv: list[str]) -> int:
    job = Job.load(Path(argv[0]))
    progress = Progress(int(argv[1]) if len(argv) > 1 else -1)
    overrides.suppress_tokenizer_free_warmup_warning()
    if job.async_override:
        overrides.install_async_override()
    job.out_dir.mkdir(parents=True, exist_ok=True)
    runner = CaseRunner(job)
    progress.say("READY")
    for entry in job.entries:
        cid = Case.from_json(entry["case"]).case_id
        progress.say("START", cid)
        t = time.monotonic()
        err = runner.run_case(entry)
        progress.say("DONE", cid, f"{time.monotonic() - t:.1f}", "ok" if err is None else "error")
    progress.say("EXIT")
    return 0

