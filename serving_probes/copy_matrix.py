"""The spec's VMM copy matrix on a real device.

Each case builds attention KV views (NHD or HND token/head order, one backing per layer
or all layers interleaved in one backing, logical block = 1 or 2 kernel blocks) plus a
Mamba raw-page view that aliases the first attention backing (vLLM's hybrid groups share
tensors), all over kvcached virtual ranges. Then it:

1. maps ``num_blocks`` blocks through the elastic core and fills them with known data;
2. copies random logical blocks with `kvcached.copy.copy_blocks` and checks the result
   against plain indexing, and that each shared backing run was copied exactly once;
3. fills the device with ordinary torch allocations until kvcached's next map is refused
   by the driver, and checks the refused allocation changed nothing;
4. releases the pressure and allocates ``num_blocks`` more blocks through the bounded
   retry (the capacity cache may hold a stale value for its TTL);
5. verifies every block's contents again.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from kvcached import _vmm
from kvcached.arena import ElasticArena
from kvcached.config import KvcachedConfig
from kvcached.copy import copy_blocks, copy_stats, reset_copy_stats
from kvcached.errors import PhysicalMemoryExhausted
from kvcached.memory import tensor_view
from kvcached.space import KvSpace, plan_geometry
from kvcached.views import annotate

BLOCK_TOKENS = 16
HEADS = 8
HEAD_DIM = 128
LAYERS = 3
DTYPE = torch.float16


@dataclass(frozen=True)
class CopyCase:
    layout: str  # "NHD" | "HND"
    layers: str  # "separate" | "interleaved"
    ratio: int  # kernel blocks per logical block

    @property
    def name(self) -> str:
        return f"{self.layout}-{self.layers}-r{self.ratio}"


def all_cases() -> list[CopyCase]:
    return [CopyCase(lay, lyr, r) for lay, lyr, r in
            itertools.product(("NHD", "HND"), ("separate", "interleaved"), (1, 2))]


def _layer_page_bytes() -> int:
    return BLOCK_TOKENS * HEADS * 2 * HEAD_DIM * torch.finfo(DTYPE).bits // 8


def _attention_view(raw_u8: torch.Tensor, case: CopyCase, num_blocks: int, offset: int,
                    stride_bytes: int) -> torch.Tensor:
    """A 4-D (kernel_blocks, ..., K+V) attention view at ``offset`` with the given block stride."""
    kb_tokens = BLOCK_TOKENS // case.ratio
    n_kernel = num_blocks * case.ratio
    item = torch.finfo(DTYPE).bits // 8
    if case.layout == "NHD":
        shape = (n_kernel, kb_tokens, HEADS, 2 * HEAD_DIM)
        inner = (HEADS * 2 * HEAD_DIM, 2 * HEAD_DIM, 1)
    else:
        shape = (n_kernel, HEADS, kb_tokens, 2 * HEAD_DIM)
        inner = (kb_tokens * 2 * HEAD_DIM, 2 * HEAD_DIM, 1)
    typed = raw_u8.view(DTYPE)
    kernel_stride = stride_bytes // case.ratio // item
    return torch.as_strided(typed, shape, (kernel_stride, *inner), offset // item)


@dataclass
class CaseResult:
    case: str
    blocks: int
    pairs_copied: int
    copy_exact: bool
    runs_copied: int
    runs_expected: int
    rejected_by_driver: bool
    rejection_left_state_unchanged: bool
    recovered_blocks: int
    recovery_ms: float
    recovery_attempts_failed: int
    contents_verified: bool


@dataclass
class _Rig:
    """One case's pool and the layer views over it (``kv_caches``: the attention views, then
    the Mamba view aliasing the first backing, as vLLM's hybrid models lay them out)."""

    arena: ElasticArena
    ranges: tuple[_vmm.VirtualRange, ...]
    views: list[torch.Tensor]
    kv_caches: list[torch.Tensor]
    capacity_blocks: int

    def close(self) -> None:
        self.arena.close()
        for r in self.ranges:
            r.close()


def _rig(case: CopyCase, capacity_blocks: int, device: str) -> _Rig:
    page = _layer_page_bytes()
    config = KvcachedConfig(page_size=_vmm.cuda_granularity(0) if device.startswith("cuda") else 2 << 20,
                            min_reserve_pages=0, max_reserve_pages=0, map_retries=6,
                            retry_backoff_s=0.04)
    n_backings = LAYERS if case.layers == "separate" else 1
    stride = page if case.layers == "separate" else LAYERS * page
    geometry = plan_geometry([stride] * n_backings, capacity_blocks, config.page_size)
    ranges = tuple(_vmm.VirtualRange(device, size, config.page_size) for size in geometry.reserved_bytes)
    try:
        arena = ElasticArena.open(KvSpace(geometry, ranges), config, name=f"probe-{case.name}")
    except BaseException:
        for r in ranges:
            r.close()
        raise
    raws = [tensor_view(r, 0, r.size) for r in ranges]
    views: list[torch.Tensor] = []
    for layer in range(LAYERS):
        raw = raws[layer] if case.layers == "separate" else raws[0]
        # Interleaving is per kernel block: a kernel row holds that kernel block of
        # every layer, so each layer's view keeps one uniform stride along dim 0.
        offset = 0 if case.layers == "separate" else layer * page // case.ratio
        views.append(_attention_view(raw, case, capacity_blocks, offset, stride))
    # Mamba raw page view aliasing the first attention backing (shared tensor).
    mamba = torch.as_strided(raws[0], (capacity_blocks, 1, 1, page), (stride, page, page, 1), 0)
    kv_caches = [*views, mamba]
    annotate(kv_caches, capacity_blocks, block_dim=0)
    return _Rig(arena, ranges, views, kv_caches, capacity_blocks)


