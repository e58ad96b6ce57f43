"""Region planning for vLLM 0.29's one KV buffer: pure geometry on the meta device."""

from __future__ import annotations

import pytest
import torch

from kvcached.errors import IntegrationError
from kvcached.integration.vllm.view_regions import plan_regions, rebase

N, P = 8, 256  # blocks, bytes per block


def test_layer_slots_are_separate_regions_and_overlays_merge() -> None:
    raw = torch.empty(3 * N * P, dtype=torch.int8, device="meta")
    views = {
        "l0": raw[: N * P].view(N, P),
        "l1": raw[N * P: 2 * N * P].view(N, P),
        "m1": raw[N * P: N * P + N * P // 2 * 2].view(N, P)[:, : P // 2],  # overlays l1's slot
        "l2": raw[2 * N * P:].view(N, P),
    }
    regions = plan_regions(views, N)
    assert [(r.start, r.end, r.stride, sorted(r.layers)) for r in regions] == [
        (0, N * P, P, ["l0"]), (N * P, 2 * N * P, P, ["l1", "m1"]), (2 * N * P, 3 * N * P, P, ["l2"])]


def test_overlapping_views_must_agree_on_the_block_stride() -> None:
    raw = torch.empty(4 * N * P, dtype=torch.int8, device="meta")
    views = {"a": raw[: N * P].view(N, P), "b": torch.as_strided(raw, (N, P), (2 * P, 1))}
    with pytest.raises(IntegrationError, match="disagree on the block stride"):
        plan_regions(views, N)


def test_a_region_wider_than_its_block_rows_is_refused() -> None:
    # Heads a whole head plane apart (LHBNC-like): block 0's bytes are not one row.
    raw = torch.empty(2 * N * P, dtype=torch.int8, device="meta")
    view = torch.as_strided(raw, (N, 2, P // 2), (P // 2, N * P // 2 * 2, 1))
    with pytest.raises(IntegrationError, match="own row"):
        plan_regions({"x": view}, N)


def test_dimension_zero_must_be_a_multiple_of_the_blocks() -> None:
    raw = torch.empty(N * P, dtype=torch.int8, device="meta")
    with pytest.raises(IntegrationError, match="block dimension 0"):
        plan_regions({"x": raw.view(N * 2 + 0, P // 2)[: N + 1]}, N)


def test_rebase_keeps_shape_strides_and_dtype() -> None:
    like = torch.empty(4 * N * P, dtype=torch.int8, device="meta")[N * P:].view(torch.float16)
    like = torch.as_strided(like, (N, 2, P // 4), (P // 2, P // 4, 1), like.storage_offset())
    raw = torch.zeros(N * P, dtype=torch.int8)
    view = rebase(raw, like, 0)
    assert (view.shape, view.stride(), view.dtype) == (like.shape, like.stride(), like.dtype)
    view[1].fill_(1.0)
    halves = raw.view(torch.float16)  # block 1 starts P bytes = P // 2 halves in
    assert halves[P // 2: P].eq(1.0).all() and halves[: P // 2].eq(0).all() and halves[P:].eq(0).all()
