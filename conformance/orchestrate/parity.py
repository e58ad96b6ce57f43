"""The parity data the comparison produces and the reports render (parent process only).

``ParityRow`` is one comparison (a case's candidate or control against the reference);
``RequestParity`` is one request of it. Both are plain dataclasses so a report, a CSV and a
test read the same fields. A row is built once, by `assemble`, from the comparison's three
typed parts: `RowIdentity` (what was compared and what ran), `RowCounts` (what the stages
counted) and `RowVerdict` (the judgement); their fields are the row's, each in one part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from typing_extensions import Self


class ProblemKind(Enum):
    """What a problem is; the verdicts decide by this, never by a problem's wording."""

    ERROR = "error"  # an engine (or the harness in it) failed the case: nothing to compare
    MISSING = "missing"  # what the comparison needs was not recorded (requests, a KV snapshot)
    NUMERIC = "numeric"  # the two sides computed differently (tokens, or KV/logprobs under one schedule)
    CHECK = "check"  # anything else the case must show (a plan fired, nothing leaked, the layout ran, ...)


class Problem(str):
    """One problem: its text (what reports, CSV and logs show, hence a `str`) and its kind."""

    kind: ProblemKind

    def __new__(cls, kind: ProblemKind, text: str) -> Self:
        self = super().__new__(cls, text)
        self.kind = kind
        return self

    def __getnewargs__(self) -> tuple[ProblemKind, str]:  # type: ignore[override]  # copy and pickle rebuild it whole
        return self.kind, str(self)


@dataclass
class KvComparison:
    compared: int = 0  # (hash key, layer) entries present in both engines and compared
    identical: int = 0
    only_reference: int = 0  # keys cached by one engine only (schedule/eviction dependent)
    only_other: int = 0
    not_comparable: int = 0  # recurrent states captured at different fill levels
    variants: int = 0  # keys under which one engine holds blocks with different contents
    max_abs_diff: float = 0.0
    first_mismatch: str = ""


@dataclass
class LogprobComparison:
    positions: int = 0
    equal: bool = True
    max_abs_diff: float = 0.0
    topk_set_differs: int = 0


@dataclass
class RequestParity:
    rid: str
    label: str
    pass_no: int
    prompt_len: int
    ref_tokens: int
    other_tokens: int
    exact: bool
    first_divergence: int | None
    ref_cached: int
    other_cached: int
    ref_complete: bool
    other_complete: bool
    logprobs_equal: bool
    logprob_max_abs_diff: float
    topk_set_differs: int = 0
    native_history_dependent: bool = False


