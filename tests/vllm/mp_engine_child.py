"""Child script: one real multiprocess vLLM engine (``MultiprocExecutor``), tokens out.

Usage: ``python mp_engine_child.py JOB.json OUT.json``. The job names the archetype, the
tensor-parallel size, the prompts (token IDs) and the passes. The engine runs with vLLM's
default ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the EngineCore and every worker are processes
of their own, so kvcached's scheduler and its KV memory never share one. The child records
the tokens of every pass and, when kvcached is on, the pools it can see (none: they live in
the EngineCore process) and the copy counters of every rank (through ``collective_rpc``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path


class RankFacts:
    """vLLM worker extension (``worker_extension_cls``): kvcached's facts on one rank,
    reachable by name through ``LLM.collective_rpc`` in every process layout."""

    def kvcached_rank_facts(self) -> dict[str, object]:
        import kvcached
        from kvcached.integration.vllm.rank_kv import registered_rank_kv

        spaces = registered_rank_kv()
        return {
            "rank": int(self.rank),  # type: ignore[attr-defined]
            "spaces": len(spaces),
            "mapped": sorted(p for kv in spaces for p in kv.pages.mapped),
            "copies": asdict(kvcached.copy_stats()),
        }


def _until_fewer_mapped(llm: object, before: list[dict[str, object]], deadline_s: float) -> list[dict[str, object]]:
    """Every rank's facts once rank 0 maps fewer pages than ``before`` says, or at the deadline;
    only utility calls reach the engine meanwhile (no request, so no step)."""
    end = time.monotonic() + deadline_s
    while True:
        facts = llm.collective_rpc("kvcached_rank_facts")  # type: ignore[attr-defined]
        if len(facts[0]["mapped"]) < len(before[0]["mapped"]) or time.monotonic() > end:
            return facts
        time.sleep(0.1)


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from conformance.cases import ARCHETYPES
    from conformance.models import ensure_model
    from conformance.vllm_series import adjusted

    job = json.loads(Path(job_path).read_text())
    arch = ARCHETYPES[job["archetype"]]
    kwargs = adjusted(arch.name, {
        "model": str(ensure_model(arch.model)), "skip_tokenizer_init": True, "enforce_eager": True,
        "dtype": arch.model.torch_dtype, "enable_prefix_caching": True, "max_model_len": 1024, "seed": 0,
        "kv_cache_memory_bytes": job.get("kv_cache_bytes", 64 << 20),
        "tensor_parallel_size": job["tp"], **dict(arch.engine_kwargs),
        "worker_extension_cls": "mp_engine_child.RankFacts",
    })
    llm = LLM(**kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    out: dict[str, object] = {"passes": []}
    for prompts in job["passes"]:
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        out["passes"].append([list(r.outputs[0].token_ids) for r in res])  # type: ignore[union-attr]
    idle_since = time.monotonic()
    if job.get("kvcached"):
        out["ranks_after_run"] = llm.collective_rpc("kvcached_rank_facts")
        out["after_run_s"] = time.monotonic() - idle_since
        if "idle_watch_s" in job:  # the idle engine gives pages back with no step (its idle grace)
            out["ranks_after_grace"] = _until_fewer_mapped(llm, out["ranks_after_run"], job["idle_watch_s"])
            out["after_grace_s"] = time.monotonic() - idle_since
        llm.reset_prefix_cache()  # idle cached blocks go back: what stays mapped is the reserve
        out["ranks_after_reset"] = llm.collective_rpc("kvcached_rank_facts")
    out["client"] = type(llm.llm_engine.engine_core).__name__
    llm.llm_engine.engine_core.shutdown()
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
