"""The harness's CUDA profile without a GPU: geometry, models, the CUDA matrix, native's floor,
and the packed CUDA attention layout the KV snapshot reads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conformance import cases as C
from conformance.device import PROFILES, Device, profile
from conformance.engine.worker import CaseRunner
from conformance.geometry import derive_page_size
from conformance.models import MODEL_SPECS, model_spec
from conformance.orchestrate.compare import judge_against_native_floor
from conformance.orchestrate.parity import Problem, ProblemKind
from tests.test_conformance_knobs import _runner
from tests.test_conformance_report import _row

MIB = 1 << 20
CUDA = PROFILES[Device.CUDA]


def test_cuda_pages_are_whole_multiples_of_the_driver_granularity() -> None:
    assert derive_page_size((65536, 65536), CUDA) == 2 * MIB  # dense llama: 32 blocks a page
    assert derive_page_size((196608,), CUDA) == 6 * MIB  # a 48-token hybrid block: lcm with 2 MiB
    assert derive_page_size((8192, 8192)) == 65536  # the CPU profile is as before
    for strides in [(65536,), (196608,), (524288,), (4 << 20,)]:
        page = derive_page_size(strides, CUDA)
        assert page % (2 * MIB) == 0 and all(page % s == 0 for s in strides)


def _attention_bytes_per_token(spec_name: str) -> int:
    cfg = dict(model_spec(spec_name, "cuda").config)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_key_value_heads"] * head_dim * 2  # K and V, 16-bit


@pytest.mark.parametrize("name", ["llama", "qwen3", "nemotron_h", "granitemoehybrid", "falcon_h1", "qwen3_next",
                                  "qwen3_5"])
def test_cuda_models_reach_a_2mib_page_within_512_tokens(name: str) -> None:
    spec = model_spec(name, "cuda")
    assert spec.torch_dtype in ("bfloat16", "float16")
    assert (2 * MIB) // _attention_bytes_per_token(name) == 512
    assert model_spec(name) is MODEL_SPECS[name]  # the CPU models are untouched


def test_cuda_mamba2_state_divides_a_2mib_page() -> None:
    cfg = dict(model_spec("mamba2", "cuda").config)
    inner = cfg["hidden_size"] * cfg.get("expand", 2)
    assert inner == cfg["num_heads"] * cfg["head_dim"]
    conv = (inner + 2 * cfg["n_groups"] * cfg["state_size"]) * (cfg["conv_kernel"] - 1) * 2
    ssm = cfg["num_heads"] * cfg["head_dim"] * cfg["state_size"] * 2
    assert (2 * MIB) % (conv + ssm) == 0


#: The SSM state of one Mamba layer in bytes (16-bit), from each hybrid's own config names.
_SSM_STATE_BYTES = {
    "nemotron_h": lambda c: c["mamba_num_heads"] * c["mamba_head_dim"] * c["ssm_state_size"] * 2,
    "falcon_h1": lambda c: c["mamba_d_ssm"] * c["mamba_d_state"] * 2,
}


@pytest.mark.parametrize("name", sorted(_SSM_STATE_BYTES))
def test_cuda_partial_hit_hybrids_have_blocks_larger_than_the_hash_unit(name: str) -> None:
    """vLLM sizes the attention block to hold one Mamba state: a state above 16 tokens of attention KV
    (64 KiB) makes the block larger than the 16-token hash unit, so a partial prefix can hit."""
    cfg = dict(model_spec(name, "cuda").config)
    assert dict(C.ARCHETYPES[name].engine_kwargs)["prefix_match_unit"] == 16
    assert _SSM_STATE_BYTES[name](cfg) >= 16 * _attention_bytes_per_token(name)


def test_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        model_spec("llama", "tpu")
    with pytest.raises(ValueError):
        profile("tpu")


def test_cuda_matrix_covers_what_only_a_gpu_does() -> None:
    full, quick = C.cuda_matrix(), C.cuda_matrix(quick=True)
    for matrix in (full, quick):
        ids = [c.case_id for c in matrix]
        assert len(ids) == len(set(ids))
        assert any(c.compiled and c.layout is C.Layout.MP and c.scheduling is C.Scheduling.ASYNC for c in matrix)
        fa3 = [c for c in matrix if c.attention == C.FA3]
        # every FlashAttention 3 case is judged against its own native baseline
        bases = {replace(c, control=C.Control.NONE) for c in fa3 if c.control is C.Control.BASELINE}
        assert {c for c in fa3 if not c.is_control} <= bases
        assert {c.control for c in matrix} >= {C.Control.BASELINE, C.Control.NEG_KV}
    assert {c.archetype.name for c in full} == set(C.ARCHETYPES)
    assert {c.fault.name for c in full} >= {"cow-admission-x2", "map-mid-alloc", "tiny-budget"}


def test_case_json_round_trips_mode_and_backend() -> None:
    case = C.Case(C.ARCHETYPES["llama"], C.Scheduling.ASYNC, compiled=True, attention=C.FA3, layout=C.Layout.MP)
    back = C.Case.from_json(json.loads(json.dumps(case.to_json())))
    assert back == case and back.case_id.endswith("-mp-graphs-flashattn")
    old = {k: v for k, v in C.Case(C.ARCHETYPES["llama"]).to_json().items() if k not in ("compiled", "attention")}
    assert C.Case.from_json(old) == C.Case(C.ARCHETYPES["llama"])  # results written before these fields


FA3_CASE = C.Case(C.ARCHETYPES["llama"], attention=C.FA3, max_tokens=4)
FA3_BASELINE = replace(FA3_CASE, control=C.Control.BASELINE)


def _differs(case: C.Case, n: int) -> object:
    return _row(case, exact_matches=3 - n, passed=False, verdict="MISMATCH",
                problems=[Problem(ProblemKind.NUMERIC, f"token mismatch in {n} request(s), first r0@3")])


def test_a_differing_fa3_baseline_is_the_floor_and_nothing_is_called_exact() -> None:
    floor, exact = _differs(FA3_BASELINE, 2), _row(FA3_CASE)
    floor, exact = judge_against_native_floor([floor, exact], {FA3_BASELINE.case_id: FA3_BASELINE,
                                                               FA3_CASE.case_id: FA3_CASE})
    assert floor.passed and floor.verdict == "native floor: 2 of 3 requests differ"
    assert exact.passed and exact.verdict.startswith("within native's floor (0 of 3")


def test_a_row_within_the_floor_passes_and_one_beyond_it_fails() -> None:
    cases = {FA3_BASELINE.case_id: FA3_BASELINE, FA3_CASE.case_id: FA3_CASE}
    floor, within = _differs(FA3_BASELINE, 2), _differs(FA3_CASE, 2)
    given = within
    floor, within = judge_against_native_floor([floor, within], cases)
    assert not given.passed  # the rows given are left as they were
    assert within.passed and not within.problems
    floor, beyond = _differs(FA3_BASELINE, 1), _differs(FA3_CASE, 2)
    floor, beyond = judge_against_native_floor([floor, beyond], cases)
    assert not beyond.passed and "beyond native's floor" in beyond.problems[-1]


def test_a_problem_keeps_its_kind_through_copies_and_renders_as_its_text() -> None:
    import copy
    import pickle

    p = Problem(ProblemKind.NUMERIC, "token mismatch in 1 request(s)")
    for again in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert again == p and again.kind is ProblemKind.NUMERIC
    row = _differs(FA3_CASE, 1)
    assert row.to_record()["problems"] == "token mismatch in 1 request(s), first r0@3"


def test_the_floor_takes_only_numeric_problems_by_kind_not_by_wording() -> None:
    """A problem of another kind fails the row whatever native did, however it is worded."""
    cases = {FA3_BASELINE.case_id: FA3_BASELINE, FA3_CASE.case_id: FA3_CASE}
    floor, row = _differs(FA3_BASELINE, 2), _differs(FA3_CASE, 1)
    row.problems.append(Problem(ProblemKind.CHECK, "token mismatch in the fired counts"))
    floor, row = judge_against_native_floor([floor, row], cases)
    assert floor.passed and not row.passed and "beyond native's floor" in row.problems[-1]


def test_an_exact_floor_changes_nothing_and_other_baselines_must_stay_exact() -> None:
    triton_case = C.Case(C.ARCHETYPES["llama"], max_tokens=4)
    triton_base = replace(triton_case, control=C.Control.BASELINE)
    base_row, row = _differs(triton_base, 1), _differs(triton_case, 1)
    base_row, row = judge_against_native_floor([base_row, row], {triton_base.case_id: triton_base,
                                                                 triton_case.case_id: triton_case})
    assert not base_row.passed and not row.passed  # outside FlashAttention 3 a baseline must be exact
    floor, fails = _row(FA3_BASELINE), _differs(FA3_CASE, 1)
    floor, fails = judge_against_native_floor([floor, fails], {FA3_BASELINE.case_id: FA3_BASELINE,
                                                               FA3_CASE.case_id: FA3_CASE})
    assert floor.verdict == "exact" and not fails.passed


NEM_GRAPHS = C.Case(C.ARCHETYPES["nemotron_h"], C.Scheduling.ASYNC, pattern=C.PrefixPattern.PARTIAL_COW, compiled=True)
NEM_GRAPHS_BASELINE = replace(NEM_GRAPHS, control=C.Control.BASELINE)


def test_a_case_native_did_not_repeat_is_judged_against_its_baseline() -> None:
    """run-12-04d: native against itself kept every token of nemotron_h's compiled async
    partial-prefix case but 2 KV blocks one bfloat16 step apart. That baseline is the case's
    floor; the same case on another hybrid, and nemotron_h's other baselines, stay exact."""
    assert NEM_GRAPHS.case_id in C.NATIVE_FLOOR_CASES and C.measures_native_floor(NEM_GRAPHS_BASELINE)
    assert not C.measures_native_floor(NEM_GRAPHS)  # the case itself is judged, it measures nothing
    kv = Problem(ProblemKind.NUMERIC, "same schedule but KV differs (max |Δ| 0.0156)")
    floor = _row(NEM_GRAPHS_BASELINE, passed=False, verdict="MISMATCH", problems=[kv])
    row = _row(NEM_GRAPHS, passed=False, verdict="MISMATCH",
               problems=[Problem(ProblemKind.NUMERIC, "same schedule but KV differs (max |Δ| 4.29e-10)")])
    floor, row = judge_against_native_floor([floor, row], {c.case_id: c for c in (NEM_GRAPHS, NEM_GRAPHS_BASELINE)})
    assert floor.passed and floor.verdict == "native floor: 0 of 3 requests differ"
    assert row.passed and row.verdict == "within native's floor (0 of 3 requests differ)"
    for other in (replace(NEM_GRAPHS, archetype=C.ARCHETYPES["falcon_h1"]), replace(NEM_GRAPHS, compiled=False)):
        assert not C.measures_native_floor(replace(other, control=C.Control.BASELINE))


