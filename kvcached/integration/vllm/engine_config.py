"""The `KvcachedConfig` of the engine a worker is building, handed from its first seam to its allocation.

One config per engine. The engine's first worker seam that needs it, the capacity report
(`memory`), resolves it (`resolve_engine_config`: the engine's explicit settings,
`engine_settings`, over the ``KVCACHED_*`` variables); the allocation seam (`backings`) takes
it (`take_engine_config`), plans the geometry and opens the ranges with that same config and
registers it with the KV space; every rank reports it with its layout and the scheduler's
pool takes it from there (`kvcached.space.KvSpace.config`). Nothing resolves it again, so the
page size the worker planned with is the one the pool maps.

Invariants: at most one config is pending; taking it leaves none behind, and a report always
resolves afresh, so the next engine built in the same process resolves its own (even after
an engine that failed between its report and its allocation). An allocation with no report
before it (the seams called directly) resolves its own. Uninstalling the worker seams drops
a pending config (`forget`).

Lock order: ``install_state.LOCK`` before this module's lock, never the reverse; no other
lock is taken while holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvcached.config import KvcachedConfig, device_defaults
from kvcached.errors import ConfigError
from kvcached.integration.vllm import ENGINE_CONFIG_KEY

__all__ = ["device_type", "engine_settings", "forget", "resolve_engine_config", "take_engine_config"]

_lock = threading.Lock()
_pending: KvcachedConfig | None = None  # resolved by the engine's report, until its allocation takes it


def engine_settings(vllm_config: Any) -> dict[str, Any]:
    """The explicit kvcached settings vLLM's config carries for this engine (`ENGINE_CONFIG_KEY`
    of ``additional_config``; none: ``{}``). Names are checked by `KvcachedConfig.resolve`."""
    extra = getattr(vllm_config, "additional_config", None)  # None: a worker without a vLLM config
    settings = extra.get(ENGINE_CONFIG_KEY, {}) if isinstance(extra, Mapping) else {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"additional_config[{ENGINE_CONFIG_KEY!r}] must be a mapping of kvcached settings, "
                          f"got {type(settings).__name__}")
    return dict(settings)


def device_type(vllm_config: Any) -> str:
    """vLLM's device type of the engine (``cuda``, ``cpu``); ``""`` without a vLLM config."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")


def resolve_engine_config(vllm_config: Any) -> KvcachedConfig:
    """Resolve the config of the engine being built; its first seam (the capacity report) calls this.

    Its explicit settings (`engine_settings`) win over the ``KVCACHED_*`` variables, and those
    over its device's defaults (`kvcached.config.device_defaults`). Always
    resolved afresh: an engine that failed between its report and its allocation must not
    leave its config to the next engine built in this process.
    """
    global _pending
    config = KvcachedConfig.resolve(defaults=device_defaults(device_type(vllm_config)),
                                    **engine_settings(vllm_config))
    with _lock:
        _pending = config
    return config


def take_engine_config() -> KvcachedConfig:
    """The engine's config for its allocation, which carries it with the KV space.

    The one the capacity report resolved; resolved now if no report ran (the seams called
    directly). Taking it leaves none behind, so the next engine resolves its own.
    """
    global _pending
    with _lock:
        config, _pending = _pending, None
    return config if config is not None else KvcachedConfig.resolve()


def forget() -> None:
    """Drop a pending config (the worker seams are uninstalled)."""
    global _pending
    with _lock:
        _pending = None
