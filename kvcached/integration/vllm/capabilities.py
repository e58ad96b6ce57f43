"""The one table of vLLM version differences kvcached depends on.

This is the only module that compares vLLM versions. Every other module asks for a
`Capabilities` value and branches on its fields, so a new vLLM release is supported by
adding rows here (and tests), never by scattering version checks.

Rows (first vLLM minor series that has the behaviour; the contract notes in
``docs/`` give the source lines):

========================  ===========  ==================================================
field                     series       meaning
========================  ===========  ==================================================
(supported range)         0.26-0.32    the native ``BlockPool`` contract `ElasticBlockPool`
                                       subclasses (constructor, hash hooks, free queue:
                                       with caching on, ``free_blocks`` queues unhashed
                                       blocks first and hashed ones last in every series)
logical_block_copy        0.26+        the worker copies logical blocks
                                       (``copy_kv_cache_blocks_inplace``)
raw_mamba_pages           0.27+        Mamba layers bind one raw page tensor
                                       (``MambaBase.bind_kv_cache``)
allocate_kv_cache         0.29+        KV tensors come from ``utils.allocate_kv_cache``;
                                       ``_allocate_kv_cache_tensors`` is gone
cpu_warmup_decision       0.30+        ``CPUWorker._should_warm_up_model()`` decides
                                       whether ``determine_available_memory`` warms the
                                       model up (eager mode with an explicit KV size: no)
request_memory_external   0.32+        ``request_memory(init_snapshot, cache_config,
                                       external_weight_memory)``: the share excludes
                                       weights held outside the process
model_runner_v2           0.26-0.28,   kvcached serves Model Runner V2 (`runner_v2`): its KV
                          0.29-0.32    comes from ``gpu.attn_utils._allocate_kv_cache`` and
                          on trial     ``_reshape_kv_cache`` (0.26-0.28) or, through the
                                       name its ``init_kv_cache`` imported, from
                                       ``allocate_kv_cache`` (0.29+); its copies from
                                       ``gpu.model_runner.copy_kv_cache_blocks_inplace``,
                                       its warm-up from ``gpu_worker.warmup_kernels``.
                                       0.29-0.32: drafted from each wheel's source, no
                                       engine has run them (V2 needs Triton, and the GPU
                                       host has 0.26): served only on trial (`TRIAL_ROWS`)
v2_profiling_cache        0.29+        V2 profiles CUDA-graph memory on a minimal KV cache
                                       (``gpu.cudagraph_utils``
                                       ``._init_minimal_kv_cache_for_profiling``)
v2_warmup_before_capture  0.30+        the worker runs V2's ``warmup_kernels`` before
                                       CUDA-graph capture, which then reads the block
                                       tables the warm-up left (0.26-0.29: after capture)
hisparse                  0.30+        ``attention_config.hisparse_config`` (V2 only)
                                       allocates KV through ``init_hisparse_kv_cache``,
                                       past ``allocate_kv_cache``: refused by name
========================  ===========  ==================================================

Also from 0.30: ``BlockPool`` gains ``unpin_blocks``, reuse watchers and frees routed to
another pool. Their only caller is HiSparse, which kvcached refuses at start-up
(`kvcached.integration.vllm.runner_v2`, the ``use_v2_model_runner`` seam);
`ElasticBlockPool.unpin_blocks` refuses by name should any other path ever call it.

From 0.34 (`UNSERVED`): Model Runner V1 is gone, and vLLM backs the KV cache with its own
virtual memory (``--enable-extensible-kv-cache``, on by default on CUDA). Such a release is
refused by name, with why, until an engine has run kvcached on it (``docs/vllm-0.34.md`` has
the decision: switch vLLM's cache off, refuse it where asked for, allocate through its
``allocate`` hook).

A release enters this table once ``nox -s compat -- <version>`` has added its row to
``reports/compat/``; any other release is refused at start-up with that hint. A release
whose rows were read from its wheel's source but whose compat row is not in yet
(``SUPPORTED[1] < series <= TRIAL``) is accepted only *on trial*: with
``KVCACHED_VLLM_TRIAL=1``, which the compat session sets so that it can produce the row that
admits the release, and with a warning. Without it such a release is refused like any other.

Version strings are parsed strictly (PEP 440); the policy for suffixes is deliberate:

* a *local label* (``0.28.0+cpu``, ``0.28.0+cu129``) is ignored: it names a build variant
  of the same released source (the CPU and CUDA 0.28.0 wheels are identical in every
  file this table describes);
* *patch* and *post* releases (``0.27.1``, ``0.28.0.post1``) belong to their minor series:
  the table is per minor series and patch releases have not changed these contracts;
* *pre-releases and dev builds* (``0.29.0rc1``, ``0.28.1.dev12+g1234``) are rejected: their
  code sits somewhere between two rows and nothing here can say which behaviour they have;
* anything that is not a PEP 440 version, or has an epoch, is rejected (no guessing).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from kvcached.config import parse_bool
from kvcached.errors import IntegrationError

Series = tuple[int, int]

#: Supported vLLM minor series, inclusive. This is the native-pool compatibility range.
SUPPORTED: tuple[Series, Series] = ((0, 26), (0, 32))
#: The newest series the rows below describe; one after `SUPPORTED` is accepted on trial only
#: (none now: 0.31 and 0.32 entered the range with their compat rows).
TRIAL: Series = (0, 32)
#: ``1`` accepts a release on trial (the compat session sets it); unset or ``0``: refused.
TRIAL_ENV = "KVCACHED_VLLM_TRIAL"
#: field -> the series on which it holds only on trial (``KVCACHED_VLLM_TRIAL=1``): rows drafted
#: from the wheels' source that no engine has run yet. Without trial the field is false there.
TRIAL_ROWS: dict[str, tuple[Series, Series]] = {
    "model_runner_v2": ((0, 29), (0, 32)),
}
#: The first series refused by name, and why (read from its wheel; no engine ran it yet).
UNSERVED: tuple[Series, str] = (
    (0, 34),
    ("from 0.34 vLLM has Model Runner V2 only (kvcached's V2 seams reach 0.32) and backs the KV "
     "cache with its own virtual memory (--enable-extensible-kv-cache, on by default on CUDA), "
     "which kvcached must switch off and allocate around; docs/vllm-0.34.md says how, and no "
     "engine has run it yet"),
)

_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the running vLLM provides. Built only by `capabilities_for` / `detect`.

    Invariant: ``SUPPORTED[0] <= series <= TRIAL``; a series after ``SUPPORTED[1]`` only on
    trial (`capabilities_for`).
    """

    version: str
    series: Series
    logical_block_copy: bool
    raw_mamba_pages: bool
    allocate_kv_cache: bool
    cpu_warmup_decision: bool
    request_memory_external: bool
    model_runner_v2: bool
    v2_profiling_cache: bool
    v2_warmup_before_capture: bool
    hisparse: bool

    def drafted(self, name: str) -> bool:
        """Whether row ``name`` is drafted on this series: it holds there on trial only
        (`TRIAL_ROWS`), whether or not this process asked for trial."""
        return _drafted(name, self.series)


