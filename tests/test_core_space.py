"""The KV space (its geometry's JSON form, the config it carries) and `ElasticArena`, the one
assembly of an elastic pool, on the real CPU backend."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvcached import ConfigError
from kvcached.arena import ElasticArena
from kvcached.config import KvcachedConfig
from kvcached.fence import StepFence
from kvcached.space import Geometry, KvSpace, plan_geometry
from kvcached.stats import stats

PAGE = 4096
STRIDE = 1024  # 4 blocks per kv page


# ---- geometry ----------------------------------------------------------------------------
@pytest.mark.parametrize("strides, num_blocks", [([STRIDE], 16), ([STRIDE, 3 * STRIDE], 37), ([6144], 5)])
def test_geometry_round_trips_through_json(strides: list[int], num_blocks: int) -> None:
    geometry = plan_geometry(strides, num_blocks, PAGE)
    wire = json.dumps(geometry.to_dict())
    assert Geometry.from_dict(json.loads(wire)) == geometry
    assert json.loads(wire) == geometry.to_dict()


def _edited(**changes: Any) -> dict[str, Any]:
    data = plan_geometry([STRIDE], 16, PAGE).to_dict()
    for key, value in changes.items():
        if value is _DROP:
            del data[key]
        else:
            data[key] = value
    return data


_DROP = object()


@pytest.mark.parametrize("data, message", [
    (_edited(num_kv_pages=_DROP), r"missing keys \['num_kv_pages'\], unknown keys \[\]"),
    (_edited(tp_size=2), r"missing keys \[\], unknown keys \['tp_size'\]"),
    (_edited(page_size=True), "page_size=True is not an int"),
    (_edited(num_blocks=16.0), "num_blocks=16.0 is not an int"),
    (_edited(strides="1024"), "strides='1024' is not a list of ints"),
    (_edited(vmm_pages=[True]), r"vmm_pages=\[True\] is not a list of ints"),
    (_edited(blocks_per_page=8), "inconsistent"),
    (_edited(num_kv_pages=5), "inconsistent"),
    ([("page_size", PAGE)], "must be a mapping"),
])
def test_geometry_from_dict_is_strict(data: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Geometry.from_dict(data)


# ---- the space's config and the arena ------------------------------------------------------
def _config(**overrides: Any) -> KvcachedConfig:
    values: dict[str, Any] = {"page_size": PAGE, "min_reserve_pages": 0, "max_reserve_pages": 0,
                              "capacity_ttl_s": 0.0, **overrides}
    return KvcachedConfig(**values)


@pytest.fixture
def vrange():
    """A 16-block geometry and one CPU range for it (the geometry tests above need neither)."""
    _vmm = pytest.importorskip("kvcached._vmm", reason="native extension not built")
    geometry = plan_geometry([STRIDE], 16, PAGE)
    r = _vmm.VirtualRange("cpu", geometry.reserved_bytes[0], PAGE)
    yield geometry, r
    r.close()


def test_a_space_refuses_a_config_with_another_page_size(vrange) -> None:
    geometry, r = vrange
    with pytest.raises(ConfigError, match="page size 4096 but its config has KVCACHED_PAGE_SIZE=8192"):
        KvSpace(geometry, (r,), config=_config(page_size=2 * PAGE))


def test_the_arena_runs_on_the_space_config_unless_given_one(vrange) -> None:
    geometry, r = vrange
    carried = _config()
    arena = ElasticArena.open(KvSpace(geometry, (r,), config=carried), name="space-test")
    assert arena.config is carried and arena.pool.config is carried and arena.faults is None
    assert type(arena.fence) is StepFence and arena.pool.fence is arena.fence
    arena.close()
    explicit = _config(max_reserve_pages=2)
    fence = StepFence()
    arena = ElasticArena.open(KvSpace(geometry, (r,), config=carried), explicit, fence=fence, name="space-test")
    assert arena.config is explicit and arena.fence is fence and arena.ledger.pool is arena.pool
    arena.close()


def test_the_arena_needs_a_config_with_the_geometry_page_size(vrange) -> None:
    geometry, r = vrange
    with pytest.raises(ConfigError, match="carries none and none was given"):
        ElasticArena.open(KvSpace(geometry, (r,)), name="space-test")
    with pytest.raises(ConfigError, match="disagrees with the page size the KV space was planned with"):
        ElasticArena.open(KvSpace(geometry, (r,)), _config(page_size=2 * PAGE), name="space-test")
    assert r.num_mapped == 0 and not [k for k in stats() if k.startswith("space-test")]


def test_the_arena_adopts_premapped_pages_pins_and_closes_once(vrange) -> None:
    geometry, r = vrange
    r.map([0])  # what the worker does for the null block before any pool exists
    space = KvSpace(geometry, (r,), frozenset({0}), _config())
    arena = ElasticArena.open(space, name="space-test", pinned=(0, 5))
    assert arena.ledger.is_held(0) and arena.ledger.is_held(5) and r.mapped_pages() == [0, 1]
    counters = arena.pool.counters()
    assert (counters.maps, counters.mapped_pages) == (2, 2), "page 0 adopted, page 1 mapped"
    key = arena.stats_key
    assert key in stats()
    arena.close()
    assert arena.closed and r.num_mapped == 0 and key not in stats()
    arena.close()  # idempotent
    assert r.num_mapped == 0


def test_a_space_maps_into_ranges_or_a_page_space_never_both(vrange) -> None:
    geometry, r = vrange
    with pytest.raises(ConfigError, match="exactly one"):
        KvSpace(geometry)
    with pytest.raises(ConfigError, match="exactly one"):
        KvSpace(geometry, (r,), pages=KvSpace(geometry, (r,)).page_space())