@dataclass
class ParityRow:
    case_id: str
    comparison: str  # "kvcached vs native" | "native vs native" | control name
    archetype: str
    scheduling: str
    pattern: str
    lengths: str
    prefix_caching: bool
    fault_plan: str
    control: str
    fault_seam: str
    scheduler_reference: str
    scheduler_other: str
    async_scheduling_reference: bool | None
    async_scheduling_other: bool | None
    layout: str  # the layout the case asked for (inproc, mp, tp2)
    layout_reference: str  # the executor and world size that really ran, e.g. MultiprocExecutor x2
    layout_other: str
    requests: int
    complete_reference: int
    complete_other: int
    output_tokens_reference: int
    output_tokens_other: int
    expected_output_tokens: int
    exact_matches: int
    first_divergence: str
    kv_blocks_compared: int
    kv_blocks_identical: int
    kv_only_reference: int
    kv_only_other: int
    kv_max_abs_diff: float
    kv_key_variants: int
    native_unstable_requests: int
    logprobs_equal: bool
    logprob_max_abs_diff: float
    prefix_hit_tokens_reference: int
    prefix_hit_tokens_other: int
    partial_prefix_hits_other: int
    cow_copies_reference: int
    cow_copies_other: int
    injected_failures_fired: str
    injected_failures_expected: int
    preemptions_reference: int
    preemptions_other: int
    peak_mapped_bytes_reference: int
    peak_mapped_bytes_other: int
    final_mapped_bytes_reference: int
    final_mapped_bytes_other: int
    same_schedule: bool
    schedule_divergence_step: int | None
    verdict: str
    passed: bool
    engine_error: str = ""  # the planned engine error the other side's client saw ("pass 2: InjectedFault")
    native_defect_reference: str = ""  # the reference failed on a known native vLLM defect (its reason)
    problems: list[Problem] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)
    wall_s_reference: float = 0.0
    wall_s_other: float = 0.0

    @property
    def native_error(self) -> bool:
        """Native vLLM failed the case on its own (a known native defect): nothing to compare,
        neither a pass nor a failure of the candidate."""
        return bool(self.native_defect_reference) and not self.passed

    def to_record(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = "; ".join(self.problems)
        d["explanations"] = "; ".join(self.explanations)
        return d

    def to_json(self) -> dict[str, Any]:
        """Every field as JSON data; a problem keeps its kind (``[kind, text]``). `from_json` inverts it."""
        return {**asdict(self), "problems": [[p.kind.value, str(p)] for p in self.problems]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParityRow:
        return cls(**{**data, "problems": [Problem(ProblemKind(kind), text) for kind, text in data["problems"]]})


@dataclass(frozen=True)
class RowIdentity:
    """What a row compares and what really ran (from the case and both results)."""

    case_id: str
    comparison: str
    archetype: str
    scheduling: str
    pattern: str
    lengths: str
    prefix_caching: bool
    fault_plan: str
    control: str
    fault_seam: str
    scheduler_reference: str
    scheduler_other: str
    async_scheduling_reference: bool | None
    async_scheduling_other: bool | None
    layout: str
    layout_reference: str
    layout_other: str
    injected_failures_expected: int
    peak_mapped_bytes_reference: int
    peak_mapped_bytes_other: int
    final_mapped_bytes_reference: int
    final_mapped_bytes_other: int
    wall_s_reference: float
    wall_s_other: float
    native_defect_reference: str


@dataclass(frozen=True)
class RowCounts:
    """What the comparison stages counted; the defaults are a row whose engines did not run."""

    requests: int = 0
    complete_reference: int = 0
    complete_other: int = 0
    output_tokens_reference: int = 0
    output_tokens_other: int = 0
    expected_output_tokens: int = 0
    exact_matches: int = 0
    first_divergence: str = ""
    kv_blocks_compared: int = 0
    kv_blocks_identical: int = 0
    kv_only_reference: int = 0
    kv_only_other: int = 0
    kv_max_abs_diff: float = 0.0
    kv_key_variants: int = 0
    native_unstable_requests: int = 0
    logprobs_equal: bool = False
    logprob_max_abs_diff: float = 0.0
    prefix_hit_tokens_reference: int = 0
    prefix_hit_tokens_other: int = 0
    partial_prefix_hits_other: int = 0
    cow_copies_reference: int = 0
    cow_copies_other: int = 0
    preemptions_reference: int = 0
    preemptions_other: int = 0
    same_schedule: bool = False
    schedule_divergence_step: int | None = None


@dataclass(frozen=True)
class RowVerdict:
    """The judgement: the verdict, its problems and explanations, and the facts it rests on."""

    verdict: str = "error"
    passed: bool = False
    problems: list[Problem] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)
    injected_failures_fired: str = ""  # what the plan's seam counted (or the budget's effects)
    engine_error: str = ""  # the planned engine error the other side's client saw


def assemble(identity: RowIdentity, counts: RowCounts, verdict: RowVerdict) -> ParityRow:
    """The one place a `ParityRow` is built: its fields are exactly the three parts' fields."""
    parts = (identity, counts, verdict)
    return ParityRow(**{f.name: getattr(part, f.name) for part in parts for f in fields(part)})
