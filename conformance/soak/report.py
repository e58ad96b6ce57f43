"""Run the churn soak and write its report: ``python -m conformance.soak``.

Writes ``result.json`` (the run's data and its environment block), ``report.md``,
``report.html`` and ``report.csv`` (with ``sections/``) through the shared report model
(``conformance.reporting``), and ``soak.png`` (RSS, mapped KV bytes and descriptors over
time) to ``--out`` (default ``reports/soak``). Exit status 1 when a check fails.
``--candidate native`` runs the native control (default ``--out reports/soak/native-control``);
its report sets its token differences beside those of the kvcached soak in ``reports/soak``.
``--render`` writes the report and the figure again from the ``result.json`` in ``--out``,
running nothing; notes written by hand in ``notes.md`` there are kept as the Notes section.

The report is always rendered from the saved ``result.json`` (``SoakRecord``), so a report
written after a run and one rendered again later say the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from conformance.reporting import (
    Image,
    Paragraph,
    Provenance,
    Report,
    Section,
    Table,
    checks_table,
    column,
    columns_of,
    notes_section,
    provenance,
    table,
    write_report,
)
from conformance.serving import exit_on_sigterm
from conformance.serving.retrial import TIE
from conformance.soak.run import CANDIDATES, Difference, Sample, SoakPlan, run, to_json

MiB = 1 << 20
KVCACHED_OUT = Path("reports/soak")
FIGURE = "soak.png"
PROG = "python -m conformance.soak"


@dataclass(frozen=True)
class SoakRecord:
    """What ``result.json`` holds, typed: everything the report and the figure read. The
    checks are the run's own verdicts, as judged when it ran."""

    plan: SoakPlan
    samples: list[Sample]
    baseline: Sample
    end: Sample
    warmup_end_s: float
    traffic_end_s: float
    sent: int
    aborted: int
    completed: int
    preemptions: int
    differences: list[Difference]
    planted: Difference | None
    checks: dict[str, bool]
    environment: Provenance

    @property
    def native(self) -> bool:
        return self.plan.candidate == "native"

    @property
    def unexplained(self) -> list[Difference]:
        return [d for d in self.differences if not d.explained]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SoakRecord:
        """A saved record; one saved before a field existed reads it as absent (a control from
        before the retrial has no planted difference; one without an environment block says so)."""
        plan = {f.name: data["plan"][f.name] for f in fields(SoakPlan) if f.name in data["plan"]}
        return cls(
            plan=SoakPlan(**plan), samples=[Sample(**s) for s in data["samples"]],
            baseline=Sample(**data["baseline"]), end=Sample(**data["end"]),
            warmup_end_s=data["warmup_end_s"], traffic_end_s=data["traffic_end_s"], sent=data["sent"],
            aborted=data["aborted"], completed=data["completed"], preemptions=data["preemptions"],
            differences=[Difference(**d) for d in data.get("differences", [])],
            planted=Difference(**data["planted"]) if data.get("planted") else None,
            checks=dict(data["checks"]), environment=Provenance.from_dict(data.get("environment", {})),
        )  # fmt: skip


def plot(record: SoakRecord, path: Path) -> None:
    """RSS, kvcached's mapped bytes (a kvcached soak only) and descriptors over time, the
    baseline and end marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in record.samples]
    panels = [("RSS, server processes (MiB)", [s.rss / MiB for s in record.samples]),
              ("open descriptors", [s.fds for s in record.samples])]
    if not record.native:
        panels.insert(1, ("kvcached mapped KV (MiB)", [s.mapped / MiB for s in record.samples]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels)), sharex=True)
    for ax, (label, ys) in zip(axes, panels, strict=True):
        ax.plot(t, ys, lw=1.2)
        ax.set_ylabel(label, fontsize=8)
        for x in (record.warmup_end_s, record.traffic_end_s):  # the baseline and the end (both idle)
            ax.axvline(x, color="grey", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"churn soak ({'native control' if record.native else 'kvcached'}): {record.sent} requests "
                      f"({record.aborted} aborted by their clients), {record.preemptions} preemptions", fontsize=9)
    if not record.native:
        axes[-1].plot(t, [s.memfds for s in record.samples], lw=1.0, label="kvcached memfds")
        axes[-1].legend(fontsize=7)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rate(differ: int, completed: int) -> str:
    return f"{differ} of {completed:,} ({differ / completed:.3%})" if completed else "none completed"


@dataclass(frozen=True)
class SideRow:
    """One soaked server of the control's comparison."""

    side: str = field(metadata=column("soaked server, replayed against native"))
    completed: str
    differ: str
    explained: int
    plan: str