NEM_BUDGET = C.Case(C.ARCHETYPES["nemotron_h"], lengths=C.LengthSet.EXTENDED,
                    pattern=C.PrefixPattern.SHARED_CONCURRENT, fault=C.TINY_BUDGET, max_tokens=4)
NEM_EQUAL_POOL = replace(NEM_BUDGET, control=C.Control.EQUAL_POOL)


def test_native_at_the_candidates_pool_is_the_floor_of_its_budget_case() -> None:
    """run-12-04b: native at the budget's pool differed from native with 1 GiB in one request,
    exactly as kvcached did. The budget case passes within that floor, never as exact; one more
    differing request fails it; an exact equal-pool run leaves the case to be exact itself."""
    cases = {NEM_EQUAL_POOL.case_id: NEM_EQUAL_POOL, NEM_BUDGET.case_id: NEM_BUDGET}
    floor, row = judge_against_native_floor([_differs(NEM_EQUAL_POOL, 1), _differs(NEM_BUDGET, 1)], cases)
    assert floor.passed and floor.verdict == "native floor: 1 of 3 requests differ"
    assert row.passed and row.verdict == "within native's floor (1 of 3 requests differ)"
    _, beyond = judge_against_native_floor([_differs(NEM_EQUAL_POOL, 1), _differs(NEM_BUDGET, 2)], cases)
    assert not beyond.passed and "beyond native's floor" in beyond.problems[-1]
    floor, row = judge_against_native_floor([_row(NEM_EQUAL_POOL), _differs(NEM_BUDGET, 1)], cases)
    assert floor.verdict == "exact" and not row.passed
    # The report names the control for what it is, and its floor as measured.
    from conformance.orchestrate.report.build import _who_and_match

    floor, within = judge_against_native_floor([_differs(NEM_EQUAL_POOL, 1), _differs(NEM_BUDGET, 1)], cases)
    assert _who_and_match(floor, "kvcached") == ("Native at the candidate's pool", "native floor: 1 of 3 requests differ")
    assert _who_and_match(_row(NEM_EQUAL_POOL), "kvcached") == ("Native at the candidate's pool", "Exact")
    assert _who_and_match(within, "kvcached") == ("kvcached", "Within native's floor (1 of 3 requests differ) (2/3 exact)")


