"""The churn soak: `vllm serve` with kvcached under random traffic for a bounded time (#14).

Traffic goes to a loopback server only, bounded in time (``duration_s``) and in clients:
``clients`` threads each send, one after another, requests drawn from a seeded generator:
prompts of random length that share a random-length prefix of one root (prefix reuse), a
random number of output tokens, and one in ``1 / abort_every`` closed by the client after a
short random wait (vLLM aborts it mid-run). The KV cache (``kv_bytes``) holds fewer tokens
than the clients ask for at once, so vLLM preempts.

Phases: warm-up (a fifth of the time), idle (traffic paused, the prefix cache reset through
vLLM's dev endpoint, the engine quiet): the *baseline*; then the rest of the traffic (and, if
vLLM's preemption counter has not moved by then, a burst of `Traffic.pressure` that needs twice
the pool: random traffic preempts only by chance) and the same idle point again: the *end*. Every
second a sampler reads the server's process tree (RSS, open descriptors, kvcached's memfds)
and kvcached's mapped bytes (the engine's charge in its budget record). The soak holds when,
at the end against the baseline: RSS outside vLLM's workers within 5% (the CPU worker grows
on its own, native alike: `SoakResult.checks`), and mapped bytes, descriptors and memfds equal. Every request that completed is then sent
to a native server, with the logprob margins of its greedy tokens.

A differing token is *retried* on native: the request runs again ``retrials`` times, each
time beside a different mix of other soak requests arriving at random moments (concurrency
changes batch shapes, and CPU kernels round by batch shape). A difference is explained only
when native itself, in one of those runs, chooses the soaked token at the first differing
position; its margin is reported beside it. Every run also plants one difference of its own
(a native output with one token changed where native's margin is ordinary) and retries it
the same way: it must be caught, which shows the comparison and the retrial can fail
(`conformance.serving.retrial`, shared with the sharing run).

The *native control* (``candidate="native"``) soaks a native server the same way and replays
its requests against a second native server. Its differences are the rate native
batching alone gives, against which kvcached's soak is read; the kvcached-only checks (mapped
bytes, memfds) do not apply to it.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from conformance.cases import ARCHETYPES
from conformance.models import FIRST_FREE_TOKEN, VOCAB_SIZE, ensure_model
from conformance.serving import retrial
from conformance.serving.retrial import Difference
from conformance.serving.server import (
    Server,
    ServerError,
    ServerSpec,
    open_descriptors,
    serving,
    settled_descriptors,
    with_tokenizer,
)

RSS_TOLERANCE = 0.05
TOKEN_BYTES = 1024  # KV of one token of the tiny llama (2 layers, K and V, 2 heads of 32 float32)
CANDIDATES = ("kvcached", "native")


@dataclass(frozen=True)
class SoakPlan:
    duration_s: float = 600.0
    clients: int = 8
    seed: int = 0
    abort_every: int = 5
    kv_bytes: int = 1 << 20  # 64 blocks of the tiny llama (TOKEN_BYTES a token): fewer than 8 clients ask for
    max_model_len: int = 512
    page_size: int = 64 << 10
    candidate: str = "kvcached"  # the soaked server; "native" is the control
    retrials: int = 24  # native reruns of each differing request (and of the planted one)

    def __post_init__(self) -> None:
        if self.candidate not in CANDIDATES:
            raise ValueError(f"SoakPlan.candidate={self.candidate!r}: not one of {CANDIDATES}")
        if self.retrials < 1:
            raise ValueError(f"SoakPlan.retrials={self.retrials}: must be at least 1")


@dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    abort_after_s: float | None  # None: runs to the end


@dataclass
class Sample:
    t: float
    rss: int  # the server's whole process tree
    fds: int
    memfds: int
    mapped: int
    worker_rss: int = 0  # of ``rss``, vLLM's worker processes (0 where they cannot be told apart)

    @property
    def engine_rss(self) -> int:
        """RSS outside vLLM's workers: the API server and the EngineCore, where kvcached keeps
        its bookkeeping (ledger, page pool, fence)."""
        return self.rss - self.worker_rss


@dataclass
class SoakResult:
    plan: SoakPlan
    samples: list[Sample] = field(default_factory=list)
    baseline: Sample | None = None
    end: Sample | None = None
    warmup_end_s: float = 0.0
    traffic_end_s: float = 0.0
    sent: int = 0
    aborted: int = 0
    completed: list[tuple[Request, list[int]]] = field(default_factory=list)
    preemptions: int = 0
    differences: list[Difference] = field(default_factory=list)
    planted: Difference | None = None  # the negative control: must stay unexplained

    @property
    def mismatches(self) -> list[int]:
        """Positions (in ``completed``) of the requests that differ."""
        return [d.position for d in self.differences]

    @property
    def unexplained(self) -> list[int]:
        return [d.position for d in self.differences if not d.explained]

    def checks(self) -> dict[str, bool]:
        """What must hold at the end; mapped bytes and memfds are kvcached's, so a native
        control has neither check (they could not fail).

        RSS is checked outside vLLM's worker processes: vLLM's CPU worker grows on its own
        under new batch shapes, native alike (measured per process: +34.8 MiB native, +32.5
        kvcached over 2 minutes of the same traffic), about 3-5% of the tree in the 2-minute
        soak. kvcached's state in the worker is its KV ranges and descriptors: the mapped
        bytes, memfds and descriptors checks cover it. The tree's and the workers' RSS are
        reported.
        """
        b, e = self.baseline, self.end
        assert b is not None and e is not None
        checks = {
            "rss outside vLLM's workers within 5% of the baseline":
                abs(e.engine_rss - b.engine_rss) <= RSS_TOLERANCE * b.engine_rss,
            "mapped bytes back to the baseline": e.mapped == b.mapped,
            "descriptors back to the baseline": e.fds == b.fds,
            "memfds back to the baseline": e.memfds == b.memfds,
            "requests aborted by their clients": self.aborted > 0,
            "vLLM preempted": self.preemptions > 0,
            "every token difference is one native also gives": not self.unexplained,
            "the planted difference is caught": self.planted is not None and not self.planted.explained,
        }
        if self.plan.candidate == "native":
            del checks["mapped bytes back to the baseline"], checks["memfds back to the baseline"]
        return checks


# ---- traffic ------------------------------------------------------------------------------------
class Traffic:
    """The seeded request stream, handed out in order to the client threads."""

    def __init__(self, plan: SoakPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._root = [self._rng.randrange(FIRST_FREE_TOKEN, VOCAB_SIZE) for _ in range(256)]
        self._lock = threading.Lock()
        self._next = 0

    def take(self) -> Request:
        with self._lock:
            r, i = self._rng, self._next
            self._next += 1
            prefix = self._root[: r.randrange(0, 160)]
            tail = [r.randrange(FIRST_FREE_TOKEN, VOCAB_SIZE) for _ in range(r.randrange(1, 64))]
            abort = r.uniform(0.05, 0.6) if r.randrange(self.plan.abort_every) == 0 else None
            return Request(i, prefix + tail, r.randrange(8, 96), abort)

    def pressure(self) -> list[Request]:
        """One request per client whose KV together is twice the pool, with fresh prompts (no
        prefix hit), none aborted: sent at once, they cannot all run to the end unless vLLM
        preempts, however fast or slow the server is."""
        tokens = 2 * (self.plan.kv_bytes // TOKEN_BYTES) // self.plan.clients
        with self._lock:
            out = []
            for _ in range(self.plan.clients):
                prompt = [self._rng.randrange(FIRST_FREE_TOKEN, VOCAB_SIZE) for _ in range(tokens * 3 // 8)]
                out.append(Request(self._next, prompt, tokens - len(prompt), None))
                self._next += 1
            return out


def _client(server: Server, traffic: Traffic, stop: threading.Event, result: SoakResult, lock: threading.Lock) -> None:
    while not stop.is_set():
        req = traffic.take()
        try:
            tokens = server.complete(req.prompt, req.max_tokens, timeout_s=req.abort_after_s or 300.0)
        except (ServerError, OSError):  # a timeout closes the connection: vLLM aborts the request
            tokens = None
        with lock:
            result.sent += 1
            if req.abort_after_s is not None and tokens is None:
                result.aborted += 1
            elif tokens is None:
                raise ServerError(f"request {req.index} failed without being aborted")
            else:
                result.completed.append((req, tokens))


def _traffic(server: Server, traffic: Traffic, seconds: float, result: SoakResult) -> None:
    """The clients' traffic for ``seconds``. A client that fails ends the phase at once, with its error."""
    stop, lock = threading.Event(), threading.Lock()
    with ThreadPoolExecutor(max_workers=traffic.plan.clients) as pool:
        clients = [pool.submit(_client, server, traffic, stop, result, lock) for _ in range(traffic.plan.clients)]
        t0 = time.monotonic()
        try:
            while not any(c.done() for c in clients) and time.monotonic() - t0 < seconds:
                time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - t0))))
        finally:
            stop.set()
        for c in clients:
            c.result()


