"""Tenant isolation on CPU: a page one engine gave back never shows its bytes to anyone.

The CPU backend punches the page out of its memfd on unmap, so the kernel hands out zeroed
memory again: in the same range (another request of the same engine) and in another range
(another engine, its own memfd). Real ranges, real pages; the GPU's counterpart is the
committed probe ``serving_probes/isolation.py`` (``cuMemCreate`` returns zeroed memory).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

_vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")

PAGE = 64 << 10
PAGES = 16


def written(vrange: object, pages: range, byte: int) -> None:
    for p in pages:
        ctypes.memset(vrange.address + p * PAGE, byte, PAGE)  # type: ignore[attr-defined]


def nonzero(vrange: object, pages: range) -> int:
    return sum(PAGE - ctypes.string_at(vrange.address + p * PAGE, PAGE).count(0)  # type: ignore[attr-defined]
               for p in pages)


def test_a_page_given_back_reads_zero_when_mapped_again() -> None:
    r = _vmm.VirtualRange("cpu", PAGES * PAGE, PAGE)
    r.map(range(PAGES))
    written(r, range(PAGES), 0xAB)
    assert nonzero(r, range(PAGES)) == PAGES * PAGE  # the control: the bytes were there
    r.unmap(range(PAGES))
    r.map(range(PAGES))
    assert nonzero(r, range(PAGES)) == 0
    r.close()


def test_another_engines_pages_never_show_a_previous_tenants_bytes() -> None:
    """One process writes 0xAB everywhere and exits; the next maps as much and reads zeros."""
    code = textwrap.dedent(f"""
        import ctypes
        from kvcached import _vmm
        r = _vmm.VirtualRange("cpu", {PAGES * PAGE}, {PAGE})
        r.map(range({PAGES}))
        ctypes.memset(r.address, 0xAB, {PAGES * PAGE})
        r.unmap(range({PAGES}))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    r = _vmm.VirtualRange("cpu", PAGES * PAGE, PAGE)
    r.map(range(PAGES))
    assert nonzero(r, range(PAGES)) == 0
    r.close()
