"""Harness-only overrides installed in engine processes before any engine is built.

1. Async scheduling on CPU. vLLM 0.28's ``CpuPlatform.check_and_update_config`` sets
   ``scheduler_config.async_scheduling = False`` unconditionally ("not required on CPU"),
   so without help an "async" case silently runs the synchronous scheduler. The override
   re-asserts ``True`` after the platform hook, but only while ``force_async(True)`` is in
   effect, i.e. only for cases that ask for async. Whether it worked is then read back from
   the running engine (``EngineHandle.scheduler_that_ran``), never assumed.

2. The "Chat template warmup failed" warning. ``LLM.__init__`` warms up chat-template
   rendering, which needs a tokenizer; the harness runs tokenizer-free
   (``skip_tokenizer_init=True``, token-ID prompts), so the warmup fails by design and vLLM
   logs a warning with a traceback. A logging filter drops exactly that record (logger
   ``vllm.renderers.base``, that message, a ValueError mentioning skip_tokenizer_init);
   any other warmup failure still gets through.
"""

from __future__ import annotations

import logging
from typing import Any

from conformance.notes import WARMUP_WARNING_EXPLANATION  # noqa: F401  (re-exported)

_state = {"force_async": False, "installed": False}


def force_async(enabled: bool) -> None:
    """Ask the next engine built in this process to keep ``async_scheduling=True``."""
    _state["force_async"] = enabled


def install_async_override() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` once per process (idempotent)."""
    if _state["installed"]:
        return
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]
    if not isinstance(original, classmethod):
        raise TypeError("CpuPlatform.check_and_update_config is no longer a classmethod; update the override")
    func = original.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        func(cls, vllm_config)
        if _state["force_async"]:
            vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    _state["installed"] = True


class _ChatWarmupFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Chat template warmup failed":
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, ValueError) and "skip_tokenizer_init" in str(exc))


def suppress_tokenizer_free_warmup_warning() -> None:
    logging.getLogger("vllm.renderers.base").addFilter(_ChatWarmupFilter())
