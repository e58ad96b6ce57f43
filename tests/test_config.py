"""Settings at their bounds, and one rule per field for configs from the environment and from code."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvcached.budget import NAME_BYTES, NO_LIMIT, record_path
from kvcached.config import INIT_PID_NS, KvcachedConfig, device_defaults, engine_name
from kvcached.errors import ConfigError


@pytest.mark.parametrize("raw", [str(NO_LIMIT), str(1 << 64), str(10**30), "16EiB", "99999999999TiB"])
def test_budget_bytes_beyond_what_a_record_holds_are_refused_naming_the_variable(raw: str) -> None:
    """2**64-1 is the record's "no limit": asking for it meant no limit at all, and 2**64 and
    above could not be stored (struct.error when the record was written)."""
    with pytest.raises(ConfigError, match="KVCACHED_BUDGET_BYTES"):
        KvcachedConfig.resolve(env={"KVCACHED_BUDGET_BYTES": raw})


def test_budget_bytes_take_whole_byte_sizes_up_to_the_records_bound() -> None:
    assert KvcachedConfig.resolve(env={"KVCACHED_BUDGET_BYTES": "1073741824"}).budget_bytes == 1 << 30
    assert KvcachedConfig.resolve(env={"KVCACHED_BUDGET_BYTES": "1GiB"}).budget_bytes == 1 << 30
    assert KvcachedConfig.resolve(env={"KVCACHED_BUDGET_BYTES": str(NO_LIMIT // 2)}).budget_bytes == NO_LIMIT // 2
    with pytest.raises(ConfigError, match=r"KVCACHED_BUDGET_BYTES.*whole number of bytes"):
        KvcachedConfig.resolve(env={"KVCACHED_BUDGET_BYTES": "0.5"})


@pytest.mark.parametrize("raw", ["off", "OFF", "Off", " off "])
def test_budget_path_off_in_any_case_switches_budgets_off(raw: str) -> None:
    """``OFF`` became a relative record file named OFF, with budgets still on."""
    config = KvcachedConfig.resolve(env={"KVCACHED_BUDGET_PATH": raw})
    assert config.budget_path == "off"
    assert record_path(config.budget_path, "cpu") is None
    assert KvcachedConfig(budget_path=raw).budget_path == "off"


VARS = {"retry_backoff_s": "KVCACHED_RETRY_BACKOFF_MS", "capacity_ttl_s": "KVCACHED_CAPACITY_TTL_MS",
        "map_retries": "KVCACHED_MAP_RETRIES", "min_reserve_pages": "KVCACHED_MIN_RESERVE_PAGES",
        "max_reserve_pages": "KVCACHED_MAX_RESERVE_PAGES", "page_size": "KVCACHED_PAGE_SIZE",
        "budget_bytes": "KVCACHED_BUDGET_BYTES", "max_cached_blocks": "KVCACHED_MAX_CACHED_BLOCKS",
        "background_refill": "KVCACHED_BACKGROUND_REFILL", "host_reserve": "KVCACHED_HOST_RESERVE",
        "idle_grace_s": "KVCACHED_IDLE_GRACE_MS"}

# (field, a bad value in code, the same value as the variable's text)
BAD = [
    ("retry_backoff_s", float("nan"), "nan"),
    ("retry_backoff_s", float("inf"), "inf"),
    ("capacity_ttl_s", 61.0, "61000"),
    ("capacity_ttl_s", -0.001, "-1"),
    ("map_retries", 101, "101"),
    ("min_reserve_pages", -1, "-1"),
    ("max_reserve_pages", (1 << 20) + 1, str((1 << 20) + 1)),
    ("page_size", 1000, "1000"),
    ("page_size", 1 << 35, str(1 << 35)),
    ("budget_bytes", NO_LIMIT, str(NO_LIMIT)),
    ("budget_bytes", -1, "-1"),
    ("max_cached_blocks", -7, "-7"),
    ("max_cached_blocks", "101%", "101%"),
    ("background_refill", "sometimes", "sometimes"),
    ("host_reserve", "101%", "101%"),
    ("idle_grace_s", 3600.5, "3600500"),
    ("idle_grace_s", -0.001, "-1"),
]


@pytest.mark.parametrize(("field", "value", "text"), BAD, ids=[f"{f}={t}" for f, _, t in BAD])
def test_a_config_built_in_code_is_validated_by_the_rules_resolve_uses(field: str, value: object, text: str) -> None:
    """``KvcachedConfig(retry_backoff_s=nan)`` was accepted, and the pool failed later with a
    ValueError. In code, through ``resolve``'s explicit arguments and through the variable,
    the value meets the same rule and is refused naming the variable."""
    var = VARS[field]
    errors = []
    for build in (lambda: KvcachedConfig(**{field: value}),
                  lambda: KvcachedConfig.resolve(env={}, **{field: value}),
                  lambda: dataclasses.replace(KvcachedConfig(), **{field: value}),
                  lambda: KvcachedConfig.resolve(env={var: text})):
        with pytest.raises(ConfigError, match=var) as caught:
            build()
        errors.append(str(caught.value))
    assert len(set(errors[:3])) == 1, f"one rule, one message: {errors}"
    if isinstance(value, int) and text == str(value) and value >= 0:  # the text reads as the value itself
        assert errors[3] == errors[0], f"one rule, one message: {errors}"


def test_values_in_code_are_kept_in_their_canonical_form() -> None:
    config = KvcachedConfig(capacity_ttl_s=1, max_cached_blocks=" 10.0% ", background_refill=" On ",
                            host_reserve="OFF", budget_path="")
    assert (config.capacity_ttl_s, config.max_cached_blocks, config.background_refill, config.host_reserve,
            config.budget_path) == (1.0, "10%", "on", None, None)
    assert config == dataclasses.replace(config)
    with pytest.raises(ConfigError, match="KVCACHED_MAP_RETRIES"):
        KvcachedConfig(map_retries=True)  # a bool is not a count


def test_default_engine_names_are_the_model_and_the_pid_on_the_host(monkeypatch) -> None:
    """On the host (its initial PID namespace) a default name stays readable: ``<model>-<pid>``;
    ``KVCACHED_ENGINE_NAME`` wins; a long model name is cut to fit a record's name field."""
    if os.stat("/proc/self/ns/pid").st_ino != INIT_PID_NS:
        pytest.skip("runs inside a PID namespace of its own (test_container_sharing covers it)")
    monkeypatch.delenv("KVCACHED_ENGINE_NAME", raising=False)
    assert engine_name("meta-llama/Llama-3.1-8B/") == f"Llama-3.1-8B-{os.getpid()}"
    long = engine_name("x" * 100)
    assert long.endswith(f"-{os.getpid()}") and len(long.encode()) == NAME_BYTES
    assert engine_name("m", {"KVCACHED_ENGINE_NAME": " mine "}) == "mine"


