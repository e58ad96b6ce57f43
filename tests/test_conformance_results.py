"""The typed data that crosses the engine-process boundary, and the page-size cross-check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance import cases as C
from conformance.engine.handle import check_page_size
from conformance.geometry import Geometry
from conformance.orchestrate.compare import schedule_parity, token_parity
from conformance.results import (
    SCHEMA_VERSION,
    CaseResult,
    Job,
    JobEntry,
    Plan,
    ProbeRecord,
    RequestRecord,
    ResultSchemaError,
    load_job,
    load_result,
    write_atomic,
)
from conformance.workload import Prompt, Workload

GEO = Geometry(16, 16, (16,), ("FullAttentionSpec",), (("l0",),), 4096, 8192, (4096, 4096), 100, 819200, 2048,
               65536, "derived")  # fmt: skip


def _request(rid: str, tokens: list[int]) -> RequestRecord:
    return RequestRecord(rid=rid, label="x", pass_no=1, prompt_len=3, token_ids=tokens, logprobs=[],
                         num_cached_tokens=0, finish_reason="length", finished=True)  # fmt: skip


def _result(tokens: list[list[int]], **kw: object) -> CaseResult:
    reqs = [_request(f"p{i}", t) for i, t in enumerate(tokens)]
    return CaseResult(case=C.Case(C.ARCHETYPES["llama"]), side="candidate", engine="kvcached", requests=reqs, geometry=GEO,
                      plan=Plan(max_model_len=64, page_size=65536), t_total=1.0, **kw)  # type: ignore[arg-type]


def test_result_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    res = _result([[1, 2], [3, 4]])
    write_atomic(path, res)
    back = load_result(path)
    assert back == res and back.geometry == GEO and isinstance(back.geometry, Geometry)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema_version=SCHEMA_VERSION - 1), "schema version"),
        (lambda d: d.pop("schema_version"), "schema version None"),
        (lambda d: d.update(surprise=1), "surprise"),
        (lambda d: d["requests"][0].update(extra_field=1), "extra_field"),
        (lambda d: d["geometry"].update(bogus=1), "bogus"),
        (lambda d: d.pop("kv_status"), "lacks field(s) ['kv_status']"),
        (lambda d: d["requests"][1].pop("finished"), "finished"),
        (lambda d: d["plan"].pop("page_size"), "page_size"),
        (lambda d: d.update(side="sideways"), "side"),
        (lambda d: d["requests"][0].update(token_ids="1,2"), "token_ids"),
    ],
)
def test_a_result_from_another_schema_fails_loudly(tmp_path: Path, edit, message: str) -> None:
    path = tmp_path / "r.json"
    write_atomic(path, _result([[1, 2], [3, 4]]))
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ResultSchemaError, match="r.json") as err:
        load_result(path)
    assert message in str(err.value)


def test_unreadable_result_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "half.json"
    path.write_text('{"schema_version": 2, "case": ')
    with pytest.raises(ResultSchemaError, match="half.json: unreadable"):
        load_result(path)


def _job(tmp_path: Path) -> Job:
    case = C.Case(C.ARCHETYPES["nemotron_h"], pattern=C.PrefixPattern.PARTIAL_COW, fault=C.COW_ADMISSION_X2)
    workload = Workload(passes=((Prompt("p1-00", "warm:3", (5, 6, 7)),),), lengths=(("one", 1),),
                        partial_boundaries=(16,))  # fmt: skip
    return Job(side="candidate", engine="kvcached", out_dir=tmp_path, page_size=None, kv_cache_bytes=1 << 20,
               async_override=True, budget_bytes_override=None,
               entries=[JobEntry(case=case, workload=workload, geometry=GEO)])  # fmt: skip


def test_job_round_trips_and_refuses_unknown_fields(tmp_path: Path) -> None:
    """The case and the workload cross as themselves: what the child reads is what was sent."""
    job = _job(tmp_path)
    path = tmp_path / "job.json"
    write_atomic(path, job)
    back = load_job(path)
    assert back == job and back.entries[0].case is not job.entries[0].case
    assert isinstance(back.entries[0].workload, Workload) and back.entries[0].workload.passes[0][0].tokens == (5, 6, 7)
    data = json.loads(path.read_text())
    data["entries"][0]["workload_v0"] = {}
    path.write_text(json.dumps(data))
    with pytest.raises(ResultSchemaError, match="workload_v0"):
        load_job(path)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("archetype", "lama", r"(?s)entries\.0\.case.*case field 'archetype': 'lama' is not one of"),
    ("max_tokens", "16", "case field 'max_tokens': '16' is not int"),
    ("prefix_caching", 1, "case field 'prefix_caching': 1 is not bool"),
    ("fault", "cow", "case field 'fault': 'cow' is not one of"),
    ("case_id", "stale", "case field 'case_id': 'stale', but the fields make"),
    ("extra", 1, r"unknown \['extra'\]"),
])  # fmt: skip
def test_a_malformed_case_in_a_job_names_its_field(tmp_path: Path, field: str, value: object, message: str) -> None:
    path = tmp_path / "job.json"
    write_atomic(path, _job(tmp_path))
    data = json.loads(path.read_text())
    data["entries"][0]["case"][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ResultSchemaError, match=message):
        load_job(path)


def test_a_malformed_workload_in_a_job_names_its_field(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    write_atomic(path, _job(tmp_path))
    data = json.loads(path.read_text())
    data["entries"][0]["workload"]["passes"][0][0]["tokens"] = ["five"]
    path.write_text(json.dumps(data))
    with pytest.raises(ResultSchemaError, match=r"entries\.0\.workload\.passes\.0\.0\.tokens\.0"):
        load_job(path)


def test_page_size_check_compares_the_engine_with_the_configuration() -> None:
    check_page_size(65536, {65536})
    # Negative controls: kvcached ignoring the configured page, or pools disagreeing.
    with pytest.raises(RuntimeError, match=r"reports VMM page size\(s\) \[2097152\].*configured 65536"):
        check_page_size(65536, {2 << 20})
    with pytest.raises(RuntimeError, match="configured 65536"):
        check_page_size(65536, {65536, 4096})
    with pytest.raises(RuntimeError):
        check_page_size(65536, set())  # no pool reported at all


def test_token_stage_alone() -> None:
    case = C.Case(C.ARCHETYPES["llama"], max_tokens=2)
    same = token_parity(case, _result([[1, 2], [3, 4]]), _result([[1, 2], [3, 4]]))
    assert same.exact and not same.findings.problems
    diff = token_parity(case, _result([[1, 2], [3, 4]]), _result([[1, 2], [3, 5]]))
    assert not diff.exact and [(p.rid, p.first_divergence) for p in diff.divergences] == [("p1", 1)]
    ref = _result([[1, 2], [3, 4]], replay={"p1": [[9, 9], [3, 4]]})
    explained = token_parity(case, ref, _result([[1, 2], [3, 5]]))
    assert explained.exact and explained.unstable == {"p1"} and "history-dependent" in explained.findings.explanations[0]


def test_schedule_stage_alone() -> None:
    def probe(fp: list[list[tuple[int, int]]]) -> ProbeRecord:
        return ProbeRecord(steps=[], schedule_fingerprint=fp, copies_total=0, copy_batches=0, preemptions_counted=0,
                           partial_prefix_hits=0, prefix_hit_admissions=0)  # fmt: skip

    a = _result([], probe=probe([[(0, 3)], [(0, 1)]]))
    assert schedule_parity(a, _result([], probe=probe([[(0, 3)], [(0, 1)]]))).same
    other = schedule_parity(a, _result([], probe=probe([[(0, 3)], [(0, 1), (1, 2)]])))
    assert not other.same and other.divergence_step == 1


def test_pool_facts_are_kvcached_pool_stats_validated() -> None:
    """The result model takes `kvcached.PoolStats` itself (one definition of a pool's facts):
    the dict an engine process sends is validated into it, and an unknown field is refused."""
    import dataclasses

    import pydantic

    import kvcached
    from conformance.results import POOL_FACTS, PoolFacts
    from kvcached.pages import PoolHealth

    assert PoolFacts is kvcached.PoolStats
    sent = dataclasses.asdict(kvcached.PoolStats(*range(12), health=PoolHealth.DEGRADED))
    sent["health"] = "degraded"  # what a msgpack channel delivers
    facts = POOL_FACTS.validate_python({"pool": sent})["pool"]
    assert PoolHealth(facts.health) is PoolHealth.DEGRADED and facts.maps == 8
    with pytest.raises(pydantic.ValidationError, match="unknown_counter"):
        POOL_FACTS.validate_python({"pool": {**sent, "unknown_counter": 1}})
