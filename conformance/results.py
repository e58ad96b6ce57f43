"""The data that crosses the process boundary: a job going into an engine process, and the
result of every case coming back.

The parent writes a `Job` (JSON) for each engine process; the engine process writes one
`CaseResult` (JSON, plus an ``.npz`` of KV arrays) per case. Both are pydantic models with
``extra="forbid"``: an unknown or missing field, a wrong type, or a result written by another
`SCHEMA_VERSION` raises `ResultSchemaError` naming the file and the field. The case (a
`conformance.cases.Case`, in its ``to_json`` form) and the workload (the frozen
`conformance.workload.Workload` itself) cross as typed fields: the reading side gets them
parsed once, when the file is read, and a malformed one names its field. A parent never
"makes do" with a partial result: a case whose engine process died is written by the parent
as a result with an ``error``, in the same schema.

Invariants:
* ``CaseResult.kv_status == "ok"`` exactly when ``kv`` is set and the ``.npz`` beside the
  JSON holds every array ``kv`` names.
* Every count is a count of the whole case (the reference's replay oracle runs after the
  recording and is not counted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from conformance.cases import Case
from conformance.geometry import Geometry
from conformance.workload import Workload
from kvcached.stats import PoolStats

#: Bumped whenever a field changes meaning, appears or disappears.
SCHEMA_VERSION = 9

Side = Literal["reference", "candidate", "control"]
EngineKind = Literal["native", "kvcached"]
KvStatus = Literal["not-run", "pending", "ok"]
_M = TypeVar("_M", bound="_Strict")


class ResultSchemaError(RuntimeError):
    """A job or result file does not match this harness's schema (version, fields, types)."""


class _Strict(BaseModel):
    """Unknown fields are refused always; read from a file, every field must be present
    (the writer dumps defaults too, so a missing one means another schema)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _complete(cls, data: Any, info: ValidationInfo) -> Any:
        if (info.context or {}).get("complete") and isinstance(data, dict):
            missing = sorted(set(cls.model_fields) - set(data))
            if missing:
                raise ValueError(f"{cls.__name__} lacks field(s) {missing}")
        return data


# ---- parent -> engine -------------------------------------------------------------------
class Budget(_Strict):
    """The tiny-budget plan: the same block count as native bytes and as a kvcached budget."""

    blocks: int
    native_kv_cache_bytes: int
    kvcached_budget_bytes: int


class Plan(_Strict):
    """What both engines of a case share, derived by the reference from its real geometry."""

    max_model_len: int
    page_size: int | None = None
    budget: Budget | None = None


def _case(value: Any) -> Case:
    return value if isinstance(value, Case) else Case.from_json(value)


#: A case crosses the boundary as `Case.to_json` and is parsed once, by `Case.from_json`,
#: when the job or result is read (a malformed case is an error naming its field).
CaseField = Annotated[Case, PlainValidator(_case), PlainSerializer(Case.to_json)]


class JobEntry(_Strict):
    """One case of a job. The reference gets only ``case``; the others get its derivations."""

    case: CaseField
    workload: Workload | None = None  # a frozen dataclass, validated by pydantic like a model
    geometry: Geometry | None = None
    plan: Plan | None = None


class Job(_Strict):
    schema_version: int = SCHEMA_VERSION
    side: Side
    engine: EngineKind
    out_dir: Path
    page_size: int | None  # explicit KVCACHED_PAGE_SIZE; None: derived from the reference geometry
    kv_cache_bytes: int
    async_override: bool
    budget_bytes_override: int | None
    entries: list[JobEntry]
    device: Literal["cpu", "cuda"] = "cpu"  # the run's `conformance.device` profile


# ---- engine -> parent -------------------------------------------------------------------
class SchedulerRan(_Strict):
    """What really ran, read from the engine, never from the requested arguments."""

    scheduler_type: str
    batch_queue: bool
    async_scheduling: bool
    executor: str  # the executor class vLLM chose
    world_size: int  # tensor x pipeline parallel ranks
    engine_core_separate: bool | None = None  # the EngineCore ran in a process of its own (None: not read)
    model_runner: str | None = None  # rank 0's model runner class, module.name (None: not read)

    @property
    def name(self) -> str:
        return self.scheduler_type + ("+batch_queue" if self.batch_queue else "")

    @property
    def runner(self) -> str | None:
        """vLLM's model runner generation that ran: V2 lives in ``vllm.v1.worker.gpu``."""
        if self.model_runner is None:
            return None
        return "V2" if self.model_runner.startswith("vllm.v1.worker.gpu.") else "V1"

    @property
    def ran_async(self) -> bool:
        return self.scheduler_type == "AsyncScheduler" and self.batch_queue


