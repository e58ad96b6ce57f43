"""This process's KV spaces: each rank's share of an engine's KV cache, found by address.

The allocation seams (`allocation`) register every engine's KV space here (`publish`), keyed
by the base address of each of its virtual ranges, which is the storage address of the KV
tensors vLLM's runner holds. The scheduler reaches a rank's space through vLLM's executor
(`kvcached.integration.vllm.engine`), by the address of the worker's own KV tensors
(`rank_kv_of`): nothing is handed over in-process.

Invariants:

* every range of a published `RankKv` maps to it, and to no other, until `forget_rank_kv`;
* `block_strides` are the block strides of the *last* allocation's ranges (what the
  0.26-0.28 reshape seam checks views against, right after that allocation); uninstalling
  the worker seams forgets them, while published spaces stay (an engine may still use them).

One lock guards both maps. Lock order: ``install_state.LOCK`` (held while installing) before
this module's lock, never the reverse; no other lock is taken while holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcached import space as _space
from kvcached.budget import BudgetRecord
from kvcached.ranks import RankPages

if TYPE_CHECKING:
    import torch

__all__ = ["NULL_BLOCK_PAGE", "RankKv", "forget_rank_kv", "rank_kv_of", "registered_rank_kv"]

#: kv page of vLLM's null block (block 0): mapped by the worker at allocation.
NULL_BLOCK_PAGE = 0


@dataclass(frozen=True, eq=False)
class RankKv:
    """This rank's share of one engine's KV cache: its ranges, and the page protocol's
    worker end over them (`kvcached.ranks.RankPages`), which the scheduler drives through
    vLLM's executor (`kvcached.integration.vllm.engine`)."""

    space: _space.KvSpace
    pages: RankPages
    budget: BudgetRecord | None = None  # the device's record, holding this rank's slot

    def close(self) -> None:
        """Unmap every page, then give up the budget slot (its charge is then zero)."""
        try:
            self.pages.close()
        finally:
            if self.budget is not None:
                self.budget.close()


_lock = threading.RLock()
_by_address: dict[int, RankKv] = {}  # range address -> the KV space that owns the range
_strides: dict[int, int] = {}  # range address -> block stride (bytes), of the last allocation


def publish(kv: RankKv, addresses: Iterable[int], strides: dict[int, int]) -> None:
    """Register ``kv`` under the base address of each of its ranges; ``strides`` become `block_strides`."""
    global _strides
    with _lock:
        _strides = strides
        for address in addresses:
            _by_address[address] = kv


def block_strides() -> dict[int, int]:
    """Range address -> block stride of the last allocation's ranges."""
    return _strides


def forget_strides() -> None:
    """Forget the last allocation's strides (the worker seams are uninstalled)."""
    global _strides
    with _lock:
        _strides = {}


def rank_kv_of(tensor: torch.Tensor) -> RankKv | None:
    """The registered KV space a KV tensor (or view) of this process lies on, if any."""
    with _lock:
        return _by_address.get(int(tensor.untyped_storage().data_ptr()))


def registered_rank_kv() -> list[RankKv]:
    """Every KV space registered in this process and not yet forgotten (distinct)."""
    with _lock:
        return list({id(kv): kv for kv in _by_address.values()}.values())


def forget_rank_kv(kv: RankKv) -> None:
    """Unmap every page of ``kv`` and drop it from the index (engine teardown); idempotent."""
    kv.close()
    with _lock:
        for address in [a for a, k in _by_address.items() if k is kv]:
            del _by_address[address]