def test_the_equal_pool_control_runs_its_budget_and_native_gets_the_budgets_pool(tmp_path: Path) -> None:
    from tests.test_conformance_knobs import PLAN

    assert NEM_EQUAL_POOL.case_id.endswith("-tiny-budget-native-equal-pool")
    with pytest.raises(ValueError, match="physical-budget plan"):
        replace(NEM_BUDGET, fault=C.NO_FAULTS, control=C.Control.EQUAL_POOL)
    with pytest.raises(ValueError, match="without fault plans"):
        replace(NEM_BUDGET, control=C.Control.BASELINE)
    knobs = _runner(tmp_path, "control", "native")._knobs(NEM_EQUAL_POOL, PLAN)
    assert PLAN.budget is not None and knobs.kv_bytes == PLAN.budget.native_kv_cache_bytes
    assert knobs.kvcached == {}
    # The other controls keep every engine's pool.
    base = _runner(tmp_path, "control", "native")._knobs(replace(NEM_BUDGET, fault=C.NO_FAULTS,
                                                                 control=C.Control.BASELINE), PLAN)
    assert base.kv_bytes == 1 << 26
    matrix = {c.case_id for c in C.cuda_matrix()}
    assert {NEM_EQUAL_POOL.case_id, NEM_BUDGET.case_id} <= matrix