def _side(side: str, record: SoakRecord) -> SideRow:
    p = record.plan
    return SideRow(side, f"{record.completed:,}", _rate(len(record.differences), record.completed),
                   len(record.differences) - len(record.unexplained),
                   f"{p.duration_s:.0f} s, {p.clients} clients, seed {p.seed}")


def control_section(record: SoakRecord, kvcached: Path) -> Section:
    """The native control's token differences beside the kvcached soak's (its result.json)."""
    title = "Beside the kvcached soak"
    if not kvcached.is_file():
        return Section(title, (Paragraph(f"No kvcached soak result at `{kvcached}` to set beside this control."),))
    other = SoakRecord.from_json(json.loads(kvcached.read_text()))
    rows = [_side(f"kvcached (`{kvcached}`)", other), _side("native (this control)", record)]
    return Section(title, (table(rows), Paragraph(
        "Both sides are the same traffic. A difference native also gives is how native's own CPU kernels "
        "round when concurrency changes batch shapes; a native server replayed against native shows "
        "the rate native alone gives.")))


@dataclass(frozen=True)
class DifferenceRow:
    """A token difference (or the planted one) and what the retrial on native found."""

    kind: str = field(metadata=column(""))
    request: int
    first_differing_token: str
    soaked_native_token: str = field(metadata=column("soaked / native token"))
    native_margin: str
    near_tie: str = field(metadata=column(f"near-tie (< {TIE})"))
    native_chose_the_soaked_token: str
    explained: str


def _difference_row(kind: str, d: Difference) -> DifferenceRow:
    if d.first < 0:
        return DifferenceRow(kind, d.request, "another length", "", "", "", "not retried", "no")
    near = "yes" if 0 <= d.margin < TIE else "no"
    return DifferenceRow(kind, d.request, str(d.first), f"{d.soaked_token} / {d.native_token}", f"{d.margin:.2g}",
                         near, f"{d.reproduced} of {d.retrials}", "yes" if d.explained else "NO")


def tokens_section(record: SoakRecord) -> Section:
    """Every difference and the planted one, with what the retrial on native found."""
    text = (f"The {record.completed:,} completed requests against a native server: {len(record.differences)} "
            f"differ, {len(record.unexplained)} of them unexplained.")
    if record.planted is not None:
        text += (f" Each difference is retried on native {record.planted.retrials} times beside other soak "
                 "traffic (a different batch mix each time); it is explained when native itself chooses the "
                 "soaked token. The planted difference (one native token replaced where native's margin is "
                 "ordinary) is retried the same way and must stay unexplained.")
    rows = [_difference_row("difference", d) for d in record.differences]
    if record.planted is not None:
        rows.append(_difference_row("planted (control)", record.planted))
    return Section("Tokens", (Paragraph(text), table(rows, columns_of(DifferenceRow), "No token difference.")))


def memory_table(record: SoakRecord) -> Table:
    """The idle baseline against the idle end."""
    b, e = record.baseline, record.end
    rows = [("RSS (MiB)", f"{b.rss / MiB:,.1f}", f"{e.rss / MiB:,.1f}")]
    if b.worker_rss or e.worker_rss:  # 0: not told apart (a run saved before the soak read it)
        rows.append(("of which vLLM's workers (MiB)", f"{b.worker_rss / MiB:,.1f}", f"{e.worker_rss / MiB:,.1f}"))
    if not record.native:
        rows.append(("kvcached mapped (MiB)", f"{b.mapped / MiB:,.1f}", f"{e.mapped / MiB:,.1f}"))
    rows.append(("open descriptors", f"{b.fds:,}", f"{e.fds:,}"))
    if not record.native:
        rows.append(("kvcached memfds", f"{b.memfds:,}", f"{e.memfds:,}"))
    return table(({"": name, "baseline": x, "end": y} for name, x, y in rows))


