"""With the plugin disabled, a real vLLM engine runs exactly as with no plugin at all.

Each run is a fresh subprocess (vLLM loads plugins once per process and patches are
process-wide), with a tiny random Llama (block 16, or the smallest block the vLLM series'
CPU attention accepts: `conformance.vllm_series`) and token-id prompts. The child records every
``KVCacheManager.allocate_slots`` result, so "exactly as native" is checked on block ids,
not only on output tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.engine_env import engine_env
from conformance.vllm_series import attention_block_size

CHILD = textwrap.dedent("""
    import functools, json, sys
    model_dir, out_path, block_size = sys.argv[1], sys.argv[2], int(sys.argv[3])

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    calls = []
    _original = KVCacheManager.allocate_slots

    @functools.wraps(_original)
    def allocate_slots(self, request, *args, **kwargs):
        blocks = _original(self, request, *args, **kwargs)
        ids = None if blocks is None else [list(group) for group in blocks.get_block_ids()]
        calls.append([request.request_id, ids])
        return blocks

    KVCacheManager.allocate_slots = allocate_slots

    from vllm import LLM, SamplingParams
    from vllm.v1.core import block_pool, kv_cache_coordinator

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=block_size, enable_prefix_caching=True, max_model_len=512, seed=0,
              kv_cache_memory_bytes=64 << 20)
    base = [(7 * i) % 1000 + 1 for i in range(80)]
    prompts = [base[:70], base[:40] + [5] * 30, base[:64] + [9] * 3, [3] * 20, base[:70]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    reset = llm.reset_prefix_cache()  # sleep mode / RLHF weight updates call this
    import kvcached
    import kvcached.integration.vllm.plugin as plugin

    stats = {k: [v.mapped_bytes, v.live_blocks, v.capacity_blocks] for k, v in kvcached.stats().items()}

    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    fence = getattr(pool, "fence", None)
    import threading
    refill_threads = lambda: sum(t.name.startswith("kvcached-refill") for t in threading.enumerate())
    during = refill_threads()
    deferred = pool.page_pool.space.deferred if fence is not None else 0
    pool_stats = {k: [v.page_takes, v.reserve_hits, v.blocking_maps] for k, v in kvcached.stats().items()}
    llm.llm_engine.engine_core.shutdown()
    json.dump({
        "running_block_sizes": list(getattr(pool, "running_block_sizes", ())),
        "step_pages": pool.page_pool.policies.reserve.step_pages if fence is not None else None,
        "step_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "blocks_per_page": None if fence is None else pool.ledger.blocks_per_page,
        "num_kv_pages": None if fence is None else pool.page_pool.space.num_kv_pages,
        "refill_threads": [during, refill_threads()],
        "deferred_refills": deferred,
        "takes": pool_stats,
        "pool_type": type(pool).__name__,
        "steps": None if fence is None else [fence.scheduled, fence.executed],
        "kv_bytes": None if fence is None else pool.page_pool.space.kv_page_bytes * pool.page_pool.space.num_kv_pages,
        "stats": stats,
        "calls": calls,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "reset": reset,
        "plugin_installed": plugin.is_installed(),
        "native_pool_name": kv_cache_coordinator.BlockPool is block_pool.BlockPool,
        "allocate_slots_is_test_wrapper": KVCacheManager.allocate_slots is allocate_slots,
    }, open(out_path, "w"))
""")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=1024, max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def run_engine(model: Path, out: Path, child: str | None = None, **env: str) -> dict:
    """Run ``child`` (default `CHILD`) in a fresh interpreter with ``env`` over the engine
    environment, none of this process's kvcached or plugin settings leaking in; its JSON."""
    child_env = {k: v for k, v in os.environ.items()
                 if not k.startswith("KVCACHED_") and k not in ("ENABLE_KVCACHED", "VLLM_PLUGINS")}
    child_env.update(engine_env("cpu"))
    child_env.update(env)
    block_size = attention_block_size(16)
    proc = subprocess.run([sys.executable, "-c", child or CHILD, str(model), str(out), str(block_size)], env=child_env,
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def normalized(calls: list) -> list:
    """Request ids carry per-process parts; number them by first appearance."""
    order: dict[str, int] = {}
    return [[order.setdefault(rid, len(order)), ids] for rid, ids in calls]


def test_disabled_plugin_is_exactly_native(tiny_llama: Path, tmp_path: Path) -> None:
    no_plugin = run_engine(tiny_llama, tmp_path / "none.json", VLLM_PLUGINS="")  # no plugin loaded at all
    disabled = run_engine(tiny_llama, tmp_path / "disabled.json", KVCACHED_ENABLE="0")
    for run in (no_plugin, disabled):
        assert run["plugin_installed"] is False
        assert run["native_pool_name"] is True
        assert run["allocate_slots_is_test_wrapper"] is True
    assert disabled["calls"], "the recorder saw no allocation"
    assert normalized(disabled["calls"]) == normalized(no_plugin["calls"])
    assert disabled["tokens"] == no_plugin["tokens"]
    assert disabled["pool_type"] == no_plugin["pool_type"] == "BlockPool"
    assert disabled["reset"] is no_plugin["reset"] is True
    assert disabled["refill_threads"] == no_plugin["refill_threads"] == [0, 0]


def shape(calls: list) -> list:
    return [[rid, None if ids is None else [len(group) for group in ids]] for rid, ids in normalized(calls)]


def test_enabled_plugin_serves_the_same_tokens_with_native_scheduling(tiny_llama: Path, tmp_path: Path) -> None:
    """Elastic pool in a real engine: same outputs, same admissions and block counts as native.

    Block ids may differ by design (page-aware choice); hits, misses and allocation sizes
    may not. Every scheduled step was matched by an executed one (the fence is paired).
    """
    native = run_engine(tiny_llama, tmp_path / "native.json", VLLM_PLUGINS="")
    elastic = run_engine(tiny_llama, tmp_path / "elastic.json", KVCACHED_ENABLE="1",
                         KVCACHED_PAGE_SIZE=str(64 << 10))
    assert elastic["plugin_installed"] is True and elastic["pool_type"] == "ElasticBlockPool"
    assert elastic["native_pool_name"] is False
    assert elastic["tokens"] == native["tokens"]
    assert shape(elastic["calls"]) == shape(native["calls"])
    assert elastic["reset"] is native["reset"] is True
    scheduled, executed = elastic["steps"]
    assert scheduled == executed > 0
    ((mapped, _live, _capacity),) = elastic["stats"].values()
    assert 0 < mapped <= elastic["kv_bytes"] // 16, "only a small fraction of the KV cache is ever mapped"
    # In-process executor on CPU (KVCACHED_BACKGROUND_REFILL=auto): refills sent ahead run
    # inline, so no thread, and each is counted as a map on the scheduler's path.
    assert elastic["deferred_refills"] > 0 and elastic["refill_threads"] == [0, 0]
    # One full-attention group: the running-request fast path is set up with its block size.
    assert elastic["running_block_sizes"] == [attention_block_size(16)]
    # ... and the busy reserve's ceiling with vLLM's token budget per step, in kv pages: the
    # group's blocks for that many tokens and a boundary block, and a page for straddling.
    blocks = math.ceil(elastic["step_tokens"] / attention_block_size(16)) + 1
    expected = min(math.ceil(blocks / elastic["blocks_per_page"]) + 1, elastic["num_kv_pages"])
    assert elastic["step_pages"] == expected > 0
    ((takes, hits, blocking),) = elastic["takes"].values()
    assert takes > 0 and 0 <= hits <= takes and blocking >= elastic["deferred_refills"]


def test_background_refills_run_on_one_thread_that_shutdown_stops(tiny_llama: Path, tmp_path: Path) -> None:
    """KVCACHED_BACKGROUND_REFILL=on (auto's choice on CUDA): refills sent ahead run on the
    channel's one thread, tokens stay native, and the engine's shutdown stops the thread."""
    native = run_engine(tiny_llama, tmp_path / "native.json", VLLM_PLUGINS="")
    elastic = run_engine(tiny_llama, tmp_path / "elastic.json", KVCACHED_ENABLE="1",
                         KVCACHED_PAGE_SIZE=str(64 << 10), KVCACHED_BACKGROUND_REFILL="on")
    assert elastic["tokens"] == native["tokens"]
    assert elastic["deferred_refills"] > 0
    assert elastic["refill_threads"] == [1, 0]
    ((takes, hits, _blocking),) = elastic["takes"].values()
    assert takes > 0 and 0 <= hits <= takes  # how many hit is timing: not checked


HOLD_CHILD = textwrap.dedent("""
    import json, os, sys
    model_dir, out_path, block_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from vllm import LLM, SamplingParams
    import kvcached

    prompts = [[(11 * i + j) % 900 + 1 for j in range(96 + 80 * (i % 4))] for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=2 + 6 * (i % 3), ignore_eos=True, detokenize=False)
              for i in range(10)]
    runs = {}
    for hold in ("0", "64"):
        os.environ["KVCACHED_HOLD_STEPS"] = hold
        llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  block_size=block_size, enable_prefix_caching=False, max_model_len=512, seed=0,
                  kv_cache_memory_bytes=32 << 20, max_num_seqs=2)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        (stats,) = kvcached.stats().values()
        runs[hold] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "maps": stats.maps,
                      "unmaps": stats.unmaps, "idle_mapped_pages": stats.mapped_bytes // stats.kv_page_bytes,
                      "peak_mapped_pages": stats.peak_mapped_bytes // stats.kv_page_bytes}
        llm.llm_engine.engine_core.shutdown()
        del llm
    json.dump(runs, open(out_path, "w"))
""")



def test_a_busy_engine_holds_pages_it_wants_again_and_gives_them_back_when_idle(tiny_llama: Path,
                                                                                tmp_path: Path) -> None:
    """Holding pages while busy (``KVCACHED_HOLD_STEPS``), through the scheduler seam that says
    whether the engine is busy. Requests end and start while others run (two at a time,
    different lengths, prefix caching off: a busy engine keeps its cached blocks, and this
    test wants none), so pages empty while the engine is busy and are
    wanted again a few steps later. The same workload runs twice in one child, holding nothing
    (the default) and then holding for 64 steps: the same tokens, fewer pages mapped when
    held, and once idle both gave back every page but the reserve's and the null block's."""
    runs = run_engine(tiny_llama, tmp_path / "runs.json", HOLD_CHILD, KVCACHED_ENABLE="1",
                      KVCACHED_PAGE_SIZE=str(64 << 10), KVCACHED_MAX_RESERVE_PAGES="1",
                      KVCACHED_BUDGET_PATH="off")
    plain, held = runs.values()
    assert held["tokens"] == plain["tokens"]
    assert plain["unmaps"] > 0, "the workload must empty pages while busy, or it tests nothing"
    assert held["maps"] < plain["maps"], ({k: v for k, v in plain.items() if k != "tokens"},
                                          {k: v for k, v in held.items() if k != "tokens"})
    for run in (plain, held):  # idle: the null block's page and at most the one reserve page
        assert run["idle_mapped_pages"] <= 2, run
