"""Worker-side seams: KV tensors over virtual ranges, byte-page metadata, block copies,
and the KV capacity the worker reports.

Model Runner V1, every series in `capabilities.SUPPORTED`. Where vLLM allocates KV tensors is the
one worker difference between the series; `Capabilities.allocate_kv_cache` tells which seams apply.
These attributes are replaced by `install`, each restored exactly by `uninstall`:

0.26-0.28 (``allocate_kv_cache`` false): ``_allocate_kv_cache_tensors`` and
``_reshape_kv_cache_tensors`` below. 0.29 and later (``allocate_kv_cache`` true): those methods are
gone and ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache`` replaces both (below).

``GPUModelRunner._allocate_kv_cache_tensors``
    Returns, per layer, an int8 tensor of exactly ``KVCacheTensor.size`` bytes, like
    vLLM's ``torch.zeros``, but over a `kvcached._vmm.VirtualRange`: one range per
    ``KVCacheTensor``, or one range for all packed tensors (``block_stride > 0``), which
    alias one backing exactly as in vLLM. Each range is rounded up to whole kv pages
    (`kvcached.space.plan_geometry`). Only kv page 0, the page of vLLM's null block
    (block 0), is mapped here: the worker's warm-up (CUDA-graph capture, dummy runs with
    zeroed block tables) reads block 0 *before* the scheduler builds its pool, and an
    unmapped page would fault. The ranges, their geometry and that premapped page are
    registered as this rank's end of the page protocol (`RankKv`, a
    `kvcached.ranks.RankPages`), found by the address of the worker's own KV tensors; the
    scheduler reaches it through vLLM's executor (`kvcached.integration.vllm.engine`),
    adopts the page, pins the null block on it, and maps every other page on every rank
    before any step touches its blocks.

``GPUModelRunner._reshape_kv_cache_tensors``
    Runs vLLM's own reshape (including its in-place hybrid restride), then attaches
    `kvcached.views.BytePageMeta` to every view it returns, list elements included
    (0.26 Mamba state lists). The block dimension comes from the attention backend
    (``get_kv_cache_block_dim``, as vLLM's hybrid restride uses) or is 0 for Mamba. For a
    view over a kvcached range it also checks that block ``b`` lies inside bytes
    ``[b*stride, (b+1)*stride)`` of its range: page mapping is per block row, so a view
    reaching outside its row (an unrestrided split K/V layout) would touch unmapped pages.

``GPUModelRunner._init_minimal_kv_cache_for_profiling``
    Marks the minimal KV cache vLLM builds to profile CUDA-graph memory. Dummy runs write
    into it before any pool exists, so it must be ordinary memory: while the mark is set
    the allocation seam delegates to vLLM and registers nothing. (0.29 builds it
    through the same ``initialize_kv_cache`` and ``allocate_kv_cache``.)

``vllm.v1.worker.gpu_model_runner.allocate_kv_cache`` (0.29)
    The name the V1 runner imported from ``vllm.v1.worker.utils`` and calls from
    ``initialize_kv_cache_tensors``. vLLM 0.29 places every layer in *one* backing
    buffer, each layer view ``[B, H, N, C]`` at ``offset + l*layer_stride +
    b*block_stride`` (``create_kv_cache_views``). kvcached runs vLLM's own function on
    the ``meta`` device, so vLLM's code decides every view's shape, strides, dtype and
    offset without allocating, then splits the buffer into its *regions* (maximal
    ranges of overlapping views: one per layer slot for layer-outermost layouts such as
    the CPU backend's LBHNC, the whole buffer for block-outermost ones such as BLHNC),
    backs each region with its own `kvcached._vmm.VirtualRange` exactly like a 0.28
    ``KVCacheTensor``, rebuilds every view with the same geometry over its region, and
    attaches `kvcached.views.BytePageMeta` (block dimension 0, as in every 0.29 view)
    with the same block-row check as ``_reshape_kv_cache_tensors``. A layer slot that
    is not a whole number of kv pages therefore costs nothing: each region starts its
    own range. Only the null block's kv page is mapped; the space is registered as for
    0.28.

``vllm.v1.worker.gpu_model_runner.copy_kv_cache_blocks_inplace``
    The name the V1 runner imported (patching ``vllm.v1.worker.utils`` would have no
    effect). When kvcached is disabled it calls the original; otherwise
    `kvcached.copy.copy_blocks`, which validates first and copies each backing's byte
    runs once. The runner's call site and timing are untouched. Model Runner V2 is
    refused at start-up (below). vLLM 0.29's own helper
    copies view by view and would only touch the listed blocks, but it copies views
    that overlay one backing (hybrid groups) once each, so a batch where a block is both
    a destination and a later source is applied twice over the same bytes, and it
    validates nothing before writing; kvcached's copy is kept on every series.

Configuration. One `KvcachedConfig` per engine: the engine's first worker seam that needs
it, the capacity report below, resolves it (the engine's explicit settings, `engine_settings`,
over the ``KVCACHED_*`` variables); the allocation seam plans the geometry and
opens the ranges with that same config and registers it with the KV space; every rank
reports it with its layout and the scheduler's pool takes it from there
(`kvcached.space.KvSpace.config`). Nothing resolves it again, so
the page size the worker planned with is the one the pool maps. The allocation takes the
config (resolving it itself if no report ran), so the next engine built in the same
process resolves its own.

Memory profiling (the KV capacity, in bytes, the worker reports to the engine, from
which vLLM derives ``num_blocks``). kvcached's KV tensors are virtual: nothing is
committed when they are made, pages are mapped per admission and given back when idle,
and an admission that finds no physical memory is a scheduling miss, not an error. So
the worker reports the *virtual* capacity vLLM would use, capped by the physical budget
kvcached is configured with (`physical_cap_bytes`: ``KVCACHED_BUDGET_BYTES``, else the
limit of the shared budget file ``KVCACHED_BUDGET_PATH``): blocks beyond the budget
could never be mapped, and reporting them would only turn every admission past the
budget into a miss. Without a budget the native capacity is reported unchanged.

``CPUWorker.determine_available_memory`` (CPU platform only)
    vLLM sizes the CPU KV cache from ``kv_cache_memory_bytes`` (or
    ``VLLM_CPU_KVCACHE_SPACE``) and refuses a size above the node's currently available
    memory, i.e. it demands the whole cache up front. With an explicit size kvcached
    runs vLLM's model warm-up and reports that size, capped, without the up-front check.
    Without one, vLLM's own RSS-based sizing (and its checks) runs and its result is
    capped.

``Worker.determine_available_memory`` and ``vllm.v1.worker.gpu_worker.request_memory``
(GPU; unit-tested, but no GPU engine has run them yet: this project's CI has no GPU)
    ``Worker.init_device`` calls ``request_memory``, which takes ``total memory x
    gpu_memory_utilization`` as this engine's share and refuses to start unless that
    much is free *now*. Peers sharing the device through kvcached legitimately hold
    memory they will give back, so the replacement returns the same share without the
    free-memory check. ``determine_available_memory`` keeps vLLM's profiling: the share
    minus what this process's profile run measured (weights, activation peak, non-torch
    growth during the run, CUDA-graph estimate), or ``kv_cache_memory_bytes`` when set
    (vLLM then profiles without any free-memory arithmetic); the result is the virtual
    capacity and is capped by the budget. Memory peers hold at start-up is in neither
    snapshot difference, so it does not shrink the capacity. Limitation, left visible:
    a peer that maps or unmaps pages *during* this engine's profile run changes the
    measured non-torch growth (a release even trips vLLM's own assertion). Co-located
    engines should pass ``kv_cache_memory_bytes``, whose path has no such arithmetic.
    Other ``Worker`` subclasses that override ``determine_available_memory`` (XPU) run
    on devices kvcached does not back (`allocate_kv_cache_tensors` refuses them).

Whether the seams act is the one switch in `install_state` (decided when the first part
is installed, from ``KVCACHED_ENABLE``/``ENABLE_KVCACHED`` unless the installer says): the
plugin only installs when enabled, but a disabled install makes every seam a pure
delegation to vLLM, so tests and tools can install the seams without changing behaviour.

Versions: the memory seams are checked against vLLM 0.28.0's to 0.32.0's source. `install` checks
the shape they rely on (the attributes exist where expected, ``request_memory`` is still
vLLM's helper) and refuses, patching nothing, a vLLM that differs. Two capability rows
follow vLLM: from 0.30 the CPU warm-up runs when ``CPUWorker._should_warm_up_model()`` says
so (``cpu_warmup_decision``); from 0.32 ``request_memory`` takes the weights held outside
the process and subtracts them from the share (``request_memory_external``).

``VllmConfig.use_v2_model_runner`` (Model Runner V2)
    vLLM's one decision between the runners, a property read while the engine's config is
    validated. While kvcached acts, a decision for V2 raises `IntegrationError` naming
    ``VLLM_USE_V2_MODEL_RUNNER=0``: V2 allocates and copies KV through its own names, which
    the seams above do not reach (``docs/model-runner-v2.md``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcached import space as _space
from kvcached.budget import BudgetRecord, Slot, expected_limit, open_slot, record_path
from kvcached.config import KvcachedConfig
from kvcached.copy import copy_blocks
from kvcached.errors import ConfigError, CopyValidationError, IntegrationError
from kvcached.faults import FaultInjector
from kvcached.host import default_host_limit
from kvcached.integration.vllm import ENGINE_CONFIG_KEY, install_state
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.patching import PatchSet, own, require_own
from kvcached.integration.vllm.view_regions import plan_regions, rebase
from kvcached.ranks import BudgetRef, RankPages
from kvcached.views import BytePageMeta, attach_meta, describe_block_view

__all__ = [
    "NULL_BLOCK_PAGE",
    "allocate_kv_cache_tensors",
    "allocate_kv_cache_views",
    "annotate_runner_views",
    "capped_kv_bytes",
    "install",
    "installed_capabilities",
    "is_enabled",
    "physical_cap_bytes",
    "uninstall",
]

_logger = logging.getLogger(__name__)

#: kv page of vLLM's null block (block 0): mapped by the worker at allocation.
NULL_BLOCK_PAGE = 0


_PART = "worker"


@dataclass
class _State:
    """What the worker seams learn while engines are built (installation lives in `install_state`)."""

    #: range address -> block stride (bytes) of the backings this process allocated
    backing_strides: dict[int, int] = field(default_factory=dict)
    #: the config resolved for the engine being built, until its allocation takes it
    config: KvcachedConfig | None = None
    #: range address -> the KV space (and its protocol end) of the engine that owns the range
    rank_kv: dict[int, RankKv] = field(default_factory=dict)


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


# Lock order: install_state.LOCK (held while installing) before _lock, never the reverse.
_lock = threading.RLock()
_patches = PatchSet()  # guarded by install_state.LOCK
_state = _State()
_profiling = threading.local()  # .active: inside _init_minimal_kv_cache_for_profiling


def is_enabled() -> bool:
    """Whether the installed seams act (False: not installed, or installed disabled)."""
    return install_state.is_enabled(_PART)


def installed_capabilities() -> Capabilities | None:
    """The capabilities the seams were installed for, or None when not installed."""
    return install_state.capabilities(_PART)


def _acting() -> bool:
    """The switch every worker seam reads (the process-wide install state)."""
    return install_state.is_enabled()


# ---- the engine's config ------------------------------------------------------------------
def engine_settings(vllm_config: Any) -> dict[str, Any]:
    """The explicit kvcached settings vLLM's config carries for this engine (`ENGINE_CONFIG_KEY`
    of ``additional_config``; none: ``{}``). Names are checked by `KvcachedConfig.resolve`."""
    extra = getattr(vllm_config, "additional_config", None)  # None: a worker without a vLLM config
    settings = extra.get(ENGINE_CONFIG_KEY, {}) if isinstance(extra, Mapping) else {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"additional_config[{ENGINE_CONFIG_KEY!r}] must be a mapping of kvcached settings, "
                          f"got {type(settings).__name__}")
    return dict(settings)


def _resolve_engine_config(vllm_config: Any) -> KvcachedConfig:
    """Resolve the config of the engine being built; its first seam (the capacity report) calls this.

    Its explicit settings (`engine_settings`) win over the ``KVCACHED_*`` variables. Always
    resolved afresh: an engine that failed between its report and its allocation must not
    leave its config to the next engine built in this process.
    """
    config = KvcachedConfig.resolve(**engine_settings(vllm_config))
    with _lock:
        _state.config = config
    return config


def _take_engine_config() -> KvcachedConfig:
    """The engine's config for its allocation, which carries it with the KV space.

    The one the capacity report resolved; resolved now if no report ran (the seams called
    directly). Taking it leaves none behind, so the next engine resolves its own.
    """
    with _lock:
        config, _state.config = _state.config, None
    return config if config is not None else KvcachedConfig.resolve()


# ---- (a) allocation ----------------------------------------------------------------------
@dataclass
class _BackingPlan:
    size: int  # bytes exposed to vLLM (the KVCacheTensor size)
    stride: int  # bytes per logical block
    layers: list[str]


def _plan_backings(kv_cache_config: Any) -> list[_BackingPlan]:
    """One backing per ``KVCacheTensor``, except that packed tensors share one."""
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        raise IntegrationError(f"KV cache config has num_blocks={num_blocks}")
    plans: list[_BackingPlan] = []
    packed: _BackingPlan | None = None
    for t in kv_cache_config.kv_cache_tensors:
        size, block_stride = int(t.size), int(t.block_stride)
        if block_stride > 0:
            if packed is None:
                packed = _BackingPlan(size, block_stride, [])
                plans.append(packed)
            elif (size, block_stride) != (packed.size, packed.stride):
                raise IntegrationError(
                    f"packed KV tensors disagree on the shared backing: size {size} / block "
                    f"stride {block_stride} vs {packed.size} / {packed.stride}"
                )
            if block_stride * num_blocks > size:
                raise IntegrationError(
                    f"packed KV tensor of {size} bytes cannot hold {num_blocks} blocks of {block_stride}"
                )
            packed.layers.extend(t.shared_by)
        else:
            if size % num_blocks:
                raise IntegrationError(
                    f"KV tensor of {size} bytes for {list(t.shared_by)} is not {num_blocks} equal blocks"
                )
            plans.append(_BackingPlan(size, size // num_blocks, list(t.shared_by)))
    if not plans:
        raise IntegrationError("KV cache config has no KV tensors")
    return plans


def _device_string(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    raise IntegrationError(f"kvcached cannot back KV tensors on device {device}")


def _expected_layers(runner: Any, kv_cache_config: Any) -> set[str]:
    skip = set(getattr(runner, "runner_only_attn_layers", ()))
    return {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names if n not in skip}


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
class _Backings:
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


def _open_backings(block_strides: Sequence[int], row_bytes: Sequence[int], num_blocks: int,
                   device: str) -> _Backings:
    """One virtual range per backing, nothing mapped yet; all or nothing."""
    from kvcached import _vmm
    from kvcached.memory import tensor_view

    config = _take_engine_config()
    geometry = _plan_geometry(block_strides, num_blocks, config.page_size, device)
    backings = _Backings(geometry, config, [], [], {})
    try:
        backings.budget = open_slot(config.budget_path, config.budget_bytes, device, rank=_current_rank(),
                                    label=f"pid {os.getpid()} rank {_current_rank()}",
                                    default_limit=_host_default(config, device))
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


def _host_default(config: KvcachedConfig, device: str) -> int | None:
    """On CPU without an explicit budget: the host budget derived from the memory available
    now (`kvcached.host`), so running out is a scheduling miss, not the OOM killer. None on
    a GPU (a failed ``cuMemCreate`` is the miss there) or with ``KVCACHED_HOST_RESERVE=off``."""
    if device != "cpu" or config.budget_bytes is not None or config.host_reserve is None:
        return None
    return default_host_limit(config.host_reserve)


def _check_budget_holds_a_page(backings: _Backings, geometry: _space.Geometry) -> None:
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


def _current_rank() -> int:
    """This worker's rank in the engine (0 for a single in-process worker)."""
    dist = torch.distributed
    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def _register(backings: _Backings) -> RankKv:
    """Map the null block's page and make the ranges answer the page protocol (closes on failure).

    The scheduler finds them through vLLM's executor (``collective_rpc``), by the address of
    the worker's own KV tensors (`rank_kv_of`): nothing is handed over in-process.
    """
    try:
        record, slot = backings.budget if backings.budget is not None else (None, None)
        space = _space.KvSpace(backings.geometry, tuple(backings.ranges), premapped=frozenset({NULL_BLOCK_PAGE}),
                               config=backings.config, charger=slot)
        local = space.page_space()
        # Warm-up may read block 0 before the scheduler's pool exists; the pool adopts the page.
        local.map_pages([NULL_BLOCK_PAGE])
        rank = _current_rank()
        faults = FaultInjector.from_env(backings.config.fault_plan or "", rank=rank)
        ref = BudgetRef(record.path, slot.index) if record is not None and slot is not None else None
        pages = RankPages(rank, local, backings.geometry, space.premapped, faults, budget=ref)  # type: ignore[arg-type]
        kv = RankKv(space, pages, record)
    except BaseException:
        backings.close()
        raise
    with _lock:
        _state.backing_strides = backings.strides
        for vrange in backings.ranges:
            _state.rank_kv[int(vrange.address)] = kv
    return kv


