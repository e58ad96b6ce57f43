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


def test_kvcached_env_reaches_the_shared_engines_after_the_scenarios_own_knobs(tmp_path) -> None:
    """``--kvcached-env``: more settings for the kvcached side, after the scenario's own, which it
    may not set (its checks depend on them); a bad item is refused before any engine starts."""
    from conformance.kvcached_env import KvcachedEnvError, parse_kvcached_env
    from conformance.sharing.report import main
    from conformance.sharing.run import SCENARIO_KNOBS

    extra = parse_kvcached_env(["KVCACHED_IDLE_GRACE_MS=250"], SCENARIO_KNOBS)
    env = SharingPlan(kvcached_env=extra).engine_env("A-llama", tmp_path / "rec")
    assert [k for k, _ in env] == [*SCENARIO_KNOBS, "KVCACHED_IDLE_GRACE_MS"] and env[-1][1] == "250"
    assert SharingPlan().engine_env("A-llama", tmp_path / "rec") == env[:-1]
    with pytest.raises(KvcachedEnvError, match="KVCACHED_MAX_CACHED_BLOCKS set by the run itself"):
        parse_kvcached_env(["KVCACHED_MAX_CACHED_BLOCKS=-1"], SCENARIO_KNOBS)
    for bad in ("KVCACHED_PAGE_SIZE=4096", "KVCACHED_IDLE_GRACE_MS=-1", "GRACE=1"):
        with pytest.raises(SystemExit):  # argparse's error: nothing started, no --out written
            main(["--kvcached-env", bad, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
