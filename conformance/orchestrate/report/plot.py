"""The memory plot: physical KV memory per scheduler step, reference vs candidate (``memory.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = float(1 << 20)


def memory_plot(
    path: Path, series: dict[str, list[tuple[str, list[int]]]], title: str, labels: dict[str, str] | None = None
) -> None:
    """``series[side] = [(case_id, mapped bytes per step), ...]`` in run order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    case_ids = [cid for cid, _ in next(iter(series.values()))] if series else []
    widths = {cid: max(len(dict(v).get(cid, [])) for v in series.values()) for cid in case_ids}
    fig, ax = plt.subplots(figsize=(12, 4.5))
    offsets: dict[str, int] = {}
    x0 = 0
    for cid in case_ids:
        offsets[cid] = x0
        x0 += max(1, widths[cid]) + 2
    styles: dict[str, dict[str, Any]] = {
        # The reference is drawn wide and pale underneath so an identical candidate stays visible.
        "reference": {"color": "tab:blue", "lw": 4.0, "alpha": 0.35},
        "candidate": {"color": "tab:red", "lw": 1.2},
    }
    for side, per_case in series.items():
        first = True
        for cid, ys in per_case:
            if not ys:
                continue
            xs = [offsets[cid] + i for i in range(len(ys))]
            label = (labels or {}).get(side, side) if first else None
            ax.step(xs, [y / MiB for y in ys], where="post", label=label, **styles.get(side, {}))
            first = False
    for cid in case_ids:
        ax.axvline(offsets[cid] - 1, color="0.85", lw=0.6)
    ax.set_xlabel("scheduler step (cases in run order, separated by grey lines)")
    ax.set_ylabel("physical KV memory [MiB]")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[1]:  # every case failed before a step: nothing drawn, no legend
        ax.legend(loc="center right")  # native sits at the top, kvcached near the floor
    else:
        ax.text(0.5, 0.5, "no case ran a step", transform=ax.transAxes, ha="center", color="0.4")
        ax.set_xticks([])
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
