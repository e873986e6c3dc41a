"""GPU-class profiles: every number has a source, KV sizes are the issue's, configs fill from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dualpath_ray.config import ConfigError
from dualpath_ray.model.cost import derive_gpu_cost, kv_bytes_per_token
from dualpath_ray.sim.profiles import load_hardware, load_model, load_sim_config, sim_config

PROFILES = Path("cluster_configs/profiles")
H100 = PROFILES / "hardware/h100-sxm-8gpu.yaml"
DS660B = PROFILES / "models/deepseek-v3.2-660b.yaml"
SMALL_MLA = PROFILES / "models/deepseek-v2-lite-mla.yaml"
QWEN = PROFILES / "models/qwen2.5-32b.yaml"


def test_kv_sizes_are_exactly_the_issues():
    assert load_model(DS660B).kv_bytes_per_token_per_layer * 61 == 576 * 2 * 61 == 70272
    assert load_model(QWEN).kv_bytes_per_token_per_layer * 64 == 8 * 128 * 2 * 2 * 64 == 262144
    small = load_model(SMALL_MLA)
    assert small.kv_values_per_token_per_layer == 576 and small.n_layer < 61, "a smaller MLA model"


def test_the_node_is_the_papers():
    node = load_hardware(H100)
    assert (node.gpus_per_node, node.cnic_gbps, node.snic_gbps, node.dram_gbs) == (8, 400, 400, 500)


def test_a_number_without_its_source_is_refused(tmp_path):
    data = yaml.safe_load(H100.read_text())
    data["values"]["dram_gbs"]["source"] = " "
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"values\.dram_gbs\.source"):
        load_hardware(path)


def test_derived_engine_times_follow_flops_and_bytes():
    node, model = load_hardware(H100), load_model(DS660B)
    cost = derive_gpu_cost(node, model, decode_gpus=32)
    assert kv_bytes_per_token(cost) == 70272
    # A typical turn (32K cached, 429 new) prefills in about 0.1-0.2 s on one GPU at 40% MFU.
    forward_s = cost.n_layer * cost.prefill_layer_ms([(32768, 429)]) / 1000
    assert 0.08 < forward_s < 0.25, forward_s
    # 671 GB of FP8 weights over 32 decode GPUs: 21 GB each, the rest of 80 GB (less 8) is KV.
    assert cost.hbm_kv_tokens == int((80e9 - 671e9 / 32 - 8e9) // 70272)
    assert cost.decode_step_ms(0, 0) == 0.0 and cost.decode_step_ms(32, 32 * 32768) > cost.decode_step_ms(1, 32768)


def test_a_sim_config_fills_the_cluster_from_its_profiles_and_refuses_a_contradiction(tmp_path):
    cfg = sim_config({"cluster": {"prefill_nodes": 2, "decode_nodes": 4},
                      "sim": {"hardware_profile": str(H100), "model_profile": str(DS660B)}})
    assert (cfg.cluster.gpus_per_node, cfg.cluster.snic_gbps, cfg.cluster.cnic_gbps) == (8, 400, 400)
    assert cfg.cluster.buffer_blocks_per_node == int(80e9 // (64 * 70272)), "the paper's 80 GB buffer in blocks"
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"snic_gbps": 100, "decode_nodes": 4},
                                    "sim": {"hardware_profile": str(H100.absolute()), "model_profile": str(DS660B.absolute())}}))
    with pytest.raises(ConfigError, match="cluster.snic_gbps: YAML says 100"):
        load_sim_config(path)


def test_too_few_decode_gpus_for_the_weights_is_a_config_error():
    with pytest.raises(ConfigError, match="cluster.decode_nodes"):
        sim_config({"cluster": {"decode_nodes": 1}, "sim": {"hardware_profile": str(H100), "model_profile": str(DS660B)}})


def test_the_committed_sim_config_loads():
    cfg = load_sim_config("cluster_configs/sim-2p4d-ds660b.yaml")
    assert cfg.cluster.prefill_nodes == 2 and cfg.cluster.decode_nodes == 4 and cfg.sim.model_profile is not None
