"""Notes shared by the engine processes and the reports: plain strings, no imports, so both
sides of the process boundary (``engine/`` and ``orchestrate/``) can read them."""

from __future__ import annotations

WARMUP_WARNING_EXPLANATION = (
    "vLLM's 'Chat template warmup failed ... skip_tokenizer_init' warning is suppressed in engine "
    "processes: the harness is tokenizer-free by design (token-ID prompts), so that warmup cannot run."
)
