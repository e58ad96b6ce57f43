"""Layouts kvcached does not serve are refused at start-up, naming the layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcached.errors import IntegrationError
from kvcached.integration.vllm.engine import check_parallel_layout


def _config(**parallel: object) -> SimpleNamespace:
    base = {"pipeline_parallel_size": 1, "data_parallel_size": 1, "distributed_executor_backend": "mp",
            "tensor_parallel_size": 1}
    return SimpleNamespace(parallel_config=SimpleNamespace(**{**base, **parallel}))


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("backend", ["mp", "uni", "ray", None])
def test_tensor_parallel_layouts_are_served(tp: int, backend: str | None) -> None:
    check_parallel_layout(_config(tensor_parallel_size=tp, distributed_executor_backend=backend))


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline parallelism (pipeline_parallel_size=2)"),
        ({"distributed_executor_backend": "external_launcher"}, "distributed_executor_backend='external_launcher'"),
        ({"data_parallel_size": 2}, "data parallelism (data_parallel_size=2)"),
    ],
)
def test_other_layouts_are_refused_by_name(parallel: dict[str, object], named: str) -> None:
    with pytest.raises(IntegrationError) as err:
        check_parallel_layout(_config(**parallel))
    assert named in str(err.value) and "supported: " in str(err.value)
