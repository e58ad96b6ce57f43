"""Child script: kvcached's page requests behind slow steps, on a multiprocess CPU engine.

Usage: ``python step_timeout_child.py JOB.json OUT.json``. The engine's EngineCore (the
scheduler and kvcached's pool) runs in this process, its one worker in a process of its own
(vLLM's ``MultiprocExecutor``: ``distributed_executor_backend="mp"``), with async scheduling
(the batch queue), so ``schedule`` for step N+1 runs while step N executes on the worker.
The worker is a slow device (`SlowStepWorker`, vLLM's ``worker_cls``: the one seam of the
delays, test code only): every step with tokens takes `STEP_DELAY_ENV` seconds longer, every
page request `REQUEST_DELAY_ENV` seconds. kvcached's reserve is 0, so every page the
scheduler needs is a blocking request, which queues on the worker behind the step in flight.
The child records how many such requests were sent with steps ahead of them, the timeout
kvcached derived, and the tokens.

Why the requests are slow too: vLLM checks a request's deadline only when it reads the reply,
after the replies of the steps ahead; a reply already there by then is taken however late.
Without the request's own delay a timeout shorter than the step fails only when the engine
reads faster than the worker answers (it did in 2 of 3 runs); with it, every time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

#: Seconds each step with scheduled tokens sleeps on the worker before it runs.
STEP_DELAY_ENV = "STEP_TIMEOUT_TEST_DELAY_S"
#: Seconds each page request sleeps on the worker before it is applied.
REQUEST_DELAY_ENV = "STEP_TIMEOUT_TEST_REQUEST_DELAY_S"


class SlowStepWorker(CPUWorker):
    """vLLM's CPU worker on a slow device, scaled down: each step with tokens takes
    ``$STEP_TIMEOUT_TEST_DELAY_S`` longer (a large prefill), each of kvcached's page
    requests ``$STEP_TIMEOUT_TEST_REQUEST_DELAY_S`` (applied in this worker's process)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        delay_page_requests(float(os.environ[REQUEST_DELAY_ENV]))

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if scheduler_output.total_num_scheduled_tokens > 0:
            time.sleep(float(os.environ[STEP_DELAY_ENV]))
        return super().execute_model(scheduler_output, *args, **kwargs)


def delay_page_requests(delay_s: float) -> None:
    """Make every page request this process's ranks apply (``RankPages.handle``) sleep first."""
    from kvcached.ranks import RankPages

    handle = RankPages.handle

    def slow_handle(self: RankPages, request: Any) -> Any:
        time.sleep(delay_s)
        return handle(self, request)

    RankPages.handle = slow_handle  # type: ignore[method-assign]


def count_requests_behind_steps(executor: Any) -> list[int]:
    """Wrap this executor's ``collective_rpc`` (instance only); the list gets, for each
    blocking page request, the RPCs still unanswered ahead of it (the steps in flight)."""
    from kvcached.integration.vllm.engine import rank_request

    original = executor.collective_rpc
    ahead: list[int] = []

    def collective_rpc(method: Any, *args: Any, **kwargs: Any) -> Any:
        if method is rank_request and not kwargs.get("non_block", False):
            ahead.append(len(executor.futures_queue))  # sent, not yet answered
        return original(method, *args, **kwargs)

    executor.collective_rpc = collective_rpc
    return ahead


def main(job_path: str, out_path: str) -> None:
    from engine_child import build_llm, engine_core, engine_kwargs, kvcached_pool, scheduler_that_ran, shutdown
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    kwargs = engine_kwargs("llama", distributed_executor_backend="mp",
                           worker_cls=f"{Path(__file__).stem}.{SlowStepWorker.__name__}",
                           enable_chunked_prefill=True, max_num_batched_tokens=job["chunk_tokens"])
    llm = build_llm(kwargs, want_async=True)
    core = engine_core(llm)
    ahead = count_requests_behind_steps(core.model_executor)
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)
    out = {
        "tokens": [list(r.outputs[0].token_ids) for r in res],
        "ran": scheduler_that_ran(llm),
        "executor": type(core.model_executor).__name__,
        "timeout_s": kvcached_pool(llm).arena.space.page_space().channel.timeout_s,
        "requests_ahead": ahead,
    }
    shutdown(llm)
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
