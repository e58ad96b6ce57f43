"""The sharing run's report: checks, figures and one picture (``reports/sharing/``).

    python -m conformance.sharing [--quick] [--out reports/sharing] [--render result.json]

runs `conformance.sharing.run` and writes ``result.json`` (with the environment block),
``timeline.png`` and ``report.md``, ``report.html`` and ``report.csv`` (with ``sections/``)
into ``--out``, through the shared report model (``conformance.reporting``). ``--render``
writes them again from a saved ``result.json``, running nothing. Exit code 0 when every
check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd  # type: ignore[import-untyped]  # no pandas-stubs in the environment

from conformance.kvcached_env import KvcachedEnvError, parse_kvcached_env
from conformance.reporting import (
    Image,
    Paragraph,
    Provenance,
    Report,
    Section,
    Table,
    column,
    columns_of,
    provenance,
    table,
    write_report,
)
from conformance.serving import exit_on_sigterm
from conformance.serving.retrial import MAX_RETRIED, TIE, Difference, NoiseFloor
from conformance.sharing.run import (
    SCENARIO_KNOBS,
    SIDES,
    Burst,
    Handover,
    MiB,
    SharingPlan,
    SharingResult,
    SharingStateError,
    run,
)

PROG = "python -m conformance.sharing"
FIGURE = "timeline.png"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _differences(bursts: list) -> list[Difference]:
    return [d for b in bursts for d in b.differences]


def _retried(d: Difference) -> str:
    if d.first < 0:
        return "failed or another length (not retried)"
    return f"margin {d.margin:g}, native chose it in {d.reproduced} of {d.retrials} retrials"


#: Reads of the record the lowered-limit check needs between B getting under its limit and its
#: bursts' end (not vacuous). Few, because the sampler's rate is the machine's: beside a CPU hog
#: (12-05) it read 5 times over those 5.1 s, 1-2 s apart, where 10 were asked for; the reads
#: themselves took under 3 ms, so the time went to the sampler's thread waiting to run.
MIN_SAMPLES_UNDER = 3


def checks(r: SharingResult) -> list[Check]:
    """Every expectation of the scenario, with what was measured."""
    plan = r.plan
    budget = int(plan["budget_bytes"])  # type: ignore[call-overload]
    used = max((s[3] for s in r.samples), default=0)
    first = {b.label: b for b in r.bursts}
    a0, b0 = first["A0"], first["B0"]
    completed = [b for b in r.bursts if b.label != "A (killed)"]
    idle_ok = all(x <= r.watermark_bytes[e] for e, xs in r.idle_bytes.items() for x in xs)
    fd_ok = all(v[0] == v[-1] for v in r.fds.values())
    ours, native = _differences(completed), _differences(r.native_bursts)
    noise = NoiseFloor.of(native)
    planted = r.planted
    served = sum(b.completed for b in completed)
    found = [
        Check("budget never exceeded", used <= budget and len(r.samples) > 0,
              f"max usage {used / MiB:.2f} MiB of {budget / MiB:.2f} MiB over {len(r.samples)} samples"),
        Check("every request completed (but the killed engine's)", all(b.completed == b.requests for b in completed),
              f"{sum(b.completed for b in completed)}/{sum(b.requests for b in completed)} requests"),
        Check("B's burst fit only because A gave its pages back", a0.peak_bytes + b0.peak_bytes > budget,
              f"A peak {a0.peak_bytes / MiB:.2f} MiB + B peak {b0.peak_bytes / MiB:.2f} MiB > budget"),
        Check("B's lowered limit holds while its burst runs",
              r.b_max_once_under_bytes <= r.limit_b_bytes and r.b_samples_once_under >= MIN_SAMPLES_UNDER,
              f"under {r.limit_b_bytes / MiB:.2f} MiB {r.b_under_limit_s:.2f} s after `kvctl limit`, at most "
              f"{r.b_max_once_under_bytes / MiB:.2f} MiB over the {r.b_samples_once_under} samples from then to "
              "the burst's end"),
        Check("B took the memory of A after SIGKILL", r.b_after_kill_peak_bytes > budget - r.a_at_kill_bytes,
              f"B peak {r.b_after_kill_peak_bytes / MiB:.2f} MiB > budget - A's {r.a_at_kill_bytes / MiB:.2f} MiB"
              + (f" (A's charge left the record {r.a_gone_s:.2f} s after SIGKILL)" if r.a_gone_s is not None else "")),
        Check("every idle point at the watermark", idle_ok,
              ", ".join(f"{e}: max {max(xs) / MiB:.2f} MiB <= {r.watermark_bytes[e] / MiB:.2f} MiB"
                        for e, xs in r.idle_bytes.items())),
        Check("file descriptors and memfds do not grow", fd_ok,
              ", ".join(f"{e}: cycle 1 {v[0]}, cycle {len(v)} {v[-1]}" for e, v in r.fds.items())),
        Check("every token difference is one native also gives", all(d.explained_by(noise) for d in ours),
              _explained(ours, served, native, noise)),
        Check("the planted difference is caught", planted is not None and planted.retrials > 0
              and not planted.explained_by(noise),
              "not planted" if planted is None else f"planted at {_retried(planted)}, above native's noise "
              f"({_floor(noise)})"),
    ]
    if r.handover is not None:  # runs from 12-07 on (step 4b)
        found.append(handover_check(r.handover, r.b0_over_s))
    return found


def handover_check(h: Handover, after_idle_s: float | None) -> Check:
    """Step 4b: B's burst, sent as A's ended, got the memory A held; how long that took, beside
    the same time for B0, sent once A was idle (B's own ramp)."""
    over = f"B over {h.above_bytes / MiB:.2f} MiB (the budget less A's peak of {h.a_peak_bytes / MiB:.2f} MiB)"
    ramp = "-" if after_idle_s is None else f"{after_idle_s:.2f} s"
    detail = (f"{over} {h.wait_s:.2f} s after its burst began (B0, sent once A was idle: {ramp})"
              if h.wait_s is not None else f"B never passed {h.above_bytes / MiB:.2f} MiB (the budget less A's peak)")
    return Check("B's burst sent as A's ended got A's memory", h.wait_s is not None,
                 f"{detail}; B's peak {h.b_peak_bytes / MiB:.2f} MiB")


def _floor(noise: NoiseFloor) -> str:
    return "none" if noise.margin is None else f"margin {noise.margin:g}"


def _explained(ours: list[Difference], served: int, native: list[Difference], noise: NoiseFloor) -> str:
    """How each token difference is explained: by a retrial, or within native's own noise."""
    retried = sum(d.explained for d in ours)
    within = sum(not d.explained and noise.covers(d) for d in ours)
    left = [d for d in ours if not d.explained_by(noise)]
    shown = "; ".join(_retried(d) for d in left[:10]) + ("; ..." if len(left) > 10 else "")
    return (f"{served - len(ours)} of {served} exact; {retried} native chose in a retrial; {within} within "
            f"native's own noise (its concurrent bursts: {len(native)} differ from native alone, at margins up "
            f"to {_floor(noise)}); {len(left)} unexplained{': ' + shown if left else ''}")


def plot(r: SharingResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = int(r.plan["budget_bytes"]) / MiB  # type: ignore[call-overload]
    df = pd.DataFrame(r.samples, columns=["t", "A", "B", "used", "limit"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=False,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    # B at the bottom, so that B's own limit reads straight off the axis.
    top.stackplot(df.t, df.B / MiB, df.A / MiB, labels=["engine B (qwen3)", "engine A (llama)"],
                  colors=["#DD8452", "#4C72B0"], alpha=0.85)
    top.axhline(budget, color="black", lw=1.2, ls="--", label="shared budget")
    if r.limit_b_bytes:
        top.axhline(r.limit_b_bytes / MiB, color="#DD8452", lw=0.8, ls=":", label="B's lowered limit")
    for i, (t, label) in enumerate(r.marks):
        top.axvline(t, color="grey", lw=0.6)
        top.text(t, budget * (1.03 + 0.12 * (i % 3)), " " + label, fontsize=7, va="bottom")
    top.set_ylabel("mapped KV (MiB)")
    top.set_ylim(0, budget * 1.45)
    top.set_title("kvcached: two vllm serve engines sharing one budget (sampled from the budget record)")
    top.legend(loc="upper center", fontsize=8, ncol=4)
    _native_panel(bottom, r, budget)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _native_panel(ax, r: SharingResult, budget: float) -> None:
    """The same bursts on native engines with the memory split statically: the KV memory a
    burst can use (its engine's half, for its whole life) against what kvcached's burst used;
    each bar carries the burst's wall time."""
    ours = {b.label: b for b in r.bursts}
    x = list(range(len(r.native_bursts)))
    native = [b.peak_bytes / MiB for b in r.native_bursts]
    shared = [ours[b.label].peak_bytes / MiB if b.label in ours else 0 for b in r.native_bursts]
    bars = [ax.bar([i - 0.2 for i in x], native, 0.4, color="grey", hatch="//",
                   label=f"native: the engine's static half of {budget:.0f} MiB"),
            ax.bar([i + 0.2 for i in x], shared, 0.4, color="#55A868", label="kvcached: mapped at the burst's peak")]
    per_bar: list[list[Burst | None]] = [list(r.native_bursts), [ours.get(b.label) for b in r.native_bursts]]
    for group, bursts in zip(bars, per_bar, strict=True):
        for rect, b in zip(group, bursts, strict=True):
            if b is not None:
                ax.text(rect.get_x() + rect.get_width() / 2, rect.get_height(), f"{b.end_s - b.start_s:.1f} s",
                        ha="center", va="bottom", fontsize=7)
    names = {"B1": "B1 (kvcached: B limited)", "B handover": "B as A ended"}
    ax.set_xticks(x, [f"{names.get(b.label, b.label)}\n{b.requests} req" for b in r.native_bursts], fontsize=8)
    ax.set_ylabel("KV MiB for the burst")
    ax.set_ylim(0, budget * 1.6)  # room above the bars for the legend
    ax.set_title("the same bursts, native with the memory split statically: a burst gets its engine's half, "
                 "never the idle half of the other (labels: burst wall time)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=2)


def _check_rows(found: list[Check]) -> Table:
    return table(({"check": c.name, "holds": "yes" if c.ok else "NO", "measured": c.detail} for c in found),
                 columns=["check", "holds", "measured"])


def idle_section(r: SharingResult) -> Section:
    """From an engine's last response to its charge back at its watermark: count, median, max."""
    stats = (pd.DataFrame({e: pd.Series(v) for e, v in r.idle_return_s.items()}).describe()
             .loc[["count", "50%", "max"]])
    frame = stats.apply(lambda col: col.map(lambda x: f"{x:.3f}")).reset_index(names="")
    text = ("From an engine's last response to its charge being back at its watermark (null page + reserve), read "
            f"from the record every {1 / float(r.plan['sample_hz']):.2f} s (0: already there at the first sample; "  # type: ignore[arg-type]
            "an engine unmaps at the end of the step that finished its last request, before the response arrives).")
    return Section("Time from idle to pages free (s)", (Paragraph(text), Table(frame)))


def bursts_table(r: SharingResult) -> Table:
    """Every burst, kvcached's then native's (the memory split statically)."""
    sides = [("kvcached", b) for b in r.bursts] + [("native (static split)", b) for b in r.native_bursts]
    return table({"engine": b.engine, "label": b.label, "requests": b.requests, "completed": b.completed,
                  "seconds": f"{b.end_s - b.start_s:.2f}", "TTFT p50 s": _ttft(b, 0.5),
                  "TTFT max s": _ttft(b, 1.0), "mismatches": len(b.differences),
                  "peak MiB": f"{b.peak_bytes / MiB:.2f}", "side": side} for side, b in sides)


def _ttft(b: Burst, q: float) -> str:
    """The ``q`` quantile (nearest rank) of a burst's times to first token; "-" for a run
    before they were recorded, or a burst with no completed request."""
    xs = sorted(b.ttft_s)
    return f"{xs[min(len(xs) - 1, int(q * len(xs)))]:.3f}" if xs else "-"


@dataclass(frozen=True)
class DifferenceRow:
    """A token difference of kvcached's bursts (or the planted one) and the retrial's finding."""

    burst: str
    request: int
    first_differing_token: int
    kvcached_native_token: str = field(metadata=column("kvcached / native token"))
    native_margin: str
    near_tie: str = field(metadata=column(f"near-tie (< {TIE:g})"))
    native_chose_it: str
    explained: str


def differences_section(r: SharingResult) -> Section:
    """Every token difference of kvcached's bursts and the planted one, with the retrial's finding."""
    found = [(b.label, d) for b in r.bursts for d in b.differences]
    if r.planted is not None:
        found.append(("planted in A0 (control)", r.planted))
    noise = NoiseFloor.of(_differences(r.native_bursts))
    rows = [DifferenceRow(label, d.position, d.first, f"{d.soaked_token} / {d.native_token}", f"{d.margin:g}",
                          "yes" if 0 <= d.margin < TIE else "no", f"{d.reproduced} of {d.retrials}",
                          _how(d, noise)) for label, d in found]
    text = (f"Each difference (the first {MAX_RETRIED}) is retried on native {r.plan['retrials']} times, beside 0 to "
            f"{int(r.plan['burst']) - 1} other requests of its burst sent at random moments (other batch "  # type: ignore[call-overload]
            "shapes each time); it is explained when native itself chooses kvcached's token, or when its margin "
            "is within native's own noise: the largest margin at which native's concurrent bursts chose another "
            f"token than native alone ({_floor(noise)}). The planted difference (a native output with one token "
            "changed where native's margin is ordinary) is judged the same way and must stay unexplained: it "
            "shows the rule can fail.")
    return Section("Token differences", (Paragraph(text), table(rows, columns_of(DifferenceRow))))


def _how(d: Difference, noise: NoiseFloor) -> str:
    return "retrial" if d.explained else "native's noise" if noise.covers(d) else "NO"


def build(r: SharingResult, found: list[Check]) -> Report:
    """The sharing run's report as data."""
    budget = int(r.plan["budget_bytes"]) / MiB  # type: ignore[call-overload]
    scenario = ("Scenario: `conformance/sharing/run.py` (A = tiny llama, B = tiny qwen3, each a multiprocess "
                f"`vllm serve`; one budget record; the usage sampled from it at {r.plan['sample_hz']} Hz).")
    plan = table(({"setting": k, "value": str(v)} for k, v in r.plan.items()), columns=["setting", "value"])
    body = (
        Section("Scenario", (Paragraph(scenario), plan)),
        Section("Timeline", (Image(FIGURE, "the two engines' mapped KV over time, and native's static split"),)),
        Section("Checks", (_check_rows(found),)),
        idle_section(r),
        Section("Bursts", (bursts_table(r),)),
        differences_section(r),
    )
    held = sum(c.ok for c in found)
    headline = (f"Two `vllm serve` engines under one {budget:.2f} MiB budget, {len(r.bursts)} bursts: "
                f"**{held} of {len(found)}** checks hold.")
    return Report(subject="Several engines, one budget: two `vllm serve` engines",
                  verdict="PASS" if held == len(found) else "FAIL", headline=headline,
                  environment=Provenance.from_dict(r.environment), body=body,
                  overview={"checks": len(found), "held": held, "samples": len(r.samples)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{SharingPlan.quick().cycles} cycles, smaller bursts")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the CUDA models in bf16, compiled, GPU-sized bursts (SharingPlan.cuda)")
    parser.add_argument("--out", type=Path, default=Path("reports/sharing"))
    parser.add_argument("--render", type=Path, help="render the report of a saved result.json (no run)")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"comma-separated, of {','.join(SIDES)} in that order (default: all): a run in parts, "
                             f"each going on from --out/{STATE} (a lent GPU's call lasts minutes)")
    parser.add_argument("--kvcached-env", action="append", default=[], metavar="KVCACHED_NAME=VALUE",
                        help="a kvcached setting for the shared side's engines (repeatable), e.g. "
                             "KVCACHED_IDLE_GRACE_MS=250; not one the scenario sets itself")
    args = parser.parse_args(argv)
    plan = (SharingPlan.cuda(args.quick) if args.device == "cuda"
            else SharingPlan.quick() if args.quick else SharingPlan())
    try:
        plan = replace(plan, kvcached_env=parse_kvcached_env(args.kvcached_env, SCENARIO_KNOBS))
    except KvcachedEnvError as e:
        parser.error(str(e))
    if args.render:
        result = SharingResult.load(args.render)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        sides, state_path = args.sides.split(","), args.out / STATE
        if unknown := sorted(set(sides) - set(SIDES)):
            parser.error(f"--sides: unknown {unknown}; the sides are {','.join(SIDES)}")
        if sides[0] == SIDES[0] and state_path.is_file():
            parser.error(f"{state_path} holds a run cut short: go on with --sides after its last side, or remove it")
        command = " ".join([*PROG.split(), *(argv if argv is not None else sys.argv[1:])])
        try:
            with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="kvcached-sharing-") as tmp:
                state = run(plan, Path(tmp), sides, state_path)
        except SharingStateError as e:
            parser.error(str(e))
        state.result.environment = provenance(_commands(state.result.environment, command)).as_dict()
        state.save(state_path)
        if len(state.done) < len(SIDES):
            print(f"sides done: {', '.join(state.done)}; go on with --sides {','.join(SIDES[len(state.done):])}")
            return 0
        result = state.result
    args.out.mkdir(parents=True, exist_ok=True)
    result.save(args.out / "result.json")
    plot(result, args.out / FIGURE)
    found = checks(result)
    write_report(build(result, found), args.out)
    if not args.render:
        (args.out / STATE).unlink(missing_ok=True)  # result.json holds all of it now
    for c in found:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
    return 0 if all(c.ok for c in found) else 1


#: A run's state between its parts (`SharingRun`), in --out until its report is written.
STATE = "run-state.json"


def _commands(earlier: dict[str, str], command: str) -> str:
    """The command line the report names: this part's, after the earlier parts' (``;``)."""
    before = earlier.get("command")
    return f"{before} ; {command}" if before else command


if __name__ == "__main__":
    sys.exit(main())
