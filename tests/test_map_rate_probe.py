"""The map-rate probe (`serving_probes.map_rate_probe`) on the CPU backend, small sizes: it runs
every condition it can here, times them, leaves nothing mapped, and its report renders again
from the saved JSON. Its figures on the GPU are the next session's; this only smoke-tests it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

from serving_probes import map_rate_probe as probe

SMALL = ["--device", "cpu", "--ranges", "3", "--range-bytes", "16MiB", "--page-bytes", "2MiB", "--batch", "2",
         "--repeats", "3"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("map-rate") / "map-rate.json"
    assert probe.main([*SMALL, "--out", str(out)]) == 0
    return out


def test_every_condition_is_timed_or_says_why_not(saved: Path) -> None:
    data = json.loads(saved.read_text())
    assert data["environment"]["command"].endswith(f"--out {saved}")
    rows = data["rows"]
    timed = {(r["condition"], r["mode"]) for r in rows}
    both = {probe.PAGESPACE, probe.PER_RANGE}
    assert timed == {(c, m) for c in "abc" for m in both} | {("d", probe.PAGESPACE)}
    assert set(data["skipped"]) == {"e"} and "CUDA only" in data["skipped"]["e"]  # no device to keep busy here
    assert data["errors"] == {}
    for r in rows:
        assert len(r["map_us"]) == len(r["unmap_us"]) == 3
        assert all(x > 0 for x in (*r["map_us"], *r["unmap_us"])), r
        assert r["thread"] == ("background" if r["condition"] == "c" else "main")
        assert (r["map_calls"], r["unmap_calls"]) == (3, 3)  # 3 ranges: one call each for the whole batch
    d = next(r for r in rows if r["condition"] == "d")
    assert d["beside_map_us"] and all(x > 0 for x in (*d["beside_map_us"], *d["beside_unmap_us"]))
    assert all(r["spinner_loops"] > 0 for r in rows if r["condition"] in "bc")
    assert data["left_mapped"] == {c: 0 for c in "abcd"} and data["teardown_left_mapped"] == 0
    assert data["floor_us"] is None  # the driver floor is CUDA's


def test_the_report_tables_every_row_and_renders_again(saved: Path, tmp_path: Path) -> None:
    from serving_probes import probe_report

    md = saved.with_suffix(".md").read_text()
    assert md.startswith("# kvcached's map rate per kv page") and ": PASS" in md.splitlines()[0]
    assert md.count("| PageSpace (engine's path) |") == 4 and md.count("| one call per range ") == 3
    assert "e not run: CUDA only" in md
    data, environment = probe_report.load(saved)
    module = __import__(probe_report.PROBES[saved.stem], fromlist=["render_saved"])
    again = module.render_saved(data, environment, tmp_path)
    assert again.read_text() == md
    assert not (tmp_path / saved.name).exists()  # rendering again leaves the saved data alone
    assert probe.main(["--render", "--out", str(saved)]) == 0
    assert saved.with_suffix(".md").read_text() == md


@pytest.mark.parametrize(("args", "says"), [
    (["--batch", "0"], "--batch 0: must be a positive integer"),
    (["--device", "gpu"], "expected cpu, cuda or cuda:N"),
    (["--range-bytes", "3MiB"], "not a multiple of --page-bytes"),
    (["--range-bytes", "4MiB", "--batch", "2"], "the probe needs 2 x --batch = 4"),
    (["--page-bytes", "2Mbit"], "--page-bytes='2Mbit' is not a byte size"),
    (["--range-bytes", "0.5"], "--range-bytes='0.5' is not a whole number of bytes"),
    (["--page-bytes", "3000", "--range-bytes", "48000", "--batch", "1"], "not a multiple of the OS page size"),
])
def test_a_bad_argument_is_a_usage_error_naming_it(args: list[str], says: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "map-rate.json"
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--device", "cpu", *args, "--out", str(out)])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not out.exists()


def test_settings_refuse_what_the_cli_would(tmp_path: Path) -> None:
    with pytest.raises(probe.ProbeArgumentError, match="--repeats 0"):
        probe.run(probe.Settings(device="cpu", repeats=0))
    with pytest.raises(probe.ProbeArgumentError, match="--switch-interval-ms"):
        probe.Settings(device="cpu", switch_interval_ms=0).check()


def test_a_failing_condition_is_recorded_and_the_ranges_still_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """b fails after its first row, d after mapping a page: the failures are recorded, the rows
    timed before them kept, the other conditions still run, and nothing stays mapped."""
    opened: list[probe.Rig] = []
    real_open, real_rows = probe.Rig.open, probe.condition_rows

    def spy(s: probe.Settings) -> probe.Rig:
        opened.append(real_open(s))
        return opened[-1]

    def rows(name: str, rig: probe.Rig, s: probe.Settings, load: object) -> Iterator[probe.Row]:
        if name == "d":
            rig.space.map_pages([s.batch])
            raise RuntimeError("planted")
        rows = real_rows(name, rig, s, load)  # type: ignore[arg-type]
        yield next(rows)
        if name == "b":  # b's first row is kept, its second never comes
            raise RuntimeError("planted in b")
        yield from rows

    monkeypatch.setattr(probe.Rig, "open", staticmethod(spy))
    monkeypatch.setattr(probe, "condition_rows", rows)
    r = probe.run(probe.Settings(device="cpu", ranges=2, range_bytes=16 << 20, batch=2, repeats=1))
    assert r.errors == {"b": "RuntimeError: planted in b", "d": "RuntimeError: planted"}
    assert r.left_mapped["d"] == 2 and r.teardown_left_mapped == 0
    assert [(row.condition, row.mode) for row in r.rows] == [
        ("a", probe.PAGESPACE), ("a", probe.PER_RANGE), ("b", probe.PAGESPACE), ("c", probe.PAGESPACE),
        ("c", probe.PER_RANGE)]
    assert not probe.checks(r)["every condition ran (e only on CUDA)"]
    assert all(vrange.closed for vrange in opened[0].ranges)


class _FakeLoad:
    """Stands in for the side stream's matmuls (`GpuLoad`): busy from `queue` to `drain`."""

    def __init__(self) -> None:
        self.queued: list[float] = []
        self.running = False

    def queue(self, ms: float) -> None:
        self.queued.append(ms)
        self.running = True

    def busy(self) -> bool:
        return self.running

    def drain(self) -> None:
        self.running = False


