"""EngineCore seams: where the scheduler's pool meets the workers' memory, in any layout.

vLLM's EngineCore owns both ends: the executor (its workers hold the KV tensors, one rank
each) and the scheduler (its pool decides which kv pages are mapped). kvcached joins them
where vLLM does, with vLLM's own channel, the executor's ``collective_rpc``: in-process for
the ``UniProcExecutor``, over its message queues for the ``MultiprocExecutor`` (every
multiprocess engine on CPU, every TP>1 engine), over Ray for the Ray executor (designed for,
not run: vLLM refuses Ray on CPU). Nothing is handed over through a module, a socket or a
file, and nothing untrusted is unpickled: requests and replies are plain data.

Three attributes are replaced, each restored exactly by `uninstall` (installed with the
scheduler seams). ``EngineCore.__init__`` itself cannot be one: it is what loads plugins in
the EngineCore process, so a patch of it would miss the very engine being built.

``EngineCore._initialize_kv_caches``
    After vLLM's own (the workers allocated their KV ranges and mapped the null block's
    page), `prepare` asks every rank for its layout (`RankLayout`: geometry, premapped
    pages, capacity, the config the worker resolved), checks that every rank agrees and
    builds the `KvSpace` whose pages are a `kvcached.ranks.RankedPageSpace` mapping each
    batch on every rank. It travels to the scheduler with the engine's own
    ``kv_cache_config`` object (attribute ``_kvcached_space``), the one vLLM passes on. A
    layout kvcached does not serve is refused here, naming it (`check_parallel_layout`).

``Scheduler.__init__``
    After vLLM's own (which built the `ElasticBlockPool`, detached), `attach` gives the pool
    the prepared space, before the engine can schedule anything.

``EngineCore.shutdown``
    Before vLLM's own (which stops the executor first), `disconnect` logs the pool's lifetime
    counters (`kvcached.stats.shutdown_line`) and closes the pool: every
    page is unmapped on every rank and every rank forgets its space. If the executor has
    already failed (a worker died), nothing can be unmapped remotely; the pool is closed
    locally and the ranks' memory went, or goes, with their processes.

The step fence needs nothing more: every request reaches every rank in order behind the
steps sent before it, so a map requested while scheduling step N is done on every rank
before step N runs there, and an unmap requested after step N executed reaches each rank
after that rank has run step N.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from kvcached.budget import BudgetRecord, EngineBudget, EngineShare
from kvcached.config import KvcachedConfig
from kvcached.config import engine_name as default_engine_name
from kvcached.errors import IntegrationError, KvcachedError
from kvcached.idle import Post
from kvcached.integration.vllm.engine_config import device_type
from kvcached.ranks import PageRequest, RankedPageSpace, RankLayout, RankReply, check_layouts
from kvcached.space import KvSpace
from kvcached.stats import shutdown_line

# A child of vLLM's logger, so its handlers (and the server's log) carry kvcached's lines.
_logger = logging.getLogger("vllm.kvcached")


def rank_rpc_timeout(executor: Any) -> float:
    """Seconds a page request may wait for every rank's reply before the engine is
    considered broken: never less than vLLM itself waits for the work that can be ahead of it.

    A request reaches each rank in order behind the steps already sent (the step fence
    above), so it waits for them. vLLM allows each step's RPCs ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``
    (``MultiprocExecutor.execute_model`` and ``sample_tokens``); up to
    ``max_concurrent_batches`` steps are in flight (its batch queue: 2 with async
    scheduling); the request itself is allowed one step's time more. A fixed timeout
    shorter than vLLM's (120 s against its 300 s, issue 32) killed EngineCore with a
    ``TimeoutError`` in ``schedule`` behind a long step vLLM tolerated. The bound is
    generous on purpose: it only turns a rank that never answers into an error.

    Read through ``vllm.envs`` when called (`prepare`, at engine start), as vLLM reads it, so
    a value the user set is honoured (vLLM caches its environment only after start-up).
    Same name, type (int seconds, default 300) and use in vLLM 0.26.0 and 0.28.0
    (``vllm/envs.py``, ``vllm/v1/executor/multiproc_executor.py``; ``max_concurrent_batches``
    is a ``VllmConfig`` property in ``vllm/config/vllm.py`` of both), so no row in
    `capabilities`. The ``UniProcExecutor`` runs requests inline and ignores it; the Ray
    executor (designed for, not run) bounds a step by ``RAY_CGRAPH_get_timeout`` instead,
    which vLLM also sets to 300 s, and is given the same derivation.

    Invariant: ``(max_concurrent_batches + 1) * VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``.
    """
    from vllm import envs

    step_s = float(envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)
    return step_s * (steps_in_flight(executor) + 1)


def steps_in_flight(executor: Any) -> int:
    """The most steps vLLM keeps in flight on ``executor``'s workers (its batch queue's size)."""
    return int(executor.vllm_config.max_concurrent_batches)


# ---- worker side (run on every rank by collective_rpc; module level, so picklable by name) --
def _flat(caches: Any) -> list[Any]:
    if isinstance(caches, (list, tuple)):
        return [t for c in caches for t in _flat(c)]
    return [caches] if caches is not None else []


def _rank_kv(worker: Any) -> Any:
    """This rank's registered KV space, found through the worker's own KV tensors."""
    from kvcached.integration.vllm.rank_kv import rank_kv_of

    runner = worker.model_runner
    for t in _flat(getattr(runner, "kv_caches", None)):
        if (kv := rank_kv_of(t)) is not None:
            if kv.pages.rank != int(worker.rank):
                raise IntegrationError(f"worker rank {worker.rank} holds the KV space of rank {kv.pages.rank}")
            return kv
    raise IntegrationError(f"worker rank {worker.rank} has no kvcached KV space (is kvcached enabled there?)")


def rank_layout(worker: Any) -> tuple[RankLayout, dict[str, Any]]:
    """This rank's layout and the config its worker resolved."""
    kv = _rank_kv(worker)
    return kv.pages.layout(), asdict(kv.space.config)


