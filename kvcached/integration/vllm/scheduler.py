"""Scheduler-side seams: where kvcached enters vLLM's EngineCore.

Nine attributes are replaced (`install`), each restored exactly by `uninstall`. Whether
they act is the process-wide switch in `install_state`, shared with the worker seams:

``vllm.v1.core.kv_cache_coordinator.BlockPool`` and ``vllm.v1.core.kv_cache_manager.get_kv_cache_coordinator``
    A coordinator builds its pool through the first module-level name. It becomes
    `elastic_block_pool`, which builds an `ElasticBlockPool` only for the engine's device KV
    cache: while `KVCacheManager` builds its coordinator through the second name (marked
    by its wrapper). Any other coordinator (``SimpleCPUOffloadConnector`` builds its CPU
    block pool through the same class, calling ``kv_cache_coordinator.get_kv_cache_coordinator``
    itself) gets vLLM's own pool: it must not claim the device's KV space. For the device
    pool, it reads the hash granularity from the native constructor
    arguments *before* kvcached initializes anything and then builds an
    `ElasticBlockPool` with exactly those arguments. A missing or invalid
    ``hash_block_size`` raises `IntegrationError` (a `RuntimeError`), which propagates out
    of the coordinator: substituting the allocation block size could tie a physical block
    to the wrong prefix. Every supported vLLM (0.26-0.29) passes it, so there is no
    legacy fallback.

``KVCacheManager.allocate_slots`` (the exhaustion seam)
    Supplies headroom (``watermark_blocks`` + ``reserved_blocks``) and the fault-injection
    site of this physical admission: ``"cow_admission"`` (after firing the trigger
    ``"partial_prefix_hit"``) when the request's local prefix hit ends inside a block, else
    ``"admission"``. Physical exhaustion surfaces as a smaller free count, so vLLM's own
    check returns ``None``: a scheduling miss, never an exception in EngineCore.

    The demand: for the duration of an admitting call, the manager's coordinator
    *instance* gets a ``get_num_blocks_to_allocate`` that calls vLLM's method and notes
    its answer, with the prefix hits it will touch, on the pool; the pool's next
    ``get_num_free_blocks`` maps pages for exactly that in one batch. The instance
    attribute is deleted in ``finally``: the class method is never replaced, and the
    scheduler's own estimates outside ``allocate_slots`` note nothing.

    The decode path (every running request, every step) does no admission work: a running
    request's call (no prefix hit, no reservation) whose possible demand free blocks on
    mapped pages already cover (the wrapper asks `ElasticBlockPool.admit_running`, the one
    definition of that test) goes straight to vLLM, which sees the native count. That costs
    one wrapper frame and the gate's call; the wrapper is compiled at install with vLLM's
    own parameters, so it passes them on as vLLM's caller did (`_compile_exact`).

``Scheduler.schedule`` / ``Scheduler.update_from_output`` (the step fence)
    A page may be read or written by any step scheduled but not yet executed (async
    scheduling runs one step ahead; copy-on-write retentions are released right after
    scheduling, before the worker has copied). ``schedule`` calls ``fence.begin_step()``
    *before* the original, so a page emptied while scheduling step N gets ticket N;
    ``update_from_output`` calls ``fence.end_step()`` *after* the original and then
    ``pool.collect()``, which unmaps only pages whose ticket has passed. vLLM 0.28's
    EngineCore matches every ``schedule()`` with exactly one ``update_from_output()`` in
    both ``step`` and ``step_with_batch_queue`` (a batch whose sampling is deferred is
    re-queued and processed later), so the counters stay paired. ``AsyncScheduler``
    inherits both methods; `install` refuses a vLLM where a subclass overrides them.
    A step whose output schedules no KV work (`touches_kv` is False) is marked on the
    fence after ``schedule`` returns, so it holds no page: the async engine leaves such an
    empty step queued while idle, and pages freed at the end of a burst must still go back.

``Scheduler.shutdown`` (teardown)
    ``EngineCore.shutdown`` closes the elastic pool while the executor still runs (the
    EngineCore seam, `kvcached.integration.vllm.engine`: every page unmapped on every
    rank), then stops the executor and calls this. A pool still open here has no rank left
    to answer, so it is abandoned (its books closed, its ``kvcached.stats()`` entry gone).
    A pool that is never shut down is closed when it is garbage-collected.

``EngineCore._initialize_kv_caches``, ``Scheduler.__init__``, ``EngineCore.shutdown``
    The page protocol's scheduler end (`kvcached.integration.vllm.engine`): every rank's
    KV layout is read through the executor after the workers allocated, the pool is
    attached to it when the scheduler is built, and closed before the executor stops.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvcached.errors import IntegrationError
from kvcached.fence import EngineStepFence
from kvcached.integration.vllm import install_state
from kvcached.integration.vllm.block_pool import ElasticBlockPool
from kvcached.integration.vllm.capabilities import Capabilities
from kvcached.integration.vllm.patching import MISSING, PatchSet, require_own

_PART = "scheduler"
_patches = PatchSet()  # guarded by install_state.LOCK


# ---- the pool factory ---------------------------------------------------------------
def _native_pool_signature() -> inspect.Signature:
    from vllm.v1.core.block_pool import BlockPool

    return inspect.signature(BlockPool)


def hash_block_size_from(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The hash granularity in the native ``BlockPool`` constructor arguments.

    Raises `IntegrationError` when it is missing or not a positive ``int``.
    """
    try:
        bound = _native_pool_signature().bind(*args, **kwargs)
    except TypeError as exc:
        raise IntegrationError(
            f"vLLM built its block pool without valid constructor arguments ({exc}); "
            "kvcached needs the native hash_block_size and will not substitute the block size"
        ) from exc
    value = bound.arguments.get("hash_block_size", MISSING)
    if value is MISSING:
        raise IntegrationError("the native BlockPool arguments carry no hash_block_size")
    if type(value) is not int or value <= 0:
        raise IntegrationError(
            f"invalid native hash_block_size={value!r}: expected a positive int"
        )
    return value