def _copy_round(rig: _Rig, case: CopyCase, blocks: list[int], rows: torch.Tensor,
                expected: list[torch.Tensor], device: str) -> tuple[int, bool]:
    """Random copies among the held blocks (unique destinations, gather-then-scatter),
    applied to ``expected`` too; (pairs copied, whether the views equal the expectation)."""
    num_blocks = len(blocks)
    perm = torch.randperm(num_blocks)
    dst_pos = perm[: num_blocks // 3]
    src_pos = torch.randint(0, num_blocks, (len(dst_pos),))
    pairs = [(blocks[s], blocks[d]) for s, d in zip(src_pos.tolist(), dst_pos.tolist(), strict=True)]
    reset_copy_stats()
    copy_blocks(rig.kv_caches, rig.capacity_blocks, pairs)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    for ref in expected:
        ref_rows = ref.view(num_blocks, case.ratio, *ref.shape[1:])
        ref_rows[dst_pos] = ref_rows[src_pos].clone()
    return len(pairs), all(torch.equal(v[rows].cpu(), ref) for v, ref in zip(rig.views, expected, strict=True))


def _recover(rig: _Rig, case: CopyCase, num_blocks: int, rows: torch.Tensor, expected: list[torch.Tensor],
             device: str) -> tuple[list[int], float, int, bool]:
    """After pressure: allocate ``num_blocks`` more, write them, and check the first blocks
    kept their contents; (blocks, ms taken, failed map attempts, contents verified)."""
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    start = time.monotonic()
    failures_before = rig.arena.pool.counters().map_failures
    more = rig.arena.ledger.allocate(num_blocks, wait=True)
    recovery_ms = (time.monotonic() - start) * 1000
    failed_attempts = rig.arena.pool.counters().map_failures - failures_before
    more_rows = _kernel_rows(more, case.ratio, device)
    for v in rig.views:
        v[more_rows] = 1.0
    verified = all(
        torch.equal(v[rows].cpu(), ref) for v, ref in zip(rig.views, expected, strict=True)
    ) and all(bool(v[more_rows].cpu().eq(1.0).all()) for v in rig.views)  # compared on the host
    del more_rows  # device tensors die before the frame does (see run_case)
    return more, recovery_ms, failed_attempts, verified


def run_case(case: CopyCase, num_blocks: int = 600, device: str = "cuda:0", seed: int = 0,
             pressure: bool = True) -> CaseResult:
    torch.manual_seed(seed)
    rig = _rig(case, 4 * num_blocks, device)
    try:
        blocks = rig.arena.ledger.allocate(num_blocks, wait=True)
        rows = _kernel_rows(blocks, case.ratio, device)
        for v in rig.views:
            v[rows] = torch.randn_like(v[rows])
        # The reference lives on the host: the probe then holds no device memory of its own
        # beyond short-lived gathers, so leak checks see kvcached's allocations alone.
        expected = [v[rows].cpu() for v in rig.views]
        pairs, copy_exact = _copy_round(rig, case, blocks, rows, expected, device)
        # One backing run per backing: separate layers give LAYERS backings (the Mamba view
        # shares the first), interleaved layers merge into one contiguous run.
        runs_expected = LAYERS if case.layers == "separate" else 1
        runs_copied = copy_stats().runs_copied
        rejected, unchanged = _pressure(rig.arena, num_blocks, device) if pressure else (False, True)
        more, recovery_ms, failed_attempts, verified = _recover(rig, case, num_blocks, rows, expected, device)
        rig.arena.ledger.release(blocks + more)
        # Device tensors die before the frame does (see kvcached.copy: under the sanitizer's
        # leak check, frames on the stack during a driver allocation outlive their call).
        del rows
        return CaseResult(case.name, num_blocks, pairs, copy_exact, runs_copied, runs_expected,
                          rejected, unchanged, len(more), round(recovery_ms, 1), failed_attempts, verified)
    finally:
        rig.close()


def _kernel_rows(blocks: list[int], ratio: int, device: str) -> torch.Tensor:
    """Device index of the kernel-block rows of logical ``blocks`` (ratio consecutive rows each).

    Built on the host and uploaded once, so no frame but the caller's holds it.
    """
    return torch.tensor([b * ratio + k for b in blocks for k in range(ratio)], dtype=torch.int64, device=device)


def _pressure(arena: ElasticArena, num_blocks: int, device: str) -> tuple[bool, bool]:
    """Fill the device with torch memory until kvcached's next map is refused; then free it.

    Returns (refused by the driver, the refusal changed nothing). The filler is released
    here, before returning, not left to the frame (see kvcached.copy on frames kept alive).
    """
    if not device.startswith("cuda"):
        return False, True
    hog: list[torch.Tensor] = []
    try:
        chunk = 1 << 30
        while chunk >= arena.pool.space.kv_page_bytes // 2:
            try:
                hog.append(torch.empty(chunk, dtype=torch.uint8, device=device))
            except RuntimeError as e:
                if not _is_device_oom(e):
                    raise
                chunk //= 2
        before = (set(arena.pool.mapped), arena.ledger.num_held)
        try:
            arena.ledger.allocate(num_blocks, wait=False)
        except PhysicalMemoryExhausted:
            return True, (set(arena.pool.mapped), arena.ledger.num_held) == before
        return False, True
    finally:
        hog.clear()


def _is_device_oom(e: RuntimeError) -> bool:
    """torch's caching allocator raises OutOfMemoryError; with caching off
    (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, as under the sanitizer) a refused cudaMalloc
    surfaces as a plain AcceleratorError that says "out of memory"."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
