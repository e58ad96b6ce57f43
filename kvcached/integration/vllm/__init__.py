"""kvcached for vLLM V1 (Model Runner V1).

vLLM activates this through its ``vllm.general_plugins`` entry point
(`kvcached.integration.vllm.plugin:register`). Importing this package is cheap and
imports nothing from vLLM; the submodules that patch vLLM import it themselves.

`status` tells whether kvcached is installed into this process's vLLM and acting.

Settings of one engine. ``KVCACHED_*`` variables configure every engine of a process; an
engine can also be given its own settings explicitly, through vLLM's ``additional_config``
under `ENGINE_CONFIG_KEY`, by `kvcached.config.KvcachedConfig` field name::

    LLM(model, additional_config={"kvcached": {"page_size": 1 << 21, "max_cached_blocks": -1}})

They win over the variables (which stay the defaults), reach every rank with vLLM's own
config, and are validated like the variables (an unknown name or a bad value is a
`kvcached.errors.ConfigError` when the engine starts).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ENGINE_CONFIG_KEY", "IntegrationStatus", "status"]

#: The key of vLLM's ``additional_config`` that holds an engine's explicit kvcached settings.
ENGINE_CONFIG_KEY = "kvcached"


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