def build(record: SoakRecord, kvcached: Path, notes: Path) -> Report:
    """The soak's report as data: the run, memory, tokens, (the control's comparison), checks, figure."""
    p = record.plan
    server = "native `vllm serve`" if record.native else "`vllm serve` with kvcached"
    pages = "" if record.native else f", {p.page_size >> 10} KiB pages"
    run_text = (f"{server} (tiny llama, {p.kv_bytes / MiB:.1f} MiB of KV{pages}) for {p.duration_s:.0f} s: "
                f"{p.clients} loopback clients, {record.sent} requests, {record.aborted} aborted by their clients, "
                f"{record.completed} completed, {record.preemptions} preemptions. Baseline: the idle engine after "
                "the warm-up (a fifth of the time), prefix cache reset; end: the same after the traffic.")
    body = [Section("Run", (Paragraph(run_text),)),
            Section("Memory and descriptors, idle baseline against idle end", (memory_table(record),)),
            tokens_section(record)]
    if record.native:
        body.append(control_section(record, kvcached))
    body += [Section("Checks", (checks_table(record.checks),)),
             Section("Over time", (Image(FIGURE, "RSS, mapped KV and descriptors over time"),))]
    if (notes_block := notes_section(notes)) is not None:
        body.append(notes_block)
    headline = (f"{p.duration_s:.0f} s, {p.clients} clients: {record.sent} requests, {record.preemptions} "
                f"preemptions; **{_rate(len(record.differences), record.completed)}** completed requests differ "
                f"from native, {len(record.unexplained)} unexplained.")
    return Report(subject="Churn soak, native control" if record.native else "Churn soak",
                  verdict="PASS" if all(record.checks.values()) else "FAIL", headline=headline,
                  environment=record.environment, body=tuple(body),
                  overview={"sent": record.sent, "completed": record.completed,
                            "differ": len(record.differences), "unexplained": len(record.unexplained)})


def render(out: Path, kvcached: Path = KVCACHED_OUT / "result.json") -> Path:
    """``report.*`` and the figure in ``out`` from its ``result.json``; returns ``report.md``."""
    record = SoakRecord.from_json(json.loads((out / "result.json").read_text()))
    plot(record, out / FIGURE)
    return write_report(build(record, kvcached, out / "notes.md"), out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--candidate", choices=CANDIDATES, default="kvcached",
                    help="the soaked server; 'native' is the control (default kvcached)")
    ap.add_argument("--out", type=Path, help="default reports/soak, or reports/soak/native-control")
    ap.add_argument("--render", action="store_true",
                    help="write the report and soak.png again from the result.json in --out, running nothing")
    args = ap.parse_args(argv)
    args.out = args.out or (KVCACHED_OUT / "native-control" if args.candidate == "native" else KVCACHED_OUT)
    if args.render:
        render(args.out)
        return 0
    if not 10 <= args.duration <= 7200 or not 1 <= args.clients <= 64:
        ap.error("--duration must be within [10, 7200] s and --clients within [1, 64]")
    plan = SoakPlan(duration_s=args.duration, clients=args.clients, candidate=args.candidate)
    env = provenance([*PROG.split(), *(argv if argv is not None else sys.argv[1:])])
    with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="kvcached-soak-") as work:
        result = run(plan, Path(work))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps({**to_json(result), "environment": env.as_dict()}) + "\n")
    print(render(args.out).read_text())
    return 0 if all(result.checks().values()) else 1


if __name__ == "__main__":
    sys.exit(main())
