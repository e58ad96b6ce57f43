"""The offline GPU bundle (serving_probes/gpu_bundle.py) on synthetic inputs: no network, no vLLM wheel."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from serving_probes import gpu_bundle as gb

PART = 64 * 1024  # small parts, so that a group spans several


def _bytes_member(arcname: str, data: bytes) -> gb.Member:
    return gb.Member(arcname, len(data), lambda: io.BytesIO(data))


def _fake_wheel(directory: Path, name: str, module: str) -> Path:
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", f"NAME = {module!r}\n")
        zf.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\n")
    return path


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A bundle of two groups: core (a fake vLLM tree, incompressible so it spans parts, and two wheels)
    and an optional moe (one fake kernel)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    core = [_bytes_member("site/vllm/__init__.py", b"__version__ = '0.26.0'\n"),
            _bytes_member("site/vllm/_C_stable_libtorch.abi3.so", os.urandom(3 * PART + 123)),
            _bytes_member("site/vllm/v1/worker/gpu_model_runner.py", b"class GPUModelRunner: ...\n")]
    core += [gb.member_from_file(p, f"wheels/{p.name}")
             for p in (_fake_wheel(wheels, "alpha", "alpha"), _fake_wheel(wheels, "beta", "beta"))]
    moe = [_bytes_member("site/vllm/_moe_C_stable_libtorch.abi3.so", os.urandom(PART // 2))]
    out = tmp_path / "bundle"
    gb.write_bundle(out, [(gb.GROUPS[0], core), (gb.GROUPS[1], moe)], part_bytes=PART, preset=0,
                    dropped=[gb.DroppedMember("vllm/vllm-rs", 42, "vllm-rs")], log=lambda _: None)
    return out


def _fake_steps(fail_kvcached: bool = False) -> gb.InstallSteps:
    """pip replaced: wheels are unzipped into site; kvcached is a file written (or a failure raised)."""
    def install_wheels(wheels: Sequence[Path], site: Path) -> None:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site)

    def build_kvcached(repo: Path, dest: Path) -> None:
        if fail_kvcached:
            raise gb.StepFailed(f"building kvcached failed (exit 1): pip install {repo}")
        (dest / "kvcached").mkdir(parents=True)
        (dest / "kvcached" / "__init__.py").write_text("__version__ = 'test'\n")

    return gb.InstallSteps(install_wheels, build_kvcached)


def _old_target(tmp_path: Path) -> Path:
    target = tmp_path / "install"
    (target / "site").mkdir(parents=True)
    (target / "site" / "old.txt").write_text("the previous install\n")
    return target


def _assert_untouched(target: Path) -> None:
    assert sorted(p.name for p in target.rglob("*")) == ["old.txt", "site"]
    assert (target / "site" / "old.txt").read_text() == "the previous install\n"
    assert not list(target.parent.glob("install.staging-*")), "a staging directory was left behind"
    assert not list(target.parent.glob("install.old-*"))


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "pyproject.toml").write_text("[project]\nname = 'kvcached'\n")
    (repo / gb.HARNESS_DIR).mkdir(exist_ok=True)
    (repo / gb.HARNESS_DIR / "pyproject.toml").write_text("[project]\nname = 'kvcached-harness'\n")
    return repo


def test_parts_respect_the_size_and_the_manifest_round_trips(bundle: Path) -> None:
    manifest = gb.read_manifest(bundle)
    core, moe = manifest.groups
    assert (core.name, core.required, moe.name, moe.required) == ("core", True, "moe", False)
    assert len(core.parts) >= 3 and [p.file for p in core.parts][:2] == ["core.part01", "core.part02"]
    assert all(p.size == PART for p in core.parts[:-1]) and 0 < core.parts[-1].size <= PART
    assert sum(p.size for p in core.parts) == core.stream_size
    assert sorted(f.name for f in bundle.iterdir()) == sorted(
        [gb.MANIFEST_NAME, *(p.file for g in manifest.groups for p in g.parts)])
    assert manifest.dropped == (gb.DroppedMember("vllm/vllm-rs", 42, "vllm-rs"),)
    assert gb.Manifest.from_json(manifest.to_json()) == manifest
    gb.write_manifest(bundle, manifest)
    assert gb.read_manifest(bundle) == manifest
    assert not list(bundle.parent.glob("bundle.building-*"))


def test_verify_accepts_an_intact_bundle(bundle: Path) -> None:
    manifest, selected = gb.verify(bundle)
    assert [g.name for g in selected] == ["core", "moe"]
    assert [g.name for g in gb.select_groups(manifest, ["moe"])] == ["core", "moe"]  # core is always in
    with pytest.raises(gb.UnknownGroup, match="gpu"):
        gb.select_groups(manifest, ["gpu"])


def test_a_corrupt_part_is_refused_naming_the_file(bundle: Path) -> None:
    part = bundle / "core.part02"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF  # same size, different bytes
    part.write_bytes(bytes(data))
    with pytest.raises(gb.CorruptPart, match="core.part02.*sha256"):
        gb.verify(bundle)
    part.write_bytes(bytes(data[:-1]))  # truncated
    with pytest.raises(gb.CorruptPart, match="core.part02.*bytes"):
        gb.verify(bundle)


def test_a_missing_part_is_refused_naming_the_file(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "moe.part01").unlink()
    with pytest.raises(gb.MissingPart, match="moe.part01"):
        gb.verify(bundle)
    gb.verify(bundle, ["core"])  # an optional group not asked for may be absent
    assert gb.main(["verify", "--bundle", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert "moe.part01" in err and err.count("\n") == 1


@pytest.mark.parametrize("mib", [0, 61, 1000])
def test_part_size_outside_1_to_60_mib_is_refused(tmp_path: Path, mib: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(gb.PartSizeError, match="1 to 60 MiB"):
        gb.part_size_bytes(mib)
    with pytest.raises(gb.PartSizeError):
        gb.pack_group(gb.GROUPS[0], [], tmp_path, mib * gb.MIB + 1 if mib else 0)
    # The CLI refuses it before looking for any wheel (there is none here).
    assert gb.main(["build", "--out", str(tmp_path / "out"), "--part-mib", str(mib)]) == 2
    assert "--part-mib" in capsys.readouterr().err
    assert gb.part_size_bytes(60) == 60 * gb.MIB and gb.part_size_bytes(1) == gb.MIB


def test_install_puts_wheels_vllm_tree_and_kvcached_into_site(bundle: Path, tmp_path: Path) -> None:
    target = _old_target(tmp_path)
    done = gb.install(bundle, target, repo=_repo(tmp_path), steps=_fake_steps(), log=lambda _: None)
    site = target / "site"
    assert done.site == site and done.groups == ("core", "moe") and done.kvcached
    assert (site / "vllm" / "v1" / "worker" / "gpu_model_runner.py").is_file()
    assert (site / "vllm" / "_C_stable_libtorch.abi3.so").stat().st_size == 3 * PART + 123
    assert (site / "vllm" / "_moe_C_stable_libtorch.abi3.so").is_file()
    assert (site / "alpha" / "__init__.py").is_file() and (site / "beta" / "__init__.py").is_file()
    assert (site / "kvcached" / "__init__.py").is_file()
    assert not (site / "old.txt").exists() and not (target / "unpacked").exists()
    assert gb.Manifest.from_json((target / gb.MANIFEST_NAME).read_text()) == gb.read_manifest(bundle)
    assert not list(tmp_path.glob("install.staging-*")) and not list(tmp_path.glob("install.old-*"))


def test_install_of_core_only_leaves_out_the_moe_kernel(bundle: Path, tmp_path: Path) -> None:
    target = tmp_path / "fresh"
    gb.install(bundle, target, groups=["core"], skip_kvcached=True, steps=_fake_steps(), log=lambda _: None)
    assert (target / "site" / "vllm" / "__init__.py").is_file()
    assert not (target / "site" / "vllm" / "_moe_C_stable_libtorch.abi3.so").exists()
    assert not (target / "site" / "kvcached").exists()


def test_a_corrupt_later_group_leaves_the_target_untouched(bundle: Path, tmp_path: Path) -> None:
    target = _old_target(tmp_path)
    (bundle / "moe.part01").write_bytes(b"x" * (bundle / "moe.part01").stat().st_size)
    with pytest.raises(gb.CorruptPart, match="moe.part01"):
        gb.install(bundle, target, repo=_repo(tmp_path), steps=_fake_steps(), log=lambda _: None)
    _assert_untouched(target)


def test_a_failing_kvcached_build_leaves_the_target_untouched(bundle: Path, tmp_path: Path) -> None:
    target = _old_target(tmp_path)
    with pytest.raises(gb.StepFailed, match="kvcached"):
        gb.install(bundle, target, repo=_repo(tmp_path), steps=_fake_steps(fail_kvcached=True), log=lambda _: None)
    _assert_untouched(target)


def test_a_conflicting_file_fails_the_install_and_leaves_the_target(bundle: Path, tmp_path: Path) -> None:
    def install_wheels(wheels: Sequence[Path], site: Path) -> None:
        (site / "vllm").mkdir()
        (site / "vllm" / "__init__.py").write_text("a wheel claiming vllm\n")

    target = _old_target(tmp_path)
    with pytest.raises(gb.InstallConflict, match="vllm/__init__.py"):
        gb.install(bundle, target, skip_kvcached=True, steps=gb.InstallSteps(install_wheels), log=lambda _: None)
    _assert_untouched(target)


def test_trim_plan_groups_drops_and_stale_rules() -> None:
    entries = [(name, 10) for name in gb.REQUIRED_MEMBERS] + [
        ("vllm/", 0), ("vllm/_moe_C_stable_libtorch.abi3.so", 47), ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", 305),
        ("vllm/vllm-rs", 42), ("vllm/_flashmla_C.abi3.so", 1), ("vllm/_qutlass_C.abi3.so", 1),
        ("vllm/_rust_tool_parser.abi3.so", 1), ("vllm/third_party/deep_gemm/include/cute/tensor.hpp", 2),
        ("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", 3),
        ("vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so", 3),
        ("vllm/third_party/fmha_sm100/cutlass/include/cutlass/matrix.h", 4),
        ("vllm/third_party/fmha_sm100/api.py", 5),
        ("vllm/entrypoints/serve/instrumentator/static/swagger-ui.css", 6)]
    plan = gb.plan_trim(entries)
    assert plan.groups["moe"] == ("vllm/_moe_C_stable_libtorch.abi3.so",)
    core = set(plan.groups["core"])
    assert set(gb.REQUIRED_MEMBERS) <= core
    assert {"vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", "vllm/third_party/fmha_sm100/api.py"} <= core
    assert {d.rule for d in plan.dropped} == {r.key for r in gb.TRIM_RULES}
    assert len(core) + len(plan.groups["moe"]) + len(plan.dropped) == len(entries) - 1  # less the directory
    with pytest.raises(gb.TrimError, match="vllm-rs"):
        gb.plan_trim([e for e in entries if e[0] != "vllm/vllm-rs"])
    with pytest.raises(gb.TrimError, match="_C_stable_libtorch"):
        gb.plan_trim([e for e in entries if e[0] != "vllm/_C_stable_libtorch.abi3.so"])


def test_wheel_tags_that_fit_the_host() -> None:
    assert gb.wheel_fits_host("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert gb.wheel_fits_host("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert gb.wheel_fits_host("partial_json_parser-0.2.1.1.post7-py3-none-any.whl")
    assert not gb.wheel_fits_host("pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert not gb.wheel_fits_host("blake3-1.0.11-cp312-cp312-macosx_11_0_arm64.whl")
    assert not gb.wheel_fits_host("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_aarch64.whl")
    assert len({gb._normalize(p.name) for p in gb.HOST_WHEELS}) == len(gb.HOST_WHEELS)


def test_probe_reports_failures_without_raising(tmp_path: Path) -> None:
    site = tmp_path / "t" / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('no CUDA torch on this machine')\n")
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("raise RuntimeError('needs CUDA')\n")
    result = gb.run_probe(site, timeout=60)
    assert "ImportError: no CUDA torch" in result["torch"]["error"]
    lines = gb.format_probe(result)
    assert any(line.startswith("vLLM") and "RuntimeError: needs CUDA" in line for line in lines)
    assert any(line.startswith("GPU") and "FAILED" in line for line in lines)
    # the serving imports report each module's failure, not the first one only
    serving = next(line for line in lines if line.startswith("serving"))
    assert "vllm.entrypoints.openai.api_server: RuntimeError: needs CUDA" in serving
    assert "vllm.benchmarks.serve: RuntimeError: needs CUDA" in serving
    assert gb.format_probe({"probe": {"error": "timed out"}}) == ["probe         FAILED: timed out"]
    assert gb.export_lines(site)[0] == f"export PYTHONPATH={site}"
    assert "export VLLM_USE_FLASHINFER_SAMPLER=0" in "\n".join(gb.export_lines(site))
    assert "V1" in gb.runner_meaning(False) and "per model" in gb.runner_meaning(None)
