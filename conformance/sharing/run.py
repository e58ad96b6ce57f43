"""Several engines, one budget: two `vllm serve` engines share one device's KV budget.

Engine A (tiny llama) and engine B (tiny qwen3), each its own OpenAI server with its own
multiprocess engine, share one budget record (``KVCACHED_BUDGET_PATH``, global limit
``KVCACHED_BUDGET_BYTES``). They are driven over loopback HTTP through this scenario:

1. **A's burst, then idle.** The time from A's last response to its charge being back at
   its idle watermark (the null block's page and the reserve) is measured.
2. **B's burst** (decoding `LONG` times longer, so that its requests overlap however the
   server spreads their arrival) needs more than the budget less A's peak: it fits only
   because A gave its pages back.
3. **B's limit lowered while it runs** (``kvctl limit``, the real command): B gives back idle
   memory and admits nothing new until it is under the limit; every request completes. More
   requests arrive once the command has returned, so that B runs under the limit whatever the
   machine's speed.
4. **Burst/idle cycles** on both engines: at every idle point each engine is at its
   watermark, and the servers' open file descriptors and memfds are the same at the last
   cycle as at the first.
4b. **The handover**: A's burst, then B's long burst sent the moment A's last response is in,
   while A may still hold its cached blocks (its idle grace, `KVCACHED_IDLE_GRACE_MS`). How
   long B's burst waits for A's memory is the time until B's charge passes the budget less
   A's peak; native runs the same two bursts on its static halves.
5. **A is killed with SIGKILL in the middle of a burst**, and B's next burst takes A's
   memory: the record reclaims a dead engine's charge.

A sampler reads the record at ``sample_hz`` the whole time: the device's usage must never
exceed the budget. Tokens: every completed request is compared with a native reference
(the same request alone on a native server of the same model, with each position's logprob
margin of the greedy token over the runner-up). Concurrent batches on CPU can differ in the
last bits, so a request may differ where native's choice is a near-tie: each difference is
retried on native servers beside other requests of its burst (`retrial`), and it is
explained only when native itself chooses kvcached's token there in one of those runs (a
wrong page would diverge where no batch mix flips native). A difference planted in a native
output, where native's margin is ordinary, is retried the same way and must stay
unexplained. The native servers' own concurrent bursts are compared too (reported).

The native side is the user's alternative: the same total memory split statically, half
per engine (``--kv-cache-memory-bytes``). Its bursts run too, and their durations are
reported beside kvcached's. Traffic is bounded (request counts, every wait) and loopback only.

On a GPU (``SharingPlan.cuda``, ``--device cuda``) the scenario is the same, GPU-sized: the CUDA
models in bf16, compiled with CUDA graphs as users serve them, 2 MiB pages, and bursts of
~2,600-token prompts that fill a 512 MiB budget by the same rule as on the CPU.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conformance.models import FIRST_FREE_TOKEN, VOCAB_SIZE, ensure_model, model_spec
from conformance.serving import retrial
from conformance.serving.retrial import Difference
from conformance.serving.server import (
    Server,
    ServerError,
    ServerSpec,
    Timed,
    settled_descriptors,
    start_server,
    with_tokenizer,
)

MiB = 1 << 20
ENGINES = (("A", "llama"), ("B", "qwen3"))  # engine label -> archetype (two different models)
Reference = dict[str, list[retrial.Reference]]  # burst key -> (tokens, margins) per request


@dataclass(frozen=True)
class SharingPlan:
    """Sizes and counts of one run. One kv block of either model is 16 KiB (2 layers, K and V,
    16 tokens, 2 heads of 32 float32): a burst of ``burst`` requests of ~200 tokens needs about
    ``burst`` x 14 blocks, some 60% of the budget."""

    budget_bytes: int = 6 * MiB
    page_size: int = 64 << 10
    burst: int = 16
    prompt_tokens: tuple[int, int] = (180, 230)
    max_tokens: int = 48
    cycles: int = 20
    limit_fraction: float = 0.25  # B's lowered limit, as a fraction of the budget
    sample_hz: float = 100.0
    max_reserve_pages: int = 4
    idle_timeout_s: float = 20.0
    retrials: int = 24  # native reruns of each difference (and of the planted one)
    #: Where the engines run (`conformance.models.model_spec`: CUDA's models are bf16, with wider KV).
    device: str = "cpu"
    max_model_len: int = 1024
    eager: bool = True  # CPU engines; on a GPU the servers compile, as users run them
    server_args: tuple[str, ...] = ()
    #: Bursts streamed, each request's time to first token kept (`Burst.ttft_s`): on the GPU,
    #: where it is measured. Not on 2 CPU cores: a token a chunk for 16 streams loads the API
    #: server and this process, and beside a hog (12-06) that spread a burst's requests over
    #: seconds, so B never needed what A gave back and the check could not see it.
    stream: bool = False
    #: More kvcached settings for the shared side's engines (``--kvcached-env``), after the
    #: scenario's own (`SCENARIO_KNOBS`, which these may not set): an idle grace on the CPU, say.
    kvcached_env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def quick(cls) -> SharingPlan:
        return cls(cycles=3, max_tokens=32, retrials=8)

    @classmethod
    def cuda(cls, quick: bool = False) -> SharingPlan:
        """GPU-sized: one kv block of either CUDA model is 128 KiB (2 layers, K and V, 16 tokens,
        8 heads of 128 bf16), so a burst of 16 requests of ~2,600 tokens needs some 330 MiB, 65%
        of a 512 MiB budget, in 2 MiB pages (the driver's granularity). Each server may take a
        tenth of the GPU besides its KV: vLLM checks that much is free as each one starts."""
        return cls(budget_bytes=512 * MiB, page_size=2 * MiB, prompt_tokens=(2300, 2900),
                   cycles=3 if quick else 10, retrials=8 if quick else 24, device="cuda", max_model_len=4096,
                   eager=False, server_args=("--gpu-memory-utilization", "0.1"), stream=True)

    def server(self, label: str, arch: str, kvcached: bool, extra_env: tuple[tuple[str, str], ...] = ()) -> ServerSpec:
        """One side's `vllm serve` on this plan's device."""
        return ServerSpec(label, kvcached, extra_env=extra_env, extra_args=self.server_args,
                          dtype=model_spec(arch, self.device).torch_dtype, eager=self.eager, device=self.device)

    def engine_env(self, name: str, record: Path) -> tuple[tuple[str, str], ...]:
        return self.own_env(name, record) + self.kvcached_env

    def own_env(self, name: str, record: Path) -> tuple[tuple[str, str], ...]:
        """The kvcached settings the scenario sets itself: its checks depend on them (the budget, the
        watermark of null page and reserve, a cap of 0 so that idle is empty)."""
        return (("KVCACHED_BUDGET_PATH", str(record)), ("KVCACHED_BUDGET_BYTES", str(self.budget_bytes)),
                ("KVCACHED_ENGINE_NAME", name), ("KVCACHED_PAGE_SIZE", str(self.page_size)),
                ("KVCACHED_MAX_CACHED_BLOCKS", "0"), ("KVCACHED_MAX_RESERVE_PAGES", str(self.max_reserve_pages)))


#: The names of `SharingPlan.own_env`: ``--kvcached-env`` may not set them.
SCENARIO_KNOBS = tuple(k for k, _ in SharingPlan().own_env("", Path()))


# ---- results --------------------------------------------------------------------------------
@dataclass
class Burst:
    """One burst: which engine, when, how long, and how its tokens compare."""

    engine: str
    label: str
    start_s: float
    end_s: float
    requests: int
    completed: int
    differences: list[Difference] = field(default_factory=list)  # requests that differ from the reference
    peak_bytes: int = 0
    ttft_s: list[float] = field(default_factory=list)  # each completed request's, when streamed


@dataclass
class Handover:
    """Step 4b: B's burst sent as A's ended. ``wait_s``: from B's burst's start to B's charge
    over ``above_bytes`` (the budget less A's peak: B is on memory A gave back), None if it
    never got there; ``b_peak_bytes``: B's largest charge read meanwhile. The same time for B0,
    sent once A was back at its watermark, is B's own ramp (`SharingResult.b0_over_s`): the
    difference is the wait for A's memory."""

    a_peak_bytes: int
    above_bytes: int
    b_peak_bytes: int
    wait_s: float | None


@dataclass
class SharingResult:
    plan: dict[str, object]
    samples: list[list[float]] = field(default_factory=list)  # [t, A bytes, B bytes, used, global limit]
    marks: list[tuple[float, str]] = field(default_factory=list)
    bursts: list[Burst] = field(default_factory=list)
    native_bursts: list[Burst] = field(default_factory=list)
    idle_return_s: dict[str, list[float]] = field(default_factory=dict)
    idle_bytes: dict[str, list[int]] = field(default_factory=dict)
    watermark_bytes: dict[str, int] = field(default_factory=dict)
    fds: dict[str, list[list[int]]] = field(default_factory=dict)  # engine -> per cycle [fds, memfds]
    limit_b_bytes: int = 0
    b_after_limit_bytes: int = 0
    b_under_limit_s: float = 0.0  # from `kvctl limit` to B at or under it, having read it (`limit_applied`)
    b_max_once_under_bytes: int = 0  # B's largest charge from then to the end of that burst
    b_samples_once_under: int = 0  # samples in that window (the check needs some)
    a_at_kill_bytes: int = 0
    a_gone_s: float | None = None  # from A's SIGKILL to its charge gone from the record (None: before 12-07)
    b_after_kill_peak_bytes: int = 0
    exits: dict[str, int] = field(default_factory=dict)
    planted: Difference | None = None  # the retrial's negative control: must stay unexplained
    environment: dict[str, str] = field(default_factory=dict)  # the report's block (`conformance.reporting`)
    handover: Handover | None = None  # None: a run from before step 4b (12-07)
    b0_over_s: float | None = None  # B0 (sent once A was idle): seconds to B's charge over the budget less A's peak

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), separators=(",", ":")))

    @classmethod
    def load(cls, path: Path) -> SharingResult:
        """A saved result (`save`), to render its report again."""
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SharingResult:
        """The result `asdict` gave (`save`, `SharingRun.save`)."""
        data = dict(data)
        for key in ("bursts", "native_bursts"):
            data[key] = [Burst(**(b | {"differences": [Difference(**d) for d in b["differences"]]}))
                         for b in data[key]]
        data["marks"] = [tuple(m) for m in data["marks"]]
        if data.get("planted") is not None:
            data["planted"] = Difference(**data["planted"])
        if data.get("handover") is not None:
            data["handover"] = Handover(**data["handover"])
        return cls(**data)


