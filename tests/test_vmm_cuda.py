"""kvcached._vmm on the CUDA backend. Runs only where a CUDA driver and device exist."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from types import ModuleType

import pytest

from kvcached import _vmm
from kvcached.errors import ConfigError, InvariantError, PhysicalMemoryExhausted

pytestmark = pytest.mark.skipif(
    not _vmm.cuda_available(), reason="no usable CUDA driver/device (libcuda.so.1 + cuInit + a GPU)"
)

MIB = 1 << 20


@pytest.fixture(scope="module")
def torch_cuda() -> ModuleType:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA support here")
    torch.cuda.init()
    # Run every kernel the tests use once, so lazy module loading and the caching
    # allocator's first segments do not show up as "memory that did not come back".
    scratch = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    scratch.fill_(5)
    int(scratch.sum().item())
    floats = scratch.view(torch.float32)
    floats.copy_(torch.arange(floats.numel(), device="cuda", dtype=torch.float32))
    float(floats[3].item())
    del scratch, floats
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch


@pytest.fixture(scope="module")
def gran() -> int:
    return _vmm.cuda_granularity(0)


def settled_free() -> int:
    return _vmm.cuda_mem_info(0)[0]


def test_device_queries(gran: int) -> None:
    free, total = _vmm.cuda_mem_info(0)
    assert 0 < free <= total
    assert gran > 0 and gran % 4096 == 0
    with pytest.raises(ConfigError):
        _vmm.cuda_mem_info(10_000)


def test_driver_floor_times_every_call_and_gives_everything_back(gran: int) -> None:
    free_before = settled_free()
    calls = _vmm.cuda_driver_floor(0, gran, 8)
    assert set(calls) == {"create_us", "map_us", "set_access_us", "unmap_us", "release_us"}
    assert all(v > 0 for v in calls.values())
    assert settled_free() == free_before
    with pytest.raises(ConfigError, match="pages must be positive"):
        _vmm.cuda_driver_floor(0, gran, 0)
    with pytest.raises(ConfigError, match="not a multiple of the device granularity"):
        _vmm.cuda_driver_floor(0, gran + 4096, 1)
    with pytest.raises(ConfigError, match="out of range"):
        _vmm.cuda_driver_floor(99, gran, 1)


def test_page_size_must_match_granularity(gran: int) -> None:
    if gran <= 4096:
        pytest.skip("granularity too small to make a misaligned page size")
    with pytest.raises(ConfigError):
        _vmm.VirtualRange("cuda:0", 4 * gran, gran // 2)


def test_reserve_map_write_read_unmap_release(torch_cuda: ModuleType, gran: int) -> None:
    torch = torch_cuda
    start_free = settled_free()
    r = _vmm.VirtualRange("cuda:0", 8 * gran, gran)
    assert r.device == "cuda:0" and r.num_pages == 8
    r.map([0, 1, 2, 3])
    assert r.committed_bytes() == 4 * gran
    assert settled_free() <= start_free - 4 * gran
    view = torch.from_dlpack(r.dlpack(gran, 2 * gran))
    assert view.device == torch.device("cuda", 0) and view.dtype == torch.uint8
    assert view.data_ptr() == r.address + gran
    view.fill_(5)
    torch.cuda.synchronize()
    assert int(view.sum().item()) == 5 * 2 * gran
    floats = view.view(torch.float32)
    floats.copy_(torch.arange(floats.numel(), device="cuda", dtype=torch.float32))
    assert float(floats[1234].item()) == 1234.0
    del view, floats
    torch.cuda.synchronize()

    with pytest.raises(InvariantError):
        r.map([3])
    r.unmap([0, 1, 2, 3])
    assert r.num_mapped == 0 and r.committed_bytes() == 0
    r.close()
    del r
    torch.cuda.empty_cache()  # the arange() temporary sits in torch's cache, not in our range
    assert settled_free() >= start_free - 2 * MIB  # everything is back


def test_a_page_of_three_granules_reserves_maps_and_reads_back(torch_cuda: ModuleType, gran: int) -> None:
    """A page that is not a power of two (a hybrid's lcm page: 6 MiB on the H200) still
    reserves: the driver takes only a power-of-two alignment (CUDA_ERROR_INVALID_VALUE, 12-04)."""
    torch = torch_cuda
    page = 3 * gran
    r = _vmm.VirtualRange("cuda:0", 4 * page, page)
    assert r.address % gran == 0
    r.map([1, 3])
    view = torch.from_dlpack(r.dlpack(page, page))
    view.fill_(7)
    torch.cuda.synchronize()
    assert int(view.sum().item()) == 7 * page
    del view
    r.unmap([1, 3])
    r.close()
    assert set(_vmm.cuda_driver_floor(0, page, 2)) >= {"map_us"}


def test_device_oom_is_exhaustion_and_rolls_back(gran: int) -> None:
    total = _vmm.cuda_mem_info(0)[1]
    page = max(gran, 1 << 30) // gran * gran  # big pages: few driver calls
    pages = total // page + 2  # more than the device has
    r = _vmm.VirtualRange("cuda:0", pages * page, page)
    before = settled_free()
    with pytest.raises(PhysicalMemoryExhausted, match="CUDA_ERROR_OUT_OF_MEMORY"):
        r.map(range(pages))
    assert r.num_mapped == 0
    assert settled_free() >= before - 2 * MIB
    r.close()


def test_view_outlives_close(torch_cuda: ModuleType, gran: int) -> None:
    torch = torch_cuda
    r = _vmm.VirtualRange("cuda:0", 2 * gran, gran)
    r.map([0])
    view = torch.from_dlpack(r.dlpack())
    r.close()
    assert r.live_views == 1
    del view
    assert r.live_views == 0


def test_stray_access_faults_in_a_subprocess() -> None:
    code = textwrap.dedent(
        """
        import torch
        from kvcached import _vmm
        g = _vmm.cuda_granularity(0)
        r = _vmm.VirtualRange("cuda:0", 4 * g, g)
        r.map([0])
        t = torch.from_dlpack(r.dlpack())
        t[: g].fill_(1)
        torch.cuda.synchronize()
        r.unmap([0])
        t[: g].fill_(2)           # the slot has no mapping any more
        torch.cuda.synchronize()
        print("survived")
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert res.returncode != 0 and "survived" not in res.stdout
    assert "illegal" in res.stderr.lower() or "fault" in res.stderr.lower(), res.stderr


def test_interpreter_exit_prints_nothing() -> None:
    code = textwrap.dedent(
        """
        import torch
        from kvcached import _vmm
        from kvcached.memory import tensor_view
        g = _vmm.cuda_granularity(0)
        ranges = [_vmm.VirtualRange("cuda:0", 4 * g, g) for _ in range(3)]
        for r in ranges:
            r.map([0, 2])
        views = [tensor_view(r, 0, g, torch.float16) for r in ranges]
        views[0].fill_(1.0)
        capsule = ranges[1].dlpack()
        ranges[2].close()
        del ranges
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert res.returncode == 0 and res.stdout == "" and res.stderr == "", res.stderr


def test_threads_without_a_current_context(gran: int) -> None:
    """A fresh thread has no CUDA context; the backend makes the primary context current."""
    r = _vmm.VirtualRange("cuda:0", 8 * gran, gran)
    errors: list[Exception] = []

    def work(pages: list[int]) -> None:
        try:
            r.map(pages)
            r.unmap(pages[1:])
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=([2 * k, 2 * k + 1],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert r.mapped_pages() == [0, 2, 4, 6]
    r.close()
    assert r.committed_bytes() == 0
