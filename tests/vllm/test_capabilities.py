"""The capability table: supported, unsupported and unparsable vLLM versions."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvcached.errors import ConfigError, IntegrationError
from kvcached.integration.vllm import capabilities
from kvcached.integration.vllm.capabilities import (
    TRIAL_ENV,
    Capabilities,
    capabilities_for,
    detect,
    parse_series,
    trial_requested,
)

_BASE = {"logical_block_copy": True, "raw_mamba_pages": True, "allocate_kv_cache": True,
         "cpu_warmup_decision": False, "request_memory_external": False, "model_runner_v2": False,
         "v2_profiling_cache": True, "v2_warmup_before_capture": False, "hisparse": False}
# V2 through _allocate_kv_cache, with no profiling cache (0.26-0.28)
_V2 = {"allocate_kv_cache": False, "model_runner_v2": True, "v2_profiling_cache": False}
_030 = {"cpu_warmup_decision": True, "v2_warmup_before_capture": True, "hisparse": True}
ROWS: dict[tuple[int, int], dict[str, object]] = {  # from the contract notes and the compat report
    (0, 26): {**_BASE, **_V2, "raw_mamba_pages": False},
    (0, 27): {**_BASE, **_V2},  # 0.27.0 == 0.27.1
    (0, 28): {**_BASE, **_V2},
    (0, 29): _BASE,
    (0, 30): {**_BASE, **_030},
    (0, 31): {**_BASE, **_030},
    (0, 32): {**_BASE, **_030, "request_memory_external": True},
}
#: Rows drafted from the wheels' source: they hold on these series on trial only.
DRAFTED = {"model_runner_v2": {(0, 29), (0, 30), (0, 31), (0, 32)}}


def row(series: tuple[int, int], trial: bool) -> dict[str, object]:
    """`ROWS` as ``capabilities_for`` gives it with or without trial."""
    return ROWS[series] | {name: True for name, on in DRAFTED.items() if trial and series in on}


@pytest.mark.parametrize("version, series", [
    ("0.26.0", (0, 26)), ("0.27.0", (0, 27)), ("0.27.1", (0, 27)), ("0.28.0", (0, 28)),
    ("0.29.0", (0, 29)), ("0.30.0", (0, 30)), ("0.31.0", (0, 31)), ("0.32.0", (0, 32)), ("0.28.0+cpu", (0, 28)), ("0.28.0+cu129", (0, 28)),
    ("0.28.0.post1", (0, 28)), ("0.28.2", (0, 28)), ("0.28", (0, 28)), (" 0.26.0 ", (0, 26)),
])
def test_supported_versions(version: str, series: tuple[int, int]) -> None:
    for trial in (False, True):
        caps = capabilities_for(version, trial=trial)
        assert caps.series == series and caps.version == version
        assert {f.name: getattr(caps, f.name) for f in dataclasses.fields(caps)
                if f.name not in ("version", "series")} == row(series, trial)
        assert {name for name in DRAFTED if caps.drafted(name)} == {n for n, on in DRAFTED.items() if series in on}


def test_drafted_rows_hold_on_trial_only_and_say_so() -> None:
    """Model Runner V2 on 0.29-0.32: its seams are read from each wheel's source, and no engine
    has run them (V2 needs Triton; the GPU host has 0.26), so kvcached serves V2 there on trial."""
    assert capabilities.TRIAL_ROWS == {"model_runner_v2": ((0, 29), (0, 32))}
    for version in ("0.26.0", "0.28.0"):
        assert capabilities_for(version).model_runner_v2 and not capabilities_for(version).drafted("model_runner_v2")
    for version in ("0.29.0", "0.32.0"):
        assert not capabilities_for(version).model_runner_v2 and capabilities_for(version, trial=True).model_runner_v2


def test_a_drafted_row_accepted_on_trial_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    capabilities_for("0.30.0")
    assert "drafted" not in caplog.text
    capabilities_for("0.30.0", trial=True)
    assert "on vLLM 0.30.0 the capability rows model_runner_v2 are drafted" in caplog.text
    caplog.clear()
    capabilities_for("0.28.0", trial=True)
    assert "drafted" not in caplog.text


@pytest.mark.parametrize("version", ["0.25.2", "0.23.0", "0.9.2", "0.33.0", "1.0.0", "0.33.0+cpu", "2"])
def test_unsupported_versions_name_the_supported_range(version: str) -> None:
    with pytest.raises(IntegrationError, match=r"supports vLLM 0\.26 to 0\.32\. .*nox -s compat -- "):
        capabilities_for(version)


@pytest.mark.parametrize("version", ["0.34.0", "0.34.0+cu130", "0.35.1", "1.0.0"])
def test_vllm_034_and_later_are_refused_by_name_with_why(version: str) -> None:
    """0.34 removed Model Runner V1 and brought vLLM's own extensible KV cache: refused, saying
    so and where the decision is, even on trial, until an engine has run it (docs/vllm-0.34.md)."""
    for trial in (False, True):
        with pytest.raises(IntegrationError) as refused:
            capabilities_for(version, trial=trial)
        text = str(refused.value)
        assert "Model Runner V2 only" in text and "--enable-extensible-kv-cache" in text
        assert "docs/vllm-0.34.md" in text and re.search(r"supports vLLM 0\.26 to 0\.32", text)
    assert (Path(__file__).resolve().parents[2] / "docs" / "vllm-0.34.md").is_file()
    with pytest.raises(IntegrationError) as older:
        capabilities_for("0.33.0")
    assert "Model Runner V2 only" not in str(older.value)  # 0.33 still has V1: the plain refusal


@pytest.mark.parametrize("version", ["", "banana", "0.28.x", "v0.28.0-cpu", "0.28.0+", "..", "1!0.28.0"])
def test_unparsable_versions_are_refused(version: str) -> None:
    with pytest.raises(IntegrationError):
        capabilities_for(version)


@pytest.mark.parametrize("version", ["0.29.0rc1", "0.28.1.dev12+g1234abc", "0.27.0a1", "0.28.0b2"])
def test_prereleases_and_dev_builds_are_not_guessed(version: str) -> None:
    with pytest.raises(IntegrationError, match="pre-release or dev build"):
        capabilities_for(version)


def test_non_string_is_refused() -> None:
    with pytest.raises(IntegrationError):
        parse_series(0.28)  # type: ignore[arg-type]


def test_capabilities_are_frozen() -> None:
    caps = capabilities_for("0.28.0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.raw_mamba_pages = False  # type: ignore[misc]


def test_detect_reads_the_installed_vllm() -> None:
    import vllm

    caps = detect()
    assert isinstance(caps, Capabilities) and caps.version == vllm.__version__
    assert caps == capabilities_for(vllm.__version__, trial=trial_requested()) and caps.series in ROWS


@pytest.fixture
def range_to_0_30(monkeypatch: pytest.MonkeyPatch) -> None:
    """The supported range as it was before 0.31 and 0.32 had their compat rows: their
    capability rows drafted from the wheels' source, the releases on trial only."""
    monkeypatch.setattr(capabilities, "SUPPORTED", ((0, 26), (0, 30)))
    monkeypatch.setattr(capabilities, "TRIAL", (0, 32))