# ---- workload ---------------------------------------------------------------------------------
def prompts(plan: SharingPlan, engine: str, burst: int, n: int | None = None,
            tokens: tuple[int, int] | None = None) -> list[list[int]]:
    """Burst ``burst`` of ``engine``: fresh random prompts (no prefix shared across bursts) of
    ``tokens`` (default the plan's ``prompt_tokens``) tokens."""
    r = random.Random(f"{engine}-{burst}")
    lo, hi = tokens or plan.prompt_tokens
    return [[r.randrange(FIRST_FREE_TOKEN, VOCAB_SIZE) for _ in range(r.randrange(lo, hi))]
            for _ in range(n or plan.burst)]


def differences(got: Sequence[list[int] | None], ref: Sequence[retrial.Reference]) -> list[Difference]:
    """The requests of a burst whose tokens differ from the reference (a failed one too: ``first``
    -1), each where it first differs; ``position`` is the request's index in the burst."""
    return retrial.differences(got, ref, range(len(got)))


def send_burst(server: Server, batch: Sequence[Sequence[int]], max_tokens: int, stream: bool) -> list[Timed | None]:
    """All of ``batch`` at once (``stream``: streamed, each request's time to first token
    kept; else None there); a failed request gives None (only a killed engine's may)."""
    def one(p: Sequence[int]) -> Timed | None:
        try:
            if stream:
                return server.complete_timed(p, max_tokens, timeout_s=300.0)
            return Timed(server.complete(p, max_tokens, timeout_s=300.0), None)
        except (ServerError, OSError):
            return None

    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        return list(pool.map(one, batch))