class RequestRecord(_Strict):
    rid: str
    label: str
    pass_no: int
    prompt_len: int
    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]]]  # per position: (token, logprob, rank), by rank
    num_cached_tokens: int
    finish_reason: str | None
    finished: bool

    def complete(self, max_tokens: int) -> bool:
        return self.finished and self.finish_reason == "length" and len(self.token_ids) == max_tokens


class StepRecord(_Strict):
    step: int
    t: float  # seconds since the probe was installed
    scheduled_tokens: int
    num_requests: int
    copies: int
    preempted: int
    mapped_bytes: int
    rank_round_trips: int
    page_takes: int  # cumulative, like rank_round_trips (kvcached.PoolStats; 0 for native)
    reserve_hits: int


class ProbeRecord(_Strict):
    steps: list[StepRecord]
    schedule_fingerprint: list[list[tuple[int, int]]]  # per step: (request order, tokens)
    copies_total: int
    copy_batches: int
    preemptions_counted: int
    partial_prefix_hits: int
    prefix_hit_admissions: int


class EngineMetrics(_Strict):
    preemptions: float
    prefix_cache_queries: float
    prefix_cache_hits: float


#: One kvcached pool as ``kvcached.stats()`` reports it: kvcached's own `PoolStats` (a
#: dataclass pydantic validates like a model: unknown, missing or mistyped fields are refused),
#: so a new stats field is one edit, in ``kvcached/stats.py``.
PoolFacts = PoolStats
#: Validates the pools' facts as they arrive from the EngineCore (plain dicts there), as strictly
#: as a result file's (the config reaches the dataclass only through a container).
POOL_FACTS = TypeAdapter(dict[str, PoolFacts], config=ConfigDict(extra="forbid"))


class CopyFacts(_Strict):
    """kvcached's block-copy counters (``kvcached.copy_stats()``) on one rank."""

    batches: int
    block_copies: int
    runs_copied: int


class KvcachedFacts(_Strict):
    """kvcached's public facts over one case (pools at start and end; copies during it, per
    rank: every rank copies the same block pairs, each in its own shard)."""

    pools_start: dict[str, PoolFacts]
    pools_end: dict[str, PoolFacts]
    copies: list[CopyFacts]
    #: After the KV snapshot, once the prefix cache was reset: what the pool holds idle (None:
    #: not measured). ``idle_reset_refused``: vLLM refused the reset, blocks were still in use.
    pools_idle: dict[str, PoolFacts] | None = None
    idle_reset_refused: bool = False

    @property
    def admission_misses(self) -> int:
        return sum(p.admission_misses for p in self.pools_end.values())

    @property
    def map_failures(self) -> int:
        return sum(p.map_failures for p in self.pools_end.values())


class KvKeyRecord(_Strict):
    group: int
    kind: str
    block_size: int
    layers: list[str]
    blocks: list[tuple[int, int]]  # (block id, tokens its primary hash covers)


class KvSnapshotMeta(_Strict):
    """The prefix-cache keys of one engine and where their arrays are (see ``kvsnap``)."""

    keys: dict[str, KvKeyRecord]
    token_dims: dict[str, int | None]
    whole_block_layers: list[str]
    num_arrays: int
    ranks: int = 1


