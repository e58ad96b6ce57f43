"""Where a run's engines compute, and the few harness settings that follow from it.

The comparison rules never depend on the device; what does is the geometry a case needs to
mean the same thing everywhere. kvcached maps whole pages of the device's VMM granularity:
4 KiB on the CPU (memfd), 2 MiB on NVIDIA GPUs (``cuMemCreate``). The boundary lengths of a
case include one whose KV straddles a page, so a 2 MiB page must be reachable by a prompt:
the CUDA profile gives its models wider attention KV (8 KV heads x head_dim 128 in bf16: 4 KiB
per token and layer, a 2 MiB page every 512 tokens; `conformance.models.model_spec`) and
engines a longer ``max_model_len``.

Exactness needs a native engine that is repeatable. On CUDA the default attention backend
of vLLM 0.26 on Hopper, FlashAttention 3, gave a native engine different tokens in its second
pass than in its first once prefix hits came in (``cuda-vllm-h200.md``); Triton attention gave
the same tokens on both passes. So the CUDA profile runs Triton attention unless a case names
another backend (its native noise floor is then measured by that case's baseline control).

Invariants:
* A profile never changes what a comparison checks, only the settings both sides share.
* The CPU profile is exactly the harness's long-standing behaviour (no attention backend
  named, 2048-token engines, 64 MiB of KV, pages of at least 64 KiB in 4 KiB units).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Device(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class DeviceProfile:
    device: Device
    #: ``max_model_len`` of every engine (the tiny models' positions allow 4096).
    max_model_len: int
    #: ``kv_cache_memory_bytes`` of every engine unless the run names one.
    kv_cache_bytes: int
    #: kvcached's smallest page on this device; a derived page is a multiple of it.
    page_unit: int
    #: A derived page is the smallest multiple of every block stride and the unit >= this.
    page_target: int
    #: The attention backend of a case that names none (None: vLLM decides).
    attention_backend: str | None
    #: Further engine arguments of every engine on this device.
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    #: Further engine arguments of one archetype's engines on this device (both sides).
    archetype_kwargs: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    #: Seconds a child is allowed per case (scaled for slow, multiprocess and compiled groups) unless
    #: the run says ``--case-timeout``.
    case_timeout_s: float = 150.0

    def kwargs_of(self, archetype: str) -> dict[str, Any]:
        return {**dict(self.engine_kwargs), **dict(dict(self.archetype_kwargs).get(archetype, ()))}


PROFILES: dict[Device, DeviceProfile] = {
    Device.CPU: DeviceProfile(Device.CPU, max_model_len=2048, kv_cache_bytes=64 << 20, page_unit=4096,
                              page_target=64 << 10, attention_backend=None),
    # 1 GiB of KV holds every workload of the matrix at 8 KiB a token (two attention layers),
    # so neither side preempts unless its case asks for it (the tiny-budget plan).
    Device.CUDA: DeviceProfile(Device.CUDA, max_model_len=4096, kv_cache_bytes=1 << 30, page_unit=2 << 20,
                               page_target=2 << 20, attention_backend="TRITON_ATTN",
                               # vLLM refuses to start unless this share of the device is free;
                               # the KV size is kv_cache_bytes whatever it is, and a run's
                               # engines (`--jobs`) start side by side.
                               engine_kwargs=(("gpu_memory_utilization", 0.2),),
                               # Gated DeltaNet prefill: vLLM 0.26 picks FlashInfer's kernel on
                               # Hopper, which the offline bundle does not carry (its JIT needs the
                               # network): "No module named 'flashinfer'" (H200, 12-04). Triton is
                               # vLLM's own kernel, the one it uses off Hopper.
                               archetype_kwargs=tuple((name, (("gdn_prefill_backend", "triton"),))
                                                      for name in ("qwen3_next", "qwen3_5")),
                               # A case takes 5-140 s on the H200; with the CPU's 150 s, a group whose
                               # engine hung at start-up held its run for 1300 s and more (12-04).
                               case_timeout_s=60.0),
}


def profile(device: Device | str) -> DeviceProfile:
    return PROFILES[Device(device)]


def detect() -> Device:
    """CUDA when torch sees a CUDA device, else the CPU (the parent imports no vLLM)."""
    import torch

    return Device.CUDA if torch.cuda.is_available() else Device.CPU
