"""Fault injection: make physical allocations fail on purpose, at named sites.

Off by default and free when off: callers hold ``faults: FaultInjector | None`` and skip
the check when it is ``None`` (`FaultInjector.from_env` returns ``None`` unless
``KVCACHED_FAULT_PLAN`` names a plan file).

A plan file is JSON::

    {"plans": [
        {"site": "cow_admission", "after_trigger": "partial_prefix_hit", "fail_next": 2},
        {"site": "map", "skip": 1, "fail_next": 1}
    ]}

* ``site``: where it fires (``"map"``: each kv page mapped by the page pool;
  ``"admission"``/``"cow_admission"``: the scheduler pool's physical admission check;
  ``"rank<N>_map"``: each map request rank N receives from the scheduler, in that rank's
  worker process (a refusal on one rank only); ``"*"``: any site).
* ``after_trigger``: the plan stays disarmed until code calls ``trigger(name)`` with
  this name (for example after a real partial-prefix hit).
* ``skip``: let this many matching checks pass first (so a failure lands in the middle of
  a batch), then fail the next ``fail_next`` checks, then stop.

The file may be rewritten at any time by another process (the conformance harness drives
the engine process this way); it is re-read when its modification time changes. Fired
counts are written next to it as ``<plan>.fired.json`` (atomically) after every firing;
a worker process's injector writes ``<plan>.rank<N>.fired.json`` instead, so processes
never overwrite each other's counts.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvcached.errors import ConfigError, InjectedFault

SITES = frozenset({"map", "admission", "cow_admission", "*"})
_RANK_SITE = re.compile(r"rank(0|[1-9][0-9]{0,3})_map")


def is_site(name: object) -> bool:
    """Whether ``name`` is a site a plan may name (`SITES`, or ``rank<N>_map``)."""
    return isinstance(name, str) and (name in SITES or _RANK_SITE.fullmatch(name) is not None)


def rank_map_site(rank: int) -> str:
    return f"rank{rank}_map"


@dataclass(slots=True)
class FaultPlan:
    """One rule. Invariant: ``fired <= fail_next``; ``armed`` is set once its trigger fired."""

    site: str
    fail_next: int = 1
    skip: int = 0
    after_trigger: str | None = None
    armed: bool = field(default=False)
    seen: int = 0
    fired: int = 0

    @classmethod
    def parse(cls, raw: object, where: str) -> FaultPlan:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: each plan must be an object, got {raw!r}")
        unknown = set(raw) - {"site", "fail_next", "skip", "after_trigger"}
        if unknown:
            raise ConfigError(f"{where}: unknown plan keys {sorted(unknown)}")
        site = raw.get("site")
        if not isinstance(site, str) or not is_site(site):
            raise ConfigError(f"{where}: site={site!r}; accepted sites are {sorted(SITES)} and rank<N>_map")
        fail_next, skip = raw.get("fail_next", 1), raw.get("skip", 0)
        for name, value in (("fail_next", fail_next), ("skip", skip)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}: {name}={value!r} must be an integer >= 0")
        trigger = raw.get("after_trigger")
        if trigger is not None and not isinstance(trigger, str):
            raise ConfigError(f"{where}: after_trigger must be a string")
        return cls(site=site, fail_next=fail_next, skip=skip, after_trigger=trigger,
                   armed=trigger is None)

    def matches(self, site: str) -> bool:
        return self.armed and self.site in (site, "*") and self.fired < self.fail_next


class FaultInjector:
    """Evaluates fault plans at named sites. Thread-safe."""

    def __init__(self, plans: list[FaultPlan], path: Path | None = None, fired_suffix: str = ".fired.json") -> None:
        self._plans = plans
        self._path = path
        self._fired_suffix = fired_suffix
        self._mtime: float | None = None
        self._lock = threading.Lock()
        self._triggers: set[str] = set()
        self._fired: dict[str, int] = {}

    @classmethod
    def from_env(cls, plan_path: str | None = None, *, rank: int | None = None) -> FaultInjector | None:
        """The injector for ``plan_path`` (default ``$KVCACHED_FAULT_PLAN``), or None when off.

        ``rank``: the injector of that rank's worker process (its own fired file).
        """
        path = plan_path if plan_path is not None else os.environ.get("KVCACHED_FAULT_PLAN")
        if not path:
            return None
        suffix = ".fired.json" if rank is None else f".rank{rank}.fired.json"
        injector = cls([], Path(path), suffix)
        injector._reload()
        return injector

    @classmethod
    def from_plans(cls, plans: list[dict[str, object]]) -> FaultInjector:
        """An in-process injector (no file), for tests and probes."""
        return cls([FaultPlan.parse(p, f"plan {i}") for i, p in enumerate(plans)])

    def add_plan(self, raw: dict[str, object]) -> None:
        """Add one plan at run time (in-process injectors only; file plans come from the file)."""
        if self._path is not None:
            raise ConfigError("this injector is driven by its plan file; rewrite the file instead")
        plan = FaultPlan.parse(raw, "added plan")
        with self._lock:
            if plan.after_trigger in self._triggers:
                plan.armed = True
            self._plans.append(plan)

    def _reload(self) -> None:
        assert self._path is not None
        try:
            mtime = self._path.stat().st_mtime_ns
        except FileNotFoundError:
            raise ConfigError(f"KVCACHED_FAULT_PLAN={str(self._path)!r}: file does not exist") from None
        if mtime == self._mtime:
            return
        try:
            doc = json.loads(self._path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"KVCACHED_FAULT_PLAN={str(self._path)!r}: invalid JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("plans"), list):
            raise ConfigError(f"KVCACHED_FAULT_PLAN={str(self._path)!r}: expected {{\"plans\": [...]}}")
        plans = [FaultPlan.parse(p, f"{self._path} plan {i}") for i, p in enumerate(doc["plans"])]
        for plan in plans:
            if plan.after_trigger in self._triggers:
                plan.armed = True
        self._plans, self._mtime = plans, mtime

    def trigger(self, name: str) -> None:
        """Record that event ``name`` happened; arms every plan waiting for it."""
        with self._lock:
            if self._path is not None:
                self._reload()
            self._triggers.add(name)
            for plan in self._plans:
                if plan.after_trigger == name:
                    plan.armed = True

    def check(self, site: str) -> None:
        """Raise `InjectedFault` if an armed plan says this check at ``site`` fails."""
        with self._lock:
            if self._path is not None:
                self._reload()
            for plan in self._plans:
                if not plan.matches(site):
                    continue
                plan.seen += 1
                if plan.seen <= plan.skip:
                    continue
                plan.fired += 1
                self._fired[site] = self._fired.get(site, 0) + 1
                self._publish()
                raise InjectedFault(f"injected failure at site {site!r}", site=site)

    def fired(self, site: str | None = None) -> int:
        """How many failures fired (at ``site``, or in total)."""
        with self._lock:
            if site is None:
                return sum(self._fired.values())
            return self._fired.get(site, 0)

    def triggered(self, name: str) -> bool:
        with self._lock:
            return name in self._triggers

    def _publish(self) -> None:
        if self._path is None:
            return
        out = self._path.with_name(self._path.name + self._fired_suffix)
        tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fired": self._fired, "triggers": sorted(self._triggers)}))
        os.replace(tmp, out)


# ---- the backend seam ----------------------------------------------------------------------
class FailingRange:
    """The backend fault seam: a backing whose calls fail on purpose, one call at a time.

    Wraps a real backing (`kvcached._vmm.VirtualRange`, any `kvcached.pages.Range`) and
    delegates everything to it, except that `fail_call` makes the ``nth`` next call of ``op``
    (``"map"`` or ``"unmap"``) raise ``error`` before the backing is touched: the error path
    of every caller above runs against real memory, for one backing at a time.
    """

    OPS = ("map", "unmap")

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self._planned: dict[str, list[tuple[int, BaseException]]] = {op: [] for op in self.OPS}
        self.calls = {op: 0 for op in self.OPS}

    def fail_call(self, op: str, nth: int, error: BaseException) -> None:
        """Make the ``nth`` next call (1: the very next) of ``op`` raise ``error``."""
        if op not in self.OPS or nth < 1:
            raise ConfigError(f"fail_call({op!r}, {nth}): op must be one of {self.OPS} and nth >= 1")
        self._planned[op].append((self.calls[op] + nth, error))

    def _check(self, op: str) -> None:
        self.calls[op] += 1
        for due, error in list(self._planned[op]):
            if due == self.calls[op]:
                self._planned[op].remove((due, error))
                raise error

    def map(self, pages: object) -> None:
        self._check("map")
        self.inner.map(pages)  # type: ignore[attr-defined]

    def unmap(self, pages: object) -> None:
        self._check("unmap")
        self.inner.unmap(pages)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)
