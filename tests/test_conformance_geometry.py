"""Prompt lengths and workloads derived from engine geometry (no engine needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from conformance.cases import LengthSet, PrefixPattern
from conformance.geometry import Geometry, derive_page_size, prompt_lengths
from conformance.models import FIRST_FREE_TOKEN, VOCAB_SIZE
from conformance.workload import Workload, build_workload, partial_boundaries

#: How a workload crosses the process boundary (pydantic validates the dataclass itself).
_WORKLOAD = TypeAdapter(Workload)


# Geometries as the running engines report them (llama block 16; NemotronH hash 16 in
# 128-token blocks with padded 64 KiB pages; Qwen3-Next's enlarged 528-token block).
def _geo(
    block: int, hash_: int, kinds: tuple[str, ...], page_bytes: int, strides: tuple[int, ...], page: int
) -> Geometry:
    return Geometry(
        block_size=block,
        hash_block_size=hash_,
        group_block_sizes=(block,) * len(kinds),
        group_kinds=kinds,
        group_layers=tuple((k,) for k in kinds),
        block_page_bytes=page_bytes,
        block_bytes_all_layers=sum(strides),
        block_strides=strides,
        num_blocks=1024,
        kv_tensor_bytes=1024 * sum(strides),
        max_model_len=2048,
        page_size_bytes=page,
        page_size_source="derived",
    )


LLAMA = _geo(16, 16, ("FullAttentionSpec",), 8192, (8192, 8192), 65536)
NEMOTRON = _geo(128, 16, ("MambaSpec", "FullAttentionSpec"), 65536, (65536,), 65536)
QWEN3_NEXT = _geo(528, 16, ("MambaSpec", "FullAttentionSpec"), 270336, (270336,), 270336)


def test_llama_lengths_merge_coinciding_labels() -> None:
    got = prompt_lengths(LLAMA, LengthSet.BOUNDARY, 2032)
    assert got == [
        ("1", 1),
        ("hash-1=block-1", 15),
        ("hash=block", 16),
        ("hash+1=block+1", 17),
        ("2*block-1", 31),
        ("page-straddle", 136),
    ]


def test_hybrid_lengths_come_from_the_enlarged_block() -> None:
    got = {label: n for label, n in prompt_lengths(NEMOTRON, LengthSet.BOUNDARY, 2032)}
    assert got == {
        "1": 1,
        "hash-1": 15,
        "hash": 16,
        "hash+1": 17,
        "block-1": 127,
        "block": 128,
        "block+1": 129,
        "2*block-1": 255,
        "page-straddle": 136,
    }
    big = {label: n for label, n in prompt_lengths(QWEN3_NEXT, LengthSet.BOUNDARY, 2032)}
    assert big["block+1"] == 529 and big["2*block-1"] == 1055
    # A derived page holds whole blocks: here exactly one 528-token block.
    assert QWEN3_NEXT.tokens_per_page == 528 and big["page-straddle"] == 536
    # A page smaller than a block puts the page boundary inside the block.
    assert replace(QWEN3_NEXT, page_size_bytes=65536).tokens_per_page == 65536 // (270336 // 528)


def test_derived_page_size_holds_whole_blocks_of_every_backing() -> None:
    assert derive_page_size((8192, 8192)) == 65536  # llama: 8 blocks per page
    assert derive_page_size((19840, 19840)) == 634880  # mamba2 states: lcm with 4 KiB, as kvcached requires
    assert derive_page_size((270336,)) == 270336  # qwen3-next: one enlarged block per page
    for strides in ((8192,), (19840,), (65536, 24576), (12288,)):
        page = derive_page_size(strides)
        assert page >= 64 << 10 and page % 4096 == 0 and all(page % s == 0 for s in strides)


def test_page_straddle_is_past_one_page_and_required() -> None:
    assert LLAMA.tokens_per_page == 128  # 8 blocks of 16 tokens in a 64 KiB page
    n = dict(prompt_lengths(LLAMA, LengthSet.BOUNDARY, 2032))["page-straddle"]
    assert LLAMA.tokens_per_page < n < 2 * LLAMA.tokens_per_page
    with pytest.raises(ValueError, match="page straddle"):
        prompt_lengths(replace(LLAMA, page_size_bytes=1 << 24), LengthSet.BOUNDARY, 2032)
    # Mamba without prefix caching: one 2048-token state block, nothing can straddle.
    mamba = replace(LLAMA, block_size=2048, hash_block_size=2048, block_page_bytes=19840, block_strides=(19840,))
    assert prompt_lengths(mamba, LengthSet.BOUNDARY, 2032) == [("1", 1)]


geometries = st.builds(
    lambda h, k, pages, page: Geometry(
        block_size=h * k,
        hash_block_size=h,
        group_block_sizes=(h * k,),
        group_kinds=("FullAttentionSpec",),
        group_layers=(("l",),),
        block_page_bytes=h * k * 256,
        block_bytes_all_layers=h * k * 512,
        block_strides=(h * k * 256, h * k * 256),
        num_blocks=pages,
        kv_tensor_bytes=pages * h * k * 512,
        max_model_len=2048,
        page_size_bytes=page,
        page_size_source="configured",
    ),
    h=st.sampled_from([1, 2, 4, 8, 16, 32]),
    k=st.integers(1, 8),
    pages=st.integers(64, 512),
    page=st.sampled_from([4096, 16384, 65536]),
)


@settings(max_examples=60, deadline=None)
@given(geo=geometries, extended=st.booleans())
def test_length_invariants(geo: Geometry, extended: bool) -> None:
    cap = 2048 - 16
    try:
        got = prompt_lengths(geo, LengthSet.EXTENDED if extended else LengthSet.BOUNDARY, cap)
    except ValueError:
        assert geo.tokens_per_page + max(1, geo.hash_block_size // 2) > cap > geo.block_size
        return
    lens = [n for _, n in got]
    assert lens == sorted(set(lens)) and all(1 <= n <= cap for n in lens)
    labels = [x for label, _ in got for x in label.split("=")]
    assert len(labels) == len(set(labels))
    must = {"1", "hash", "block", "block+1", "2*block-1", "page-straddle"}
    assert must <= set(labels) | ({"2*block-1"} if 2 * geo.block_size - 1 > cap else set())


@settings(max_examples=40, deadline=None)
@given(geo=geometries, pattern=st.sampled_from(list(PrefixPattern)), seed=st.integers(0, 2**31))
def test_workload_invariants(geo: Geometry, pattern: PrefixPattern, seed: int) -> None:
    cap = 2048 - 16
    if pattern is PrefixPattern.PARTIAL_COW and not partial_boundaries(geo, cap):
        return
    try:
        lens = prompt_lengths(geo, LengthSet.BOUNDARY, cap)
    except ValueError:
        return
    w = build_workload(pattern, lens, geo, cap, seed)
    again = build_workload(pattern, lens, geo, cap, seed)
    assert w == again and _WORKLOAD.validate_json(_WORKLOAD.dump_json(w)) == w
    rids = [p.rid for p in w.prompts]
    assert len(rids) == len(set(rids))
    for p in w.prompts:
        assert 0 < len(p.tokens) <= cap
        assert all(FIRST_FREE_TOKEN <= t < VOCAB_SIZE for t in p.tokens)
    assert len(w.passes) == 2


def test_partial_prefixes_end_inside_blocks_on_hash_boundaries() -> None:
    bounds = partial_boundaries(NEMOTRON, 2032)
    assert bounds == [16, 144, 240]
    w = build_workload(PrefixPattern.PARTIAL_COW, prompt_lengths(NEMOTRON, LengthSet.BOUNDARY, 2032), NEMOTRON, 2032, 7)
    warm = w.passes[0]
    # "cache three prompts first": each warm prompt's final hash boundary is one partial boundary.
    assert len(warm) == 3
    assert [len(p.tokens) // 16 * 16 for p in warm] == bounds
    hits = [p for p in w.passes[1] if p.label.startswith("partial:")]
    root = warm[-1].tokens
    for p in hits:
        b = int(p.label.split(":")[1].split("+")[0])
        assert p.tokens[:b] == root[:b] and b % 16 == 0 and b % 128
    assert partial_boundaries(LLAMA, 2032) == []


def test_warm3_caches_three_then_runs_all() -> None:
    lens = prompt_lengths(LLAMA, LengthSet.BOUNDARY, 2032)
    w = build_workload(PrefixPattern.WARM_THEN_ALL, lens, LLAMA, 2032, 3)
    assert len(w.passes[0]) == 3
    labels = {p.label.split(":", 1)[1] for p in w.passes[1] if p.label.startswith(("root:", "fresh:"))}
    assert labels == {label for label, _ in lens}
    assert w.corrupt_prefix_tokens == 16