def _pressure(server: Server, traffic: Traffic, result: SoakResult) -> None:
    """`Traffic.pressure`, all at once, each request kept like the clients' (`_client`)."""
    def one(req: Request) -> None:
        tokens = server.complete(req.prompt, req.max_tokens, timeout_s=600.0)
        with lock:
            result.sent += 1
            result.completed.append((req, tokens))

    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=traffic.plan.clients) as pool:
        for f in [pool.submit(one, req) for req in traffic.pressure()]:
            f.result()


# ---- observing ----------------------------------------------------------------------------------
def _rss(server: Server) -> tuple[int, int]:
    """RSS of the server's process tree, and of the vLLM workers in it (their process title,
    set by vLLM, names them ``VLLM::Worker...``)."""
    import psutil  # type: ignore[import-untyped]  # no types-psutil in the environment

    root = psutil.Process(server.proc.pid)
    total = workers = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss = proc.memory_info().rss
            is_worker = any("::Worker" in part for part in proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        total += rss
        workers += rss if is_worker else 0
    return total, workers


def _mapped(record: Path | None) -> int:
    """The engine's charge in its budget record; a native server has none."""
    from kvcached.budget import BudgetRecord

    if record is None:
        return 0
    with BudgetRecord(str(record), create=False) as rec:
        snap = rec.snapshot()
        return sum(snap.charge_of(e) for e in snap.engines)


def _sample(server: Server, record: Path | None, t0: float, settled: bool = False) -> Sample:
    fds, memfds = settled_descriptors(server) if settled else open_descriptors(server)
    rss, workers = _rss(server)
    return Sample(round(time.monotonic() - t0, 2), rss, fds, memfds, _mapped(record), workers)


class Sampler(threading.Thread):
    """Reads the server once a second into ``out`` until ``halt`` is set."""

    def __init__(self, server: Server, record: Path | None, t0: float, out: list[Sample]) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.server, self.record, self.t0, self.out = server, record, t0, out
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            self.out.append(_sample(self.server, self.record, self.t0))


def _idle(server: Server, record: Path | None, t0: float) -> Sample:
    """Reset the prefix cache (vLLM's dev endpoint) and read the quiet engine."""
    req = urllib.request.Request(server.url + "/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        if r.status != 200:
            raise ServerError(f"reset_prefix_cache answered {r.status}")
    time.sleep(1.0)  # the next step unmaps what the fence allows, then the engine idles
    return _sample(server, record, t0, settled=True)


def _preemptions(server: Server) -> int:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:num_preemptions_total")))


# ---- the run ------------------------------------------------------------------------------------
def _model(work: Path) -> Path:
    return with_tokenizer(ensure_model(ARCHETYPES["llama"].model), work / "model")


def _soaked_spec(plan: SoakPlan, work: Path) -> tuple[ServerSpec, Path | None]:
    """The soaked server and, for kvcached, its budget record (the mapped-bytes reading)."""
    dev_mode = ("VLLM_SERVER_DEV_MODE", "1")  # /reset_prefix_cache
    if plan.candidate == "native":
        return ServerSpec("soak-native-control", False, extra_env=(dev_mode,), log_stats=True), None
    record = work / "budget" / "host.budget"
    record.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = (("KVCACHED_PAGE_SIZE", str(plan.page_size)), ("KVCACHED_BUDGET_DIR", str(record.parent)), dev_mode)
    return ServerSpec("soak-kvcached", True, extra_env=env, log_stats=True), record


def soaked_side(plan: SoakPlan, work: Path, result: SoakResult) -> None:
    spec, record = _soaked_spec(plan, work)
    traffic = Traffic(plan)
    with serving(spec, _model(work), work / "logs", max_model_len=plan.max_model_len,
                 kv_cache_bytes=plan.kv_bytes) as server:
        t0 = time.monotonic()
        sampler = Sampler(server, record, t0, result.samples)
        sampler.start()
        try:
            _traffic(server, traffic, plan.duration_s / 5, result)
            result.warmup_end_s = round(time.monotonic() - t0, 2)
            result.baseline = _idle(server, record, t0)
            _traffic(server, traffic, plan.duration_s * 4 / 5, result)
            # Random traffic preempts by chance (shared prefixes, aborts, how requests overlap):
            # under a CPU hog 4 minutes of it once never did (12-04, twice). If vLLM's own counter
            # has not moved, a burst that needs twice the pool makes it, whatever the speed.
            if _preemptions(server) == 0:
                _pressure(server, traffic, result)
            result.traffic_end_s = round(time.monotonic() - t0, 2)
            result.end = _idle(server, record, t0)
            result.preemptions = _preemptions(server)
        finally:
            sampler.halt.set()
            sampler.join()


def native_side(plan: SoakPlan, work: Path, result: SoakResult) -> None:
    """The completed requests on a native server, with the margins of its greedy tokens; each
    difference, and the planted one, retried there."""
    spec = ServerSpec("soak-native", False)
    with serving(spec, _model(work), work / "logs", max_model_len=plan.max_model_len,
                 kv_cache_bytes=plan.kv_bytes) as server, ThreadPoolExecutor(max_workers=plan.clients) as pool:
        ref = list(pool.map(lambda c: server.complete_with_margins(c[0].prompt, c[0].max_tokens, 300.0),
                            result.completed))
        found = find_differences(result.completed, ref)
        rng = random.Random(plan.seed)
        result.differences = [retry(server, result.completed, d, plan, rng) if i < retrial.MAX_RETRIED else d
                              for i, d in enumerate(found)]
        result.planted = retry(server, result.completed, plant(result.completed, ref, rng), plan, rng)


def find_differences(completed: Sequence[tuple[Request, list[int]]],
                     ref: Sequence[retrial.Reference]) -> list[Difference]:
    """Requests whose soaked tokens differ from native's, each at its first differing token."""
    return retrial.differences([got for _, got in completed], ref, [req.index for req, _ in completed])


def plant(completed: Sequence[tuple[Request, list[int]]], ref: Sequence[retrial.Reference],
          rng: random.Random) -> Difference:
    """`retrial.plant` over the completed requests' references (``request``: the soak's id)."""
    planted = retrial.plant(ref, rng)
    return dataclasses.replace(planted, request=completed[planted.position][0].index)


def retry(server: Server, completed: Sequence[tuple[Request, list[int]]], d: Difference, plan: SoakPlan,
          rng: random.Random) -> Difference:
    """`retrial.retry` of ``d``'s request beside up to ``plan.clients - 1`` other completed ones."""
    target = completed[d.position][0]
    others = [(r.prompt, r.max_tokens) for r, _ in completed if r.index != target.index]
    return retrial.retry(server, target.prompt, d, others, plan.retrials, plan.clients, rng)


def run(plan: SoakPlan, work: Path) -> SoakResult:
    result = SoakResult(plan)
    soaked_side(plan, work, result)
    native_side(plan, work, result)
    return result


def to_json(result: SoakResult) -> dict:
    out = asdict(result)
    out["completed"] = len(result.completed)
    out["mismatches"] = result.mismatches
    out["unexplained"] = result.unexplained
    out["checks"] = result.checks()
    return out
