"""The P/D plan and its bottleneck-free check, without a cluster."""

from __future__ import annotations

import logging

from dualpath_ray.config import DualPathConfig
from dualpath_ray.runtime.placement.topology import (
    front_end_options,
    plan_nodes,
    scheduler_options,
    slot_resource,
    warn_if_outside_bounds,
)


def test_plan_names_nodes_engines_and_readers():
    cfg = DualPathConfig().with_overrides(cluster={"prefill_nodes": 2, "decode_nodes": 1, "gpus_per_node": 3})
    nodes = plan_nodes(cfg)
    assert [(n.node_id, n.role, n.bundle_index) for n in nodes] == [
        ("p0", "prefill", 0), ("p1", "prefill", 1), ("d0", "decode", 0)
    ], "one logical node per configured node, bundle index within its role"
    assert nodes[1].engine_names() == ["prefill/p1/g0", "prefill/p1/g1", "prefill/p1/g2"], "g engines per node"
    assert nodes[2].reader_name == "reader/d0", "one reader per node"
    assert slot_resource("decode") == "dualpath_decode_slot", "the per-node slot resource of a role"


def test_ratio_inside_the_bottleneck_free_range_gives_no_warning():
    cfg = DualPathConfig().with_overrides(
        cluster={"gpus_per_node": 8, "snic_gbps": 400, "cnic_gbps": 400, "dram_gbs": 500, "prefill_nodes": 1, "decode_nodes": 2}
    )
    assert warn_if_outside_bounds(cfg) is None, "1/2 is inside [1/7, 3.5]"


def test_ratio_outside_the_range_warns_naming_the_saturating_resource(caplog):
    cfg = DualPathConfig().with_overrides(
        cluster={"gpus_per_node": 8, "snic_gbps": 400, "cnic_gbps": 400, "dram_gbs": 500, "prefill_nodes": 4, "decode_nodes": 1}
    )
    with caplog.at_level(logging.WARNING, logger="dualpath_ray.topology"):
        message = warn_if_outside_bounds(cfg)
    assert message is not None and "de_" in message, f"4/1 > 3.5 saturates a decode-side resource: {message}"
    assert message in caplog.text, "the warning is logged"
    low = cfg.with_overrides(cluster={"prefill_nodes": 1, "decode_nodes": 8})
    assert "pe_cnic_write" in (warn_if_outside_bounds(low) or ""), "1/8 < 1/7 saturates the PE CNIC"


def test_control_actors_restart_and_resend_as_often_as_the_config_says():
    cfg = DualPathConfig().with_overrides(
        runtime={"namespace": "ns", "scheduler_max_restarts": 4, "front_end_max_restarts": 2, "max_call_resends": 1}
    )
    scheduler = scheduler_options(cfg, on_head=True)
    assert (scheduler["max_restarts"], scheduler["max_task_retries"]) == (4, 1), (
        "the scheduler's restarts and call resends are bounded by the config, not -1 (for ever)"
    )
    assert scheduler["name"] == "scheduler" and scheduler["lifetime"] == "detached", "the named, detached singleton"
    front_end = front_end_options(cfg, "rollout-server")
    assert (front_end["max_restarts"], front_end["max_task_retries"]) == (2, 1), (
        "a front end is restarted (0 before: it died for good) and its calls in flight are sent again"
    )
    defaults = DualPathConfig().runtime
    assert defaults.scheduler_max_restarts >= 1 and defaults.max_call_resends >= 1, "restarts are on by default"


def test_a_reader_sees_its_nodes_gpus_to_pin_its_buffer_whatever_rays_override_setting():
    from ray.util.placement_group import PlacementGroup

    from dualpath_ray.runtime.placement.topology import reader_options

    spec = plan_nodes(DualPathConfig())[0]
    group = PlacementGroup.empty()
    env = reader_options(group, spec, "ns")["runtime_env"]["env_vars"]
    assert env == {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}, (
        "a zero-GPU reader keeps CUDA_VISIBLE_DEVICES, so it can pin (Ray's override would blank it)"
    )
    with_qos = reader_options(group, spec, "ns", env_vars={"UCX_IB_SL": "3"})["runtime_env"]["env_vars"]
    assert with_qos == {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "UCX_IB_SL": "3"}, "the role's QoS variables stay"
