"""The environment every vLLM engine process of this project runs with.

vLLM on CPU, offline: no telemetry, loopback only for its queues, the engine core in-process
(about 3 s to start instead of 26 s), one OpenMP thread per CPU engine process (`engine_env`),
and Model Runner V1 (`MODEL_RUNNER_ENV`: the harness's
``--model-runner`` can leave the choice to vLLM, or ask for V2). One definition serves the harness, the tests' engine children and the nox sessions.
This module imports nothing, so ``noxfile.py`` can load it without the project installed.
"""

ENGINE_ENV: dict[str, str] = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}

#: CPU engines only: one OpenMP thread per engine process. With a thread per core (torch's default,
#: which vLLM keeps on CPU) each parallel region waits at its barrier for the thread whose core
#: another process holds: 4 requests of 192 tokens, one at a time, on a native `vllm serve` took
#: 89.1 s, and 5.3 s with one thread, beside a CPU hog on one of the 2 cores (12-05). The tiny models
#: gain nothing from more threads. On a GPU the threads stay vLLM's choice, as users run it.
CPU_ENGINE_ENV: dict[str, str] = {"OMP_NUM_THREADS": "1"}


def engine_env(device: str) -> dict[str, str]:
    """`ENGINE_ENV` for engines on ``device`` (``cpu``: with `CPU_ENGINE_ENV`)."""
    return {**ENGINE_ENV, **CPU_ENGINE_ENV} if device == "cpu" else dict(ENGINE_ENV)


#: ``--model-runner`` -> the value of VLLM_USE_V2_MODEL_RUNNER (None: unset, vLLM decides).
MODEL_RUNNER_ENV: dict[str, str | None] = {"v1": "0", "v2": "1", "vllm": None}


def with_model_runner(env: dict[str, str], model_runner: str) -> dict[str, str]:
    """``env`` with vLLM's runner switch set as ``model_runner`` asks (`MODEL_RUNNER_ENV`)."""
    if model_runner not in MODEL_RUNNER_ENV:
        raise ValueError(f"model runner {model_runner!r}: one of {sorted(MODEL_RUNNER_ENV)}")
    value = MODEL_RUNNER_ENV[model_runner]
    out = {k: v for k, v in env.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    if value is not None:
        out["VLLM_USE_V2_MODEL_RUNNER"] = value
    return out


#: kvcached variables that describe the machine's vLLM, not one engine's case: a child keeps them.
HOST_KNOBS: tuple[str, ...] = ("KVCACHED_VLLM_TRIAL",)


def without_kvcached(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` less every kvcached knob (``KVCACHED_*``, upstream's ``ENABLE_KVCACHED``),
    so that a child engine gets only what its case sets; `HOST_KNOBS` stay (a release the
    compat session runs on trial is on trial in every child)."""
    return {k: v for k, v in environ.items()
            if k in HOST_KNOBS or not (k.startswith("KVCACHED_") or k == "ENABLE_KVCACHED")}
