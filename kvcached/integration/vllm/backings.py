"""Virtual ranges behind one engine's KV tensors on this rank: planned, opened, registered.

Both allocation seams (`allocation`, one per vLLM generation) describe their backings the
same way, as a block stride and a byte size each, and hand them here:

* `open_backings` takes the engine's config (`engine_config.take_engine_config`), plans the
  geometry (`kvcached.space.plan_geometry`: each range rounded up to whole kv pages), claims
  this process's slot in the device's budget record, and opens one `kvcached._vmm.VirtualRange`
  per backing, nothing mapped yet. All or nothing: on any failure every range and the slot
  are closed again.
* `register` maps only kv page 0, the page of vLLM's null block (block 0): the worker's
  warm-up (CUDA-graph capture, dummy runs with zeroed block tables) reads block 0 *before*
  the scheduler builds its pool, and an unmapped page would fault. The ranges, their
  geometry and that premapped page become this rank's end of the page protocol (`RankKv`, a
  `kvcached.ranks.RankPages`), published in `rank_kv` by the address of the worker's own KV
  tensors; the scheduler reaches it through vLLM's executor (`kvcached.integration.vllm.engine`),
  adopts the page, pins the null block on it, and maps every other page on every rank before
  any step touches its blocks. On failure the backings are closed; nothing is published.

kvcached backs KV tensors on CPU and CUDA devices only (`device_string` refuses others).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcached import space as _space
from kvcached.budget import BudgetRecord, Slot, open_slot
from kvcached.config import KvcachedConfig
from kvcached.errors import ConfigError, IntegrationError
from kvcached.faults import FaultInjector
from kvcached.host import default_host_limit
from kvcached.integration.vllm import rank_kv
from kvcached.integration.vllm.engine_config import take_engine_config
from kvcached.integration.vllm.rank_kv import NULL_BLOCK_PAGE, RankKv
from kvcached.ranks import BudgetRef, RankPages

__all__ = ["Backings", "current_rank", "device_string", "host_default", "open_backings", "register"]


def device_string(device: torch.device) -> str:
    """kvcached's name of a device it can back KV tensors on (``cpu``, ``cuda:N``)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    raise IntegrationError(f"kvcached cannot back KV tensors on device {device}")


def _map_granularity(device: str) -> int:
    """The smallest page size the VMM backend accepts on ``device`` (a multiple of 4 KiB)."""
    from kvcached import _vmm

    native = _vmm.os_page_size() if device == "cpu" else _vmm.cuda_granularity(int(device.split(":")[1]))
    return math.lcm(4096, int(native))


def _plan_geometry(strides: Sequence[int], num_blocks: int, page_size: int, device: str) -> _space.Geometry:
    """`kvcached.space.plan_geometry`, naming a page size that fits when the configured one does not.

    An unpadded Mamba page (a pure SSM model: 19840 bytes for the tiny Mamba2, 128 x 155)
    shares no large power of two with any page size, so a kv page would span many VMM
    pages; a page size that is a multiple of the block stride avoids that.
    """
    try:
        return _space.plan_geometry(strides, num_blocks, page_size)
    except ConfigError as exc:
        fit = math.lcm(_map_granularity(device), *strides)
        raise ConfigError(
            f"{exc}. On {device}, KVCACHED_PAGE_SIZE={fit} (or a multiple) holds whole blocks of every backing"
        ) from exc


@dataclass
class Backings:
    """Virtual ranges for the KV backings of one engine, before they are registered."""

    geometry: _space.Geometry
    config: KvcachedConfig  # the engine's config, planned with; carried with the space
    ranges: list[Any]  # kvcached._vmm.VirtualRange, one per backing
    rows: list[torch.Tensor]  # int8 view of each backing's ``num_blocks`` block rows
    strides: dict[int, int]  # range base address -> block stride
    budget: tuple[BudgetRecord, Slot] | None = None  # this process's slot in the device's record

    def close(self) -> None:
        try:
            for vrange in self.ranges:  # nothing stays mapped; the VA goes with the last view
                vrange.close()
        finally:
            if self.budget is not None:
                self.budget[0].close()  # the slot goes, and with it the charge