def test_packed_cuda_attention_blocks_span_kernel_blocks() -> None:
    torch = pytest.importorskip("torch")
    from conformance.engine.kvsnap import attention_block, split_packed_block

    # 6 kernel blocks of 16 tokens, 2 heads, head_size 4; a 48-token scheduler block spans 3
    t = torch.arange(6 * 2 * 16 * 8, dtype=torch.float32).reshape(6, 2, 16, 8)
    block = attention_block(t, 1, 48)
    assert block.shape == (2, 48, 8)
    assert all(torch.equal(block[:, 16 * i : 16 * (i + 1)], t[3 + i]) for i in range(3))
    (k, k_axis), (v, v_axis) = split_packed_block(block, 20)
    assert k.shape == v.shape == (2, 20, 4) and k_axis == v_axis == 1
    assert torch.equal(k[:, 17], t[4][:, 1, :4]) and torch.equal(v[:, 17], t[4][:, 1, 4:])
    with pytest.raises(RuntimeError, match="not a packed HND view"):
        attention_block(t, 0, 40)


def test_a_native_error_is_neither_a_pass_nor_a_failure() -> None:
    from conformance.orchestrate import report as R

    failing = C.Case(C.ARCHETYPES["llama"], C.Scheduling.ASYNC, max_tokens=4)
    native = _row(failing, passed=False, verdict="error", exact_matches=0,
                  native_defect_reference="native vLLM 0.26.0 fails here on its own, in registry.py: ...")
    good = _row(FA3_CASE)
    report = R.build_report([native, good], [(native, []), (good, [])], {"date": "today"}, "KVCached",
                            {failing.case_id: failing, FA3_CASE.case_id: FA3_CASE}, [], 1.0)
    assert (report.passed, report.failed, report.native_errors, report.verdict) == (1, 0, 1, "PASS")
    assert "1 native errors" in report.headline
    broken = _row(failing, passed=False, verdict="error", exact_matches=0)  # no known defect: a failure
    report = R.build_report([broken, good], [(broken, []), (good, [])], {"date": "today"}, "KVCached",
                            {failing.case_id: failing, FA3_CASE.case_id: FA3_CASE}, [], 1.0)
    assert (report.failed, report.native_errors, report.verdict) == (1, 0, "FAIL")