def _drafted(name: str, series: Series) -> bool:
    rows = TRIAL_ROWS.get(name)
    return rows is not None and rows[0] <= series <= rows[1]


# field -> first series that has it; it holds through the end of SUPPORTED unless `_LAST` ends it.
_FIRST: dict[str, Series] = {
    "logical_block_copy": (0, 26),
    "raw_mamba_pages": (0, 27),
    "allocate_kv_cache": (0, 29),
    "cpu_warmup_decision": (0, 30),
    "request_memory_external": (0, 32),
    "model_runner_v2": (0, 26),
    "v2_profiling_cache": (0, 29),
    "v2_warmup_before_capture": (0, 30),
    "hisparse": (0, 30),
}
# field -> last series that has it (rows that end; none now).
_LAST: dict[str, Series] = {}


def _range_text() -> str:
    lo, hi = SUPPORTED
    return f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"


def parse_series(version: str) -> Series:
    """The minor series ``(major, minor)`` of a vLLM version string, per the module policy.

    Raises `IntegrationError` for strings that are not PEP 440 versions, epochs,
    pre-releases and dev builds.
    """
    if not isinstance(version, str):
        raise IntegrationError(f"vLLM version must be a string, got {version!r}")
    try:
        parsed = Version(version.strip())
    except InvalidVersion:
        raise IntegrationError(
            f"cannot parse vLLM version {version!r}; kvcached supports vLLM {_range_text()}"
        ) from None
    if parsed.epoch != 0:
        raise IntegrationError(f"vLLM version {version!r} has an epoch; kvcached does not guess")
    if parsed.is_prerelease or parsed.is_devrelease:
        raise IntegrationError(
            f"vLLM {version!r} is a pre-release or dev build; its behaviour may sit between "
            f"two released series, so kvcached does not guess. Supported: released vLLM "
            f"{_range_text()}"
        )
    release = parsed.release
    return (release[0], release[1] if len(release) > 1 else 0)


