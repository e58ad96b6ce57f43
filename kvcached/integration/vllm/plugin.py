"""vLLM plugin entry point (group ``vllm.general_plugins``, name ``kvcached``).

vLLM imports this module in every process (front end, EngineCore, workers) and calls
`register` once per process. Two rules follow from how vLLM loads plugins:

* The *import* of this module is wrapped by vLLM in ``try/except`` that only logs, so a
  failing import would silently give a native run. The import is therefore trivial
  (standard library only); everything else is imported inside the functions.
* The *call* of `register` is not wrapped: its exceptions stop the engine. Configuration
  errors (a malformed ``KVCACHED_ENABLE``) and integration errors (an unsupported vLLM)
  are raised from here on purpose.

Switch: ``KVCACHED_ENABLE`` (or upstream's ``ENABLE_KVCACHED``), parsed strictly
(1/0, true/false, yes/no, on/off); anything else raises `ConfigError` naming the variable.
When disabled, `register` patches nothing and vLLM runs exactly as without the plugin.

`install` is idempotent and all-or-nothing; `uninstall` restores every replaced
attribute exactly (the seams are listed in ``scheduler`` and ``worker``). What is
installed, and whether it acts, is recorded in one place, `install_state`; this module
keeps no flag of its own (`kvcached.integration.vllm.status` reports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcached.integration.vllm.capabilities import Capabilities


def register() -> None:
    """vLLM's plugin hook: install kvcached if the environment switches it on."""
    from kvcached.config import enabled_from_env

    if enabled_from_env():
        install()
        route_core_logs()


def route_core_logs() -> None:
    """Send the core's log records (``kvcached.*``; the core never imports vLLM) where vLLM
    sends its own: to the handlers of the ``vllm`` logger, which does not propagate to the
    root, so without this a core warning (a budget record that became unreadable) never
    reaches ``vllm serve``'s log. Leaves a ``kvcached`` logger the application configured
    (one with handlers) alone; idempotent."""
    import logging

    core, host = logging.getLogger("kvcached"), logging.getLogger("vllm")
    if core.handlers or not host.handlers:
        return
    for handler in host.handlers:
        core.addHandler(handler)
    core.setLevel(host.getEffectiveLevel())
    core.propagate = False  # the handlers are vLLM's: a root handler would print it twice


def install() -> Capabilities:
    """Install the scheduler and worker seams for the running vLLM; idempotent.

    The switch (``KVCACHED_ENABLE``/``ENABLE_KVCACHED``) is read now and recorded once for
    both parts; installed while off, the seams delegate to vLLM. `register` installs only
    when on. Raises `IntegrationError` for an unsupported vLLM, with nothing patched; if
    the worker part fails, a scheduler part installed here is removed again.
    """
    from kvcached.config import enabled_from_env
    from kvcached.integration.vllm import install_state

    with install_state.LOCK:
        state = install_state.current()
        if state is not None and state.complete:
            return state.caps
        from kvcached.integration.vllm import capabilities, scheduler, worker

        enabled = enabled_from_env()
        caps = capabilities.detect()
        had_scheduler = state is not None and "scheduler" in state.parts
        scheduler.install(caps, enabled=enabled)
        try:
            worker.install(caps, enabled=enabled)
        except BaseException:
            if not had_scheduler:
                scheduler.uninstall()
            raise
        installed = install_state.current()
        if installed is None or not installed.complete:
            from kvcached.errors import InvariantError

            raise InvariantError("both seam parts were installed under the lock, yet are not recorded")
        return installed.caps  # the recorded object: every later install() returns this one


def uninstall() -> None:
    """Restore every attribute kvcached replaced; idempotent."""
    from kvcached.integration.vllm import install_state

    with install_state.LOCK:
        if install_state.current() is None:
            return
        from kvcached.integration.vllm import scheduler, worker

        worker.uninstall()
        scheduler.uninstall()


def is_installed() -> bool:
    """Whether every kvcached seam is installed (the switch may still be off)."""
    from kvcached.integration.vllm import install_state

    state = install_state.current()
    return state is not None and state.complete