#: ``.building`` is True while `KVCacheManager` builds its coordinator (seam 1b): the one
#: device KV pool of the engine. Every other coordinator (``SimpleCPUOffloadConnector``'s
#: CPU pool, a tool's) gets vLLM's own pool.
_device_pool = threading.local()


@contextlib.contextmanager
def building_device_pool() -> Iterator[None]:
    """The scope in which a coordinator's pool is the engine's device KV pool (this thread)."""
    previous = getattr(_device_pool, "building", False)
    _device_pool.building = True
    try:
        yield
    finally:
        _device_pool.building = previous


def _wrap_get_coordinator(original: Callable[..., Any]) -> Callable[..., Any]:
    """``kv_cache_manager.get_kv_cache_coordinator``: marks the device pool's construction."""
    @functools.wraps(original)
    def get_kv_cache_coordinator(*args: Any, **kwargs: Any) -> Any:
        with building_device_pool():
            return original(*args, **kwargs)

    return get_kv_cache_coordinator


def elastic_block_pool(*args: Any, **kwargs: Any) -> Any:
    """Replacement for the coordinator's ``BlockPool``: validate, then build the elastic pool
    for the engine's device KV cache (built by `KVCacheManager`), vLLM's own for any other.

    When the seams were installed disabled it builds vLLM's own pool, untouched.
    """
    if not install_state.is_enabled() or not getattr(_device_pool, "building", False):
        from vllm.v1.core.block_pool import BlockPool

        return BlockPool(*args, **kwargs)
    hash_block_size_from(args, kwargs)
    return ElasticBlockPool(*args, **kwargs)


# ---- wrappers -------------------------------------------------------------------------
def _elastic_pool(obj: Any) -> ElasticBlockPool | None:
    pool = getattr(obj, "block_pool", None)
    return pool if isinstance(pool, ElasticBlockPool) else None


def _demand_noter(original: Callable[..., int]) -> Callable[[Any, ElasticBlockPool], Callable[..., int]]:
    """Builds, for one admission, the coordinator's demand-noting ``get_num_blocks_to_allocate``.

    ``original`` is vLLM's method (its signature tells where ``new_computed_blocks`` is).
    The result is bound to one coordinator instance, and shadows the class method on that
    instance only while one ``allocate_slots`` call admits: the checks vLLM
    makes inside it are the admission's demand, and nothing else is (the scheduler's own
    estimates outside ``allocate_slots`` and every native pool see vLLM's method).
    """
    name = "new_computed_blocks"
    signature = _signature_naming(original, "KVCacheCoordinator.get_num_blocks_to_allocate", (name,))
    parameter = signature.parameters[name]
    params = list(signature.parameters.values())[1:]  # after self
    positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    position = params.index(parameter) if positional else None
    default = None if parameter.default is parameter.empty else parameter.default

    def bind(coordinator: Any, pool: ElasticBlockPool) -> Callable[..., int]:
        def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
            num_blocks = original(coordinator, *args, **kwargs)
            if position is not None and position < len(args):
                new_computed_blocks = args[position]
            else:
                new_computed_blocks = kwargs.get(name, default)
            pool.note_demand(num_blocks, new_computed_blocks)
            return num_blocks

        return get_num_blocks_to_allocate

    return bind


