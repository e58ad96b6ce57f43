"""kvcached for vLLM V1 (Model Runner V1).

vLLM activates this through its ``vllm.general_plugins`` entry point
(`kvcached.integration.vllm.plugin:register`). Importing this package is cheap and
imports nothing from vLLM; the submodules that patch vLLM import it themselves.

`status` tells whether kvcached is installed into this process's vLLM and acting.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IntegrationStatus", "status"]


@dataclass(frozen=True, slots=True)
class IntegrationStatus:
    """kvcached's vLLM integration in this process, at one instant.

    ``installed``: every kvcached seam is patched into vLLM (what the plugin does when
    ``KVCACHED_ENABLE=1``; a single seam part installed by a test does not count).
    ``enabled``: installed and acting; seams installed while the switch is off only
    delegate to vLLM. ``vllm_version``: the vLLM the seams were installed for; when not
    installed, the importable vLLM's version, or None when vLLM cannot be imported.
    Invariant: ``enabled`` implies ``installed``.
    """

    installed: bool
    enabled: bool
    vllm_version: str | None


def status() -> IntegrationStatus:
    """The integration's state, read from its one install record (`install_state`).

    Never installs anything. Imports vLLM only when kvcached is not installed (to report
    its version), so calling this in a process without kvcached costs a vLLM import.
    """
    from kvcached.integration.vllm import install_state

    state = install_state.current()
    if state is not None and state.complete:
        return IntegrationStatus(installed=True, enabled=state.enabled, vllm_version=state.caps.version)
    from kvcached.integration.vllm.capabilities import vllm_version

    return IntegrationStatus(installed=False, enabled=False, vllm_version=vllm_version())
