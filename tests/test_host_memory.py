"""Host memory as a CPU engine's budget sees it (`kvcached.host`): the real reading, memory
cgroups (v1 and v2, read from file trees laid out as the kernel lays them out) and the
derived limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcached.errors import ConfigError
from kvcached.host import HostMemory, default_host_limit, parse_reserve, read_host_memory

GiB = 1 << 30


def test_the_real_reading_is_within_the_kernels_figures() -> None:
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.split(":")[0] in ("MemTotal", "MemAvailable")}
    memory = read_host_memory()
    assert 0 < memory.available <= memory.total <= meminfo["MemTotal"]


def _tree(tmp_path: Path, cgroup: str, files: dict[str, str], meminfo_gib: tuple[int, int] = (64, 48)) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {meminfo_gib[0] * GiB // 1024} kB\nMemFree: 1 kB\n"
                                  f"MemAvailable: {meminfo_gib[1] * GiB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_without_a_cgroup_limit_it_is_meminfo(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/a\n", {"a/memory.max": "max\n", "a/memory.current": "5\n"})
    assert read_host_memory(proc, root) == HostMemory(64 * GiB, 48 * GiB)


def test_a_v2_limit_anywhere_above_counts(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/a/b\n", {
        "a/memory.max": str(8 * GiB), "a/memory.current": str(6 * GiB),  # the parent has 2 GiB left
        "a/b/memory.max": str(16 * GiB), "a/b/memory.current": str(1 * GiB),
    })
    assert read_host_memory(proc, root) == HostMemory(8 * GiB, 2 * GiB)


def test_a_v1_memory_controller_counts_and_its_unlimited_value_does_not(tmp_path: Path) -> None:
    huge = str(9223372036854771712)
    proc, root = _tree(tmp_path, "4:memory:/box/job\n3:cpuset:/\n", {
        "memory/box/memory.limit_in_bytes": huge, "memory/box/memory.usage_in_bytes": "1",
        "memory/box/job/memory.limit_in_bytes": str(4 * GiB),
        "memory/box/job/memory.usage_in_bytes": str(3 * GiB),
    })
    assert read_host_memory(proc, root) == HostMemory(4 * GiB, 1 * GiB)
    proc, root = _tree(tmp_path / "free", "4:memory:/box\n", {
        "memory/box/memory.limit_in_bytes": huge, "memory/box/memory.usage_in_bytes": "1"})
    assert read_host_memory(proc, root) == HostMemory(64 * GiB, 48 * GiB)


def test_a_meminfo_without_the_figures_is_a_clear_error(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, "0::/\n", {})
    (proc / "meminfo").write_text("MemTotal: 1 kB\n")
    with pytest.raises(ConfigError, match=r"no \['MemAvailable'\].*KVCACHED_BUDGET_BYTES"):
        read_host_memory(proc, root)


@pytest.mark.parametrize(("raw", "parsed"), [("off", None), ("OFF", None), ("10%", "10%"), ("0", 0),
                                             ("2.50%", "2.5%"), ("1073741824", GiB)])
def test_reserve_values(raw: str, parsed: object) -> None:
    assert parse_reserve("KVCACHED_HOST_RESERVE", raw) == parsed


@pytest.mark.parametrize("raw", ["-1", "nan%", "101%", "-1%", "1.5", "1GiB", "", "inf%"])
def test_bad_reserve_values_name_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="KVCACHED_HOST_RESERVE"):
        parse_reserve("KVCACHED_HOST_RESERVE", raw)


def test_the_derived_limit() -> None:
    memory = HostMemory(total=100 * GiB, available=30 * GiB)
    assert default_host_limit("10%", memory) == 20 * GiB
    assert default_host_limit(GiB, memory) == 29 * GiB
    assert default_host_limit("50%", memory) == 0, "never negative"
