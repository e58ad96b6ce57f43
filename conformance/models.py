"""Tiny random-weight models, generated locally and cached by a hash of their spec.

Nothing is downloaded. A model is a transformers config plus random initialisation,
written with ``save_pretrained``. The cache key covers everything that determines the
weights (config class, model class, config arguments, dtype, weight seed and the
transformers version), so two processes that ask for the same spec always load
byte-identical weights, and a perturbed spec (another weight seed: the negative
control) can never be mistaken for the reference model.

Invariants:
* ``ensure_model(spec)`` returns a directory whose ``conformance-spec.json`` equals
  ``spec.to_json()``; the directory is complete or absent (written to a temporary
  sibling, then renamed), so concurrent or interrupted writers never leave half a model.
* Only this module imports transformers; callers pass plain data.
* Generating a model never runs torch in the caller: ``_generate`` runs in a child
  interpreter. GNU OpenMP is not fork-safe: once its thread pool has run, a fork of the process
  (vLLM's EngineCore, started with ``fork``) hangs in its first parallel op. On the H200 every
  multiprocess engine whose worker had just written its model hung there, in
  ``gpu_input_batch.py``'s first ``torch.zeros`` (``reports/gpu/conformance/run-12-04``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# The vocabulary shared by every tiny model. Prompt token IDs are drawn from
# [FIRST_FREE_TOKEN, VOCAB_SIZE) so no special token (pad 0, bos 1, eos 2) appears.
VOCAB_SIZE = 1024
FIRST_FREE_TOKEN = 3

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    # Large enough that greedy choices are far from ties, so token IDs are a sharp
    # signal: a wrong KV byte changes them instead of hiding in rounding noise.
    "initializer_range": 0.1,
}
_ATTN: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a tiny model's files.

    ``config`` is stored as a sorted tuple of pairs so the spec stays hashable and its
    JSON form (and therefore the cache key) is canonical.
    """

    name: str
    config_class: str
    model_class: str
    config: tuple[tuple[str, Any], ...]
    torch_dtype: str = "float32"
    weight_seed: int = 0
    notes: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config_class": self.config_class,
            "model_class": self.model_class,
            "config": {k: v for k, v in self.config},
            "torch_dtype": self.torch_dtype,
            "weight_seed": self.weight_seed,
            "transformers": _transformers_version(),
        }

    def cache_key(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def with_weight_seed(self, seed: int) -> ModelSpec:
        """The same architecture with other random weights (negative control)."""
        return replace(self, weight_seed=seed)


def _spec(name: str, config_class: str, model_class: str, dtype: str = "float32", **cfg: Any) -> ModelSpec:
    merged = dict(_COMMON)
    merged.update(cfg)
    return ModelSpec(name, config_class, model_class, tuple(sorted(merged.items())), dtype)


_LINEAR_ATTN = {
    "linear_conv_kernel_dim": 4,
    # The CPU GDN kernel only supports head dim 128 (32 fails with "Unexpected head dim size").
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
}

MODEL_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _spec("llama", "LlamaConfig", "LlamaForCausalLM", num_hidden_layers=2, **_ATTN),
        _spec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", num_hidden_layers=2, **_ATTN),
        _spec(
            "mamba2",
            "Mamba2Config",
            "Mamba2ForCausalLM",
            hidden_size=128,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=32,
            state_size=16,
            n_groups=1,
            expand=2,
            time_step_rank=8,
            chunk_size=64,
        ),
        _spec(
            "nemotron_h",
            "NemotronHConfig",
            "NemotronHForCausalLM",
            hidden_size=128,
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=32,
            n_groups=1,
            chunk_size=64,
        ),
        _spec(
            "granitemoehybrid",
            "GraniteMoeHybridConfig",
            "GraniteMoeHybridForCausalLM",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["mamba", "mamba", "mamba", "attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=128,
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_head=32,
            mamba_chunk_size=64,
        ),
        _spec(
            "falcon_h1",
            "FalconH1Config",
            "FalconH1ForCausalLM",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            mamba_d_ssm=256,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_chunk_size=64,
        ),
        _spec(
            "qwen3_next",
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            dtype="bfloat16",
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            **_ATTN,
            **_LINEAR_ATTN,
        ),
        # The spec's serving-probe model: Qwen3.5 text (gated DeltaNet + full attention,
        # dense MLP), FP16. vLLM's Qwen3.5 module imports its vision sibling, which needs
        # torchvision, so it runs where a CUDA vLLM is installed (see Archetype.needs_cuda).
        _spec(
            "qwen3_5",
            "Qwen3_5TextConfig",
            "Qwen3_5ForCausalLM",
            dtype="float16",
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            **_ATTN,
            **_LINEAR_ATTN,
        ),
    )
}


# ---- CUDA geometry -------------------------------------------------------------------------------
#: Attention KV of 4 KiB per token and layer in 16-bit floats: a 2 MiB page every 512 tokens.
_CUDA_ATTN: dict[str, Any] = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128}

