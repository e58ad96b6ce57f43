"""The sharing scenario's plans without engines: the CPU plan and the GPU-sized one obey the same
sizing rule (a burst is most of the budget; B's long double burst needs A's memory), and a GPU
plan's servers are what users run there."""

from __future__ import annotations

import math

import pytest

from conformance.models import model_spec
from conformance.serving.server import ServerSpec
from conformance.sharing.run import ENGINES, LONG, MiB, SharingPlan

BLOCK = 16  # tokens per block, `start_server`'s --block-size


def _block_bytes(arch: str, device: str) -> int:
    spec = model_spec(arch, device)
    c = dict(spec.config)
    width = {"float32": 4, "bfloat16": 2}[spec.torch_dtype]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * width * BLOCK


def _burst_bytes(plan: SharingPlan, arch: str, n: int, max_tokens: int) -> int:
    per_request = math.ceil((sum(plan.prompt_tokens) / 2 + max_tokens) / BLOCK)
    return n * per_request * _block_bytes(arch, plan.device)


@pytest.mark.parametrize("plan", [SharingPlan(), SharingPlan.cuda(), SharingPlan.cuda(quick=True)],
                         ids=["cpu", "cuda", "cuda-quick"])
def test_every_plan_sizes_its_bursts_by_the_same_rule(plan: SharingPlan) -> None:
    for _, arch in ENGINES:
        burst = _burst_bytes(plan, arch, plan.burst, plan.max_tokens)
        assert 0.5 * plan.budget_bytes < burst < 0.75 * plan.budget_bytes, (arch, burst / MiB)
        # B's long double burst needs more than the budget less A's burst: A must give memory back.
        assert _burst_bytes(plan, arch, 2 * plan.burst, LONG * plan.max_tokens) > plan.budget_bytes - burst
    assert plan.prompt_tokens[1] + LONG * plan.max_tokens <= plan.max_model_len
    assert plan.budget_bytes % plan.page_size == 0


def test_a_gpu_plan_serves_as_users_do_and_the_cpu_plan_is_unchanged() -> None:
    cuda = SharingPlan.cuda()
    spec = cuda.server("kvcached-A", "llama", True)
    assert (spec.dtype, spec.eager, spec.extra_args) == ("bfloat16", False, ("--gpu-memory-utilization", "0.1"))
    assert cuda.page_size % (2 * MiB) == 0 and cuda.device == "cuda"
    assert SharingPlan().server("native-A", "llama", False) == ServerSpec("native-A", False)
    assert SharingPlan().max_model_len == 1024