def rank_request(worker: Any, request: PageRequest) -> RankReply:
    """Apply one page request on this rank (a close also forgets the space)."""
    from kvcached.integration.vllm.rank_kv import forget_rank_kv

    kv = _rank_kv(worker)
    reply = kv.pages.handle(request)
    if request.op == "close" and reply.ok:
        forget_rank_kv(kv)
    return reply


def runs_inline(executor: Any) -> bool:
    """Whether the executor's worker runs in this process, on the caller's thread: its
    "non-blocking" ``collective_rpc`` then runs the call before returning."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return isinstance(executor, UniProcExecutor)


def refills_in_background(setting: str, executor: Any, device_type: str) -> bool:
    """``KVCACHED_BACKGROUND_REFILL``: ``on``/``off``, or ``auto``: an in-process worker on
    CUDA (a refill's driver calls cost far more there than a thread handoff; on CPU an
    mmap costs less than handing the work to a thread under the GIL, so it runs inline and
    is counted as a blocking map)."""
    if setting != "auto":
        return setting == "on" and runs_inline(executor)
    return runs_inline(executor) and device_type == "cuda"


class ExecutorChannel:
    """`kvcached.ranks.PageChannel` over a vLLM executor's ``collective_rpc``.

    ``call_later`` should not cost the caller the call. A multiprocess executor sends it
    over its queues and returns a future. An in-process one (``UniProcExecutor``: every
    TP=1 engine on a GPU) runs it inline; with ``background`` it runs on one thread of the
    channel's own instead (see `refills_in_background`), and so does a busy step's unmap.
    That is safe because a refill's pages are never handed out, touched or unmapped until
    the pool has its reply, an unmap's pages are never handed out or mapped again until it
    has that one's (and no step in flight touches them: the fence chose them), the rank
    serializes the requests it applies (`kvcached.ranks.RankPages`), and the backends
    release the GIL and lock their ranges.
    """

    def __init__(self, executor: Any, timeout_s: float, *, background: bool = False) -> None:
        self.executor = executor
        self.timeout_s = timeout_s
        self._background = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcached-refill")
                            if background else None)

    def call(self, request: PageRequest) -> list[RankReply]:
        return list(self.executor.collective_rpc(rank_request, timeout=self.timeout_s, args=(request,)))

    def call_later(self, request: PageRequest) -> Any:
        """Send without waiting; returns a future of the replies."""
        if self._background is not None:
            return self._background.submit(self.call, request)
        return self.executor.collective_rpc(rank_request, timeout=self.timeout_s, args=(request,), non_block=True)

    def close(self) -> None:
        """Stop the background thread, if any, after the calls it has (idempotent)."""
        if self._background is not None:
            self._background.shutdown(wait=True)


# ---- EngineCore side ---------------------------------------------------------------------------
def check_parallel_layout(vllm_config: Any) -> None:
    """Refuse, naming it, a parallel layout kvcached does not serve (before any page maps)."""
    par = vllm_config.parallel_config
    supported = ("supported: one engine core per engine with tensor parallelism of any size, "
                 "through the uniproc, multiprocess or Ray executor")
    if int(getattr(par, "pipeline_parallel_size", 1)) > 1:
        raise IntegrationError(f"kvcached does not serve pipeline parallelism "
                               f"(pipeline_parallel_size={par.pipeline_parallel_size}); {supported}")
    if getattr(par, "distributed_executor_backend", None) == "external_launcher":
        raise IntegrationError("kvcached does not serve distributed_executor_backend='external_launcher' "
                               f"(every rank runs its own scheduler); {supported}")
    if int(getattr(par, "data_parallel_size", 1)) > 1:
        raise IntegrationError(f"kvcached does not serve data parallelism (data_parallel_size="
                               f"{par.data_parallel_size}): it has not been run; {supported}")


def _elastic_pool(scheduler: Any) -> Any:
    from kvcached.integration.vllm.block_pool import ElasticBlockPool

    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    return pool if isinstance(pool, ElasticBlockPool) else None


SPACE_ATTRIBUTE = "_kvcached_space"
#: Where `prepare` leaves the engine's `idle_post` for `attach` (None: an in-process engine).
IDLE_POST_ATTRIBUTE = "_kvcached_idle_post"


def idle_post(core: Any) -> Post | None:
    """How the pool's idle grace runs its give-back on ``core``'s thread while it idles; None
    for an in-process engine (``LLM`` without multiprocessing), whose thread is its caller's.

    A served engine (`EngineCoreProc`: ``vllm serve``, ``AsyncLLM``, a multiprocess ``LLM``)
    blocks on its input queue when it has no work, and each time that queue yields it first
    runs and drops the callables on its ``_idle_state_callbacks`` (``_process_input_queue``,
    vLLM 0.26.0-0.32.0, where pausing the engine uses the same list). A ``WAKEUP`` request,
    which vLLM handles as nothing (its signal handlers send one to stop an idle engine), makes
    the queue yield. The timer's thread appends and sends; the callable runs on the engine's.
    """
    queue = getattr(core, "input_queue", None)
    if queue is None:
        return None
    from vllm.v1.engine import EngineCoreRequestType

    wakeup = getattr(EngineCoreRequestType, "WAKEUP", None)
    if wakeup is None or not callable(getattr(type(core), "_notify_idle_state_callbacks", None)):
        raise IntegrationError(f"{type(core).__qualname__} has no idle callbacks or no WAKEUP request, which "
                               "kvcached's idle grace needs (vLLM 0.26-0.32 have both); set KVCACHED_IDLE_GRACE_MS=0")

    def post(action: Callable[[], None]) -> None:
        core._idle_state_callbacks.append(lambda _core: action())
        queue.put_nowait((wakeup, None))

    return post


def prepare(core: Any, kv_cache_config: Any) -> None:
    """Ask every rank for its KV layout; leave the engine's space on ``kv_cache_config``."""
    from kvcached.integration.vllm.install_state import is_enabled

    if not is_enabled() or int(getattr(kv_cache_config, "num_blocks", 0)) <= 0 \
            or not kv_cache_config.kv_cache_tensors:
        return
    check_parallel_layout(core.vllm_config)
    executor = core.model_executor
    timeout_s = rank_rpc_timeout(executor)
    replies = executor.collective_rpc(rank_layout, timeout=timeout_s)
    geometry, premapped, available = check_layouts([layout for layout, _ in replies])
    configs = {tuple(sorted(c.items())) for _, c in replies}
    if len(configs) != 1:
        raise IntegrationError(f"ranks resolved different kvcached configs: {sorted(configs)}")
    config = KvcachedConfig(**replies[0][1])
    background = refills_in_background(config.background_refill, executor, device_type(core.vllm_config))
    channel = ExecutorChannel(executor, timeout_s, background=background)
    pages = RankedPageSpace(geometry, channel, len(replies), config.capacity_ttl_s)
    pages.note_available([RankReply(i, True, available_bytes=available) for i in range(len(replies))])
    limiter = join_budgets(engine_name(core.vllm_config), [layout for layout, _ in replies], pages.kv_page_bytes)
    setattr(kv_cache_config, SPACE_ATTRIBUTE, KvSpace(geometry, premapped=premapped, config=config, pages=pages,
                                                      limiter=limiter))
    post = idle_post(core) if config.idle_grace_s > 0 else None
    setattr(kv_cache_config, IDLE_POST_ATTRIBUTE, post)
    _logger.info(
        "kvcached: elastic KV cache active on %d rank(s) (%s): %d kv pages of %d bytes, %d blocks, "
        "VMM page %d bytes, reserve %d-%d pages%s%s, refills %s, %s", len(replies), type(executor).__name__,
        geometry.num_kv_pages, pages.kv_page_bytes, geometry.num_blocks, geometry.page_size, config.min_reserve_pages,
        config.max_reserve_pages, f" (held over {config.hold_steps} busy steps)" if config.hold_steps else "",
        grace_text(config.idle_grace_s, post),
        "on a background thread" if background else
        ("inline" if runs_inline(executor) else "through the executor's queues"), timeout_text(executor, timeout_s))


