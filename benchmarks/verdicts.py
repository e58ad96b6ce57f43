"""The benchmarks' one verdict rule (issue #12), for a metric judged by kvcached/native ratios
measured in alternating rounds:

* "met" when the median ratio meets the target;
* "inconclusive" when the per-round ratios fall on both sides of it;
* "missed" otherwise.

Imported by the ``bench_*.py`` scripts, which run with this folder on ``sys.path``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def verdict(ratios: Sequence[float], target: float, *, higher_is_better: bool = False) -> str:
    """Judge ``ratios`` against ``target`` (an upper bound, or a lower one if ``higher_is_better``)."""
    sign = -1.0 if higher_is_better else 1.0  # turn every target into "value <= target"
    vals, t = [sign * r for r in ratios], sign * target
    if min(vals) <= t < max(vals):
        return "inconclusive"
    return "met" if statistics.median(vals) <= t else "missed"