@pytest.mark.parametrize("version, series", [("0.31.0", (0, 31)), ("0.32.0", (0, 32)), ("0.32.1+cpu", (0, 32))])
def test_drafted_releases_are_accepted_on_trial_only(version: str, series: tuple[int, int], range_to_0_30: None,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(IntegrationError, match=rf"{TRIAL_ENV}=1 accepts it on trial"):
        capabilities_for(version)
    caps = capabilities_for(version, trial=True)
    assert caps.series == series and {f.name: getattr(caps, f.name) for f in dataclasses.fields(caps)
                                      if f.name not in ("version", "series")} == row(series, True)
    assert "accepted on trial" in caplog.text


@pytest.mark.parametrize("version", ["0.33.0", "0.25.2", "1.0.0"])
def test_trial_does_not_widen_past_the_drafted_rows(version: str, range_to_0_30: None) -> None:
    with pytest.raises(IntegrationError, match="is not supported") as info:
        capabilities_for(version, trial=True)
    assert "on trial" not in str(info.value)


@pytest.mark.parametrize("raw, want", [(None, False), ("0", False), ("", False), ("1", True), (" on ", True)])
def test_the_trial_switch(raw: str | None, want: bool) -> None:
    assert trial_requested({} if raw is None else {TRIAL_ENV: raw}) is want


@pytest.mark.parametrize("raw", ["2", "nan", "maybe"])
def test_a_bad_trial_switch_is_named(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"{TRIAL_ENV}={raw!r}"):
        trial_requested({TRIAL_ENV: raw})


def test_capabilities_is_the_only_module_that_compares_vllm_versions() -> None:
    root = Path(__file__).resolve().parents[2] / "kvcached"
    # Reporting the version string (``vllm_version``, e.g. in ``status()``) is not comparing it.
    version_use = re.compile(r"vllm\.__version__|version\(\s*[\'\"]vllm|packaging|(?<!vllm)(?<!max)_version\b")
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "capabilities.py" and version_use.search(path.read_text())
    ]
    assert offenders == []


def _served(version: str, runner: str) -> str:
    """What the README says of ``runner`` on ``version``, derived from the table alone."""
    try:
        caps = capabilities_for(version)
    except IntegrationError as refused:
        if "Model Runner V2 only" in str(refused):
            return ("refused by name: V1 is gone" if runner == "V1"
                    else "refused by name: vLLM's own extensible KV cache")
        return "refused (no compat row)"
    if runner == "V1" or caps.model_runner_v2:
        return "served"
    assert caps.drafted("model_runner_v2") and capabilities_for(version, trial=True).model_runner_v2
    return f"on trial (`{TRIAL_ENV}=1`), else refused by name"


def test_the_readme_says_which_runner_each_release_is_served_on() -> None:
    """The README's table of releases and runners is the capability table's (each row's series
    range must agree on every release in it)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| (0\.\d+(?:-0\.\d+|\+)?) \| ([^|]+) \| ([^|]+) \|$", readme, re.MULTILINE)
    assert [r[0] for r in rows] == ["0.26-0.28", "0.29-0.32", "0.33", "0.34+"]
    for series, v1, v2 in rows:
        lo, _, hi = series.rstrip("+").partition("-")
        last = int((hi or lo).split(".")[1]) + (1 if series.endswith("+") else 0)
        for minor in range(int(lo.split(".")[1]), last + 1):
            version = f"0.{minor}.0"
            assert (_served(version, "V1"), _served(version, "V2")) == (v1.strip(), v2.strip()), version
