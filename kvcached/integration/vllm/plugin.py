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
attribute exactly (the seams are listed in ``scheduler`` and ``worker``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcached.integration.vllm.capabilities import Capabilities

_lock = threading.RLock()
_installed: Capabilities | None = None


def register() -> None:
    """vLLM's plugin hook: install kvcached if the environment switches it on."""
    from kvcached.config import enabled_from_env

    if enabled_from_env():
        install()


def install() -> Capabilities:
    """Install the scheduler and worker seams for the running vLLM; idempotent.

    The seams act only when ``KVCACHED_ENABLE``/``ENABLE_KVCACHED`` is on (read now);
    installed while off they delegate to vLLM. `register` installs only when on.
    Raises `IntegrationError` for an unsupported vLLM, with nothing patched.
    """
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        from kvcached.config import enabled_from_env
        from kvcached.integration.vllm import capabilities, scheduler, worker

        enabled = enabled_from_env()
        caps = capabilities.detect()
        scheduler.install(caps, enabled=enabled)
        try:
            worker.install(caps)
        except BaseException:
            scheduler.uninstall()
            raise
        _installed = caps
        return caps


def uninstall() -> None:
    """Restore every attribute kvcached replaced; idempotent."""
    global _installed
    with _lock:
        if _installed is None:
            return
        from kvcached.integration.vllm import scheduler, worker

        worker.uninstall()
        scheduler.uninstall()
        _installed = None


def is_installed() -> bool:
    with _lock:
        return _installed is not None