def trial_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVCACHED_VLLM_TRIAL`` asks to accept a release on trial (a boolean switch,
    parsed like every other: unset is no). A value that is not one is a `ConfigError` naming it."""
    return parse_bool(TRIAL_ENV, (os.environ if environ is None else environ).get(TRIAL_ENV, "0"))


def capabilities_for(version: str, trial: bool = False) -> Capabilities:
    """The capabilities of vLLM ``version``; `IntegrationError` if unsupported or unparsable.

    ``trial`` also accepts a series after `SUPPORTED` up to `TRIAL` (its rows read from the
    wheel's source, its compat row not in yet), with a warning, and turns on the rows drafted
    for this series (`TRIAL_ROWS`).
    """
    series = parse_series(version)
    lo, hi = SUPPORTED
    on_trial = trial and hi < series <= TRIAL
    if on_trial:
        _logger.warning("kvcached: vLLM %s accepted on trial (%s=1): its capability rows are read from its "
                        "wheel's source and its compat row is not in reports/compat/ yet", version, TRIAL_ENV)
    elif not lo <= series <= hi:
        unserved = f" ({UNSERVED[1]})" if series >= UNSERVED[0] else ""
        raise IntegrationError(
            f"vLLM {version} is not supported{unserved}; kvcached supports vLLM {_range_text()}. A release is "
            f"supported once `nox -s compat -- {version}` has added its row to reports/compat/ and "
            "kvcached/integration/vllm/capabilities.py its entry" + (
                f"; its entry is drafted, so {TRIAL_ENV}=1 accepts it on trial, as that session does"
                if hi < series <= TRIAL else "")
        )
    flags = {name: first <= series <= _LAST.get(name, series) for name, first in _FIRST.items()}
    drafted = [name for name in TRIAL_ROWS if flags[name] and _drafted(name, series)]
    for name in drafted:
        flags[name] = trial
    if trial and drafted:
        _logger.warning("kvcached: on vLLM %s the capability rows %s are drafted from its wheel's source and "
                        "accepted on trial (%s=1): no engine has run them yet", version, ", ".join(drafted), TRIAL_ENV)
    return Capabilities(version=version, series=series, **flags)


def detect() -> Capabilities:
    """The capabilities of the vLLM installed in this process (reads ``vllm.__version__``)."""
    import vllm

    return capabilities_for(vllm.__version__, trial=trial_requested())


def vllm_version() -> str | None:
    """``vllm.__version__`` (importing vLLM), or None when vLLM cannot be imported."""
    try:
        import vllm
    except ImportError:
        return None
    return str(vllm.__version__)
