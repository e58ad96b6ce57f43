"""The project's one verdict rule (issue #12), for a metric judged by kvcached/native ratios
measured in alternating rounds:

* "met" when the median ratio meets the target;
* "inconclusive" when the per-round ratios fall on both sides of it;
* "missed" otherwise.

Used by the GPU probes (`serving_probes.bandwidth`) and the ``benchmarks/bench_*.py``
scripts, through ``conformance.reporting``. It imports nothing beyond the standard library
and never vLLM, so both the CPU benchmark environment and a GPU machine can import it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

#: The rule in one sentence, for the reports that print it.
RULE = ("Verdict rule: met when the median ratio meets the target, inconclusive when the per-round "
        "ratios fall on both sides of it, missed otherwise.")


def verdict(ratios: Sequence[float], target: float, *, higher_is_better: bool = False) -> str:
    """Judge ``ratios`` against ``target`` (an upper bound, or a lower one if ``higher_is_better``)."""
    sign = -1.0 if higher_is_better else 1.0  # turn every target into "value <= target"
    vals, t = [sign * r for r in ratios], sign * target
    if min(vals) <= t < max(vals):
        return "inconclusive"
    return "met" if statistics.median(vals) <= t else "missed"