class FaultRecord(_Strict):
    fired: dict[str, int] | None  # None: the seam wrote no fired file
    triggers: list[str] | None


class EngineErrorRecord(_Strict):
    """The engine error a client saw (cases whose plan fails inside ``execute_model``)."""

    pass_no: int  # the pass whose ``generate`` raised (earlier passes' requests are recorded)
    error_type: str
    message: str


class TeardownFacts(_Strict):
    """What the engine left behind once it was shut down (read by the engine process).

    ``record_live_slots``/``record_charged_bytes``: live slots of the case's own budget
    record and their charges (None: the case used no record of its own);
    ``registered_spaces``: kvcached KV spaces still registered in this process; ``memfds``:
    this process's memfd descriptors before the engine started and after its shutdown;
    ``live_children``: descendants of this process still alive (EngineCore, workers);
    ``settle_s``: how long after the shutdown they took to go (see ``engine/teardown_check.py``).
    """

    record_live_slots: int | None
    record_charged_bytes: int | None
    registered_spaces: int
    memfds_before: int
    memfds_after: int
    live_children: list[str]
    settle_s: float  # seconds after shutdown until no slot and no engine process was left (or the cap)


class CaseResult(_Strict):
    schema_version: int = SCHEMA_VERSION
    case: CaseField
    side: Side
    engine: EngineKind
    error: str | None = None
    traceback: str | None = None
    native_defect: str | None = None  # the error is this known defect of native vLLM (its reason)
    kv_status: KvStatus = "not-run"
    model: dict[str, Any] | None = None
    plan: Plan | None = None
    fault_seam: Literal["kvcached", "harness-emulated"] | None = None
    #: kvcached's settings for the engine, by `kvcached.config.KvcachedConfig` field name, as the
    #: engine was given them (vLLM's ``additional_config``; empty for a native engine)
    kvcached_config: dict[str, int | str] = Field(default_factory=dict)
    engine_kwargs: dict[str, Any] | None = None
    t_engine_start: float | None = None
    scheduler: SchedulerRan | None = None
    geometry: Geometry | None = None
    workload: Workload | None = None
    requests: list[RequestRecord] | None = None
    t_passes: list[float] = Field(default_factory=list)
    corrupted_blocks: list[int] = Field(default_factory=list)
    metrics: EngineMetrics | None = None
    probe: ProbeRecord | None = None
    kvcached: KvcachedFacts | None = None
    mapped_bytes_peak: int = 0
    mapped_bytes_final: int = 0
    fault: FaultRecord | None = None
    kv: KvSnapshotMeta | None = None
    t_kv_snapshot: float | None = None
    replay: dict[str, list[list[int]]] = Field(default_factory=dict)
    engine_error: EngineErrorRecord | None = None  # the planned engine error (not a case error)
    teardown: TeardownFacts | None = None  # set for cases whose plan ends in an engine error
    t_total: float | None = None  # set when the engine process finished the case

    @property
    def finished(self) -> bool:
        return self.t_total is not None


def _check_version(data: Any, path: Path) -> None:
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise ResultSchemaError(
            f"{path}: written with schema version {version!r}, this harness reads {SCHEMA_VERSION} "
            "(an engine process from another checkout?)"
        )


def _load(model: type[_M], path: Path) -> _M:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ResultSchemaError(f"{path}: unreadable: {e}") from e
    _check_version(data, path)
    try:
        return model.model_validate(data, context={"complete": True})
    except ValidationError as e:
        raise ResultSchemaError(f"{path}: does not match {model.__name__}: {e}") from e


def load_result(path: Path) -> CaseResult:
    return _load(CaseResult, path)


def load_job(path: Path) -> Job:
    return _load(Job, path)


def write_atomic(path: Path, record: BaseModel) -> None:
    """Write ``record`` as JSON through a temporary file, so a reader never sees half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(record.model_dump_json())
    tmp.rename(path)

