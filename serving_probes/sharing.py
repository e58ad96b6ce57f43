"""Two processes share one GPU through the kvcached core (no vLLM): handoff and return.

Each tenant is a process of its own with a large virtual range on the device, a `PageSpace`
over it and a slot in the GPU's budget record (named by the device's UUID; the probe uses a
record of its own, with a global limit of ``limit_fraction`` of the device's free memory at
start). The parent drives them over pipes:

1. **A fills** more than half of the free memory (``a_fraction``), then **releases** it while
   **B is trying to grow** (retrying every millisecond on `PhysicalMemoryExhausted`): the
   *handoff latency* is from A's unmap returning to B's next successful map.
2. **B grows past what was free at A's peak** (so the memory it uses was A's).
3. **Both contend**: both grow at once towards ``a_fraction`` each (more than the limit
   together); the record refuses what does not fit, before ``cuMemCreate``.
4. **The device backstop**: the record's limit cleared, both grow at once as far as the
   device allows; the device's out-of-memory arrives as `PhysicalMemoryExhausted`, typed.
5. **Cycles**: A and B fill and release ``cycles`` times; the device's free memory (read in
   the parent with ``cuMemGetInfo``) at each cycle's end is compared with the start.

The parent samples the record throughout: its usage never exceeds the limit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conformance.reporting import Bullets, Provenance, Section
from serving_probes.probe_report import write_probe_report

GiB = 1 << 30
PAGE = 2 << 20
BATCH = 64  # pages per map call


# ---- a tenant (child process) --------------------------------------------------------------------
def tenant(conn: Any, device: str, record_path: str, virtual_bytes: int) -> None:
    """Serve commands from the parent until ``("exit",)``; replies are plain tuples."""
    from kvcached import _vmm
    from kvcached.budget import BudgetRecord
    from kvcached.errors import PhysicalMemoryExhausted
    from kvcached.pages import PageSpace

    record = BudgetRecord(record_path)
    vrange = _vmm.VirtualRange(device, virtual_bytes, PAGE)
    space = PageSpace((vrange,), (1,), vrange.num_pages, record.slot(rank=0, device=device))
    mapped = 0
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "grow":  # (target pages, retry_until_s): map batches up to target
                target, until = args
                refusals, first_ok, why = 0, 0.0, ""
                while mapped < target:
                    batch = list(range(mapped, min(target, mapped + BATCH)))
                    try:
                        space.map_pages(batch)
                    except PhysicalMemoryExhausted as e:
                        refusals += 1
                        why = "budget" if "budget" in str(e) else "device"
                        if time.monotonic() >= until:
                            break
                        time.sleep(0.001)
                        continue
                    if refusals and not first_ok:
                        first_ok = time.monotonic()
                    mapped += len(batch)
                conn.send((mapped, refusals, first_ok, why))
            elif cmd == "release":
                space.unmap_pages(list(range(mapped)))
                mapped = 0
                conn.send((time.monotonic(),))
    finally:
        if mapped:
            space.unmap_pages(list(range(mapped)))
        vrange.close()
        record.close()


@dataclass
class Tenant:
    name: str
    proc: Any
    conn: Any

    def ask(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def answer(self, timeout_s: float = 300.0) -> tuple[Any, ...]:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"tenant {self.name} did not answer within {timeout_s} s")
        return tuple(self.conn.recv())


# ---- the parent ----------------------------------------------------------------------------------
@dataclass
class SharingProbe:
    device: str
    free_start: int = 0
    limit: int = 0
    a_peak_bytes: int = 0
    b_blocked_at_a_peak_bytes: int = 0
    free_at_a_peak: int = 0
    b_after_handoff_bytes: int = 0
    handoff_ms: list[float] = field(default_factory=list)
    contention: list[dict[str, int]] = field(default_factory=list)
    backstop: dict[str, object] = field(default_factory=dict)
    cycles_free: list[int] = field(default_factory=list)
    max_used: int = 0  # the record's largest usage while its limit was set
    samples: int = 0
    samples_over_limit: int = 0
    checks: dict[str, bool] = field(default_factory=dict)


def _spawn(name: str, device: str, record: str, virtual: int) -> Tenant:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=tenant, args=(child, device, record, virtual), name=f"tenant-{name}", daemon=True)
    proc.start()
    return Tenant(name, proc, parent)


class _Watch(threading.Thread):
    """Samples the record every 2 ms: usage over its limit while one is set is a violation."""

    def __init__(self, record: Any) -> None:
        super().__init__(daemon=True)
        self.record, self.max_used, self.samples, self.over = record, 0, 0, 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.002):
            snap = self.record.snapshot()
            if snap.limit is not None:
                self.max_used = max(self.max_used, snap.used)
                self.over += snap.used > snap.limit
            self.samples += 1


def run(device: str = "cuda:0", a_fraction: float = 0.6, limit_fraction: float = 0.9,
        cycles: int = 5, handoffs: int = 5) -> SharingProbe:
    from kvcached import _vmm
    from kvcached.budget import BudgetRecord

    index = int(device.partition(":")[2] or 0)
    out = SharingProbe(device, free_start=_vmm.cuda_mem_info(index)[0])
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / f"{_vmm.cuda_device_uuid(index).lower()}.budget")
        record = BudgetRecord(path)
        a, b = (_spawn(n, device, path, int(out.free_start * 1.1) // PAGE * PAGE) for n in ("A", "B"))
        watch = _Watch(record)
        try:
            _phases(out, record, a, b, index, a_fraction, limit_fraction, cycles, handoffs, watch)
        finally:
            watch.halt.set()
            for t in (a, b):
                t.ask("exit")
                t.proc.join(60)
            record.close()
    out.max_used, out.samples, out.samples_over_limit = watch.max_used, watch.samples, watch.over
    out.checks["budget never exceeded while set"] = watch.over == 0 and out.max_used <= out.limit
    return out


def _pages(nbytes: float) -> int:
    return int(nbytes) // PAGE


def _phases(out: SharingProbe, record: Any, a: Tenant, b: Tenant, index: int, a_fraction: float,
            limit_fraction: float, cycles: int, handoffs: int, watch: _Watch) -> None:
    from kvcached import _vmm

    # Contexts first (each child's CUDA context takes memory): then the baseline.
    for t in (a, b):
        t.ask("grow", 1, 0.0)
        t.answer()
        t.ask("release")
        t.answer()
    out.free_start = _vmm.cuda_mem_info(index)[0]
    out.limit = int(out.free_start * limit_fraction)
    record.set_limit(out.limit)
    watch.start()
    for _ in range(handoffs):
        _handoff(out, a, b, index, a_fraction)
    _contend(out, a, b, a_fraction)
    record.set_limit(None)
    _backstop(out, a, b)
    record.set_limit(out.limit)
    for _ in range(cycles):
        for t in (a, b):
            t.ask("grow", _pages(out.free_start * a_fraction), 0.0)
            t.answer()
            t.ask("release")
            t.answer()
        out.cycles_free.append(_vmm.cuda_mem_info(index)[0])
    out.checks["device memory back at its start every cycle"] = all(f >= out.free_start - 64 * PAGE
                                                                   for f in out.cycles_free)


def _handoff(out: SharingProbe, a: Tenant, b: Tenant, index: int, a_fraction: float) -> None:
    from kvcached import _vmm

    a.ask("grow", _pages(out.free_start * a_fraction), 0.0)
    out.a_peak_bytes = a.answer()[0] * PAGE
    out.free_at_a_peak = _vmm.cuda_mem_info(index)[0]
    target = _pages(out.free_start * a_fraction)  # past what was free at A's peak
    b.ask("grow", target, time.monotonic() + 60.0)  # B retries every millisecond
    time.sleep(0.5)
    a.ask("release")
    (released,) = a.answer()
    mapped, refusals, first_ok, _ = b.answer()
    out.b_after_handoff_bytes = mapped * PAGE
    out.b_blocked_at_a_peak_bytes = 0 if not refusals else mapped * PAGE
    out.handoff_ms.append(round((first_ok - released) * 1000, 3) if first_ok else -1.0)
    out.checks["B grew past what was free at A's peak"] = (
        out.checks.get("B grew past what was free at A's peak", True) and out.b_after_handoff_bytes > out.free_at_a_peak
        and first_ok > 0)
    b.ask("release")
    b.answer()


def _contend(out: SharingProbe, a: Tenant, b: Tenant, a_fraction: float) -> None:
    target = _pages(out.free_start * a_fraction)
    for t in (a, b):
        t.ask("grow", target, 0.0)
    got = {t.name: t.answer() for t in (a, b)}
    out.contention.append({n: g[0] * PAGE for n, g in got.items()} | {f"{n} refused by": g[3] for n, g in got.items()})
    total = sum(g[0] for g in got.values()) * PAGE
    out.checks["contention: refused by the record, within the limit"] = (
        total <= out.limit and any(g[3] == "budget" for g in got.values()))
    for t in (a, b):
        t.ask("release")
        t.answer()


def _backstop(out: SharingProbe, a: Tenant, b: Tenant) -> None:
    target = _pages(out.free_start * 0.75)
    for t in (a, b):
        t.ask("grow", target, 0.0)
    got = {t.name: t.answer() for t in (a, b)}
    out.backstop = {n: {"bytes": g[0] * PAGE, "refused_by": g[3]} for n, g in got.items()}
    out.checks["no record limit: the device's own out-of-memory, typed"] = any(
        g[3] == "device" for g in got.values())
    for t in (a, b):
        t.ask("release")
        t.answer()


def write_report(probe: SharingProbe, out_dir: Path, environment: Provenance, save: bool = True) -> Path:
    def g(n: int) -> str:
        return f"{n / GiB:.1f} GiB"

    found = (
        f"free at start {g(probe.free_start)}; record limit {g(probe.limit)}",
        (f"A's peak {g(probe.a_peak_bytes)} (free then: {g(probe.free_at_a_peak)}); B after the handoff "
         f"{g(probe.b_after_handoff_bytes)}; handoff latency {probe.handoff_ms} ms"),
        f"contention: {probe.contention}",
        f"device backstop (no record limit): {probe.backstop}",
        f"free at each cycle's end: {[g(f) for f in probe.cycles_free]}",
        (f"handoff latency median {sorted(probe.handoff_ms)[len(probe.handoff_ms) // 2]} ms "
         f"(min {min(probe.handoff_ms)}, max {max(probe.handoff_ms)}, {len(probe.handoff_ms)} handoffs)"),
        (f"record usage while limited: max {g(probe.max_used)}; {probe.samples_over_limit} of {probe.samples} "
         "samples (every 2 ms) over the limit"),
    )
    return write_probe_report(out_dir, "sharing", "Two processes share one GPU through the kvcached core",
                              environment, asdict(probe),
                              "`serving_probes/sharing.py` (its docstring). 2 MiB pages, one budget record for the GPU.",
                              [Section("Measured", (Bullets(found),))], probe.checks, save)


def render_saved(data: dict[str, object], environment: Provenance, out_dir: Path) -> Path:
    """The report of a saved run (``sharing.json``), rendered again."""
    return write_report(SharingProbe(**data), out_dir, environment, save=False)  # type: ignore[arg-type]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(asdict(run()))