def test_the_0_26_qwen3_5_refusal_is_a_known_native_defect_there_only() -> None:
    from conformance import vllm_series as vs

    err = ("ValidationError: 1 validation error for ModelConfig\n  Value error, Model architectures "
           "['Qwen3_5ForCausalLM'] are not supported for now. Supported architectures: dict_keys(['A'])")
    assert vs.native_defect("0.26.0", err, "__init__") is not None
    assert vs.native_defect("0.28.0", err, "__init__") is None
    assert vs.native_defect("0.26.0", err.replace("Qwen3_5", "Llama"), "__init__") is None


@pytest.mark.parametrize(("executor", "separate", "layout", "holds"), [
    ("UniProcExecutor", True, C.Layout.MP, True),  # CUDA, TP=1: the EngineCore process runs UniProc
    ("UniProcExecutor", False, C.Layout.MP, False),
    ("MultiprocExecutor", True, C.Layout.MP, True),  # the CPU
    ("UniProcExecutor", False, C.Layout.INPROC, True),
    ("UniProcExecutor", None, C.Layout.MP, False),  # results written before the fact: the executor decides
])
def test_the_layout_that_ran_is_read_from_the_engine_core_process(executor: str, separate: bool | None,
                                                                   layout: C.Layout, holds: bool) -> None:
    from conformance.orchestrate.compare import Pair, _layout_checks
    from conformance.results import CaseResult, SchedulerRan

    ran = SchedulerRan(scheduler_type="Scheduler", batch_queue=False, async_scheduling=False, executor=executor,
                       world_size=1, engine_core_separate=separate)
    case = C.Case(C.ARCHETYPES["llama"], layout=layout)
    res = CaseResult(case=case.to_json(), side="reference", engine="native", scheduler=ran)
    found = _layout_checks(case, Pair(case, res, res, None, None, False))
    assert (not found.problems) == holds


def test_the_0_26_qwen3_5_text_config_refusal_is_a_known_native_defect() -> None:
    from conformance import vllm_series as vs

    err = ("TypeError: Invalid type of HuggingFace config. Expected type: <class "
           "'vllm.transformers_utils.configs.qwen3_5.Qwen3_5Config'>, but found type: <class "
           "'transformers.models.qwen3_5.configuration_qwen3_5.Qwen3_5TextConfig'>")
    assert vs.native_defect("0.26.0", err, "get_hf_config") is not None
    assert vs.native_defect("0.28.0", err, "get_hf_config") is None
    assert vs.native_defect("0.26.0", err.replace("Qwen3_5TextConfig", "LlamaConfig"), "get_hf_config") is None


def _cuda_runner(tmp_path: Path) -> CaseRunner:
    return _runner(tmp_path, "reference", "native", device="cuda")


@pytest.mark.parametrize(("fault", "fp32"), [(C.NO_FAULTS, False), (C.CACHED_CAP, False), (C.TINY_BUDGET, True),
                                             (C.COW_ADMISSION_X2, True), (C.MAP_MID_ALLOCATION, True)])
def test_cuda_cases_that_reschedule_run_in_float32_and_plan_from_their_own_geometry(
        tmp_path: Path, fault: C.FaultPlan, fp32: bool) -> None:
    runner = _cuda_runner(tmp_path)
    pattern = C.PrefixPattern.PARTIAL_COW if fault.needs_partial_hits else C.PrefixPattern.WARM_THEN_ALL
    plain = C.Case(C.ARCHETYPES["nemotron_h"], pattern=pattern)
    case = C.Case(C.ARCHETYPES["nemotron_h"], pattern=pattern, fault=fault)
    dtype = runner._engine_kwargs(case, tmp_path, 4096, 1 << 30, {})["dtype"]
    assert dtype == ("float32" if fp32 else "bfloat16")
    # A bf16 case's geometry must not plan a float32 case (its budget came out half the size).
    assert (runner._geometry_key(case) != runner._geometry_key(plain)) == fp32


def test_cuda_cases_that_reschedule_keep_16_bits_where_the_model_has_no_float32_kernel(tmp_path: Path) -> None:
    """Gated DeltaNet refuses float32 on CUDA (0.26): such a model's rescheduling case runs in its CPU dtype."""
    runner = _cuda_runner(tmp_path)
    for name, dtype in (("qwen3_next", "bfloat16"), ("granitemoehybrid", "float32")):
        case = C.Case(C.ARCHETYPES[name], pattern=C.PrefixPattern.PARTIAL_COW, fault=C.COW_ADMISSION_X2)
        assert runner._engine_kwargs(case, tmp_path, 4096, 1 << 30, {})["dtype"] == dtype, name


