"""What ``pip install .`` ships: kvcached alone, its console scripts and its one vLLM plugin; the harness
(conformance/, serving_probes/) is its own distribution, ``harness/``, the only one that registers the
engine agent's plugin (a user's vLLM processes must never import the harness).

The wheels are built the way the shared environment and the GPU host build them (``--no-build-isolation``,
offline), with this interpreter's build tools; building kvcached compiles csrc.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "harness"
AGENT = ("conformance_agent", "conformance.engine.agent:register")


class BuildFailed(RuntimeError):
    """pip could not build or install one of this repository's distributions."""


def _pip(*args: str, cwd: Path) -> None:
    # From outside the checkout (cwd), so the source tree never stands in for what was installed.
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--no-index",
                           "-q"], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildFailed(f"pip {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")


def _wheel(project: Path, out: Path) -> zipfile.ZipFile:
    out.mkdir(parents=True, exist_ok=True)
    _pip("wheel", "-w", str(out), str(project), cwd=out)
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _entry_points(wheel: zipfile.ZipFile) -> dict[str, dict[str, str]]:
    """The wheel's entry points, read by importlib.metadata from inside the zip, as pip would install them."""
    (info,) = {n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")}
    found: dict[str, dict[str, str]] = {}
    for ep in metadata.PathDistribution(zipfile.Path(wheel, f"{info}/")).entry_points:
        found.setdefault(ep.group, {})[ep.name] = ep.value
    return found


def test_the_product_wheel_is_kvcached_alone(tmp_path: Path) -> None:
    wheel = _wheel(ROOT, tmp_path)
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert tops == {"kvcached", "kvcached-0.1.0.dist-info"}, f"the wheel ships more than kvcached: {sorted(tops)}"
    assert any(n.startswith("kvcached/_vmm") for n in wheel.namelist()), "the native module is missing"
    assert _entry_points(wheel) == {
        "console_scripts": {"kvctl": "kvcached.cli.kvctl:main", "kvtop": "kvcached.cli.kvtop:main"},
        "vllm.general_plugins": {"kvcached": "kvcached.integration.vllm.plugin:register"},
    }


def test_the_harness_is_its_own_distribution_with_the_agent_plugin(tmp_path: Path) -> None:
    wheel = _wheel(HARNESS, tmp_path / "wheel")
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names} == {"conformance", "serving_probes", "kvcached_harness-0.1.0.dist-info"}
    assert "conformance/reporting/templates/report.html.j2" in names  # package data ships too
    assert _entry_points(wheel) == {"vllm.general_plugins": dict([AGENT])}


def test_the_gpu_hosts_target_install_registers_the_agent(tmp_path: Path) -> None:
    """The GPU bundle installs the harness with ``--target`` (then PYTHONPATH): the entry point is found there."""
    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(HARNESS), cwd=tmp_path)
    (dist,) = metadata.distributions(name="kvcached-harness", path=[str(target)])
    assert [(ep.group, ep.name, ep.value) for ep in dist.entry_points] == [("vllm.general_plugins", *AGENT)]