def grace_text(seconds: float, post: Post | None) -> str:
    """The idle grace as the start-up line gives it."""
    if seconds <= 0:
        return ""
    if post is None:
        return f", cached-block cap at once when idle (an in-process engine: no idle grace of {seconds:g} s)"
    return f", cached-block cap after {seconds:g} s idle"


def timeout_text(executor: Any, timeout_s: float) -> str:
    """The rank requests' timeout as the start-up line gives it (an in-process worker runs
    them on the caller's thread: vLLM's ``UniProcExecutor`` applies no timeout)."""
    if runs_inline(executor):
        return "rank requests run in this process (no timeout)"
    return (f"rank requests time out after {timeout_s:g} s ({steps_in_flight(executor)} step(s) in flight "
            "and the request, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS each)")


def engine_name(vllm_config: Any) -> str:
    """The engine's name in its budget records (``kvctl``): `kvcached.config.engine_name` of
    the served model (``KVCACHED_ENGINE_NAME``, else the model's last path part and a tag
    unique among the host's live processes, containers included)."""
    model = getattr(vllm_config, "model_config", None)
    served = getattr(model, "served_model_name", None) or getattr(model, "model", None) or "engine"
    if isinstance(served, (list, tuple)):
        served = served[0] if served else "engine"
    return default_engine_name(str(served))


