"""The worker seams installed for one test, with kvcached's environment pinned."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvcached.integration.vllm import rank_kv, worker
from kvcached.integration.vllm.capabilities import detect


def forget_all() -> None:
    """Forget every KV space the worker seams registered in this process."""
    for kv in rank_kv.registered_rank_kv():
        rank_kv.forget_rank_kv(kv)


def registered_space(tensor: object) -> object:
    """The KV space the worker seam registered for ``tensor`` (asserting there is one)."""
    kv = rank_kv.rank_kv_of(tensor)  # type: ignore[arg-type]
    assert kv is not None, "the allocation registered no KV space"
    return kv.space


@contextlib.contextmanager
def worker_installed(monkeypatch: pytest.MonkeyPatch, page_size: int) -> Iterator[None]:
    """kvcached enabled with ``page_size``, no budget; the installed vLLM's seams; all undone after."""
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(page_size))
    for var in ("ENABLE_KVCACHED", "KVCACHED_BUDGET_BYTES", "KVCACHED_BUDGET_PATH", "KVCACHED_PAGE_SIZE_MB"):
        monkeypatch.delenv(var, raising=False)
    worker.install(detect())
    try:
        yield
    finally:
        worker.uninstall()
        forget_all()
