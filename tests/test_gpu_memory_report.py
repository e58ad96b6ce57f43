"""The device-memory probe's checks and report, on recorded runs (no GPU): each check can fail."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from conformance.reporting.environment import Provenance
from serving_probes.gpu_memory import EngineRun, Sample, Workload, checks, report

MIB = 1 << 20


def _run(side: str, kv: int, used: int, maps: tuple[int, int, int, int], unmaps: tuple[int, int, int, int]) -> EngineRun:
    phases = ("startup", "after burst 1", "idle after burst 1", "after burst 2")
    run = EngineRun(side, num_blocks=1000, kv_tensor_bytes=1000 * 64 * 1024, startup_s=10.0)
    for i, name in enumerate(phases):
        mapped = kv if "after burst" in name and "idle" not in name else 2 * MIB
        run.phases[name] = {"t": float(i), "device_used": used + mapped, "process_used": used, "kv_mapped": mapped}
        run.counters[name] = {"maps": maps[i], "unmaps": unmaps[i], "mapped_bytes": mapped, "live_blocks": 0}
        run.kv_pointers.append([1 << 40])
        run.samples.append(Sample(float(i), used + mapped, used, mapped))
    run.tokens = [[[5, 6, 7]], [[5, 6, 7]]]
    run.graph_replays = [30, 30]
    run.pools = [{"vmm_page_bytes": 2 * MIB, "kv_page_bytes": 4 * MIB}]
    return run


def _runs() -> list[EngineRun]:
    native = _run("native", 0, 40 << 30, (0,) * 4, (0,) * 4)
    native.counters = {}
    return [native, _run("kvcached", 80 * MIB, 1 << 30, (1, 41, 41, 81), (0, 0, 40, 40)),
            _run("kvcached-second", 0, 1 << 30, (1,) * 4, (0,) * 4)]


def test_every_check_holds_on_a_good_run(tmp_path: Path) -> None:
    runs = _runs()
    assert all(checks(runs).values()), checks(runs)
    md = report(runs, Workload(requests=2), tmp_path,
                Provenance.from_dict({"date": "today", "gpu": "H200", "torch": "2.11"}))
    text = md.read_text()
    assert ": PASS" in text.splitlines()[0] and f"**{len(checks(runs))} of {len(checks(runs))}** checks hold" in text
    assert (tmp_path / "memory.png").stat().st_size > 0


def _kvc(runs: list[EngineRun]) -> EngineRun:
    return next(r for r in runs if r.side == "kvcached")


PLANTED = {
    "kvcached gave native's tokens in both bursts": lambda rs: _kvc(rs).tokens[1][0].__setitem__(0, 9),
    "pages went after burst 1 (unmaps) and came back in burst 2 (maps)":
        lambda rs: _kvc(rs).counters["idle after burst 1"].__setitem__("unmaps", 0),
    "the KV tensors kept their addresses through unmap and remap": lambda rs: _kvc(rs).kv_pointers[2].append(7),
    "CUDA graphs replayed in both bursts (before and after the remap)":
        lambda rs: _kvc(rs).graph_replays.__setitem__(1, 0),
    "and vLLM sized it exactly as the first (not misled by the first's pages)":
        lambda rs: setattr(rs[2], "num_blocks", 999),
    "idle after a burst, kvcached's mapped KV is back within its reserve of its start-up value":
        lambda rs: _kvc(rs).phases["idle after burst 1"].__setitem__("kv_mapped", 64 * MIB),
    "vLLM sized kvcached's KV range within 1.0% of native's KV tensors":
        lambda rs: setattr(rs[0], "num_blocks", 1011),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_each_check_sees_a_planted_failure(name: str) -> None:
    runs = copy.deepcopy(_runs())
    PLANTED[name](runs)
    assert [k for k, v in checks(runs).items() if not v] == [name]


def test_an_engine_failure_names_its_exception_not_the_shutdown_noise() -> None:
    from serving_probes.gpu_memory import failure_of

    log = ("INFO starting\nTraceback (most recent call last):\n  File 'x.py', line 1\nValueError: no room\n"
           + "WARNING destroy_process_group() was not called\n" * 200)
    assert failure_of(log, limit=200).startswith("Traceback") and "ValueError: no room" in failure_of(log, 200)
    assert failure_of("just a tail\n" * 10, limit=12) == "just a tail\n"  # no traceback: the tail
