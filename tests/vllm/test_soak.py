"""The churn soak's CI variant: two minutes of random traffic through `vllm serve` with
kvcached (`conformance.soak.run`; `nox -s soak` runs ten). Every check must hold; the
negative controls show each comparison can fail."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from conformance.serving.retrial import PLANTED_MARGIN
from conformance.serving.server import serving
from conformance.soak.run import (
    TOKEN_BYTES,
    Difference,
    Request,
    Sample,
    SoakPlan,
    SoakResult,
    Traffic,
    _model,
    _preemptions,
    _pressure,
    _soaked_spec,
    find_differences,
    plant,
    run,
)


@pytest.mark.multiprocess  # two real servers, one after the other; every wait is bounded
def test_two_minutes_of_churn_leave_nothing_behind(tmp_path: Path) -> None:
    result = run(SoakPlan(duration_s=120.0, retrials=8), tmp_path)
    failed = [name for name, holds in result.checks().items() if not holds]  # named first: a long repr is cut
    assert not failed, (failed, result.preemptions, result.baseline, result.end, result.differences, result.planted)
    assert len(result.completed) > 100 and result.samples
    # The planted difference was retried on the real native server, and native never chose it.
    assert result.planted is not None and (result.planted.retrials, result.planted.reproduced) == (8, 0)


def test_the_checks_see_a_leak_and_a_mismatch() -> None:
    base = Sample(t=1.0, rss=1000 << 20, fds=100, memfds=2, mapped=10 << 16)
    caught = Difference(0, 0, 3, 10, 11, 0.5, retrials=8, reproduced=0)
    result = SoakResult(SoakPlan(), baseline=base, end=base, aborted=1, preemptions=1, planted=caught)
    assert all(result.checks().values())
    for changed, check in (({"rss": 1060 << 20}, "rss"), ({"mapped": 11 << 16}, "mapped"),
                           ({"fds": 101}, "descriptors"), ({"memfds": 3}, "memfds")):
        result.end = dataclasses.replace(base, **changed)
        assert [name for name, ok in result.checks().items() if not ok] == [
            next(n for n in result.checks() if n.startswith(check))]
    # vLLM's worker growing on its own (native alike) is not kvcached's: reported, not failed.
    result.end = dataclasses.replace(base, rss=1060 << 20, worker_rss=60 << 20)
    assert all(result.checks().values())
    result.end = base
    # Native gave the first difference's token in one retrial; never the second's, nor the
    # third's (another length: not retried).
    result.differences = [Difference(4, 40, 2, 7, 8, 1e-7, 8, 1), Difference(5, 50, 2, 7, 8, 1e-7, 8, 0),
                          Difference(6, 60, -1, -1, -1, -1.0)]
    assert result.mismatches == [4, 5, 6] and result.unexplained == [5, 6]
    assert [n for n, ok in result.checks().items() if not ok] == ["every token difference is one native also gives"]
    result.differences = []
    for planted in (None, dataclasses.replace(caught, reproduced=1)):  # missing, or native gave it
        result.planted = planted
        assert [n for n, ok in result.checks().items() if not ok] == ["the planted difference is caught"]


def test_differences_are_found_at_their_first_token_and_the_planted_one_is_real() -> None:
    reqs = [Request(i, [5, 6, 7], 4, None) for i in range(3)]
    ref = [([9, 9, 9, 9], [0.2, 0.3, 0.4, 0.5]), ([9, 8, 7, 6], [1e-2, 1e-2, 3e-7, 0.9]), ([1, 2], [0.1, 0.1])]
    soaked = [[9, 9, 9, 9], [9, 8, 5, 6], [1, 2, 3]]
    found = find_differences(list(zip(reqs, soaked, strict=True)), ref)
    assert found == [Difference(1, 1, 2, 5, 7, 3e-7), Difference(2, 2, -1, -1, -1, -1.0)]
    planted = plant(list(zip(reqs, soaked, strict=True))[1:], ref[1:], random.Random(0))
    # The second request's first margin of PLANTED_MARGIN or more is its last token's.
    assert (planted.position, planted.request, planted.first, planted.native_token) == (0, 1, 3, 6)
    assert planted.soaked_token != 6 and 3 <= planted.soaked_token < 1024 and planted.margin >= PLANTED_MARGIN


def _saved(result: SoakResult, path: Path) -> Path:
    import json

    from conformance.soak.run import to_json

    path.mkdir(parents=True, exist_ok=True)
    (path / "result.json").write_text(json.dumps({**to_json(result), "environment": {"command": "cmd"}}))
    return path


def test_the_native_control_has_only_the_checks_that_can_fail_on_native(tmp_path: Path) -> None:
    from conformance.soak.report import render

    with pytest.raises(ValueError, match="candidate='kvached'"):
        SoakPlan(candidate="kvached")
    base = Sample(t=1.0, rss=1000 << 20, fds=100, memfds=0, mapped=0)
    caught = Difference(0, 0, 3, 10, 11, 0.5, retrials=8, reproduced=0)
    result = SoakResult(SoakPlan(candidate="native"), samples=[base], baseline=base, end=base, aborted=1,
                        preemptions=1, planted=caught)
    assert all(result.checks().values())
    assert not any("mapped" in name or "memfds" in name for name in result.checks())
    result.end = dataclasses.replace(base, fds=101)
    assert [name for name, ok in result.checks().items() if not ok] == ["descriptors back to the baseline"]
    # The control's report sets its rate beside the kvcached soak's result.
    kvcached = SoakResult(SoakPlan(), samples=[base], baseline=base, end=base, aborted=1, preemptions=1,
                          planted=caught, differences=[Difference(3, 30, 1, 5, 6, 0.2, 8, 0)])
    kvcached.completed = [(None, [1])] * 100  # type: ignore[list-item]
    result.completed = [(None, [1])] * 50  # type: ignore[list-item]
    result.differences = [Difference(7, 70, 1, 5, 6, 1e-4, 8, 2), Difference(9, 90, 3, 5, 6, 2e-4, 8, 0)]
    other = _saved(kvcached, tmp_path / "kvcached") / "result.json"
    text = render(_saved(result, tmp_path / "control"), other).read_text()
    assert "| kvcached (" in text and "1 of 100 (1.000%)" in text and "2 of 50 (4.000%)" in text
    assert "native control: FAIL" in text and "kvcached mapped" not in text
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()
            if ln.startswith(("| difference", "| planted"))]
    assert rows == [["difference", "70", "1", "5 / 6", "0.0001", "yes", "2 of 8", "yes"],
                    ["difference", "90", "3", "5 / 6", "0.0002", "yes", "0 of 8", "NO"],
                    ["planted (control)", "0", "3", "10 / 11", "0.5", "no", "0 of 8", "NO"]]
    assert "| command" in text and (tmp_path / "control" / "report.html").is_file()


@pytest.mark.parametrize("candidate", ["kvcached", "native"])
def test_a_saved_soak_is_drawn_and_rendered_again(tmp_path: Path, candidate: str) -> None:
    import json

    from conformance.soak.report import SoakRecord, render

    base = Sample(t=1.0, rss=1000 << 20, fds=100, memfds=2, mapped=10 << 16)
    result = SoakResult(SoakPlan(candidate=candidate), samples=[base, dataclasses.replace(base, t=2.0)],
                        baseline=base, end=base, warmup_end_s=1.0, traffic_end_s=2.0, sent=3, aborted=1,
                        preemptions=1)
    loaded = SoakRecord.from_json(json.loads((_saved(result, tmp_path) / "result.json").read_text()))
    assert (loaded.plan, loaded.samples, loaded.sent) == (result.plan, result.samples, 3)
    (tmp_path / "notes.md").write_text("**Why.** Because\nof this.\n\nAnd that.\n")
    first = render(tmp_path, tmp_path / "none.json").read_text()
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert "## Notes\n\n**Why.** Because of this.\n\nAnd that.\n" in first
    assert render(tmp_path, tmp_path / "none.json").read_text() == first


def test_the_pressure_burst_needs_twice_the_pool_with_fresh_prompts() -> None:
    plan = SoakPlan()
    traffic = Traffic(plan)
    traffic.take()
    burst = traffic.pressure()
    assert len(burst) == plan.clients and [r.index for r in burst] == list(range(1, 1 + plan.clients))
    assert sum(len(r.prompt) + r.max_tokens for r in burst) == 2 * plan.kv_bytes // TOKEN_BYTES
    assert all(r.abort_after_s is None and len(r.prompt) + r.max_tokens <= plan.max_model_len for r in burst)
    assert len({tuple(r.prompt[:8]) for r in burst}) == plan.clients  # no shared prefix to hit


@pytest.mark.multiprocess  # one real server; every request bounded
def test_the_pressure_burst_makes_vllm_preempt(tmp_path: Path) -> None:
    """The soak's way to the preemption it checks when random traffic made none (a CPU hog
    once slowed two minutes of it, then four, below any): the burst alone, on the real server."""
    plan = SoakPlan(duration_s=0.0)
    spec, _ = _soaked_spec(plan, tmp_path)
    result = SoakResult(plan)
    with serving(spec, _model(tmp_path), tmp_path / "logs", max_model_len=plan.max_model_len,
                 kv_cache_bytes=plan.kv_bytes) as server:
        _pressure(server, Traffic(plan), result)
        assert _preemptions(server) > 0
    assert len(result.completed) == plan.clients
