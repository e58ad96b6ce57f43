"""Per configuration (blocks, concurrency): the median of each side's pair ratios (kvcached/native
step time) over the 4 rounds, its range, after/before, and each round's after/before.

    python ratios.py FOLDER   # FOLDER holds old-N.json and new-N.json (bench_scheduler_loop.py's)
"""

import json
import statistics
import sys
from pathlib import Path


def ratios(folder: Path, side: str, round_: int) -> dict[tuple[int, int], list[float]]:
    saved = json.loads((folder / f"{side}-{round_}.json").read_text())
    return {(r["config"]["blocks"], r["config"]["concurrency"]): [k / n for n, k in zip(r["native_ms"], r["kvcached_ms"])]
            for r in saved["results"]}


def main(folder: Path) -> None:
    print("| blocks | concurrency | before (9e0bef7) | after | after / before | per round |")
    print("|---|---|---|---|---|---|")
    for key in sorted(ratios(folder, "old", 1)):
        old: list[float] = []
        new: list[float] = []
        per_round = []
        for r in (1, 2, 3, 4):
            o, n = ratios(folder, "old", r)[key], ratios(folder, "new", r)[key]
            old += o
            new += n
            per_round.append(statistics.median(n) / statistics.median(o))
        mo, mn = statistics.median(old), statistics.median(new)
        print(f"| {key[0]:,} | {key[1]} | {mo:.3f} ({min(old):.3f}-{max(old):.3f}) | {mn:.3f} ({min(new):.3f}-{max(new):.3f}) "
              f"| {mn / mo:.3f} | {', '.join(f'{x:.3f}' for x in per_round)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
