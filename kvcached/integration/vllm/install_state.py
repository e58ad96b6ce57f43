"""The one record of what kvcached installed into this process's vLLM, and whether it acts.

kvcached patches vLLM in two *parts*: the scheduler seams (`scheduler`) and the worker
seams (`worker`). The plugin installs both; tests may install one alone. Every installed
part shares one `InstallState`: the `Capabilities` it was installed for, the switch
(``enabled``) and the set of parts in place. The plugin, the scheduler seams and the
worker seams keep no installed/enabled flag of their own; they all read this module, so
"is kvcached on?" has exactly one answer in a process.

The switch is decided once, when the first part is installed: the installer's explicit
value, else ``KVCACHED_ENABLE``/``ENABLE_KVCACHED`` read at that moment. A later part joins
with that decision; one that asks for other capabilities or another switch is refused
with nothing patched. While enabled the seams act; installed disabled, every seam
delegates to vLLM. Uninstalling the last part forgets the state, so the next install
decides again.

This module imports only the standard library and kvcached's core (never vLLM), so the
plugin module and ``kvcached.integration.vllm.status`` stay cheap to import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcached.errors import IntegrationError

if TYPE_CHECKING:
    from kvcached.integration.vllm.capabilities import Capabilities

#: The parts a complete installation consists of (what `plugin.install` puts in place).
PARTS: frozenset[str] = frozenset({"scheduler", "worker"})

#: Held while a part is installed or uninstalled (and by the plugin around both parts), so
#: the patches and this record change together. Reentrant: the plugin holds it while the
#: parts take it again. Lock order: this lock before any lock of the seam modules.
LOCK = threading.RLock()


@dataclass(frozen=True, slots=True)
class InstallState:
    """What is installed. Invariant: ``parts`` is a non-empty subset of `PARTS`."""

    caps: Capabilities
    enabled: bool
    parts: frozenset[str]

    @property
    def complete(self) -> bool:
        """Every part is installed (the plugin's installation, not a test's single part)."""
        return self.parts == PARTS


_state: InstallState | None = None


def current() -> InstallState | None:
    """The installation in this process, or None when no part is installed."""
    with LOCK:
        return _state


def is_enabled(part: str | None = None) -> bool:
    """Whether kvcached's seams act: some part (or ``part``) is installed, with the switch on."""
    state = current()
    return state is not None and state.enabled and (part is None or part in state.parts)


def capabilities(part: str | None = None) -> Capabilities | None:
    """The capabilities the seams (or ``part``) were installed for; None when not installed."""
    state = current()
    if state is None or (part is not None and part not in state.parts):
        return None
    return state.caps


def install_part(part: str, caps: Capabilities, enabled: bool | None, apply: Callable[[], None]) -> None:
    """Install ``part`` with ``apply`` (validate, then patch) and record it; all or nothing.

    ``enabled`` None means "the switch already decided, else the environment's". A part
    already installed with these settings is left alone (idempotent). Other capabilities
    or another switch than what is recorded raise `IntegrationError` before ``apply``
    runs; if ``apply`` raises, nothing is recorded (it patched nothing, by its contract).
    """
    global _state
    if part not in PARTS:
        raise IntegrationError(f"unknown kvcached seam part {part!r}")
    with LOCK:
        state = _state
        if enabled is None:
            if state is not None:
                enabled = state.enabled
            else:
                from kvcached.config import enabled_from_env

                enabled = enabled_from_env()
        if state is not None and (state.caps, state.enabled) != (caps, enabled):
            raise IntegrationError(
                f"kvcached's {part} seams: already installed for vLLM {state.caps.version} with "
                f"enabled={state.enabled}; refusing vLLM {caps.version} with enabled={enabled}"
            )
        if state is not None and part in state.parts:
            return
        apply()
        parts = frozenset({part}) if state is None else state.parts | {part}
        _state = InstallState(caps, enabled, parts)


def uninstall_part(part: str, restore: Callable[[], None]) -> None:
    """Run ``restore`` (which undoes ``part``'s patches exactly) and forget ``part``; idempotent."""
    global _state
    with LOCK:
        restore()
        state = _state
        if state is None or part not in state.parts:
            return
        rest = state.parts - {part}
        _state = InstallState(state.caps, state.enabled, rest) if rest else None