def test_the_cuda_rows_are_timed_and_rendered_with_the_floor(tmp_path: Path) -> None:
    """What only a GPU runs, as far as it runs here: e's rows (queued device work, asked
    whether it still ran) and the floor row, through the report."""
    s = probe.Settings(device="cpu", ranges=2, range_bytes=16 << 20, batch=2, repeats=2, gpu_busy_ms=7.0)
    rig = probe.Rig.open(s)
    load = _FakeLoad()
    try:
        rows = list(probe.condition_rows("e", rig, s, load))  # type: ignore[arg-type]
        assert rig.mapped() == 0
    finally:
        rig.close()
    assert [(r.condition, r.mode) for r in rows] == [("e", probe.PAGESPACE)] and load.queued == [7.0, 7.0]
    assert rows[0].busy_before_map == rows[0].busy_after_map == rows[0].busy_after_unmap == [True, True]
    floor = {"create_us": 15.0, "map_us": 4.0, "set_access_us": 32.0, "unmap_us": 21.0, "release_us": 15.0}
    r = probe.Result(probe.Settings(device="cuda", ranges=2, range_bytes=16 << 20, batch=2, repeats=2),
                     rows, floor_us=floor, device_name="a GPU", matmul_ms=1.5)
    checks = probe.checks(r)
    assert checks["e: the device was busy when every timed map began"]
    assert not checks["every condition ran (e only on CUDA)"]  # a to d are missing here
    environment = probe.provenance("test")
    md = probe.write(r, tmp_path / "map-rate.json", environment).read_text()
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in md.splitlines() if line.startswith(("| floor", "| e "))}
    # 2 VMM pages a kv page: 2 x (15 + 4 + 32) to map, 2 x (21 + 15) to unmap; 3 and 2 calls a VMM page
    assert cells["floor"][:4] == ["C++", "raw driver calls x 2", "12 / 8", "102"] and cells["floor"][5] == "72.0"
    assert cells["e"][:3] == ["main", "PageSpace (engine's path)", "2 / 2"] and cells["e"][-1] == "2 of 2 / 2 of 2"
    assert "one 8192x8192 bf16 matmul takes 1.50 ms" in md