#: What the CUDA profile changes in each model (`conformance.device`): 16-bit weights, as users
#: serve them (fp32 models stay bf16; fp16 stays fp16), attention wide enough that a 2 MiB page
#: is reached by a prompt, and, where vLLM would not pad a Mamba page to the attention page, a
#: state whose size shares the page's power of two. Hybrids' Mamba pages are padded to the
#: attention page (``Platform._align_hybrid_block_size``), so only their attention matters.
_CUDA_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": _CUDA_ATTN,
    "qwen3": _CUDA_ATTN,
    # A pure SSM model keeps its unpadded state page: 30 heads x 32 x state 32 in bf16 plus a
    # width-3 conv over 960 + 2 x 32 channels is 65,536 bytes, 32 states to a 2 MiB page
    # (the tiny CPU model's 19,840 bytes share only 2^7 with it: a 310 MiB page).
    # Its SSD chunk is 16 tokens, a divisor of the 16-token block: vLLM's CUDA path writes a
    # state every block // chunk chunks in its default Mamba cache mode ("all"), and with the
    # CPU model's 64-token chunk that stride is 0 ("slice step cannot be zero", 0.26.0 on H200).
    "mamba2": {"hidden_size": 480, "num_heads": 30, "head_dim": 32, "state_size": 32, "conv_kernel": 3,
               "chunk_size": 16},
    # As falcon_h1 below: a Mamba state above 64 KiB (32 heads x 32 x state 32 in bf16, plus the
    # conv) so that align mode's attention block is larger than the 16-token hash unit (with the CPU
    # dims it stayed at 16: "no hash boundary inside a block", 0.26.0 on H200). The 16-token SSD
    # chunk divides every block, as for mamba2.
    "nemotron_h": {**_CUDA_ATTN, "mamba_num_heads": 32, "mamba_head_dim": 32, "ssm_state_size": 32,
                   "chunk_size": 16},
    # head_dim is hidden_size / heads here; the Mamba mixer is 2 x hidden = heads x head.
    "granitemoehybrid": {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
                         "mamba_n_heads": 64},
    # A Mamba state above 64 KiB (32 heads x 32 x state 32 in bf16, plus the conv) makes vLLM
    # enlarge the attention block past the hash unit in either Mamba cache mode, so partial
    # prefixes hit (with the CPU dims it stays at 16 tokens: hash == block).
    "falcon_h1": {**_CUDA_ATTN, "mamba_d_ssm": 1024, "mamba_n_heads": 32, "mamba_d_state": 32},
    "qwen3_next": _CUDA_ATTN,
    "qwen3_5": _CUDA_ATTN,
}


def model_spec(name: str, device: str = "cpu") -> ModelSpec:
    """The tiny model ``name`` as the harness runs it on ``device`` ("cpu" or "cuda")."""
    spec = MODEL_SPECS[name]
    if device == "cpu":
        return spec
    if device != "cuda":
        raise ValueError(f"unknown device {device!r}; known: cpu, cuda")
    config = {**dict(spec.config), **_CUDA_OVERRIDES[name]}
    dtype = "bfloat16" if spec.torch_dtype == "float32" else spec.torch_dtype
    return replace(spec, config=tuple(sorted(config.items())), torch_dtype=dtype)


def models_dir() -> Path:
    """Root of the model cache: ``$KVCACHED_MODELS_DIR`` or ``~/.cache/kvcached-conformance/models``."""
    env = os.environ.get("KVCACHED_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvcached-conformance" / "models"


def model_path(spec: ModelSpec) -> Path:
    return models_dir() / f"{spec.name}-seed{spec.weight_seed}-{spec.cache_key()}"


def ensure_model(spec: ModelSpec) -> Path:
    """Return the directory of ``spec``'s model, generating it on first use."""
    path = model_path(spec)
    marker = path / "conformance-spec.json"
    if marker.is_file():
        stored = json.loads(marker.read_text())
        if stored != spec.to_json():
            raise RuntimeError(f"model cache entry {path} does not match its key; delete it")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _generate_apart(spec, tmp)
        (tmp / "conformance-spec.json").write_text(json.dumps(spec.to_json(), sort_keys=True, indent=1))
        try:
            tmp.rename(path)
        except OSError:
            # Another process finished the same model first; theirs is equivalent.
            if not (path / "conformance-spec.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


class ModelGenerationError(RuntimeError):
    """The child interpreter that generates a model failed; its stderr's tail says why."""


def _generate_apart(spec: ModelSpec, out: Path) -> None:
    """``_generate`` in a child interpreter, so the caller's OpenMP pool never starts (see the
    module's invariants: a process that forks vLLM's EngineCore afterwards must not hang)."""
    code = "import pickle, sys; from conformance.models import _generate; _generate(*pickle.load(sys.stdin.buffer))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((spec, out)), env=env,
                          capture_output=True, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-12:]
        raise ModelGenerationError(f"generating model {spec.name!r} into {out} failed (exit "
                                   f"{proc.returncode}):\n" + "\n".join(tail))


def _generate(spec: ModelSpec, out: Path) -> None:
    import torch
    import transformers

    config = getattr(transformers, spec.config_class)(**dict(spec.config))
    dtype = getattr(torch, spec.torch_dtype)
    # Seed a private generator state only for the duration of the initialisation so
    # generating a model never perturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.weight_seed)
        model = getattr(transformers, spec.model_class)(config)
    model = model.to(dtype)
    model.config.torch_dtype = spec.torch_dtype
    model.save_pretrained(str(out))


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")
