"""The traffic isolation policy (runtime/placement/qos.py, qos_fabric.py, `dualpath qos`) without a cluster:
the default config must generate the paper's values exactly, on both fabrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath_ray.cli import main
from dualpath_ray.config import ConfigError, DualPathConfig, parse_config
from dualpath_ray.config.qos import QosConfig
from dualpath_ray.runtime.placement.qos import ActorKind, actor_environment, engine_kind, kv_transport_knobs
from dualpath_ray.runtime.placement.qos_fabric import (
    ets_shares,
    largest_remainder,
    opensm_policy,
    roce_policy,
)
from dualpath_ray.runtime.placement.topology import environment_options

PAPER_OPENSM = [
    "qos TRUE",
    "qos_max_vls 4",
    "qos_high_limit 240",
    "qos_vlarb_high 0:192,1:192,2:0,3:192",
    "qos_vlarb_low 0:192,1:192,2:64,3:192",
    "qos_sl2vl 0,1,2,3,0,0,0,0,0,0,0,0,0,0,0,0",
]


def test_default_config_generates_the_papers_infiniband_policy_exactly() -> None:
    qos = DualPathConfig().qos
    assert qos.fabric == "ib" and qos.enabled, "the default is the paper's fabric, with isolation on"
    lines = list(opensm_policy(qos).lines)
    for expected, got in zip(PAPER_OPENSM, lines, strict=True):
        assert got == expected, f"the OpenSM line is the paper's value: {got!r} != {expected!r}"
    assert qos.kv_virtual_lane == 2, "KV traffic rides VL 2 (the paper's low-priority lane)"
    assert qos.collective_virtual_lane == 3, "collectives ride VL 3, one of the paper's high-priority lanes"


def test_default_environment_by_actor_kind_on_infiniband() -> None:
    qos = QosConfig()
    kv_only = {"UCX_IB_SL": "2"}
    engines = {"UCX_IB_SL": "2", "NCCL_IB_SL": "3"}
    assert actor_environment(qos, ActorKind.PREFILL_ENGINE) == engines, "prefill engines: KV channel + collectives"
    assert actor_environment(qos, ActorKind.DECODE_ENGINE) == engines, "decode engines: KV channel + collectives"
    assert actor_environment(qos, ActorKind.READER) == kv_only, "readers move KV only, run no model"
    assert actor_environment(qos, ActorKind.SCHEDULER) == {}, "the scheduler is control-only"
    assert engine_kind("prefill") is ActorKind.PREFILL_ENGINE and engine_kind("decode") is ActorKind.DECODE_ENGINE, (
        "a topology role names its engine kind"
    )
    assert kv_transport_knobs(qos) == {"service_level": 2}, "the KV transport's queue pairs get SL 2 and no GRH class"


def test_roce_environment_carries_dscp_shifted_into_the_traffic_class() -> None:
    qos = QosConfig(fabric="roce")
    assert actor_environment(qos, ActorKind.DECODE_ENGINE) == {
        "UCX_IB_SL": "2", "UCX_IB_TRAFFIC_CLASS": "64", "NCCL_IB_SL": "3", "NCCL_IB_TC": "104",
    }, "KV: priority 2 and DSCP 16 << 2; collectives: priority 3 and DSCP 26 << 2"
    assert actor_environment(qos, ActorKind.READER) == {"UCX_IB_SL": "2", "UCX_IB_TRAFFIC_CLASS": "64"}, (
        "readers get the KV channel's marking only"
    )
    assert kv_transport_knobs(qos) == {"service_level": 2, "traffic_class": 64}, "verbs/UCX knobs of the KV channel"


def test_roce_policy_maps_dscp_to_priority_to_tc_and_mirrors_the_arbitration() -> None:
    policy = roce_policy(QosConfig(fabric="roce"))
    assert policy.dscp_to_priority == ((16, 2), (26, 3)), "KV DSCP 16 -> priority 2, collectives DSCP 26 -> 3"
    assert policy.priority_to_tc == (0, 1, 2, 3, 0, 0, 0, 0), "priority -> TC follows the SL2VL table"
    assert policy.tc_bandwidth == (32, 31, 6, 31, 0, 0, 0, 0), (
        "240/256 of the link to the high lanes by weight (31.25 % each), the rest (6.25 %) to KV, summing to 100"
    )
    assert sum(policy.tc_bandwidth) == 100, "ETS shares sum to 100"
    assert policy.pfc == (0, 0, 1, 1, 0, 0, 0, 0), "both RDMA priorities are lossless"
    assert policy.commands == (
        "mlnx_qos -i <netdev> --trust dscp",
        "mlnx_qos -i <netdev> --dscp2prio set,16,2",
        "mlnx_qos -i <netdev> --dscp2prio set,26,3",
        "mlnx_qos -i <netdev> --prio_tc 0,1,2,3,0,0,0,0",
        "mlnx_qos -i <netdev> --tsa ets,ets,ets,ets,ets,ets,ets,ets --tcbw 32,31,6,31,0,0,0,0",
        "mlnx_qos -i <netdev> --pfc 0,0,1,1,0,0,0,0",
    ), "the NIC commands set exactly the mapping, shares and PFC above"


def test_ets_rounding_keeps_the_total_and_an_unlimited_high_priority_takes_everything() -> None:
    assert largest_remainder([33.4, 33.3, 33.3]) == (34, 33, 33), "leftover units go to the largest remainders"
    assert sum(largest_remainder([12.5] * 8)) == 100, "the total is kept"
    assert ets_shares(QosConfig(high_limit=255))[2] == 0, "high_limit 255 (no limit): KV is guaranteed nothing"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"vlarb_high": "0:192,1:192,2:8,3:192"}, "KV must be low priority only"),
        ({"vlarb_low": "0:192,1:192,2:0,3:192"}, "KV would never be sent"),
        ({"vlarb_high": "0:192,1:192,2:0,3:0"}, "collectives' VL 3 no weight"),
        ({"collective_service_level": 2}, "both map to VL 2"),
        ({"sl_to_vl": "0,1,15,3,0,0,0,0,0,0,0,0,0,0,0,0"}, "drops its packets"),
        ({"sl_to_vl": "0,1,2"}, "needs 16 comma-separated VLs"),
        ({"vlarb_low": "0:192,x"}, "not 'VL:weight'"),
        ({"vlarb_low": "0:192,1:300"}, "weight 0..255"),
        ({"fabric": "roce", "kv_service_level": 9, "sl_to_vl": "0,1,2,3,0,0,0,0,0,2,0,0,0,0,0,0"}, "must be 0..7"),
        ({"fabric": "roce", "kv_dscp": 26}, "KV needs a DSCP of its own"),
        ({"kv_service_level": 16}, "less than or equal to 15"),
    ],
)
def test_invalid_policies_are_refused_naming_the_field(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"qos": fields})
    assert "qos" in str(error.value) and needle in str(error.value), f"the error names the section and says why: {error.value}"


def test_disabled_qos_injects_nothing() -> None:
    qos = QosConfig(enabled=False)
    assert all(actor_environment(qos, kind) == {} for kind in ActorKind), "no actor gets any variable"
    assert kv_transport_knobs(qos) == {}, "the transport gets no service level"
    assert environment_options({}) == {}, "no variables: no runtime_env option at all"
    assert environment_options({"UCX_IB_SL": "2"}) == {"runtime_env": {"env_vars": {"UCX_IB_SL": "2"}}}, (
        "variables become the actor's runtime_env env_vars"
    )


def test_cli_prints_the_policy_per_fabric(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["qos"]) == 0, "the default config prints"
    text = capsys.readouterr().out
    for line in PAPER_OPENSM:
        assert f"  {line}\n" in text + "\n", f"the text output holds the OpenSM line {line!r}"
    assert "reader          UCX_IB_SL=2\n" in text, "each actor kind's variables are listed"
    assert main(["qos", "--fabric", "roce", "--json"]) == 0, "--fabric overrides the config's fabric"
    data = json.loads(capsys.readouterr().out)
    assert data["roce"]["dscp_to_priority"] == {"16": 2, "26": 3}, "the JSON holds the RoCE mapping"
    assert data["environment"]["prefill_engine"]["NCCL_IB_TC"] == "104", "and the per-actor environment"
    assert "opensm" not in data, "a RoCE fabric has no subnet manager policy"


def test_cli_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["qos", "--fabric", "ethernet"]) == 2, "an unknown fabric is a usage error"
    err = capsys.readouterr().err.strip()
    assert err == "dualpath qos: --fabric must be one of ib, roce (got 'ethernet')", f"one line naming the flag: {err!r}"
    config = tmp_path / "c.yaml"
    config.write_text("qos:\n  kv_service_level: 9\n  sl_to_vl: 0,1,2,3,0,0,0,0,0,2,0,0,0,0,0,0\n")  # fine on IB
    assert main(["qos", "--config", str(config), "--fabric", "roce"]) == 2, "a config that does not fit the fabric"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--fabric roce" in err and "0..7" in err, f"one line naming the flag: {err!r}"