def tokens_of(got: Sequence[Timed | None]) -> list[list[int] | None]:
    return [None if g is None else g.tokens for g in got]


def ttfts_of(got: Sequence[Timed | None]) -> list[float]:
    """The completed requests' times to first token."""
    return [g.ttft_s for g in got if g is not None and g.ttft_s is not None]


# ---- observing the record -----------------------------------------------------------------------
def engine_charge(snap: Any, name: str) -> int:
    """The bytes engine ``name`` holds charged in a record's snapshot (0: no live row)."""
    row = snap.engine(name)
    return int(snap.charge_of(row)) if row is not None else 0


def limit_applied(snap: Any, name: str, limit: int, since: float) -> bool:
    """Whether engine ``name`` holds at most ``limit`` bytes, having published its bytes since
    ``since`` (wall clock): the transaction of that publish read the limit too (`EngineBudget.poll`),
    so the engine keeps to it from then on. Its charge alone can dip under the limit before
    then: beside a CPU hog (12-07) B's did at the very moment ``kvctl`` returned, and rose to
    1.62 MiB over a 1.50 MiB limit before B's engine read it."""
    row = snap.engine(name)
    return row is not None and row.updated >= since and snap.charge_of(row) <= limit


class Sampler(threading.Thread):
    """Reads the budget record every 1/``hz`` s: each engine's charge, usage and the limit."""

    def __init__(self, record: Path, names: dict[str, str], hz: float, t0: float) -> None:
        super().__init__(daemon=True, name="budget-sampler")
        self.record, self.names, self.period, self.t0 = record, names, 1.0 / hz, t0
        self.rows: list[list[float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        from kvcached.budget import BudgetRecord

        with BudgetRecord(str(self.record), create=False) as rec:
            while not self.halt.wait(self.period):
                snap = rec.snapshot()
                per = [engine_charge(snap, self.names[label]) for label in ("A", "B")]
                self.rows.append([round(time.monotonic() - self.t0, 3), *per, snap.used, snap.limit or 0])

    def latest(self, label: str) -> int:
        return int(self.rows[-1][1 if label == "A" else 2]) if self.rows else 0

    def peak(self, label: str, since_s: float) -> int:
        col = 1 if label == "A" else 2
        return int(max((r[col] for r in self.rows if r[0] >= since_s), default=0))


def kvctl(record: Path, *args: str) -> str:
    """The real command line tool, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "--path", str(record), *args],
                          capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise ServerError(f"kvctl {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return done.stdout


# ---- servers ------------------------------------------------------------------------------------
@contextmanager
def two_servers(specs: dict[str, tuple[ServerSpec, Path]], logs: Path, kv_bytes: int,
                max_model_len: int) -> Iterator[dict[str, Server]]:
    """Both servers (by engine label) launched at once, waited for, stopped (SIGTERM) at exit."""
    with ExitStack() as stack:
        servers = {}
        for label, (spec, model) in specs.items():
            servers[label] = start_server(spec, model, logs, max_model_len=max_model_len, kv_cache_bytes=kv_bytes)
            stack.callback(servers[label].stop)
        for server in servers.values():
            server.wait_healthy(300.0)
        say(f"  servers {', '.join(s.spec.label for s in servers.values())} up in "
            f"{max(s.start_s for s in servers.values()):.0f} s")
        yield servers


def native_servers(plan: SharingPlan, work: Path, suffix: str = "") -> AbstractContextManager[dict[str, Server]]:
    """`two_servers`, native, each with half the budget: the user's static split."""
    specs = {label: (plan.server(f"native-{label}{suffix}", arch, False), path)
             for label, (arch, path) in models(plan, work).items()}
    return two_servers(specs, work / "logs", plan.budget_bytes // 2, plan.max_model_len)


def models(plan: SharingPlan, work: Path) -> dict[str, tuple[str, Path]]:
    """Per engine label: its archetype, and its model on the plan's device with a tokenizer."""
    return {label: (arch, with_tokenizer(ensure_model(model_spec(arch, plan.device)), work / f"model-{arch}"))
            for label, arch in ENGINES}


def kv_page_bytes(server: Server) -> int:
    """The kv page size the engine's log reports (``kvcached: elastic KV cache active ...``)."""
    import re

    match = re.search(r"kv pages of (\d+) bytes", server.log())
    if match is None:
        raise ServerError(f"{server.spec.label}: kvcached is not active (no kv page line in its log)")
    return int(match.group(1))


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``predicate`` held (polled every 10 ms); raises on timeout."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise ServerError(f"condition not met within {timeout_s} s")
        time.sleep(0.01)
    return time.monotonic() - t0


# ---- the scenario -------------------------------------------------------------------------------
def burst_plan(plan: SharingPlan) -> dict[str, list[tuple[int, int, int]]]:
    """Per engine, the (burst index, requests, max tokens) compared with native: A's first and
    cycle bursts; B's first (long), its long one with twice the requests (its limit is lowered
    while it runs), its cycle bursts, the double-size one after A's death, and the requests sent
    once its limit is lowered (`limited_burst`)."""
    n, m = plan.burst, plan.max_tokens
    a = [(0, n, m)] + [(1 + c, n, m) for c in range(plan.cycles)]
    b = [(0, n, LONG * m), (1, 2 * n, LONG * m)] + [(2 + c, n, m) for c in range(plan.cycles)]
    b += [(2 + plan.cycles, 2 * n, LONG * m), (after_limit_index(plan), n, LONG * m)]
    return {"A": a, "B": b}


def held_prompt_tokens(plan: SharingPlan) -> tuple[int, int]:
    """Prompt lengths of A's killed burst: three times the plan's, capped so that a prompt and its
    ``LONG`` output fit ``max_model_len``."""
    lo, hi = plan.prompt_tokens
    cap = plan.max_model_len - LONG * plan.max_tokens - 1
    return min(3 * lo, cap - 1), min(3 * hi, cap)


def after_limit_index(plan: SharingPlan) -> int:
    """The index of B's burst sent once `kvctl limit` has returned (after every other B burst's)."""
    return 3 + plan.cycles


#: A step 4b burst: engine, burst index, requests, max tokens, prompt lengths.
HandoverBurst = tuple[str, int, int, int, tuple[int, int]]


def handover_bursts(plan: SharingPlan) -> dict[str, HandoverBurst]:
    """Step 4b's bursts by label, in the order sent. A's is the killed burst's kind (twice the
    requests, long outputs, prompts three times as long), so that A holds memory however its
    requests reach the server; B's is B's long one. A's index comes after its killed burst's, B's
    after every other B burst's, so neither is in `burst_plan`: they are timed, not compared (the
    rest of the run compares every other request)."""
    n, m = plan.burst, plan.max_tokens
    return {"A handover": ("A", 2 + plan.cycles, 2 * n, LONG * m, held_prompt_tokens(plan)),
            "B handover": ("B", 4 + plan.cycles, n, LONG * m, plan.prompt_tokens)}


@functools.cache
def compared_bursts(plan: SharingPlan) -> dict[str, tuple[str, list[list[int]], int]]:
    """`burst_plan` by burst key (``A0``, ``B1``, ...): engine, prompts and max tokens (read, never
    changed: one copy per plan)."""
    return {f"{engine}{index}": (engine, prompts(plan, engine, index, n), m)
            for engine, bursts in burst_plan(plan).items() for index, n, m in bursts}


#: B's first burst decodes this many times longer: its 16 requests reach the server in waves
#: on a busy machine, and with short outputs the early ones finished before the late ones
#: came (measured: a 2.1 MiB peak, where the check needs more than the budget less A's peak).
#: So does B's limited burst, so that it still runs well after `kvctl` (a Python start) has
#: lowered the limit. That one also has twice the requests: B gets under its limit only as
#: running requests finish, and the check needs the burst to go on under it, admitting the
#: ones still waiting (with one burst's worth, the last ones could end within 0.1 s of it on
#: a fast machine: measured, 8 samples). So do A's killed burst (it must still hold memory
#: when it is killed) and B's double burst after it (it must overlap to need A's memory):
#: under a CPU hog, short ones timed out waiting for A's charge (CI, 12-03).
LONG = 6


@dataclass
class Stage:
    """What the kvcached scenario runs on: its plan, servers, sampler, reference and results."""

    plan: SharingPlan
    servers: dict[str, Server]
    names: dict[str, str]
    sampler: Sampler
    reference: Reference
    result: SharingResult
    record: Path

    def now(self) -> float:
        return time.monotonic() - self.sampler.t0

    def mark(self, label: str) -> None:
        self.result.marks.append((round(self.now(), 3), label))
        say(f"  {label}")

    def burst(self, engine: str, index: int, n: int | None = None, label: str = "", max_tokens: int = 0,
              tokens: tuple[int, int] | None = None) -> Burst:
        """Burst ``index`` of ``engine``, sent at once; its tokens are compared with the reference
        of ``ENGINEindex`` where there is one."""
        batch = prompts(self.plan, engine, index, n, tokens)
        start = self.now()
        got = send_burst(self.servers[engine], batch, max_tokens or self.plan.max_tokens, self.plan.stream)
        done = Burst(engine, label or f"{engine}{index}", round(start, 3), round(self.now(), 3), len(batch),
                     sum(t is not None for t in got), ttft_s=ttfts_of(got))
        ref = self.reference.get(f"{engine}{index}")
        if ref is not None:
            done.differences = differences(tokens_of(got), ref)
        done.peak_bytes = self.sampler.peak(engine, start)
        self.result.bursts.append(done)
        return done

    def burst_read(self, engine: str, above: int, index: int, n: int | None, max_tokens: int,
                   label: str = "", tokens: tuple[int, int] | None = None) -> tuple[Burst, int, float | None]:
        """`burst` on a thread of its own while ``engine``'s charge is read from the record
        (`charge_over` ``above``): the burst, the largest charge read, and the seconds from the
        burst's start to the read that saw the charge over ``above`` (None: never)."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            start = self.now()
            running = pool.submit(self.burst, engine, index, n, label, max_tokens, tokens)
            seen, at = self.charge_over(engine, above, running)
            return running.result(timeout=600), seen, None if at is None else round(at - start, 3)

    def charge_over(self, engine: str, above: int, running: Future[Burst]) -> tuple[int, float | None]:
        """``engine``'s largest charge read from the record (every 10 ms, a reader of its own)
        until it is over ``above`` or ``running`` ends, and the stage time of the read that saw
        it over (None: it never was)."""
        from kvcached.budget import BudgetRecord

        seen, at = 0, None
        with BudgetRecord(str(self.record), create=False) as rec:
            while not running.done():
                seen = max(seen, engine_charge(rec.snapshot(), self.names[engine]))
                if seen > above:
                    at = self.now()
                    break
                time.sleep(0.01)
        return seen, at

    def until(self, holds: Callable[[Any], bool], timeout_s: float) -> float:
        """Seconds until ``holds`` is true of the record's snapshot, read every 10 ms by a reader
        of its own (`wait_until`; raises on timeout)."""
        from kvcached.budget import BudgetRecord

        with BudgetRecord(str(self.record), create=False) as rec:
            return wait_until(lambda: holds(rec.snapshot()), timeout_s)

    def idle(self, engine: str) -> None:
        """Wait for ``engine`` to be back at its watermark; record how long that took."""
        watermark = self.result.watermark_bytes[engine]
        took = wait_until(lambda: self.sampler.latest(engine) <= watermark, self.plan.idle_timeout_s)
        self.result.idle_return_s.setdefault(engine, []).append(round(took, 3))
        self.result.idle_bytes.setdefault(engine, []).append(self.sampler.latest(engine))


def native_side(plan: SharingPlan, work: Path, result: SharingResult) -> Reference:
    """Native servers, half the budget each: the reference tokens (every compared request
    alone), the same bursts concurrently (their durations, and the noise floor), and the
    retrial's negative control (`plant`ed in A's first burst, retried there)."""
    reference: Reference = {}
    with native_servers(plan, work) as by:
        bursts = compared_bursts(plan)
        for key, (engine, batch, m) in bursts.items():
            reference[key] = [by[engine].complete_with_margins(p, m) for p in batch]
        say(f"  reference: {sum(len(b) for _, b, _ in bursts.values())} requests, each alone")
        t0 = time.monotonic()
        timed = [(key, *bursts[key]) for key in ("A0", "B0", "B1", f"B{2 + plan.cycles}")]
        timed += [(key, engine, prompts(plan, engine, index, n, tokens), m)  # one after the other, as step 4b
                  for key, (engine, index, n, m, tokens) in handover_bursts(plan).items()]
        for key, engine, batch, m in timed:
            start = time.monotonic() - t0
            got = send_burst(by[engine], batch, m, plan.stream)
            ref = reference.get(key)  # the handover's bursts are timed only
            result.native_bursts.append(Burst(engine, key, round(start, 3), round(time.monotonic() - t0, 3),
                                              len(batch), sum(t is not None for t in got),
                                              [] if ref is None else differences(tokens_of(got), ref),
                                              plan.budget_bytes // 2, ttfts_of(got)))
        planted = retrial.plant(reference["A0"], random.Random(0))
        result.planted = retry_in_burst(plan, by["A"], "A0", planted, random.Random(1))
    return reference


def retrial_side(plan: SharingPlan, work: Path, result: SharingResult) -> None:
    """Every difference of kvcached's compared bursts (up to `retrial.MAX_RETRIED`) retried on native
    servers, half the budget each (`retrial.retry`); none started when nothing differs."""
    keys = compared_bursts(plan)
    pending = [(burst, k) for burst in result.bursts if burst.label in keys
               for k, d in enumerate(burst.differences) if d.first >= 0][:retrial.MAX_RETRIED]
    if not pending:
        return
    rng = random.Random(2)
    say(f"  {len(pending)} difference(s) to retry")
    with native_servers(plan, work, "-retrial") as by:
        for burst, k in pending:
            burst.differences[k] = retry_in_burst(plan, by[burst.engine], burst.label, burst.differences[k], rng)


def retry_in_burst(plan: SharingPlan, server: Server, key: str, d: Difference, rng: random.Random) -> Difference:
    """`retrial.retry` of request ``d.position`` of burst ``key`` beside others of that burst."""
    _, batch, m = compared_bursts(plan)[key]
    companions = [(p, m) for i, p in enumerate(batch) if i != d.position]
    return retrial.retry(server, batch[d.position], d, companions, plan.retrials, plan.burst, rng)


def shared_side(plan: SharingPlan, work: Path, reference: Reference,
                result: SharingResult) -> None:
    """The kvcached scenario (module docstring, steps 1-5) on two engines sharing a record."""
    record = work / "host.budget"
    names = {label: f"{label}-{arch}" for label, arch in ENGINES}
    specs = {label: (plan.server(f"kvcached-{label}", arch, True, plan.engine_env(names[label], record)), path)
             for label, (arch, path) in models(plan, work).items()}
    # The virtual capacity: the budget itself (each engine could take all of it).
    with two_servers(specs, work / "logs", plan.budget_bytes, plan.max_model_len) as servers:
        sampler = Sampler(record, names, plan.sample_hz, time.monotonic())
        sampler.start()
        stage = Stage(plan, servers, names, sampler, reference, result, record)
        try:
            for label, server in stage.servers.items():
                result.watermark_bytes[label] = (1 + plan.max_reserve_pages) * kv_page_bytes(server)
            run_scenario(stage)
        finally:
            sampler.halt.set()
            sampler.join(10)
            result.samples = sampler.rows
        for label, server in stage.servers.items():
            code = server.proc.poll()
            result.exits[label] = code if code is not None else 0


def run_scenario(stage: Stage) -> None:
    plan, result = stage.plan, stage.result
    stage.mark("A burst")
    a0 = stage.burst("A", 0)
    stage.idle("A")
    stage.mark("B burst (A idle)")
    # B's peak is read from the record while the burst runs too (`burst_read`, up to what
    # shows B used memory A gave back), not only by the sampler: beside a CPU hog the
    # sampler's reads came 1-2 s apart (12-05) and can miss a peak.
    b0, seen, result.b0_over_s = stage.burst_read("B", plan.budget_bytes - a0.peak_bytes, 0, None,
                                                  LONG * plan.max_tokens)
    b0.peak_bytes = max(b0.peak_bytes, seen)
    stage.idle("B")
    limited_burst(stage)
    for cycle in range(plan.cycles):
        if cycle in (0, plan.cycles - 1):
            stage.mark(f"cycle {cycle + 1}")
        for engine, index in (("A", 1 + cycle), ("B", 2 + cycle)):
            stage.burst(engine, index)
            stage.idle(engine)
            result.fds.setdefault(engine, []).append(list(settled_descriptors(stage.servers[engine])))
    handover(stage)
    kill_a(stage)


def handover(stage: Stage) -> None:
    """Step 4b: A's burst, then B's long one the moment A's last response is in. How long B
    waits for the memory A still holds (its idle grace), read from the record as B's charge
    passing the budget less A's peak."""
    plan, result = stage.plan, stage.result
    (a_label, (_, a_index, a_n, a_max, a_tokens)), (b_label, (_, b_index, b_n, b_max, b_tokens)) = \
        handover_bursts(plan).items()
    stage.mark("handover: B's burst as A's ends")
    # A's peak is read from the record through its whole burst (a charge over the budget never
    # comes), not only by the sampler, whose reads came seconds apart beside a CPU hog (12-05).
    # Beside a hog (12-07) A's burst of the plan's own kind ran within its reserve pages: its
    # peak was its watermark, so B's bar was all B could ever have, and B never passed it. Hence
    # A's killed-burst kind of burst (`handover_bursts`).
    a, a_seen, _ = stage.burst_read("A", plan.budget_bytes, a_index, a_n, a_max, a_label, a_tokens)
    a_peak = max(a.peak_bytes, a_seen)
    above = plan.budget_bytes - a_peak
    b, seen, wait_s = stage.burst_read("B", above, b_index, b_n, b_max, b_label, b_tokens)
    result.handover = Handover(a_peak, above, max(seen, b.peak_bytes), wait_s)
    wait_until(lambda: stage.sampler.latest("A") <= result.watermark_bytes["A"], plan.idle_timeout_s)
    stage.idle("B")


def limited_burst(stage: Stage) -> None:
    """B's limit is lowered (``kvctl limit``) while its burst runs, cleared after.

    Requests are also sent once ``kvctl`` has returned (the event), so that the burst goes on
    under the lowered limit however fast its first requests were served: on a busy machine the
    command's start outlasted a whole burst (CI run, 12-04: the burst ended 0.24 s before the limit).
    """
    plan, result = stage.plan, stage.result
    limit = int(plan.budget_bytes * plan.limit_fraction)
    result.limit_b_bytes = limit
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = pool.submit(stage.burst, "B", 1, 2 * plan.burst, "", LONG * plan.max_tokens)
        wait_until(lambda: stage.sampler.latest("B") > limit, 60.0)
        stage.mark("kvctl limit B")
        kvctl(stage.record, "limit", stage.names["B"], str(limit))
        lowered, set_at = stage.now(), time.time()
        after = pool.submit(stage.burst, "B", after_limit_index(plan), None, "", LONG * plan.max_tokens)
        applied = stage.until(lambda snap: limit_applied(snap, stage.names["B"], limit, set_at), 120.0)
        result.b_under_limit_s = round(applied, 3)
        under = stage.now()
        end = max(running.result(timeout=600).end_s, after.result(timeout=600).end_s)
    once_under = [r[2] for r in stage.sampler.rows if under <= r[0] <= end]
    result.b_max_once_under_bytes = int(max(once_under, default=0))
    result.b_samples_once_under = len(once_under)
    if under > end:  # B got under only once its requests were all served: the check below is vacuous
        raise ServerError(f"B's bursts ended {end - lowered:.2f} s after the limit, before B was under it")
    wait_until(lambda: stage.sampler.latest("B") <= limit, plan.idle_timeout_s)
    result.b_after_limit_bytes = stage.sampler.latest("B")
    kvctl(stage.record, "clear", stage.names["B"])
    stage.mark("kvctl clear B")
    stage.idle("B")


def kill_a(stage: Stage) -> None:
    """SIGKILL A's whole server while its burst holds memory; then, once the record has freed
    A's charge, B's double burst."""
    plan, result = stage.plan, stage.result
    server = stage.servers["A"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        # Long outputs, so that A's requests, reaching the server in waves on a busy machine,
        # overlap and hold memory until the kill (short ones ended before the late ones came).
        # Twice a burst, as B's after the kill: needing more than the whole budget, A fills what
        # it may however its requests reach the server (one burst of them, arriving in waves
        # beside a CPU hog, never held a third of the budget within 60 s: 12-05).
        # Its prompts are three times as long, so that each request holds its share from its
        # prefill on and a few at once fill a third: with the plan's prompts, arriving in waves
        # beside a CPU hog, all 32 were served without A's charge passing a third (CI, 12-05).
        # The wait reads the record itself (`charge_over`), not the sampler's latest row.
        killed = pool.submit(stage.burst, "A", 1 + plan.cycles, 2 * plan.burst, "A (killed)",
                             LONG * plan.max_tokens, held_prompt_tokens(plan))
        result.a_at_kill_bytes, _ = stage.charge_over("A", plan.budget_bytes // 3, killed)
        if killed.done():
            raise ServerError(f"A's killed burst ended before A held a third of the budget "
                              f"(at most {result.a_at_kill_bytes / MiB:.2f} MiB)")
        stage.mark("SIGKILL A")
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
    # The record frees a dead engine's charge once the last of its processes is gone (their
    # locks go with them), not when the server's own process is: B's burst starts then, so
    # that its bar is all A left. How long that took is the scenario's to report.
    result.a_gone_s = round(stage.until(lambda snap: engine_charge(snap, stage.names["A"]) == 0, 60.0), 3)
    start = stage.now()
    stage.mark("B: 2x burst")
    # As B's first: overlapping, and needing twice the budget, so B fills what A left. The check
    # waits on that event (B's charge over the budget less A's charge at the kill), read from
    # the record while the burst runs, not on the sampler catching a peak: beside a CPU hog the
    # sampler went 6 s between reads (12-05).
    above = plan.budget_bytes - result.a_at_kill_bytes
    _, seen, _ = stage.burst_read("B", above, 2 + plan.cycles, 2 * plan.burst, LONG * plan.max_tokens)
    result.b_after_kill_peak_bytes = max(stage.sampler.peak("B", start), seen)
    stage.idle("B")


#: A run's sides, in order: native (reference tokens, static split, the planted control), the
#: shared kvcached side, the retrial of its differences on native.
SIDES = ("native", "shared", "retrial")


@dataclass
class SharingRun:
    """A run between its sides: the result so far, native's reference tokens, and the sides
    done (a prefix of `SIDES`). Saved after each side (`run`), so that a run goes on over
    several invocations, as on a lent GPU whose calls last minutes and whose three sides each
    start two servers."""

    result: SharingResult
    reference: Reference = field(default_factory=dict)
    done: list[str] = field(default_factory=list)

    def save(self, path: Path) -> None:
        """Written whole, then renamed over ``path``: a run killed while saving keeps the last state."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"result": asdict(self.result), "reference": self.reference, "done": self.done},
                                  separators=(",", ":")))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, plan: SharingPlan) -> SharingRun:
        """The state `save` wrote; `SharingStateError` if it is not one, or another plan made it."""
        try:
            data = json.loads(path.read_text())
            state = cls(SharingResult.from_dict(data["result"]),
                        {k: [(list(t), list(m)) for t, m in refs] for k, refs in data["reference"].items()},
                        list(data["done"]))
        except (ValueError, KeyError, TypeError) as e:
            raise SharingStateError(f"{path} is not a sharing run's saved state ({type(e).__name__}: {e}): "
                                    "remove it to start over") from None
        if state.result.plan != plan_record(plan):
            raise SharingStateError(f"{path} is a run of another plan (--quick or --device differ): remove it, "
                                    "or go on with the plan that made it")
        return state


def plan_record(plan: SharingPlan) -> dict[str, Any]:
    """The plan as its result records it: in JSON's types (lists, not tuples), so that the report
    a run writes and the one rendered again from its saved JSON are the same."""
    return json.loads(json.dumps(asdict(plan)))


class SharingStateError(ValueError):
    """Sides asked for out of their order, or a saved state of another plan: nothing ran."""


def check_order(done: Sequence[str], sides: Sequence[str]) -> None:
    """`SharingStateError` unless ``sides`` are the next of `SIDES` after ``done``, in order."""
    if list(sides) != list(SIDES[len(done):len(done) + len(sides)]) or not sides:
        raise SharingStateError(f"sides {', '.join(sides) or 'none'} cannot run now: sides done: "
                                f"{', '.join(done) or 'none'}; they run in the order {', '.join(SIDES)}")


def _run_side(side: str, plan: SharingPlan, work: Path, state: SharingRun) -> None:
    """Run ``side``, the next one `state` lacks (`run` checked the order before the first)."""
    say(f"{side} side")
    if side == "native":
        state.reference = native_side(plan, work, state.result)
    elif side == "shared":
        shared_side(plan, work, state.reference, state.result)
    else:
        retrial_side(plan, work, state.result)
    state.done.append(side)


def run(plan: SharingPlan, work: Path, sides: Sequence[str] = SIDES, state_path: Path | None = None) -> SharingRun:
    """The run's ``sides`` (each after those `state_path` says are done, saving the state
    there after each); the whole scenario by default."""
    work.mkdir(parents=True, exist_ok=True)
    if state_path is not None and state_path.is_file():
        state = SharingRun.load(state_path, plan)
    else:
        state = SharingRun(SharingResult(plan=plan_record(plan)))
    check_order(state.done, sides)  # before any server starts
    for side in sides:
        _run_side(side, plan, work, state)
        if state_path is not None:
            state.save(state_path)
    return state


def say(line: str) -> None:
    """A progress line on stderr: a run takes minutes, the GPU one longer than a device call."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)
