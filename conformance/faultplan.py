"""The fault-plan file format shared by the harness and kvcached's fault seam.

This is the ONE place that knows the on-disk format, so adjusting it to kvcached's
``FaultInjector`` means editing this module only.

Plan file (written by the harness, read inside the engine process by kvcached through
``KVCACHED_FAULT_PLAN=<path>``)::

    {"plans": [{"site": "cow_admission", "after_trigger": "partial_prefix_hit", "fail_next": 2},
               {"site": "map", "skip": 1, "fail_next": 1}]}

Fired file (written by the seam next to the plan, ``<plan path>.fired.json``)::

    {"fired": {"cow_admission": 2}, "triggers": ["partial_prefix_hit"]}

Invariants:
* A rule fails exactly ``fail_next`` consecutive checks of ``site`` after it is armed.
  It is armed after ``skip`` passing checks, and only once ``after_trigger`` (if set)
  has been raised.
* ``read_fired`` never invents a count: a missing fired file means the seam never wrote
  one, which the comparator reports as "did not fire" (a failed case), never as zero
  silently accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Sites and triggers named by kvcached's core (docs/contracts.md).
SITE_MAP = "map"
SITE_ADMISSION = "admission"
SITE_COW_ADMISSION = "cow_admission"
TRIGGER_PARTIAL_PREFIX_HIT = "partial_prefix_hit"
KNOWN_SITES = frozenset({SITE_MAP, SITE_ADMISSION, SITE_COW_ADMISSION})
KNOWN_TRIGGERS = frozenset({TRIGGER_PARTIAL_PREFIX_HIT})


@dataclass(frozen=True)
class FaultRule:
    """Fail ``fail_next`` consecutive checks of ``site`` once armed."""

    site: str
    fail_next: int
    skip: int = 0
    after_trigger: str | None = None

    def __post_init__(self) -> None:
        if self.site not in KNOWN_SITES:
            raise ValueError(f"unknown fault site {self.site!r}; known: {sorted(KNOWN_SITES)}")
        if self.after_trigger is not None and self.after_trigger not in KNOWN_TRIGGERS:
            raise ValueError(f"unknown trigger {self.after_trigger!r}")
        if self.fail_next < 1 or self.skip < 0:
            raise ValueError("fail_next must be >= 1 and skip >= 0")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"site": self.site, "fail_next": self.fail_next}
        if self.skip:
            out["skip"] = self.skip
        if self.after_trigger is not None:
            out["after_trigger"] = self.after_trigger
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FaultRule:
        return cls(
            site=str(data["site"]),
            fail_next=int(data["fail_next"]),
            skip=int(data.get("skip", 0)),
            after_trigger=data.get("after_trigger"),
        )


def write_plan(path: Path, rules: tuple[FaultRule, ...]) -> Path:
    """Write the plan file and remove any stale fired file from an earlier run."""
    path.write_text(json.dumps({"plans": [r.to_json() for r in rules]}, indent=1))
    fired_path(path).unlink(missing_ok=True)
    return path


def read_plan(path: Path) -> tuple[FaultRule, ...]:
    data = json.loads(path.read_text())
    return tuple(FaultRule.from_json(r) for r in data["plans"])


def fired_path(plan_path: Path) -> Path:
    return plan_path.with_name(plan_path.name + ".fired.json")


def write_fired(plan_path: Path, fired: Mapping[str, int], triggers: Sequence[str] = ()) -> None:
    """Used by the harness-emulated seam; kvcached writes the same shape itself."""
    data = {"fired": dict(fired), "triggers": sorted(set(triggers))}
    fired_path(plan_path).write_text(json.dumps(data, sort_keys=True))


def read_fired(plan_path: Path) -> dict[str, int] | None:
    """Fired counts per site, or None when the seam wrote no fired file."""
    p = fired_path(plan_path)
    if not p.is_file():
        return None
    data = json.loads(p.read_text())
    return {str(k): int(v) for k, v in data["fired"].items()}


def read_triggers(plan_path: Path) -> list[str]:
    """Triggers the seam saw raised (empty when it wrote none or no fired file)."""
    p = fired_path(plan_path)
    return sorted(json.loads(p.read_text()).get("triggers", [])) if p.is_file() else []
