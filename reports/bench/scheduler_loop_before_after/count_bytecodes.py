"""Deterministic per-step cost of bench_scheduler_loop's kvcached side: the bytecodes Python
executes per step (``sys.settrace`` opcode events), by function, at one pool size. No timing,
so a busy machine gives the same figures as a quiet one.

    cd TREE && python .../count_bytecodes.py BLOCKS OUT.json   # TREE: main, or the old worktree

The old tree (e881f39) names its seam plan ``_plan`` and takes no ``planned`` argument.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import sys
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, "benchmarks")
import bench_scheduler_loop as B  # noqa: E402

from kvcached.integration.vllm import scheduler as seams  # noqa: E402
from kvcached.integration.vllm.capabilities import detect  # noqa: E402


def _installer() -> Any:
    caps = detect()
    if hasattr(seams, "plan"):
        planned = seams.plan()
        return lambda: seams.install(caps, enabled=True, planned=planned)
    plan = seams._plan()  # the old tree
    seams._plan = lambda: plan
    return lambda: seams.install(caps, enabled=True)


def main(blocks: int, out: str) -> None:
    install = _installer()

    @contextlib.contextmanager
    def installed() -> Iterator[None]:
        install()
        try:
            yield
        finally:
            seams.uninstall()

    with installed():
        sched = B._scheduler(B.Config("sync", blocks, 256, 65536), kvcached=True)
    warm = B._Side(sched, B._requests(256, 16, 0, "warm"), 0, installed)
    while warm.running:
        warm.step()
    warm.finish()
    counts: collections.Counter[str] = collections.Counter()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        name = frame.f_code.co_filename
        where = name.rsplit("/", 1)[-1] if "/kvcached/" in name or "kvcached seam" in name else \
            ("~vllm" if "/vllm/" in name else "~other")
        key = f"{where}:{frame.f_code.co_name}"

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[key] += 1
            return local
        return local

    side, steps = B._Side(sched, B._requests(256, 16, 1, "run"), 1, installed), 0
    gc.disable()
    while side.running:
        sys.settrace(trace)
        side.step()
        sys.settrace(None)
        steps += 1
    per_step = {k: v / steps for k, v in sorted(counts.items())}
    json.dump({"blocks": blocks, "steps": steps, "per_step": per_step}, open(out, "w"), indent=1)
    print(f"{blocks} blocks, {steps} steps: {sum(per_step.values()):.0f} bytecodes per step, kvcached's "
          f"{sum(v for k, v in per_step.items() if not k.startswith('~')):.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
