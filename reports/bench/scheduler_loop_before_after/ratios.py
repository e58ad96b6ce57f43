"""The tables of README.md from one run.sh folder: per pool size, the median of each side's
pair ratios (kvcached/native step time) over the 4 rounds, its range, and after/before.

    python ratios.py FOLDER   # FOLDER holds old-N.json and new-N.json (bench_scheduler_loop.py's)
"""

import json
import statistics
import sys
from pathlib import Path


def ratios(folder: Path, side: str, round_: int) -> dict[int, list[float]]:
    saved = json.loads((folder / f"{side}-{round_}.json").read_text())
    return {r["config"]["blocks"]: [k / n for n, k in zip(r["native_ms"], r["kvcached_ms"])] for r in saved["results"]}


def main(folder: Path) -> None:
    for blocks in (10_000, 100_000):
        old: list[float] = []
        new: list[float] = []
        per_round = []
        for r in (1, 2, 3, 4):
            o, n = ratios(folder, "old", r)[blocks], ratios(folder, "new", r)[blocks]
            old += o
            new += n
            per_round.append(statistics.median(n) / statistics.median(o))
        mo, mn = statistics.median(old), statistics.median(new)
        print(f"| {blocks:,} | {mo:.3f} ({min(old):.3f}-{max(old):.3f}) | {mn:.3f} ({min(new):.3f}-{max(new):.3f}) "
              f"| {mn / mo:.3f} | {', '.join(f'{x:.3f}' for x in per_round)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
