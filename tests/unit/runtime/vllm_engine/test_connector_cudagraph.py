"""The connector asks vLLM for PIECEWISE CUDA graphs, through the lookup vLLM itself makes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_vllm_finds_that_the_connector_needs_piecewise_cuda_graphs() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from dualpath_ray.runtime.vllm_engine.host import CONNECTOR_MODULE

    # The config VllmHost builds; config/vllm.py resolves the class this way before it decides
    # whether FULL CUDA graphs must become PIECEWISE.
    config = KVTransferConfig(kv_connector="DualPathConnector", kv_role="kv_both", kv_connector_module_path=CONNECTOR_MODULE)
    connector = KVConnectorFactory.get_connector_class(config)
    assert connector.requires_piecewise_for_cudagraph(config.kv_connector_extra_config), (
        "the layer hooks are Python around each attention op: a FULL graph replay would skip them"
    )