def open_backings(block_strides: Sequence[int], row_bytes: Sequence[int], num_blocks: int,
                  device: str) -> Backings:
    """One virtual range per backing, nothing mapped yet; all or nothing."""
    from kvcached import _vmm
    from kvcached.memory import tensor_view

    config = take_engine_config()
    geometry = _plan_geometry(block_strides, num_blocks, config.page_size, device)
    backings = Backings(geometry, config, [], [], {})
    try:
        backings.budget = open_slot(config.budget_path, config.budget_bytes, device, rank=current_rank(),
                                    label=f"pid {os.getpid()} rank {current_rank()}",
                                    default_limit=host_default(config, device))
        _check_budget_holds_a_page(backings, geometry)
        for stride, size, reserved in zip(block_strides, row_bytes, geometry.reserved_bytes, strict=True):
            # reserved = whole kv pages covering num_blocks * stride >= size
            vrange = _vmm.VirtualRange(device, max(reserved, size), config.page_size)
            backings.ranges.append(vrange)
            backings.rows.append(tensor_view(vrange, 0, size, dtype=torch.int8))
            backings.strides[int(vrange.address)] = stride
    except BaseException:
        backings.close()
        raise
    return backings


def host_default(config: KvcachedConfig, device: str) -> int | None:
    """On CPU without an explicit budget: the host budget derived from the memory available
    now (`kvcached.host`), so running out is a scheduling miss, not the OOM killer. None on
    a GPU (a failed ``cuMemCreate`` is the miss there) or with ``KVCACHED_HOST_RESERVE=off``."""
    if device != "cpu" or config.budget_bytes is not None or config.host_reserve is None:
        return None
    return default_host_limit(config.host_reserve)


def _check_budget_holds_a_page(backings: Backings, geometry: _space.Geometry) -> None:
    """A global limit below one kv page would refuse every map, the null block's first:
    refuse it here, naming both sizes, instead of failing on the first map."""
    if backings.budget is None:
        return
    record = backings.budget[0]
    limit = record.snapshot().limit
    page = sum(geometry.vmm_pages) * geometry.page_size
    if limit is not None and limit < page:
        raise ConfigError(f"the budget's global limit ({limit} bytes, KVCACHED_BUDGET_BYTES or the record "
                          f"{record.path}) is smaller than one kv page of this engine ({page} bytes)")


def current_rank() -> int:
    """This worker's rank in the engine (0 for a single in-process worker)."""
    dist = torch.distributed
    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def register(backings: Backings) -> RankKv:
    """Map the null block's page and make the ranges answer the page protocol (closes on failure).

    The scheduler finds them through vLLM's executor (``collective_rpc``), by the address of
    the worker's own KV tensors (`rank_kv.rank_kv_of`): nothing is handed over in-process.
    """
    try:
        record, slot = backings.budget if backings.budget is not None else (None, None)
        space = _space.KvSpace(backings.geometry, tuple(backings.ranges), premapped=frozenset({NULL_BLOCK_PAGE}),
                               config=backings.config, charger=slot)
        local = space.page_space()
        # Warm-up may read block 0 before the scheduler's pool exists; the pool adopts the page.
        local.map_pages([NULL_BLOCK_PAGE])
        rank = current_rank()
        faults = FaultInjector.from_env(backings.config.fault_plan or "", rank=rank)
        ref = BudgetRef(record.path, slot.index) if record is not None and slot is not None else None
        pages = RankPages(rank, local, backings.geometry, space.premapped, faults, budget=ref)  # type: ignore[arg-type]
        kv = RankKv(space, pages, record)
    except BaseException:
        backings.close()
        raise
    rank_kv.publish(kv, [int(vrange.address) for vrange in backings.ranges], backings.strides)
    return kv