def test_a_devices_defaults_come_under_the_variables_and_the_explicit_settings() -> None:
    """``defaults`` (`device_defaults`) fill only what neither the caller nor a variable set;
    unknown names in them are refused like explicit ones."""
    cuda = device_defaults("cuda")
    assert cuda == {"hold_steps": 256, "idle_grace_s": 0.25}
    assert device_defaults("cpu") == {} and device_defaults("") == {}
    assert KvcachedConfig.resolve(env={}, defaults=cuda).hold_steps == 256
    assert KvcachedConfig.resolve(env={}, defaults=cuda).idle_grace_s == 0.25
    assert KvcachedConfig.resolve(env={"KVCACHED_IDLE_GRACE_MS": "0"}, defaults=cuda).idle_grace_s == 0.0
    assert KvcachedConfig.resolve(env={"KVCACHED_IDLE_GRACE_MS": "1000"}, defaults=cuda).idle_grace_s == 1.0
    assert KvcachedConfig.resolve(env={"KVCACHED_HOLD_STEPS": "0"}, defaults=cuda).hold_steps == 0
    assert KvcachedConfig.resolve(env={"KVCACHED_HOLD_STEPS": "0"}, defaults=cuda, hold_steps=5).hold_steps == 5
    assert KvcachedConfig.resolve(env={}).hold_steps == 0
    with pytest.raises(ConfigError, match="unknown kvcached option"):
        KvcachedConfig.resolve(env={}, defaults={"hold_step": 1})
    with pytest.raises(ConfigError, match="KVCACHED_HOLD_STEPS"):
        KvcachedConfig.resolve(env={}, defaults={"hold_steps": -1})  # checked by the field's one rule
