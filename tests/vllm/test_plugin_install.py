"""Plugin activation: idempotent install, exact uninstall, strict switch, vLLM's loader."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import ModuleType
from typing import Any

import pytest
import vllm
from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_manager
from vllm.v1.core.sched import async_scheduler
from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.v1.worker import cpu_worker, gpu_model_runner, gpu_worker

from kvcached.errors import ConfigError, IntegrationError
from kvcached.integration.vllm import IntegrationStatus, plugin, scheduler, status, worker
from kvcached.integration.vllm.capabilities import detect

SWITCHES = ("KVCACHED_ENABLE", "ENABLE_KVCACHED")
# Loaded up front so their namespaces are in every snapshot (the seams live there). The
# worker modules also patch vLLM's own namespaces when first imported (cpu/shm.py replaces
# torch_utils.async_tensor_h2d), which must not be mistaken for a seam.
SEAM_MODULES = (block_pool, kv_cache_coordinator, kv_cache_manager, vllm_scheduler, async_scheduler,
                gpu_model_runner, gpu_worker, cpu_worker)


def owners() -> list[Any]:
    """Every loaded vLLM module and every class it defines: all namespaces a seam could touch."""
    found: list[Any] = []
    for name, module in list(sys.modules.items()):
        if not (name == "vllm" or name.startswith("vllm.")) or not isinstance(module, ModuleType):
            continue
        found.append(module)
        found.extend(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name)
    return found


def namespace_snapshot() -> dict[int, tuple[Any, dict[str, Any]]]:
    return {id(owner): (owner, dict(vars(owner))) for owner in owners()}


def assert_identical(before: dict[int, tuple[Any, dict[str, Any]]]) -> None:
    """Every attribute that existed is the very same object again; nothing new but submodules."""
    for owner, attrs in before.values():
        now = vars(owner)
        changed = [name for name, value in attrs.items() if now.get(name, attrs) is not value]
        added = [name for name in now.keys() - attrs.keys() if not isinstance(now[name], ModuleType)]
        assert not changed and not added, f"{owner!r}: changed {changed}, added {added}"


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plugin.uninstall()
    yield
    plugin.uninstall()


def test_install_is_idempotent_and_uninstall_restores_every_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    before = namespace_snapshot()
    caps = plugin.install()
    assert plugin.is_installed() and scheduler.is_enabled()
    patched = namespace_snapshot()
    assert kv_cache_coordinator.BlockPool is scheduler.elastic_block_pool
    assert plugin.install() is caps  # second call: no-op
    assert_identical(patched)
    assert "schedule" not in vars(async_scheduler.AsyncScheduler)  # inherits the wrapped method
    plugin.uninstall()
    assert not plugin.is_installed()
    assert_identical(before)
    plugin.uninstall()  # second call: no-op
    assert_identical(before)
    assert kv_cache_coordinator.BlockPool is block_pool.BlockPool


def test_install_then_reinstall_after_uninstall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    before = namespace_snapshot()
    for _ in range(2):
        plugin.install()
        plugin.uninstall()
    assert_identical(before)


@pytest.mark.parametrize("env", [{}, {"KVCACHED_ENABLE": "0"}, {"ENABLE_KVCACHED": "false"},
                                 {"KVCACHED_ENABLE": "no"}])
def test_register_when_disabled_patches_nothing(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = namespace_snapshot()
    plugin.register()
    assert not plugin.is_installed()
    assert_identical(before)


@pytest.mark.parametrize("env", [{"KVCACHED_ENABLE": "1"}, {"KVCACHED_ENABLE": "yes"},
                                 {"ENABLE_KVCACHED": "true"}, {"ENABLE_KVCACHED": "TRUE"}])
def test_register_when_enabled_installs(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plugin.register()
    plugin.register()  # vLLM may call it again in the same process
    assert plugin.is_installed() and scheduler.is_enabled()


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["2", "enable", "tru", "1.0"])
def test_malformed_switch_raises_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    before = namespace_snapshot()
    with pytest.raises(ConfigError, match=name):
        plugin.register()
    assert not plugin.is_installed()
    assert_identical(before)


def test_unsupported_vllm_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    before = namespace_snapshot()
    with pytest.raises(IntegrationError, match=r"0\.26 to 0\.32"):
        plugin.register()
    assert not plugin.is_installed()
    assert_identical(before)


def test_install_while_disabled_only_delegates() -> None:
    before_pool = kv_cache_coordinator.BlockPool
    plugin.install()  # switch off: the seams are installed but act as vLLM
    assert plugin.is_installed() and not scheduler.is_enabled()
    pool = kv_cache_coordinator.BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    assert type(pool) is block_pool.BlockPool
    plugin.uninstall()
    assert kv_cache_coordinator.BlockPool is before_pool


def test_status_reads_the_one_install_state(monkeypatch: pytest.MonkeyPatch) -> None:
    version = vllm.__version__
    assert status() == IntegrationStatus(installed=False, enabled=False, vllm_version=version)
    plugin.install()  # switch off: installed, delegating
    assert status() == IntegrationStatus(installed=True, enabled=False, vllm_version=version)
    assert not scheduler.is_enabled() and not worker.is_enabled()
    plugin.uninstall()
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    plugin.register()
    assert status() == IntegrationStatus(installed=True, enabled=True, vllm_version=version)
    assert plugin.is_installed() and scheduler.is_enabled() and worker.is_enabled()
    plugin.uninstall()
    assert status() == IntegrationStatus(installed=False, enabled=False, vllm_version=version)
    assert not scheduler.is_enabled() and not worker.is_enabled()


def test_one_switch_for_every_part() -> None:
    """A part installed alone (as tests do) fixes the switch; a part or the plugin asking for
    another one is refused with nothing patched."""
    before = namespace_snapshot()
    scheduler.install(detect(), enabled=True)
    assert scheduler.is_enabled() and not worker.is_enabled(), "the worker part is not installed"
    assert status().installed is False and not plugin.is_installed(), "one part is not an installation"
    patched = namespace_snapshot()
    with pytest.raises(IntegrationError, match="already installed"):
        worker.install(detect(), enabled=False)
    with pytest.raises(IntegrationError, match="already installed"):
        plugin.install()  # the environment's switch is off here
    assert_identical(patched)
    assert worker.installed_capabilities() is None
    worker.install(detect())  # joins with the recorded switch
    assert worker.is_enabled() and plugin.is_installed() and status().enabled
    plugin.uninstall()
    assert_identical(before)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    child_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, env=child_env,
                          capture_output=True, text=True, timeout=300)


def test_entry_point_module_imports_nothing_heavy() -> None:
    out = _python("""
        import sys
        import kvcached.integration.vllm.plugin as p
        heavy = sorted(m for m in ("vllm", "torch", "kvcached._vmm") if m in sys.modules)
        print(heavy)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_status_is_public_and_importing_the_package_imports_no_vllm() -> None:
    out = _python("""
        import sys
        from kvcached.integration.vllm import status
        imported = "vllm" in sys.modules
        s = status()
        import vllm
        print(imported, s.installed, s.enabled, s.vllm_version == vllm.__version__)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False False True"


def test_vllm_plugin_loader_installs_through_the_entry_point() -> None:
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from kvcached.integration.vllm import plugin, status
        assert status().installed == plugin.is_installed()
        print("installed" if plugin.is_installed() else "native")
    """
    on = _python(code, KVCACHED_ENABLE="1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip().splitlines()[-1] == "installed"
    off = _python(code)
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip().splitlines()[-1] == "native"


def test_config_error_from_register_stops_vllm() -> None:
    """vLLM swallows plugin *import* errors but not errors raised by register()."""
    out = _python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    """, KVCACHED_ENABLE="maybe")
    assert out.returncode != 0
    assert "ConfigError" in out.stderr and "KVCACHED_ENABLE" in out.stderr


def test_allocate_slots_seam_has_vllms_own_signature() -> None:
    """The exhaustion seam is compiled against vLLM's parameter list (no ``*args`` per call)."""
    import inspect

    native = kv_cache_manager.KVCacheManager.allocate_slots
    scheduler.install(detect(), enabled=True)
    try:
        seam = kv_cache_manager.KVCacheManager.allocate_slots
        assert seam is not native and seam.__wrapped__ is native
        assert inspect.signature(seam, follow_wrapped=False) == inspect.signature(native)
    finally:
        scheduler.uninstall()


def test_a_wrapper_that_hides_the_parameters_is_refused_and_nothing_is_patched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A foreign ``*args, **kwargs`` wrapper without functools.wraps: refused at install, not
    misread at run time. Control: the same wrapper with functools.wraps installs."""
    import functools

    native = kv_cache_manager.KVCacheManager.allocate_slots

    def hiding(self: Any, *args: Any, **kwargs: Any) -> Any:
        return native(self, *args, **kwargs)

    monkeypatch.setattr(kv_cache_manager.KVCacheManager, "allocate_slots", hiding)
    before = namespace_snapshot()
    with pytest.raises(IntegrationError, match="allocate_slots.*cannot read"):
        scheduler.install(detect(), enabled=True)
    assert_identical(before)
    assert scheduler.installed_capabilities() is None
    monkeypatch.setattr(kv_cache_manager.KVCacheManager, "allocate_slots", functools.wraps(native)(hiding))
    scheduler.install(detect(), enabled=True)
    scheduler.uninstall()


def test_a_parameter_named_like_the_seams_locals_is_refused() -> None:
    """The compiled body names ``pool`` and ``original``: a vLLM parameter of that name
    would be shadowed, so it is refused instead."""
    import inspect

    def allocate_slots(self: Any, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, reserved_blocks: int = 0, pool: Any = None) -> Any:
        return None

    with pytest.raises(IntegrationError, match=r"\['pool'\]"):
        scheduler._compile_exact(scheduler._ALLOCATE_SLOTS, inspect.signature(allocate_slots), allocate_slots,
                                 lookahead="0", namespace={})


_LOG_PROBE = textwrap.dedent("""
    import logging, vllm.logger  # vLLM configures its "vllm" logger on import
    from kvcached.integration.vllm import plugin
    plugin.register()
    plugin.register()  # idempotent: one handler, one line
    logging.getLogger("kvcached.budget").warning("core-log-probe")
""")


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_core_warnings_reach_vllms_log_when_enabled(enabled: str) -> None:
    """A core warning (``kvcached.*``) is written by vLLM's own handler, in vLLM's format,
    once; disabled, nothing is routed (Python's last-resort handler prints the bare text)."""
    env = {**os.environ, "KVCACHED_ENABLE": enabled, "VLLM_LOGGING_LEVEL": "INFO"}
    out = subprocess.run([sys.executable, "-c", _LOG_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "core-log-probe" in ln]
    assert len(lines) == 1, lines
    vllm_format = lines[0].startswith("WARNING") and "[" in lines[0] and lines[0] != "core-log-probe"
    assert vllm_format == (enabled == "1"), lines