def rank_kv_of(tensor: torch.Tensor) -> RankKv | None:
    """The registered KV space a KV tensor (or view) of this process lies on, if any."""
    with _lock:
        return _state.rank_kv.get(int(tensor.untyped_storage().data_ptr()))


def registered_rank_kv() -> list[RankKv]:
    """Every KV space registered in this process and not yet forgotten (distinct)."""
    with _lock:
        return list({id(kv): kv for kv in _state.rank_kv.values()}.values())


def forget_rank_kv(kv: RankKv) -> None:
    """Unmap every page of ``kv`` and drop it from the index (engine teardown); idempotent."""
    kv.close()
    with _lock:
        for address in [a for a, k in _state.rank_kv.items() if k is kv]:
            del _state.rank_kv[address]


def allocate_kv_cache_tensors(runner: Any, kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """kvcached's ``_allocate_kv_cache_tensors``: int8 tensors over virtual ranges.

    Only the null block's kv page is mapped on return (see the module docstring).
    """
    plans = _plan_backings(kv_cache_config)
    device = _device_string(torch.device(runner.device))
    backings = _open_backings([p.stride for p in plans], [p.size for p in plans],
                              int(kv_cache_config.num_blocks), device)
    tensors = {name: rows for plan, rows in zip(plans, backings.rows, strict=True) for name in plan.layers}
    expected = _expected_layers(runner, kv_cache_config)
    if expected != set(tensors):
        backings.close()
        raise IntegrationError(
            "KV tensors do not cover the KV cache groups' layers: missing "
            f"{sorted(expected - set(tensors))}, unexpected {sorted(set(tensors) - expected)}"
        )
    _register(backings)
    return tensors


def _wrap_allocate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _allocate_kv_cache_tensors(self: Any, kv_cache_config: Any) -> dict[str, torch.Tensor]:
        if not _acting() or getattr(_profiling, "active", False):
            return original(self, kv_cache_config)
        return allocate_kv_cache_tensors(self, kv_cache_config)

    return _allocate_kv_cache_tensors


def _wrap_profiling(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _init_minimal_kv_cache_for_profiling(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_profiling, "active", False)
        _profiling.active = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _profiling.active = outer

    return _init_minimal_kv_cache_for_profiling


# ---- (a') allocation, vLLM with one backing buffer (allocate_kv_cache) -----------------------
def allocate_kv_cache_views(
    kv_cache_config: Any,
    device: Any,
    layout: Any,
    kernel_block_sizes: Sequence[int] | None,
    vllm_allocate: Callable[..., dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """kvcached's ``allocate_kv_cache`` (vLLM 0.29): vLLM's views, over virtual ranges.

    ``vllm_allocate`` is vLLM's function; it runs on the ``meta`` device, so its views
    carry the geometry and no memory. Only the null block's kv page is mapped on return.
    """
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        raise IntegrationError(f"KV cache config has num_blocks={num_blocks}")
    target = _device_string(torch.device(device))
    shapes = vllm_allocate(kv_cache_config, torch.device("meta"), layout, kernel_block_sizes)
    if not shapes:
        return {}  # attention-free model: vLLM allocates nothing either
    regions = plan_regions(shapes, num_blocks)
    backings = _open_backings([r.stride for r in regions], [num_blocks * r.stride for r in regions],
                              num_blocks, target)
    try:
        tensors: dict[str, torch.Tensor] = {}
        for region, rows in zip(regions, backings.rows, strict=True):
            for name in region.layers:
                like = shapes[name]
                tensors[name] = rebase(rows, like, int(like.storage_offset()) * like.element_size() - region.start)
        pending: list[tuple[torch.Tensor, BytePageMeta]] = []
        for name, t in tensors.items():  # every 0.29 view is [B, H, N, C]: blocks are dimension 0
            meta = _describe(name, t, num_blocks, 0)
            _check_block_major(name, meta, backings.strides[meta.backing_id])
            pending.append((t, meta))
    except BaseException:
        backings.close()
        raise
    for t, meta in pending:  # all or nothing: metadata only once every view checked out
        attach_meta(t, meta)
    _register(backings)
    return tensors


def _wrap_allocate_views(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def allocate_kv_cache(
        kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        if not _acting() or getattr(_profiling, "active", False):
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        return allocate_kv_cache_views(kv_cache_config, device, layout, kernel_block_sizes, original)

    return allocate_kv_cache


# ---- (b) metadata on views -----------------------------------------------------------------
def _layer_block_dims(runner: Any, kernel_block_sizes: Sequence[int]) -> tuple[dict[str, int], set[str]]:
    """Block dimension of each layer's view, and the names of the Mamba layers."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    dims: dict[str, int] = {}
    mamba: set[str] = set()
    for group in runner._kv_cache_spec_attn_group_iterator():
        if group.kv_cache_group_id == len(kernel_block_sizes):
            continue  # vLLM's trailing group of layers without KV cache
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            dims.update(dict.fromkeys(group.layer_names, 0))
            mamba.update(group.layer_names)
        elif isinstance(spec, AttentionSpec):
            dim = group.backend.get_kv_cache_block_dim(
                kernel_block_sizes[group.kv_cache_group_id],
                spec.num_kv_heads,
                spec.head_size,
                cache_dtype_str=runner.cache_config.cache_dtype,
            )
            dims.update(dict.fromkeys(group.layer_names, int(dim)))
    return dims, mamba


def _describe(name: str, view: torch.Tensor, num_blocks: int, block_dim: int | None) -> BytePageMeta:
    """`describe_block_view` for layer ``name``, failing as an `IntegrationError` that names it."""
    try:
        return describe_block_view(view, num_blocks, block_dim=block_dim)
    except CopyValidationError as exc:
        raise IntegrationError(f"layer {name}: cannot describe its KV view: {exc}") from exc


def _check_block_major(name: str, meta: BytePageMeta, stride: int) -> None:
    """Block b of a view over a kvcached range must lie in bytes [b*stride, (b+1)*stride)."""
    end = meta.backing_offset + meta.segments[-1][0] + meta.segments[-1][1]
    if meta.block_stride != stride or end > stride:
        raise IntegrationError(
            f"layer {name}: its view's logical block covers bytes [{meta.backing_offset}, {end}) "
            f"with block stride {meta.block_stride}, outside the {stride}-byte block row kvcached "
            "maps pages for (a K/V-first layout that was not restrided blocks-first?)"
        )


def annotate_runner_views(
    runner: Any, kv_caches: dict[str, Any], kernel_block_sizes: Sequence[int], caps: Capabilities
) -> None:
    """Attach byte-page metadata to every view vLLM's reshape returned (lists included)."""
    num_blocks = int(runner.kv_cache_config.num_blocks)
    dims, mamba = _layer_block_dims(runner, kernel_block_sizes)
    strides = _state.backing_strides
    pending: list[tuple[torch.Tensor, BytePageMeta]] = []
    for name, entry in kv_caches.items():
        is_list = isinstance(entry, (list, tuple))
        if name in mamba and is_list == caps.raw_mamba_pages:
            want = "one raw page tensor" if caps.raw_mamba_pages else "a list of state tensors"
            raise IntegrationError(f"Mamba layer {name}: vLLM {caps.version} should hold {want}")
        for t in entry if is_list else (entry,):
            meta = _describe(name, t, num_blocks, dims.get(name))
            stride = strides.get(meta.backing_id)
            if stride is not None:
                _check_block_major(name, meta, stride)
            pending.append((t, meta))
    for t, meta in pending:  # all or nothing
        attach_meta(t, meta)


def _wrap_reshape(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _reshape_kv_cache_tensors(
        self: Any, kv_cache_raw_tensors: dict[str, torch.Tensor], kernel_block_sizes: list[int]
    ) -> dict[str, Any]:
        kv_caches: dict[str, Any] = original(self, kv_cache_raw_tensors, kernel_block_sizes)
        state = install_state.current()
        if state is not None and state.enabled:
            annotate_runner_views(self, kv_caches, kernel_block_sizes, state.caps)
        return kv_caches

    return _reshape_kv_cache_tensors


# ---- (c) block copies ----------------------------------------------------------------------
def _wrap_copy(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def copy_kv_cache_blocks_inplace(kv_caches: Any, num_blocks: int, kv_cache_block_copies: Any) -> None:
        if not _acting():
            original(kv_caches, num_blocks, kv_cache_block_copies)
            return
        copy_blocks(kv_caches, num_blocks, kv_cache_block_copies, faults=_copy_faults(kv_caches))

    return copy_kv_cache_blocks_inplace


def _copy_faults(kv_caches: Any) -> FaultInjector | None:
    """The fault injector of the rank whose KV tensors these are (fault site ``copy``)."""
    for entry in kv_caches:
        for tensor in entry if isinstance(entry, (list, tuple)) else (entry,):
            kv = rank_kv_of(tensor)
            return kv.pages.faults if kv is not None else None
    return None


# ---- (d) memory profiling -------------------------------------------------------------------
def physical_cap_bytes(config: KvcachedConfig | None = None, device: str = "cpu") -> int | None:
    """The physical bytes this engine's KV pages may ever occupy, or None (no limit).

    ``budget_bytes`` wins (the engine will ask the device's record for exactly that limit).
    Otherwise the lower of the limit its claim would be under (`kvcached.budget.expected_limit`:
    live engines' limit, else the device limit; never a stale one an earlier engine left)
    and, on CPU, the host budget the engine would derive now (`_host_default`).
    """
    config = config if config is not None else KvcachedConfig.resolve()
    if config.budget_bytes is not None:
        return config.budget_bytes
    if record_path(config.budget_path, device) is None:
        return None  # budgets off: nothing is limited
    default = _host_default(config, device)
    limits = [default, expected_limit(config.budget_path, device, default)]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def capped_kv_bytes(virtual_bytes: int, config: KvcachedConfig | None = None, device: str = "cpu") -> int:
    """The KV capacity to report: ``virtual_bytes``, at most the physical budget."""
    cap = physical_cap_bytes(config, device)
    reported = int(virtual_bytes) if cap is None else min(int(virtual_bytes), cap)
    _logger.info("kvcached: KV capacity %d bytes (virtual %d, physical budget %s)", reported,
                 int(virtual_bytes), "none" if cap is None else cap)
    return reported


def _wrap_cpu_determine(original: Callable[..., int], caps: Capabilities) -> Callable[..., int]:
    @functools.wraps(original)
    def determine_available_memory(self: Any) -> int:
        if not _acting():
            return original(self)
        config = _resolve_engine_config(getattr(self, "vllm_config", None))
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is None:
            return capped_kv_bytes(original(self), config)  # vLLM's RSS-based sizing, checks included
        # vLLM's version warms the model up first (0.30+: when its own decision says so),
        # then checks `explicit` against the node's available memory; the KV tensors are
        # virtual, so only the warm-up applies.
        if not caps.cpu_warmup_decision or self._should_warm_up_model():
            self.model_runner.warming_up_model()
        return capped_kv_bytes(explicit, config)

    return determine_available_memory


def _wrap_gpu_determine(original: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(original)
    def determine_available_memory(self: Any) -> int:
        available = original(self)
        if not _acting():
            return available
        return capped_kv_bytes(available, _resolve_engine_config(getattr(self, "vllm_config", None)),
                               _device_string(torch.device(self.device)))

    return determine_available_memory


def _share(init_snapshot: Any, cache_config: Any, external_weight_memory: int = 0) -> int:
    """vLLM's share of the device, without "that much must be free now": peers' elastic
    pages come and go, and kvcached admits only what can be mapped. Weights held outside
    the process (0.32+) are not part of it, as in vLLM."""
    share = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
    return share - external_weight_memory if external_weight_memory > 0 else share


def _wrap_request_memory(original: Callable[..., int], caps: Capabilities) -> Callable[..., int]:
    if caps.request_memory_external:

        @functools.wraps(original)
        def request_memory_external(init_snapshot: Any, cache_config: Any, external_weight_memory: int = 0) -> int:
            if not _acting():
                return original(init_snapshot, cache_config, external_weight_memory)
            return _share(init_snapshot, cache_config, external_weight_memory)

        return request_memory_external

    @functools.wraps(original)
    def request_memory(init_snapshot: Any, cache_config: Any) -> int:
        if not _acting():
            return original(init_snapshot, cache_config)
        return _share(init_snapshot, cache_config)

    return request_memory


# ---- (e) Model Runner V2 ---------------------------------------------------------------------
V2_REFUSAL = (
    "vLLM selected Model Runner V2 for this engine, and kvcached serves Model Runner V1 only (V2 "
    "allocates and copies KV through other functions: docs/model-runner-v2.md). Set "
    "VLLM_USE_V2_MODEL_RUNNER=0 to run V1 with kvcached (features that exist only in V2, such as "
    "watermark_config or HiSparse, keep V2 selected), or KVCACHED_ENABLE=0 to run V2 without kvcached"
)


def _wrap_v2_decision(original: property) -> property:
    """``VllmConfig.use_v2_model_runner`` that refuses V2 while kvcached acts.

    vLLM reads this decision when it validates the engine's config, before any worker, runner
    or KV tensor exists, so the refusal comes at start-up with nothing built. Disabled (or
    deciding V1), it returns vLLM's own answer.
    """
    decide = original.fget
    assert decide is not None

    @functools.wraps(decide)
    def use_v2_model_runner(self: Any) -> bool:
        v2 = bool(decide(self))
        if v2 and _acting():
            raise IntegrationError(V2_REFUSAL)
        return v2

    return property(use_v2_model_runner, original.fset, original.fdel, original.__doc__)


def _v2_plan() -> list[tuple[Any, str, Any]]:
    from vllm.config import VllmConfig

    decision = own(VllmConfig, "use_v2_model_runner")
    if not isinstance(decision, property) or decision.fget is None:
        raise IntegrationError("vllm.config.VllmConfig.use_v2_model_runner is not the property kvcached "
                               "expects (vLLM's Model Runner V1/V2 decision)")
    return [(VllmConfig, "use_v2_model_runner", _wrap_v2_decision(decision))]


# ---- install / uninstall ---------------------------------------------------------------------
def _memory_plan(caps: Capabilities) -> list[tuple[Any, str, Any]]:
    """The memory-profiling seams (see the module docstring), after checking vLLM's shape."""
    from vllm.platforms import current_platform
    from vllm.v1.worker import gpu_worker, utils

    request = require_own(gpu_worker, "request_memory")
    if request is not utils.request_memory:
        raise IntegrationError(
            "vllm.v1.worker.gpu_worker.request_memory is not vLLM's helper; another plugin replaced it"
        )
    # CPUWorker overrides determine_available_memory and gets its own seam below.
    plan = [
        (gpu_worker, "request_memory", _wrap_request_memory(request, caps)),
        (gpu_worker.Worker, "determine_available_memory",
         _wrap_gpu_determine(require_own(gpu_worker.Worker, "determine_available_memory", exclusive=False))),
    ]
    if current_platform.is_cpu():
        from vllm.v1.worker import cpu_worker

        cpu = cpu_worker.CPUWorker
        if caps.cpu_warmup_decision:
            require_own(cpu, "_should_warm_up_model")
        plan.append((cpu, "determine_available_memory",
                     _wrap_cpu_determine(require_own(cpu, "determine_available_memory"), caps)))
    return plan


def _vllm_helper(module: Any, name: str, utils: Any) -> Callable[..., Any]:
    """``module.name``, which must still be the helper of that name in ``vllm.v1.worker.utils``."""
    helper = require_own(module, name)
    if helper is not getattr(utils, name, None):
        raise IntegrationError(
            f"{module.__name__}.{name} is not vLLM's helper; another plugin already replaced it"
        )
    return helper


def _plan(caps: Capabilities) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for every seam, after checking vLLM's shape."""
    if not caps.logical_block_copy:
        raise IntegrationError(f"vLLM {caps.version} has no logical block copy helper")
    from vllm.v1.worker import gpu_model_runner, utils

    runner = gpu_model_runner.GPUModelRunner
    copy_original = _vllm_helper(gpu_model_runner, "copy_kv_cache_blocks_inplace", utils)
    allocation: list[tuple[Any, str, Any]]
    if caps.allocate_kv_cache:
        allocation = [(gpu_model_runner, "allocate_kv_cache",
                       _wrap_allocate_views(_vllm_helper(gpu_model_runner, "allocate_kv_cache", utils)))]
    else:
        allocation = [
            (runner, "_allocate_kv_cache_tensors", _wrap_allocate(require_own(runner, "_allocate_kv_cache_tensors"))),
            (runner, "_reshape_kv_cache_tensors", _wrap_reshape(require_own(runner, "_reshape_kv_cache_tensors"))),
        ]
    return [
        *allocation,
        (
            runner,
            "_init_minimal_kv_cache_for_profiling",
            _wrap_profiling(require_own(runner, "_init_minimal_kv_cache_for_profiling")),
        ),
        (gpu_model_runner, "copy_kv_cache_blocks_inplace", _wrap_copy(copy_original)),
        *_memory_plan(caps),
        *_v2_plan(),
    ]


def install(caps: Capabilities, *, enabled: bool | None = None) -> None:
    """Replace the worker-side attributes; idempotent. Nothing is patched on error.

    ``enabled``: the switch (None: the one already recorded in `install_state`, else
    ``KVCACHED_ENABLE``/``ENABLE_KVCACHED`` now). Other capabilities or another switch
    than the installed ones raise `IntegrationError`.
    """
    install_state.install_part(_PART, caps, enabled, lambda: _patches.apply(_plan(caps)))  # validates first


def _restore() -> None:
    _patches.restore()
    with _lock:
        _state.backing_strides = {}
        _state.config = None


def uninstall() -> None:
    """Restore every replaced attribute exactly (in reverse order); idempotent.

    Registered KV spaces are left alone: an engine may still be using them.
    """
    install_state.uninstall_part(_PART, _restore)