def _partial_prefix_hit(manager: Any, request: Any, num_new_computed_tokens: int,
                        new_computed_blocks: Any) -> bool:
    """Whether the request's local prefix hit ends inside a block of some group.

    Mirrors vLLM's ``SingleTypeKVCacheManager._has_partial_local_hit``: such a hit makes
    the manager allocate a copy-on-write block for the shared tail.
    """
    if new_computed_blocks is None:
        return False
    num_local = request.num_computed_tokens + num_new_computed_tokens
    managers = manager.coordinator.single_type_managers
    for group, blocks in enumerate(new_computed_blocks.blocks):
        if len(blocks) > 0 and num_local % managers[group].block_size != 0:
            return True
    return False


_COUNT = "get_num_blocks_to_allocate"

#: The exhaustion seam's body, compiled once at install against vLLM's own parameter list
#: (`_wrap_allocate_slots`): with the same parameters as the method it wraps, a call costs
#: what vLLM's own call costs (measured: 119 ns, against 419 ns through ``*args, **kwargs``),
#: and every argument is a local variable (nothing is read per call). ``{params}`` is the
#: parameter list after ``self`` and ``{call}`` passes each one on by name.
_ALLOCATE_SLOTS = """
def allocate_slots(self, {params}):
    pool = self.block_pool
    if not isinstance(pool, elastic):
        return original(self, {call})
    # The decode path: a running request's call (no prefix hit, no reservation) goes
    # straight to vLLM when the pool's one gate, `ElasticBlockPool.admit_running`, says the
    # blocks it can ask for are already on mapped pages, or is open for the whole schedule
    # call (`ElasticBlockPool.begin_schedule`).
    if (request.status is running and num_new_computed_tokens == 0 and new_computed_blocks is None
            and reserved_blocks == 0 and (pool.running_open or pool.admit_running(num_new_tokens + {lookahead}))):
        return original(self, {call})
    previous = begin(self, pool, request, num_new_computed_tokens, new_computed_blocks, reserved_blocks)
    try:
        return original(self, {call})
    finally:
        end(self, pool, previous)
"""

#: The parameters `_ALLOCATE_SLOTS` reads; ``num_lookahead_tokens`` is optional (0 without it).
_READS = ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks", "reserved_blocks")


def _wrap_allocate_slots(original: Callable[..., Any], count: Callable[..., int]) -> Callable[..., Any]:
    """The exhaustion seam; ``count`` is vLLM's ``KVCacheCoordinator.get_num_blocks_to_allocate``."""
    signature = _signature_naming(original, "KVCacheManager.allocate_slots", _READS)
    noter = _demand_noter(count)
    from vllm.v1.request import RequestStatus

    def begin(manager: Any, pool: ElasticBlockPool, request: Any, num_new_computed_tokens: int,
              new_computed_blocks: Any, reserved: int) -> tuple[Any, bool]:
        """Enter an admitting call: its fault site and headroom, and the demand noter."""
        site = "admission"
        if _partial_prefix_hit(manager, request, num_new_computed_tokens, new_computed_blocks):
            site = "cow_admission"
            pool.trigger("partial_prefix_hit")
        coordinator = manager.coordinator
        shadowing = _COUNT not in coordinator.__dict__  # False only inside a nested admission
        previous = pool.begin_admission(manager.watermark_blocks, reserved, site,
                                        request.status is not RequestStatus.RUNNING)
        if shadowing:
            setattr(coordinator, _COUNT, noter(coordinator, pool))
        return previous, shadowing

    def end(manager: Any, pool: ElasticBlockPool, entered: tuple[Any, bool]) -> None:
        previous, shadowing = entered
        if shadowing:
            delattr(manager.coordinator, _COUNT)
        pool.end_admission(previous)

    return _compile_exact(
        _ALLOCATE_SLOTS, signature, original,
        lookahead="num_lookahead_tokens" if "num_lookahead_tokens" in signature.parameters else "0",
        namespace={"elastic": ElasticBlockPool, "running": RequestStatus.RUNNING, "begin": begin, "end": end},
    )


