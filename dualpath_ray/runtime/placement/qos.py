"""Traffic isolation of KV transfers from model collectives (paper section 5), the `qos` section.

On a real cluster the KV transfers share each GPU's compute NIC (CNIC) with the model's
collectives (AllToAll, AllGather, ReduceScatter). DualPath keeps model latency intact by putting
all KV traffic in a low-priority class the NIC and switches arbitrate in hardware. This module
turns the one description of that policy, the `qos` config section (config/qos.py), into what
each process needs; the fabric side (the subnet manager's or the switches' configuration) is
rendered by runtime/placement/qos_fabric.py.

Which knob sets what (each cited where it is defined):
* InfiniBand. A packet's class is its service level (SL, 0-15). Each switch and HCA port maps
  SL -> virtual lane (VL) through the SL2VL table, and VLs are arbitrated by a two-level weighted
  round robin (a high- and a low-priority table of (VL, weight), and a high limit on how much
  high-priority data may pass before low priority gets a turn). The subnet manager programs
  both tables (OpenSM: qos_sl2vl, qos_vlarb_high, qos_vlarb_low, qos_high_limit; opensm
  doc/qos-config.txt, IBA 7.6.6 and 7.6.9). OpenSM does not choose the SL of MPI-style traffic:
  the application puts it in its queue pairs' address vectors. So:
  - UCX_IB_SL: the SL of UCX's IB queue pairs, i.e. of NIXL's KV transfers ("InfiniBand:
    Service level. RoCEv2: Ethernet Priority", openucx/ucx src/uct/ib/base/ib_iface.c);
  - NCCL_IB_SL: the SL of NCCL's queue pairs, i.e. of the model's collectives (NCCL_PARAM
    IbSl "IB_SL", NVIDIA/nccl src/transport/net_ib; docs.nvidia.com/deeplearning/nccl env.html);
  - the pyverbs transport (transport_verbs.py) puts the KV SL into its own queue pairs' path.
* RoCE. The class is the DSCP in the IP header; the queue pair's GRH traffic class byte carries
  it as DSCP << 2 (the two low bits are ECN). NIC and switch map DSCP -> priority (with
  "trust dscp") and priority -> traffic class (TC), and arbitrate TCs by ETS. So:
  - UCX_IB_TRAFFIC_CLASS / NCCL_IB_TC: the traffic class byte of UCX's / NCCL's queue pairs
    (UCX's own RoCEv2 default is 106 = DSCP 26 << 2 | ECT(0); NCCL's is 0);
  - UCX_IB_SL / NCCL_IB_SL: the Ethernet priority on RoCEv2, set to the priority the class's
    DSCP maps to, so the sending NIC queues the traffic in the same TC the switches use.

The defaults (the paper's lanes and arbitration tables) are the `qos` section's, config/qos.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dualpath_ray.config.qos import QosConfig

ECN_BITS = 2  # a traffic class byte is DSCP << 2 | ECN


class ActorKind(str, enum.Enum):
    """Who runs in a process, as far as traffic classes go."""

    PREFILL_ENGINE = "prefill_engine"
    DECODE_ENGINE = "decode_engine"
    READER = "reader"
    SCHEDULER = "scheduler"  # control only: no KV, no collectives

    def __str__(self) -> str:
        return str(self.value)


ENGINES = (ActorKind.PREFILL_ENGINE, ActorKind.DECODE_ENGINE)
KV_ENDPOINTS = (*ENGINES, ActorKind.READER)


@dataclass(frozen=True)
class TrafficClass:
    """How one kind of traffic is marked: the SL (IB) or Ethernet priority (RoCE) of its queue
    pairs, and on RoCE the GRH traffic class byte (DSCP << 2)."""

    service_level: int
    traffic_class: int | None  # None on InfiniBand: arbitration there is by SL only


def kv_class(qos: QosConfig) -> TrafficClass:
    return TrafficClass(qos.kv_service_level, qos.kv_dscp << ECN_BITS if qos.fabric == "roce" else None)


def collective_class(qos: QosConfig) -> TrafficClass:
    return TrafficClass(
        qos.collective_service_level, qos.collective_dscp << ECN_BITS if qos.fabric == "roce" else None
    )


def kv_channel_environment(qos: QosConfig) -> dict[str, str]:
    """UCX's variables for the KV channel (NIXL reads them when its agent starts)."""
    marking = kv_class(qos)
    env = {"UCX_IB_SL": str(marking.service_level)}
    if marking.traffic_class is not None:
        env["UCX_IB_TRAFFIC_CLASS"] = str(marking.traffic_class)
    return env


def collective_environment(qos: QosConfig) -> dict[str, str]:
    """NCCL's variables for the model's collectives."""
    marking = collective_class(qos)
    env = {"NCCL_IB_SL": str(marking.service_level)}
    if marking.traffic_class is not None:
        env["NCCL_IB_TC"] = str(marking.traffic_class)
    return env


def actor_environment(qos: QosConfig, kind: ActorKind) -> dict[str, str]:
    """The variables an actor of `kind` runs with: KV endpoints get the KV channel's, engines
    (which run the model) also the collectives'; the scheduler moves neither."""
    if not qos.enabled:
        return {}
    env: dict[str, str] = {}
    if kind in KV_ENDPOINTS:
        env.update(kv_channel_environment(qos))
    if kind in ENGINES:
        env.update(collective_environment(qos))
    return env


def kv_transport_knobs(qos: QosConfig) -> dict[str, int]:
    """`make_transport`'s service_level / traffic_class for this process's KV transport."""
    if not qos.enabled:
        return {}
    marking = kv_class(qos)
    knobs = {"service_level": marking.service_level}
    if marking.traffic_class is not None:
        knobs["traffic_class"] = marking.traffic_class
    return knobs


def engine_kind(role: str) -> ActorKind:
    """The ActorKind of an engine of `role` ("prefill" or "decode")."""
    return ActorKind.PREFILL_ENGINE if role == "prefill" else ActorKind.DECODE_ENGINE