def join_budgets(name: str, layouts: list[RankLayout], rank_page_bytes: int) -> EngineBudget | None:
    """Register the engine ``name`` in the budget record of every device its ranks charge;
    None when the ranks report none (budgets off). All or nothing."""
    by_path: dict[str, list[int]] = {}
    for layout in layouts:
        if layout.budget is not None:
            by_path.setdefault(layout.budget.path, []).append(layout.budget.slot)
    if not by_path:
        return None
    shares: list[EngineShare] = []
    try:
        for path, slots in sorted(by_path.items()):
            record = BudgetRecord(path, create=False)
            try:
                shares.append(EngineShare(record.engine(name, tuple(slots)), rank_page_bytes * len(slots)))
            except BaseException:
                record.close()
                raise
    except BaseException:
        EngineBudget(shares).close()
        raise
    _logger.info("kvcached: engine %r in budget record(s) %s", name, ", ".join(sorted(by_path)))
    return EngineBudget(shares)


def attach(scheduler: Any) -> None:
    """Give the scheduler's elastic pool the space `prepare` left on its ``kv_cache_config``."""
    pool = _elastic_pool(scheduler)
    if pool is None:
        return
    space = getattr(scheduler.kv_cache_config, SPACE_ATTRIBUTE, None)
    if space is None:
        raise IntegrationError("the scheduler built an elastic pool but no rank reported a KV layout "
                               "(the EngineCore seam did not run: is kvcached installed in this process?)")
    if space.geometry.num_blocks != pool.num_gpu_blocks:
        raise IntegrationError(f"ranks reserved {space.geometry.num_blocks} KV blocks but the scheduler has "
                               f"{pool.num_gpu_blocks}: the two sides disagree on the KV geometry")
    pool.attach(space)
    pool.set_idle_post(getattr(scheduler.kv_cache_config, IDLE_POST_ATTRIBUTE, None))
    pool.running_block_sizes = full_attention_block_sizes(scheduler.kv_cache_manager)
    pool.set_step_tokens(int(scheduler.scheduler_config.max_num_batched_tokens))


