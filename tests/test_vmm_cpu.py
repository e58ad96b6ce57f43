"""kvcached._vmm on the CPU backend: real mappings, real memory, no mocks.

Views go through numpy's DLPack (`kvcached.memory.array_view`), so this file runs on every
Python the core supports (``nox -s core``); the tests of torch's view (`tensor_view`) skip
where torch is not installed.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached import _vmm
from kvcached.budget import LocalBudget
from kvcached.errors import (
    BackendError,
    ConfigError,
    InvariantError,
    PhysicalMemoryExhausted,
)
from kvcached.memory import array_view, default_device_string, tensor_view
from kvcached.pages import PageSpace

OS_PAGE = _vmm.os_page_size()
MIB = 1 << 20
PS = 2 * MIB  # the page size the engine uses


def child_env() -> dict[str, str]:
    """Environment for a child interpreter; under ASan, let SIGSEGV kill it like it normally would."""
    env = dict(os.environ)
    if "ASAN_OPTIONS" in env:
        env["ASAN_OPTIONS"] += ":handle_segv=0"
    return env


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )


def reservation_present(address: int, size: int) -> bool:
    """True when /proc/self/maps still has a mapping covering the start of [address, address + size)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def rss_shmem() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("RssShmem missing from /proc/self/status")


# ---------------------------------------------------------------------------------------
# construction and arguments
# ---------------------------------------------------------------------------------------


def test_properties() -> None:
    r = _vmm.VirtualRange("cpu", 8 * PS, PS)
    assert r.device == "cpu"
    assert r.size == 8 * PS and r.page_size == PS and r.num_pages == 8
    assert r.num_mapped == 0 and r.mapped_pages() == [] and not r.closed
    assert r.address % PS == 0 and r.address != 0  # slots are aligned to min(page_size, 2 MiB)
    assert r.live_views == 0
    assert r.committed_bytes() == 0
    assert r.physical_available() > 0  # MemAvailable without a budget
    assert "cpu" in repr(r)
    assert default_device_string() in ("cpu", "cuda:0")
    assert _vmm.cuda_available() in (True, False)


@pytest.mark.parametrize(
    ("device", "size", "page_size"),
    [
        ("gpu", PS, PS),
        ("cuda:x", PS, PS),
        ("cpu", 0, PS),
        ("cpu", -PS, PS),
        ("cpu", PS, 0),
        ("cpu", 3 * PS, 2 * PS),  # size not a multiple of the page size
        ("cpu", 3 * 1000, 1000),  # page size not a multiple of the OS page
    ],
)
def test_bad_arguments_raise_config_error(device: str, size: int, page_size: int) -> None:
    with pytest.raises(ConfigError):
        _vmm.VirtualRange(device, size, page_size)


def test_cuda_without_driver_is_a_backend_error() -> None:
    if _vmm.cuda_available():
        pytest.skip("a CUDA driver is present")
    with pytest.raises(BackendError):
        _vmm.VirtualRange("cuda", PS, PS)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@pytest.mark.parametrize("page_size", [OS_PAGE, 3 * OS_PAGE, PS, 3 * PS])
def test_reservations_leave_no_address_space_behind(page_size: int) -> None:
    before = vm_size()
    for _ in range(100):
        r = _vmm.VirtualRange("cpu", 4 * page_size, page_size)
        assert r.address % min(page_size, PS) == 0
        r.map([1])
        del r
    assert vm_size() - before < PS


def test_context_manager_closes() -> None:
    with _vmm.VirtualRange("cpu", 4 * OS_PAGE, OS_PAGE) as r:
        r.map([0, 1])
    assert r.closed and r.num_mapped == 0


# ---------------------------------------------------------------------------------------
# map / unmap
# ---------------------------------------------------------------------------------------


