"""Fault injection: make physical allocations fail on purpose, at named sites.

This module is the one definition of a fault plan: kvcached's injector, the conformance
harness (which writes plans and reads what fired) and its emulated seam for native runs all
use `FaultRule`, `RuleState` and the file functions below.

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
  worker process (a refusal on one rank only); ``"copy"``: each non-empty batch of block
  copies a worker is asked for (vLLM's ``copy_kv_cache_blocks_inplace``), checked on every
  rank after the batch is validated and before any byte is written; ``"*"``: any site).

The copy site is the one failure kvcached cannot turn into a scheduling miss: it happens
inside vLLM's ``execute_model``, which cannot fail a single request, so the engine fails
exactly as native vLLM fails when its own copy raises.
* ``after_trigger``: the rule stays disarmed until code calls ``trigger(name)`` with
  this name (`TRIGGERS`: ``"partial_prefix_hit"``, raised by a real partial-prefix hit).
* ``skip``: once armed, let this many matching checks pass (so a failure lands in the
  middle of a batch), then fail the next ``fail_next`` (>= 1) checks, then stop.

Every rule sees every check of its site; the check fails if any rule fires.

The file may be rewritten at any time by another process (the conformance harness drives
the engine process this way); it is re-read when its modification time changes. Fired
counts are written next to it as ``<plan>.fired.json`` (atomically) after every firing::

    {"fired": {"cow_admission": 2}, "triggers": ["partial_prefix_hit"]}

A worker process's injector writes ``<plan>.rank<N>.fired.json`` instead, so processes
never overwrite each other's counts. A missing fired file reads as None (nothing was
written), never as zero.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached.errors import ConfigError, InjectedFault

SITES = frozenset({"map", "admission", "cow_admission", "copy", "*"})
TRIGGERS = frozenset({"partial_prefix_hit"})
_RANK_SITE = re.compile(r"rank(0|[1-9][0-9]{0,3})_map")
_KEYS = frozenset({"site", "fail_next", "skip", "after_trigger"})


def is_site(name: object) -> bool:
    """Whether ``name`` is a site a plan may name (`SITES`, or ``rank<N>_map``)."""
    return isinstance(name, str) and (name in SITES or _RANK_SITE.fullmatch(name) is not None)


def rank_map_site(rank: int) -> str:
    return f"rank{rank}_map"


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One rule of a plan; `ConfigError` names the bad field (nothing half-built)."""

    site: str
    fail_next: int = 1
    skip: int = 0
    after_trigger: str | None = None

    def __post_init__(self) -> None:
        if not is_site(self.site):
            raise ConfigError(f"site={self.site!r}; accepted sites are {sorted(SITES)} and rank<N>_map")
        for name, value, low in (("fail_next", self.fail_next, 1), ("skip", self.skip, 0)):
            if type(value) is not int or value < low:
                raise ConfigError(f"{name}={value!r} must be an integer >= {low}")
        if self.after_trigger is not None and self.after_trigger not in TRIGGERS:
            raise ConfigError(f"after_trigger={self.after_trigger!r}; known triggers are {sorted(TRIGGERS)}")

    @classmethod
    def parse(cls, raw: object, where: str) -> FaultRule:
        """A rule from its JSON object; errors name ``where`` (the file and the plan's index)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: each plan must be an object, got {raw!r}")
        unknown = set(raw) - _KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown plan keys {sorted(unknown)}")
        try:
            return cls(**raw)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except TypeError:
            raise ConfigError(f"{where}: a plan needs a site") from None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"site": self.site, "fail_next": self.fail_next}
        if self.skip:
            out["skip"] = self.skip
        if self.after_trigger is not None:
            out["after_trigger"] = self.after_trigger
        return out


@dataclass(slots=True)
class RuleState:
    """A rule's progress. Invariants: ``passed <= rule.skip``, ``fired <= rule.fail_next``,
    and nothing is counted before the rule is armed."""

    rule: FaultRule
    armed: bool
    passed: int = 0
    fired: int = 0

    @classmethod
    def start(cls, rule: FaultRule, triggers: Iterable[str] = ()) -> RuleState:
        """A fresh state, armed if the rule waits for no trigger or one already seen."""
        return cls(rule, rule.after_trigger is None or rule.after_trigger in set(triggers))

    def trigger(self, name: str) -> None:
        if self.rule.after_trigger == name:
            self.armed = True

    def check(self, site: str) -> bool:
        """One check at ``site``: True when this rule makes it fail."""
        rule = self.rule
        if not self.armed or rule.site not in (site, "*") or self.fired >= rule.fail_next:
            return False
        if self.passed < rule.skip:
            self.passed += 1
            return False
        self.fired += 1
        return True


# ---- plan files ------------------------------------------------------------------------------
def fired_path(plan_path: Path, rank: int | None = None) -> Path:
    """Where the injector of ``rank``'s worker (None: the scheduler's process) writes its counts."""
    suffix = ".fired.json" if rank is None else f".rank{rank}.fired.json"
    return plan_path.with_name(plan_path.name + suffix)


def write_plan(path: Path, rules: Iterable[FaultRule]) -> Path:
    """Write the plan file and remove any stale fired file from an earlier run."""
    path.write_text(json.dumps({"plans": [r.to_json() for r in rules]}, indent=1))
    fired_path(path).unlink(missing_ok=True)
    return path


def read_plan(path: Path) -> tuple[FaultRule, ...]:
    """The rules of a plan file; `ConfigError` naming the file when it is missing or malformed."""
    where = f"KVCACHED_FAULT_PLAN={str(path)!r}"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: file does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"plans"} or not isinstance(doc["plans"], list):
        raise ConfigError(f"{where}: expected {{\"plans\": [...]}}")
    return tuple(FaultRule.parse(p, f"{where} plan {i}") for i, p in enumerate(doc["plans"]))


def write_fired(plan_path: Path, fired: Mapping[str, int], triggers: Iterable[str] = (), *,
                rank: int | None = None) -> None:
    """Publish fired counts (atomically: a reader sees the old file or the new one)."""
    out = fired_path(plan_path, rank)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"fired": dict(fired), "triggers": sorted(set(triggers))}, sort_keys=True))
    os.replace(tmp, out)


def read_fired(plan_path: Path, rank: int | None = None) -> dict[str, int] | None:
    """Fired counts per site, or None when no fired file was written."""
    p = fired_path(plan_path, rank)
    if not p.is_file():
        return None
    return {str(k): int(v) for k, v in json.loads(p.read_text())["fired"].items()}


def read_triggers(plan_path: Path, rank: int | None = None) -> list[str]:
    """Triggers the writer saw raised (empty when it wrote no fired file)."""
    p = fired_path(plan_path, rank)
    return sorted(json.loads(p.read_text()).get("triggers", [])) if p.is_file() else []


# ---- the injector ----------------------------------------------------------------------------
class FaultInjector:
    """Evaluates a plan's rules at named sites. Thread-safe."""

    def __init__(self, rules: Iterable[FaultRule], path: Path | None = None, rank: int | None = None) -> None:
        self._states = [RuleState.start(r) for r in rules]
        self._path = path
        self._rank = rank
        self._mtime: int | None = None
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
        injector = cls((), Path(path), rank)
        injector._reload()
        return injector

    @classmethod
    def from_plans(cls, plans: Iterable[Mapping[str, object]]) -> FaultInjector:
        """An in-process injector (no file), for tests and probes."""
        return cls(FaultRule.parse(dict(p), f"plan {i}") for i, p in enumerate(plans))

    def add_plan(self, raw: Mapping[str, object]) -> None:
        """Add one rule at run time (in-process injectors only; file plans come from the file)."""
        if self._path is not None:
            raise ConfigError("this injector is driven by its plan file; rewrite the file instead")
        rule = FaultRule.parse(dict(raw), "added plan")
        with self._lock:
            self._states.append(RuleState.start(rule, self._triggers))

    def _reload(self) -> None:
        assert self._path is not None
        try:
            mtime = self._path.stat().st_mtime_ns
        except FileNotFoundError:
            raise ConfigError(f"KVCACHED_FAULT_PLAN={str(self._path)!r}: file does not exist") from None
        if mtime != self._mtime:
            self._states = [RuleState.start(r, self._triggers) for r in read_plan(self._path)]
            self._mtime = mtime

    def trigger(self, name: str) -> None:
        """Record that event ``name`` happened; arms every rule waiting for it."""
        with self._lock:
            if self._path is not None:
                self._reload()
            self._triggers.add(name)
            for state in self._states:
                state.trigger(name)

    def check(self, site: str) -> None:
        """Raise `InjectedFault` if a rule makes this check at ``site`` fail (every rule sees it)."""
        with self._lock:
            if self._path is not None:
                self._reload()
            fired = [state.check(site) for state in self._states]
            if not any(fired):
                return
            self._fired[site] = self._fired.get(site, 0) + 1
            if self._path is not None:
                write_fired(self._path, self._fired, self._triggers, rank=self._rank)
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


# ---- the backend seam ----------------------------------------------------------------------
class FailingRange:
    """The backend fault seam: a backing whose calls fail on purpose, one call at a time.

    Wraps a real backing (`kvcached._vmm.VirtualRange`, any `kvcached.pages.Range`) and
    delegates everything to it, except that `fail_call` makes the ``nth`` next call of ``op``
    (``"map"`` or ``"unmap"``) raise ``error`` before the backing is touched: the error path
    of every caller above runs against real memory, for one backing at a time. A call is a
    whole batch (`PageSpace.map_pages` maps its kv pages in one call per backing).
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

    def recover(self) -> None:
        """Forget every failure planned and not yet raised: the backend has recovered."""
        for planned in self._planned.values():
            planned.clear()

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