def _signature_naming(original: Callable[..., Any], qualname: str, names: tuple[str, ...]) -> inspect.Signature:
    """``original``'s signature (following ``__wrapped__``), which must name ``names`` and
    list every parameter: a foreign wrapper that hides them (``*args`` without
    ``functools.wraps``) is refused at install instead of misread at run time."""
    signature = inspect.signature(original)
    missing = [n for n in names if n not in signature.parameters]
    hidden = [p.name for p in signature.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing or hidden:
        raise IntegrationError(
            f"{qualname} has signature {signature}, without {missing or hidden}; it was replaced by a "
            "wrapper kvcached cannot read (use functools.wraps)"
        )
    return signature


def _compile_exact(template: str, signature: inspect.Signature, original: Callable[..., Any], *,
                   lookahead: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """Compile ``template`` with ``signature``'s parameters (after ``self``), as dataclasses
    compile ``__init__``: defaults are the original's own objects, bound by name."""
    params, call, defaults = [], [], {}
    keyword_only = False
    for p in list(signature.parameters.values())[1:]:
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            params.append("*")
            keyword_only = True
        if p.default is p.empty:
            params.append(p.name)
        else:
            defaults[f"_default_{p.name}"] = p.default
            params.append(f"{p.name}=_default_{p.name}")
        call.append(f"{p.name}={p.name}" if keyword_only else p.name)
    source = template.format(params=", ".join(params), call=", ".join(call), lookahead=lookahead)
    clashes = sorted(set(signature.parameters) & ({"original", "pool", "previous"} | set(namespace)))
    if clashes:
        raise IntegrationError(f"{original.__qualname__} has parameters {clashes}, which the kvcached "
                               "seam's body also names; this vLLM is not supported")
    scope = {**namespace, **defaults, "original": original}
    # The source is the template above and vLLM's parameter names (identifiers); defaults
    # are bound as objects, never written out.
    exec(compile(source, f"<kvcached seam {original.__qualname__}>", "exec"), scope)  # noqa: S102
    wrapper = scope[original.__name__]
    return functools.wraps(original)(wrapper)


def _scheduler_pool(scheduler: Any) -> ElasticBlockPool | None:
    return _elastic_pool(getattr(scheduler, "kv_cache_manager", None))


def touches_kv(output: Any) -> bool:
    """Whether the worker may read or write a KV block while running this step.

    Conservative: any scheduled token, block copy, block to zero, connector metadata or
    tail offload counts (fields a vLLM lacks count as absent).
    """
    if getattr(output, "total_num_scheduled_tokens", 1):
        return True
    for name in ("kv_cache_block_copies", "new_block_ids_to_zero", "partial_tail_offloads"):
        if getattr(output, name, None):
            return True
    return getattr(output, "kv_connector_metadata", None) is not None


def _wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = _scheduler_pool(self)
        if pool is None:
            return original(self, *args, **kwargs)
        # Before the original: pages emptied while scheduling this step get its ticket.
        step = pool.fence.begin_step()
        pages = pool.page_pool
        pages.batch_top_ups()  # one refill for the step's takes, sent as it is scheduled
        pool.begin_schedule()
        try:
            output = original(self, *args, **kwargs)
        finally:
            pool.end_schedule()
            pages.end_top_ups()
        if isinstance(pool.fence, EngineStepFence) and not touches_kv(output):
            pool.fence.mark_kv_free(step)
        return output

    return schedule


def _wrap_update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original(self, *args, **kwargs)
        pool = _scheduler_pool(self)
        if pool is not None:
            pool.fence.end_step()
            pool.collect(busy=self.has_unfinished_requests())
        return outputs

    return update_from_output


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # EngineCore stopped the executor before calling this: no step can touch a page.
        pool = _scheduler_pool(self)
        if pool is not None and not pool.closed:
            # EngineCore.shutdown normally closed it already, with the executor alive
            # (`engine.disconnect`); a pool still open here has no rank to answer.
            pool.abandon()
        return result

    return shutdown


# ---- install / uninstall --------------------------------------------------------------
def _plan() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for every seam, after checking vLLM's shape."""
    from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_manager
    from vllm.v1.core.sched import scheduler

    if kv_cache_coordinator.BlockPool is not block_pool.BlockPool:
        raise IntegrationError(
            "vllm.v1.core.kv_cache_coordinator.BlockPool is not vLLM's BlockPool; "
            "another plugin already replaced it"
        )
    if kv_cache_manager.get_kv_cache_coordinator is not kv_cache_coordinator.get_kv_cache_coordinator:
        raise IntegrationError("vllm.v1.core.kv_cache_manager.get_kv_cache_coordinator is not vLLM's; "
                               "another plugin already replaced it")
    if "hash_block_size" not in _native_pool_signature().parameters:
        raise IntegrationError("vLLM's BlockPool takes no hash_block_size; this vLLM is not supported")
    from vllm.v1.engine.core import EngineCore

    from kvcached.integration.vllm import engine

    coordinator = kv_cache_coordinator.KVCacheCoordinator
    manager = kv_cache_manager.KVCacheManager
    sched = scheduler.Scheduler
    return [
        (kv_cache_coordinator, "BlockPool", elastic_block_pool),
        (kv_cache_manager, "get_kv_cache_coordinator", _wrap_get_coordinator(kv_cache_manager.get_kv_cache_coordinator)),
        (manager, "allocate_slots", _wrap_allocate_slots(require_own(manager, "allocate_slots"),
                                                         require_own(coordinator, _COUNT))),
        (sched, "schedule", _wrap_schedule(require_own(sched, "schedule"))),
        (sched, "update_from_output",
         _wrap_update_from_output(require_own(sched, "update_from_output"))),
        (sched, "shutdown", _wrap_shutdown(require_own(sched, "shutdown"))),
        (EngineCore, "_initialize_kv_caches",
         engine.wrap_initialize_kv_caches(require_own(EngineCore, "_initialize_kv_caches"))),
        # AsyncScheduler.__init__ calls this one first (super) and then sets only its own
        # spec-decode fields: the pool is attached inside it, before any step.
        (sched, "__init__", engine.wrap_scheduler_init(require_own(sched, "__init__", exclusive=False))),
        # DPEngineCoreProc.shutdown calls this one first (super); kvcached refuses data
        # parallelism at start-up anyway (engine.check_parallel_layout).
        (EngineCore, "shutdown", engine.wrap_shutdown(require_own(EngineCore, "shutdown", exclusive=False))),
    ]


def plan() -> list[tuple[Any, str, Any]]:
    """The replacements `install` would apply now, compiled (vLLM's shape checked first).

    A tool that installs and uninstalls around every step (the scheduler-loop benchmark)
    plans once and passes the plan to each `install`, so every install applies the same,
    already warm wrappers instead of compiling new ones."""
    return _plan()


def install(caps: Capabilities, *, enabled: bool | None = None,
            planned: list[tuple[Any, str, Any]] | None = None) -> None:
    """Replace the scheduler-side attributes; idempotent. Nothing is patched on error.

    ``enabled``: the switch (None: the one already recorded in `install_state`, else
    ``KVCACHED_ENABLE``/``ENABLE_KVCACHED`` now). Installed disabled, every seam delegates
    to vLLM (the coordinator gets vLLM's own pool), so tools can install the seams without
    changing behaviour. Other capabilities or another switch than the installed ones
    raise `IntegrationError`. ``planned``: a `plan()` made in this process while vLLM's
    originals were in place (they are again after `uninstall`); default a fresh one.
    """
    def apply() -> None:
        _patches.apply(planned if planned is not None else _plan())

    install_state.install_part(_PART, caps, enabled, apply)  # validates first


def uninstall() -> None:
    """Restore every replaced attribute exactly (in reverse order); idempotent."""
    install_state.uninstall_part(_PART, _patches.restore)


def installed_capabilities() -> Capabilities | None:
    """The capabilities the seams were installed for, or None when not installed."""
    return install_state.capabilities(_PART)


def is_enabled() -> bool:
    """Whether the installed seams act (False: not installed, or installed disabled)."""
    return install_state.is_enabled(_PART)
