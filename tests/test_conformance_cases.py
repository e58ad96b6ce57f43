"""The case model and the default matrices."""

from __future__ import annotations

import pytest

from conformance import cases as C


def test_matrix_ids_unique_and_round_trip() -> None:
    for matrix in (C.default_matrix(), C.quick_matrix()):
        ids = [c.case_id for c in matrix]
        assert len(ids) == len(set(ids))
        for c in matrix:
            assert C.Case.from_json(c.to_json()) == c


def test_default_matrix_covers_the_issue() -> None:
    m = C.default_matrix()
    assert {c.archetype.name for c in m} == {
        "llama",
        "qwen3",
        "mamba2",
        "nemotron_h",
        "granitemoehybrid",
        "falcon_h1",
        "qwen3_next",
        "qwen3_5",  # declared everywhere; select_cases leaves it out without CUDA
    }
    assert {c.scheduling for c in m} == {C.Scheduling.SYNC, C.Scheduling.ASYNC}
    assert {c.fault.name for c in m} == set(C.FAULT_PLANS) - {p.name for p in C.SWEEP_PLANS}
    assert {c.pattern for c in m} == set(C.PrefixPattern)
    assert any(not c.prefix_caching for c in m)
    # CoW admission failures in both schedulers; controls every time.
    cow = {c.scheduling for c in m if c.fault is C.COW_ADMISSION_X2}
    assert cow == {C.Scheduling.SYNC, C.Scheduling.ASYNC}
    # Every control but native at the candidate's pool, which measures a floor only CUDA needs.
    assert {c.control for c in m} == set(C.Control) - {C.Control.EQUAL_POOL}


def test_quick_matrix_is_small_but_complete() -> None:
    q = C.quick_matrix()
    assert len(q) <= 12
    assert {c.fault.name for c in q} == set(C.FAULT_PLANS) - {p.name for p in C.SWEEP_PLANS}
    assert {c.control for c in q if c.is_control} == {C.Control.BASELINE, C.Control.NEG_WEIGHTS, C.Control.NEG_KV}


def test_invalid_combinations_are_rejected() -> None:
    llama, nem = C.ARCHETYPES["llama"], C.ARCHETYPES["nemotron_h"]
    with pytest.raises(ValueError, match="partial"):
        C.Case(llama, pattern=C.PrefixPattern.PARTIAL_COW)
    with pytest.raises(ValueError, match="partial prefix pattern"):
        C.Case(nem, fault=C.COW_ADMISSION_X2)
    with pytest.raises(ValueError, match="prefix caching"):
        C.Case(nem, prefix_caching=False, pattern=C.PrefixPattern.SHARED_CONCURRENT)
    with pytest.raises(ValueError, match="controls"):
        C.Case(llama, fault=C.MAP_MID_ALLOCATION, control=C.Control.BASELINE)


def test_select_keeps_controls_under_fault_filter() -> None:
    m = C.quick_matrix()
    sel = C.select(m, faults=["none"])
    assert all(c.fault.name == "none" for c in sel)
    assert any(c.is_control for c in sel)
    assert all(c.scheduling is C.Scheduling.ASYNC for c in C.select(m, schedulers=["async"]))
    assert {c.archetype.name for c in C.select(m, archetypes=["nemotron_h"])} == {"nemotron_h"}


def test_the_sweep_fails_every_site_at_each_of_its_first_three_checks() -> None:
    full, quick = C.sweep_matrix(), C.sweep_matrix(quick=True)
    points = {(r.site, r.skip + 1) for c in full for r in c.fault.rules}
    assert points == {(site, k) for site in C.SWEEP_SITES for k in (1, 2, 3)}
    assert all(r.fail_next == 1 and c.fault.expected_fired == 1 for c in full for r in c.fault.rules)
    assert {c.scheduling for c in full if c.layout is C.Layout.INPROC} == {C.Scheduling.SYNC, C.Scheduling.ASYNC}
    assert {c.layout for c in full if c.fault.rules[0].site == "rank1_map"} == {C.Layout.TP2}
    assert {(r.site, r.skip) for c in quick for r in c.fault.rules} == {(site, 0) for site in C.SWEEP_SITES}
    # At TP=2: the sites that cross the process boundary at every check, both schedulers.
    tp2 = {(c.fault.rules[0].site, c.fault.rules[0].skip + 1, c.scheduling) for c in full if c.layout is C.Layout.TP2}
    for site in ("map", "copy", "rank1_map"):
        assert {(site, k, s) for k in (1, 2, 3) for s in C.Scheduling} <= tp2
    assert {(site, 1, s) for site in ("admission", "cow_admission") for s in C.Scheduling} <= tp2
    assert [c.fault.ends_in_engine_error for c in full].count(True) == 3 * 2 * 2
    assert len({c.case_id for c in full}) == len(full) == 46
