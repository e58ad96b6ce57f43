"""``--kvcached-env KVCACHED_NAME=VALUE``: kvcached settings a harness program passes to the
kvcached side's engines (the serving benchmark's servers, the sharing scenario's), checked by
kvcached's own config parser before any engine starts."""

from __future__ import annotations

from collections.abc import Sequence

#: Not settings: the switch itself, and fault plans (the fault sweep's business).
NOT_SETTINGS = ("KVCACHED_ENABLE", "KVCACHED_FAULT_PLAN")


class KvcachedEnvError(ValueError):
    """An item that is not ``KVCACHED_<knob>=VALUE`` of a knob and value kvcached accepts."""


def parse_kvcached_env(items: Sequence[str], reserved: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """``items`` as (name, value) pairs, in order; `KvcachedEnvError` naming the first problem:
    not ``NAME=VALUE``, not a knob of kvcached's config, one of ``reserved`` (the caller sets it
    itself), or a value the config refuses."""
    from kvcached.config import ENV_NAMES, KvcachedConfig
    from kvcached.errors import ConfigError

    pairs = []
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.startswith("KVCACHED_") or name in NOT_SETTINGS:
            raise KvcachedEnvError(f"--kvcached-env {item!r}: want KVCACHED_<knob>=VALUE, a knob of kvcached's "
                                   "config (not KVCACHED_ENABLE or a fault plan)")
        pairs.append((name, value))
    env = dict(pairs)
    if unknown := sorted(set(env) - ENV_NAMES):
        raise KvcachedEnvError(f"--kvcached-env: not a knob of kvcached's config: {', '.join(unknown)}")
    if taken := sorted(set(env) & set(reserved)):
        raise KvcachedEnvError(f"--kvcached-env: {', '.join(taken)} set by the run itself (its checks depend on it)")
    try:
        KvcachedConfig.resolve(env)
    except ConfigError as e:
        raise KvcachedEnvError(f"--kvcached-env: {e}") from None
    return tuple(pairs)