def test_cuda_gated_deltanet_models_ask_for_vllms_triton_prefill(tmp_path: Path) -> None:
    runner = _cuda_runner(tmp_path)
    for name in ("qwen3_next", "qwen3_5", "llama"):
        kw = runner._engine_kwargs(C.Case(C.ARCHETYPES[name]), tmp_path, 4096, 1 << 30, {})
        assert kw.get("gdn_prefill_backend") == ("triton" if name != "llama" else None)
    assert "gdn_prefill_backend" not in PROFILES[Device.CPU].kwargs_of("qwen3_next")


V1_RUNNER, V2_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


@pytest.mark.parametrize(("reference", "other", "problem"), [
    (V2_RUNNER, V2_RUNNER, None),
    (V1_RUNNER, "vllm.v1.worker.cpu_model_runner.CPUModelRunner", None),  # both V1
    (V2_RUNNER, V1_RUNNER, "model runners differ: reference V2, other V1"),
    (V2_RUNNER, None, None),  # a result written before the fact was read
])
def test_both_sides_must_have_run_the_same_model_runner(reference: str, other: str | None,
                                                         problem: str | None) -> None:
    """vLLM decides the runner per engine (``--model-runner vllm``); a comparison of a V2 engine
    against a V1 engine is no comparison, and the row names both."""
    from conformance.orchestrate.compare import Pair, _layout_checks, _layout_ran
    from conformance.results import CaseResult, SchedulerRan

    case = C.Case(C.ARCHETYPES["llama"])

    def result(side: str, runner: str | None) -> CaseResult:
        ran = SchedulerRan(scheduler_type="Scheduler", batch_queue=False, async_scheduling=False,
                           executor="UniProcExecutor", world_size=1, engine_core_separate=False, model_runner=runner)
        return CaseResult(case=case.to_json(), side=side, engine="native", scheduler=ran)  # type: ignore[arg-type]

    ref, oth = result("reference", reference), result("candidate", other)
    found = _layout_checks(case, Pair(case, ref, oth, None, None, False))
    assert found.problems == ([problem] if problem else [])
    assert _layout_ran(ref.scheduler).endswith(", in-process, Model Runner " + ("V2" if "gpu.model" in reference else "V1"))


@pytest.mark.parametrize(("choice", "value"), [("v1", "0"), ("v2", "1"), ("vllm", None)])
def test_the_model_runner_choice_sets_vllms_switch(choice: str, value: str | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.orchestrate.runner import child_env

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # a user's own setting never leaks through
    assert child_env("kvcached", C.Layout.INPROC, choice).get("VLLM_USE_V2_MODEL_RUNNER") == value
    with pytest.raises(ValueError, match="model runner 'v3'"):
        child_env("kvcached", C.Layout.INPROC, "v3")


def test_cpu_engines_run_one_openmp_thread_and_gpu_engines_vllms_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Harness children and servers alike: one thread on the CPU (a busy core stalls a pool of
    them at every barrier), and on a GPU what vLLM picks, as users run it."""
    from conformance.orchestrate.runner import child_env
    from conformance.serving.server import ServerSpec, _server_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for layout in (C.Layout.INPROC, C.Layout.MP):
        assert child_env("native", layout, "v1", "cpu")["OMP_NUM_THREADS"] == "1"
        assert "OMP_NUM_THREADS" not in child_env("native", layout, "vllm", "cuda")
    assert _server_env(ServerSpec("native", False))["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in _server_env(ServerSpec("native", False, device="cuda"))


@pytest.mark.parametrize(("argv", "seconds"), [(["--device", "cpu"], 150.0), (["--device", "cuda"], 60.0),
                                               (["--device", "cuda", "--case-timeout", "90"], 90.0)])
def test_the_case_timeout_is_the_devices_unless_the_run_names_one(argv: list[str], seconds: float) -> None:
    from conformance.orchestrate.cli import _config, build_parser

    assert _config(build_parser().parse_args(argv)).case_timeout_s == seconds