def full_attention_block_sizes(manager: Any) -> tuple[int, ...]:
    """Each group's block size if every group is plain full attention, else ``()``: the
    condition under which a running request's demand is bounded by its new tokens
    (`ElasticBlockPool.admit_running`)."""
    from vllm.v1.core import single_type_kv_cache_manager

    # Feature detection, not an error path: without the class the fast path stays off and
    # every request takes the full admission (slower, the same answers).
    full_attention = getattr(single_type_kv_cache_manager, "FullAttentionManager", None)
    if full_attention is None:
        return ()
    managers = getattr(getattr(manager, "coordinator", None), "single_type_managers", ())
    if not managers or any(type(m) is not full_attention for m in managers):
        return ()
    return tuple(int(m.block_size) for m in managers)


def disconnect(core: Any) -> None:
    """Close the pool: unmap on every rank while the executor runs; locally if it cannot."""
    pool = _elastic_pool(getattr(core, "scheduler", None))
    if pool is None or not pool.attached or pool.closed:
        return
    executor = getattr(core, "model_executor", None)
    space = pool.arena.space.page_space()
    _logger.info("%s", shutdown_line(pool.ledger.pool_stats()))
    try:
        if executor is None or getattr(executor, "is_failed", False):
            # A worker died: no rank can answer. The pool's books close here; each rank's
            # memory is returned with its process, which the executor's shutdown ends.
            pool.abandon()
            return
        pool.close()
        space.channel.call(PageRequest("close"))
    except (KvcachedError, RuntimeError, TimeoutError, AssertionError) as exc:
        # The executor broke while closing (vLLM's own assertion when its queues are gone):
        # the same as above, found out one call later.
        _logger.warning("kvcached: ranks unreachable at shutdown (%s: %s); closing the pool locally",
                        type(exc).__name__, exc)
        pool.abandon()
    finally:
        if isinstance(space.channel, ExecutorChannel):
            space.channel.close()


def wrap_initialize_kv_caches(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initialize_kv_caches(self: Any, *args: Any, **kwargs: Any) -> Any:
        kv_cache_config = original(self, *args, **kwargs)
        prepare(self, kv_cache_config)
        return kv_cache_config

    return _initialize_kv_caches


def wrap_scheduler_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attach(self)

    return __init__


def wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        disconnect(self)
        return original(self, *args, **kwargs)

    return shutdown