def test_round_trip_through_numpy_view() -> None:
    r = _vmm.VirtualRange("cpu", 8 * PS, PS)
    r.map([1, 3])
    page1, page3 = array_view(r, PS, PS), array_view(r, 3 * PS, PS).view(np.int32)
    page1.fill(0x5A)
    page3[:] = np.arange(PS // 4, dtype=np.int32)
    assert int(page1.sum()) == 0x5A * PS and page1.ctypes.data == r.address + PS
    r.unmap([1])
    r.map([1])  # a remapped page comes back zeroed: its memory was really released
    assert int(array_view(r, PS, PS).sum()) == 0
    assert int(page3[123]) == 123  # the other page is untouched
    r.unmap([1, 3])


def test_array_view_is_a_writable_dlpack_1_view_that_keeps_the_range() -> None:
    r = _vmm.VirtualRange("cpu", 4 * OS_PAGE, OS_PAGE)
    r.map([1])
    cap = r.dlpack(OS_PAGE, 16, versioned=True)
    assert "dltensor_versioned" in repr(cap) and r.live_views == 1
    del cap  # never consumed: its own destructor frees it
    assert r.live_views == 0
    view = array_view(r, OS_PAGE + 8, 100)
    assert view.dtype == np.uint8 and view.shape == (100,) and view.flags.writeable and r.live_views == 1
    view[:] = 9
    assert int(array_view(r, OS_PAGE, OS_PAGE)[8:108].sum()) == 900
    del view
    gc.collect()
    assert r.live_views == 0
    from kvcached.memory import _Exporter

    with pytest.raises(BufferError, match="never a copy"):
        np.from_dlpack(_Exporter(r, 0, 8), copy=True)


def test_round_trip_through_torch_view() -> None:
    torch = pytest.importorskip("torch")
    r = _vmm.VirtualRange("cpu", 8 * PS, PS)
    r.map([1, 3])
    assert r.mapped_pages() == [1, 3] and r.is_mapped(3) and not r.is_mapped(0)
    page1 = tensor_view(r, PS, PS)
    page3 = tensor_view(r, 3 * PS, PS, dtype=torch.int32)
    page1.fill_(0x5A)
    page3.copy_(torch.arange(PS // 4, dtype=torch.int32))
    assert int(page1.sum()) == 0x5A * PS
    assert torch.equal(tensor_view(r, 3 * PS, PS).view(torch.int32), torch.arange(PS // 4, dtype=torch.int32))

    r.unmap([1])
    r.map([1])  # a remapped page comes back zeroed: its memory was really released
    assert int(tensor_view(r, PS, PS).sum()) == 0
    assert int(page3[123]) == 123  # the other page is untouched
    r.unmap([1, 3])
    assert r.num_mapped == 0 and r.committed_bytes() == 0


def test_empty_batches_are_no_ops() -> None:
    r = _vmm.VirtualRange("cpu", 2 * OS_PAGE, OS_PAGE)
    r.map([])
    r.unmap([])
    assert r.num_mapped == 0


@pytest.mark.parametrize(
    ("setup", "call", "pages"),
    [
        ([0], "map", [0]),  # double map
        ([], "map", [1, 1]),  # same page twice in one batch
        ([], "map", [4]),  # out of range
        ([], "map", [-1]),
        ([], "map", [0, 1, 99]),  # bad index after good ones: nothing may be mapped
        ([], "unmap", [0]),  # unmap of an unmapped page
        ([0], "unmap", [0, 0]),
        ([0], "unmap", [0, 1]),  # a valid page followed by an unmapped one
        ([0], "unmap", [4]),
    ],
)
def test_invariant_errors_change_nothing(setup: list[int], call: str, pages: list[int]) -> None:
    r = _vmm.VirtualRange("cpu", 4 * OS_PAGE, OS_PAGE)
    r.map(setup)
    with pytest.raises(InvariantError):
        getattr(r, call)(pages)
    assert r.mapped_pages() == setup


def test_is_mapped_bad_index() -> None:
    r = _vmm.VirtualRange("cpu", 2 * OS_PAGE, OS_PAGE)
    with pytest.raises(InvariantError):
        r.is_mapped(2)


def test_close_is_idempotent_and_final() -> None:
    r = _vmm.VirtualRange("cpu", 8 * OS_PAGE, OS_PAGE)
    r.map(range(8))
    r.close()
    r.close()
    assert r.closed and r.num_mapped == 0 and r.committed_bytes() == 0
    for call in (lambda: r.map([0]), lambda: r.unmap([0]), lambda: r.dlpack()):
        with pytest.raises(InvariantError):
            call()


# ---------------------------------------------------------------------------------------
# memory really goes back
# ---------------------------------------------------------------------------------------


def test_memory_is_returned_to_the_os() -> None:
    n = 64
    r = _vmm.VirtualRange("cpu", n * PS, PS)
    before = rss_shmem()
    r.map(range(n))
    assert r.committed_bytes() == 0  # sparse until touched
    array_view(r).fill(1)  # touches every 4 KiB
    touched = rss_shmem()
    assert r.committed_bytes() == n * PS
    assert touched - before >= n * PS * 0.95
    r.unmap(range(n))
    after = rss_shmem()
    assert r.committed_bytes() == 0  # the memfd holes are punched
    assert after - before <= 4 * MIB
    print(f"RssShmem before={before / MIB:.1f} MiB touched={touched / MIB:.1f} MiB after={after / MIB:.1f} MiB")


# ---------------------------------------------------------------------------------------
# the OS refusing (budgets are charged above the range: tests/test_budget_record.py)
# ---------------------------------------------------------------------------------------


def _reachable_map_limit() -> int:
    """vm.max_map_count, or skip the test where it is too large to reach cheaply."""
    with open("/proc/sys/vm/max_map_count") as f:
        max_maps = int(f.read())
    if max_maps > 1 << 20:
        pytest.skip(f"vm.max_map_count={max_maps} is too large to reach cheaply")
    return max_maps


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="at vm.max_map_count, ASan's own allocator cannot mmap and aborts the child",
)
def test_map_is_all_or_nothing_when_the_os_refuses_mid_batch() -> None:
    """No budget: the kernel's mapping limit (vm.max_map_count) makes mmap fail part way through."""
    max_maps = _reachable_map_limit()
    res = run_python(
        f"""
        from kvcached import _vmm
        from kvcached.errors import BackendError
        n = 2 * {max_maps} + 4096
        r = _vmm.VirtualRange("cpu", n * 4096, 4096)
        try:
            r.map(range(0, n, 2))  # every other page: each mapped slot is its own VMA
        except BackendError as e:
            print(type(e).__name__, r.num_mapped, r.committed_bytes())
        r.map([1, 3])
        print("after", r.mapped_pages())
        """
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["PhysicalMemoryExhausted 0 0", "after [1, 3]"]


def test_a_batch_refused_at_the_mapping_limit_gives_every_mapping_back() -> None:
    """Refused at vm.max_map_count, a batch's rollback leaves each slot a mapping of its own when
    the OS cannot build the replacement; whether it can depends on the process's count at the
    failure (odd or even: the OS may be left one above its limit). Either way the range ends as
    one reservation again, so the process is not held at the limit. Four ranges, each after one
    more mapping of the process's own, meet both counts."""
    max_maps = _reachable_map_limit()
    res = run_python(
        f"""
        import mmap
        from kvcached import _vmm
        from kvcached.errors import BackendError
        def mappings():
            with open("/proc/self/maps") as f:
                return sum(1 for _ in f)
        n = 2 * {max_maps} + 4096
        kept = []
        for _ in range(4):
            kept.append(mmap.mmap(-1, 4096))  # one mapping more than the last range saw
            r = _vmm.VirtualRange("cpu", n * 4096, 4096)
            before = mappings()
            try:
                r.map(range(0, n, 2))
            except BackendError as e:
                refused = type(e).__name__
            left = mappings() - before
            r.map([1, 3])
            print(refused, r.num_mapped, "left", 0 <= left <= 8, left)
            r.close()
        """
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split("\n")[:4]
    assert all(line.startswith("PhysicalMemoryExhausted 2 left True") for line in lines), lines


# ---------------------------------------------------------------------------------------
# DLPack views and lifetime
# ---------------------------------------------------------------------------------------


def test_dlpack_capsule_into_torch() -> None:
    torch = pytest.importorskip("torch")
    r = _vmm.VirtualRange("cpu", 4 * OS_PAGE, OS_PAGE)
    r.map([1, 2])
    cap = r.dlpack(OS_PAGE + 16, 100)
    assert type(cap).__name__ == "PyCapsule"
    assert r.live_views == 1
    t = torch.from_dlpack(cap)
    assert t.dtype == torch.uint8 and t.shape == (100,) and t.device.type == "cpu"
    assert t.data_ptr() == r.address + OS_PAGE + 16
    t[:] = 7
    assert r.live_views == 1
    del cap  # consumed: torch owns the view now, the capsule must not free it
    assert r.live_views == 1
    del t
    assert r.live_views == 0


def test_unconsumed_capsule_runs_deleter() -> None:
    r = _vmm.VirtualRange("cpu", 2 * OS_PAGE, OS_PAGE)
    caps = [r.dlpack() for _ in range(3)]
    assert r.live_views == 3
    del caps
    assert r.live_views == 0


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 1), (0, 3 * OS_PAGE), (2 * OS_PAGE + 1, -1), (OS_PAGE, -2)])
def test_dlpack_bounds(offset: int, nbytes: int) -> None:
    r = _vmm.VirtualRange("cpu", 2 * OS_PAGE, OS_PAGE)
    with pytest.raises(ConfigError):
        r.dlpack(offset, nbytes)
    assert r.live_views == 0


def test_tensor_view_dtype_checks() -> None:
    torch = pytest.importorskip("torch")
    r = _vmm.VirtualRange("cpu", 2 * OS_PAGE, OS_PAGE)
    r.map([0, 1])
    assert tensor_view(r, 0, 64, torch.float32).shape == (16,)
    assert tensor_view(r).shape == (2 * OS_PAGE,)
    with pytest.raises(ConfigError):
        tensor_view(r, 0, 6, torch.float32)
    with pytest.raises(ConfigError):
        tensor_view(r, 2, 8, torch.float32)


def test_view_keeps_reservation_after_close_and_del() -> None:
    r = _vmm.VirtualRange("cpu", 4 * PS, PS)
    address, size = r.address, r.size
    r.map([0])
    view = array_view(r)
    r.close()  # pages are gone (the view now faults if read) but the VA stays reserved
    del r
    gc.collect()
    assert reservation_present(address, size)
    del view
    gc.collect()
    assert not reservation_present(address, size)


def test_view_keeps_data_when_range_object_dropped() -> None:
    r = _vmm.VirtualRange("cpu", 2 * PS, PS)
    r.map([0, 1])
    view = array_view(r, PS, PS)
    view.fill(3)
    address = r.address
    del r
    gc.collect()
    assert int(view.sum()) == 3 * PS  # still mapped: nobody closed the range
    del view
    gc.collect()
    assert not reservation_present(address, 2 * PS)


def test_stray_access_to_unmapped_slot_is_sigsegv() -> None:
    res = run_python(
        """
        import ctypes
        from kvcached import _vmm
        r = _vmm.VirtualRange("cpu", 4 * 4096, 4096)
        r.map([0])
        ctypes.memset(r.address, 1, 4096)
        r.unmap([0])
        print("reading", flush=True)
        ctypes.string_at(r.address, 1)
        print("survived")
        """
    )
    assert res.returncode == -11, res.stderr
    assert "reading" in res.stdout and "survived" not in res.stdout


def test_interpreter_exit_prints_nothing() -> None:
    res = run_python(
        """
        import os, tempfile
        from kvcached import _vmm
        from kvcached.budget import BudgetRecord
        from kvcached.memory import array_view
        from kvcached.pages import PageSpace
        record = BudgetRecord(os.path.join(tempfile.mkdtemp(), "b"), limit=64 << 20)
        slot = record.slot(rank=0, device="cpu")
        ranges = [_vmm.VirtualRange("cpu", 8 << 20, 2 << 20) for _ in range(3)]
        for r in ranges:
            PageSpace((r,), (1,), 4, slot).map_pages([0, 2])
        views = [array_view(r) for r in ranges]
        views[0][:10] = 1
        capsule = ranges[1].dlpack()          # never consumed
        ranges[2].close()                      # closed, but its view is alive
        cycle = [ranges[0]]; cycle.append(cycle)  # only the cycle collector could free this
        del ranges
        """
    )
    assert res.returncode == 0
    assert res.stdout == "" and res.stderr == ""


# ---------------------------------------------------------------------------------------
# concurrency
# ---------------------------------------------------------------------------------------


def test_map_each_maps_every_backing_in_turn_and_notes_each_done() -> None:
    """`map_each`: native ranges and any other backing (the fault seam's wrapper) in order;
    ``done`` gets an entry per backing that mapped its whole list."""
    from kvcached.faults import FailingRange

    ranges = [_vmm.VirtualRange("cpu", 4 * PS, PS) for _ in range(3)]
    wrapped = FailingRange(ranges[1])
    done: list[None] = []
    _vmm.map_each([(ranges[0], [0, 2]), (wrapped, [1]), (ranges[2], [3])], done)
    assert done == [None] * 3 and wrapped.calls["map"] == 1
    assert [r.mapped_pages() for r in ranges] == [[0, 2], [1], [3]]
    _vmm.map_each([], done)
    assert len(done) == 3
    for r in ranges:
        r.close()


@pytest.mark.parametrize("fails", ["native", "wrapped"])
def test_map_each_stops_at_the_first_failure_and_says_how_far_it_got(fails: str) -> None:
    """The failing backing maps nothing (a range is all-or-nothing; the wrapper raises before
    its range is touched), those after it are not tried, and ``done`` counts those before."""
    from kvcached.faults import FailingRange

    ranges = [_vmm.VirtualRange("cpu", 4 * PS, PS) for _ in range(4)]
    wrapped = FailingRange(ranges[2])
    if fails == "native":
        ranges[1].map([3])  # the list below asks for page 3 again there: refused whole
        lists = [[0, 1], [2, 3], [0], [0]]
        error: type[Exception] = InvariantError
    else:
        wrapped.fail_call("map", 1, PhysicalMemoryExhausted("planted"))
        lists = [[0, 1], [2], [0], [0]]
        error = PhysicalMemoryExhausted
    done: list[None] = []
    with pytest.raises(error):
        _vmm.map_each([(ranges[0], lists[0]), (ranges[1], lists[1]), (wrapped, lists[2]), (ranges[3], lists[3])],
                      done)
    assert len(done) == (1 if fails == "native" else 2)
    assert ranges[0].mapped_pages() == [0, 1] and ranges[3].mapped_pages() == []
    assert ranges[1].mapped_pages() == ([3] if fails == "native" else [2])
    assert ranges[2].mapped_pages() == []
    with pytest.raises(ValueError, match="a \\(backing, pages\\) pair"):
        _vmm.map_each([(ranges[3],)], done)  # type: ignore[list-item]
    for r in ranges:
        r.close()


def test_unmap_each_tries_every_backing_and_raises_the_first_failure_after() -> None:
    """`unmap_each`: a backing that fails (a native range asked for a page it does not map, the
    wrapper's planted failure) does not stop the others; the first failure is raised after."""
    from kvcached.faults import FailingRange

    ranges = [_vmm.VirtualRange("cpu", 4 * PS, PS) for _ in range(4)]
    for r in ranges:
        r.map([0, 1])
    wrapped = FailingRange(ranges[2])
    wrapped.fail_call("unmap", 1, PhysicalMemoryExhausted("planted"))
    with pytest.raises(InvariantError):  # the first failure: range 1 does not map page 3
        _vmm.unmap_each([(ranges[0], [0]), (ranges[1], [1, 3]), (wrapped, [0]), (ranges[3], [0, 1])])
    assert [r.mapped_pages() for r in ranges] == [[1], [0, 1], [0, 1], []]
    with pytest.raises(PhysicalMemoryExhausted, match="planted"):
        wrapped.fail_call("unmap", 1, PhysicalMemoryExhausted("planted"))
        _vmm.unmap_each([(wrapped, [0]), (ranges[0], [1])])
    assert ranges[0].mapped_pages() == [] and ranges[2].mapped_pages() == [0, 1]
    _vmm.unmap_each([(wrapped, [0, 1]), (ranges[1], [0, 1])])
    assert all(r.mapped_pages() == [] for r in ranges)
    for r in ranges:
        r.close()


def test_threads_on_disjoint_pages() -> None:
    r = _vmm.VirtualRange("cpu", 64 * OS_PAGE, OS_PAGE)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        mine = list(range(k * 16, (k + 1) * 16))
        try:
            for _ in range(200):
                r.map(mine)
                r.unmap(mine[::2])
                r.unmap(mine[1::2])
        except (InvariantError, PhysicalMemoryExhausted, BackendError) as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert r.num_mapped == 0


def test_racing_maps_of_one_page() -> None:
    r = _vmm.VirtualRange("cpu", 4 * OS_PAGE, OS_PAGE)

    def attempt(barrier: threading.Barrier, outcomes: list[str]) -> None:
        barrier.wait()
        try:
            r.map([2])
            outcomes.append("ok")
        except InvariantError:
            outcomes.append("double")

    for _ in range(50):
        outcomes: list[str] = []
        barrier = threading.Barrier(4)
        threads = [threading.Thread(target=attempt, args=(barrier, outcomes)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["double", "double", "double", "ok"]
        r.unmap([2])


# ---------------------------------------------------------------------------------------
# model-based: random batches against a set
# ---------------------------------------------------------------------------------------

NUM_PAGES = 12
ops = st.lists(
    st.tuples(st.sampled_from(["map", "unmap"]), st.lists(st.integers(-1, NUM_PAGES), max_size=5)),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, limit_pages=st.integers(0, NUM_PAGES))
def test_matches_a_set_model(ops: list[tuple[str, list[int]]], limit_pages: int) -> None:
    """A range under a budget (`PageSpace` charging a `LocalBudget`, checked before mapping)."""
    budget = LocalBudget(limit_pages * OS_PAGE)
    r = _vmm.VirtualRange("cpu", NUM_PAGES * OS_PAGE, OS_PAGE)
    space = PageSpace((r,), (1,), NUM_PAGES, budget)
    model: set[int] = set()
    for op, pages in ops:
        valid_index = all(0 <= p < NUM_PAGES for p in pages) and len(set(pages)) == len(pages)
        if op == "map":
            if pages and len(model) + len(pages) > limit_pages:
                expected: type[Exception] | None = PhysicalMemoryExhausted
            elif not valid_index or model & set(pages):
                expected = InvariantError
            else:
                expected = None
        else:
            expected = None if valid_index and set(pages) <= model else InvariantError
        call = space.map_pages if op == "map" else space.unmap_pages
        if expected is None:
            call(pages)
            model = model | set(pages) if op == "map" else model - set(pages)
        else:
            with pytest.raises(expected):
                call(pages)
        assert r.mapped_pages() == sorted(model)
        assert budget.used == len(model) * OS_PAGE
    space.unmap_pages(sorted(model))
    assert budget.used == 0
