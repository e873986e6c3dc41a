"""Traffic isolation of KV transfers from model collectives (paper section 5), the `qos` section.

On a real cluster the KV transfers share each GPU's compute NIC (CNIC) with the model's
collectives (AllToAll, AllGather, ReduceScatter). DualPath keeps model latency intact by putting
all KV traffic in a low-priority class the NIC and switches arbitrate in hardware. This module
holds the one description of that policy and turns it into what each process needs; the fabric
side (the subnet manager's or the switches' configuration) is rendered by runtime/deploy/qos_fabric.py.

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

Defaults reproduce the paper: KV on SL 2 -> VL 2, collectives on SL 3 -> VL 3 (the paper's
high-priority VLs are 0, 1 and 3), qos_high_limit 240, qos_vlarb_high 0:192,1:192,2:0,3:192,
qos_vlarb_low 0:192,1:192,2:64,3:192. On RoCE the KV class is DSCP 16 (priority 2) and the
collectives' DSCP 26 (priority 3), mirroring the VLs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DROP_VL = 15  # in an SL2VL table: packets of this SL are dropped
MAX_DATA_VL = 14
MAX_ARBITRATION_ENTRIES = 64  # IBA 7.6.9: a VL arbitration table has at most 64 entries
ETHERNET_PRIORITIES = 8
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


def parse_arbitration(text: str) -> tuple[tuple[int, int], ...]:
    """An OpenSM VL arbitration table "VL:weight,VL:weight,..." as (VL, weight) pairs, in order
    (the arbiter serves entries in order; a VL may appear more than once)."""
    entries = [item.strip() for item in text.split(",") if item.strip()]
    if not entries or len(entries) > MAX_ARBITRATION_ENTRIES:
        raise ValueError(f"needs 1 to {MAX_ARBITRATION_ENTRIES} 'VL:weight' entries, e.g. '0:192,1:192,2:0,3:192'")
    pairs = []
    for entry in entries:
        vl, sep, weight = entry.partition(":")
        if not sep or not vl.strip().isdigit() or not weight.strip().isdigit():
            raise ValueError(f"entry {entry!r} is not 'VL:weight' with two non-negative integers")
        pair = (int(vl), int(weight))
        if pair[0] > MAX_DATA_VL or pair[1] > 255:
            raise ValueError(f"entry {entry!r}: VL must be 0..{MAX_DATA_VL} and weight 0..255")
        pairs.append(pair)
    return tuple(pairs)


def parse_sl2vl(text: str) -> tuple[int, ...]:
    """An OpenSM SL2VL table "vl0,vl1,...,vl15": the VL of each of the 16 SLs (15 = drop)."""
    items = [item.strip() for item in text.split(",")]
    if len(items) != 16 or not all(item.isdigit() and int(item) <= DROP_VL for item in items):
        raise ValueError("needs 16 comma-separated VLs (0..15, 15 = drop), one per SL 0..15")
    return tuple(int(item) for item in items)


def weight_of(table: tuple[tuple[int, int], ...], vl: int) -> int:
    return sum(weight for entry_vl, weight in table if entry_vl == vl)


class QosConfig(BaseModel):
    """Traffic classes of KV transfers and model collectives, and the fabric's arbitration.

    The defaults are the paper's (section 5): KV traffic on a low-priority virtual lane (VL 2),
    collectives on a high-priority one (VL 3), with its arbitration tables. `dualpath qos`
    prints the resulting environment per actor and the fabric policy to install."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    enabled: bool = Field(
        True, description="Put the settings below into every engine's and reader's runtime_env (and the pyverbs "
        "transport's queue pairs). They only take effect on an RDMA fabric configured by `dualpath qos`.",
    )
    fabric: Literal["ib", "roce"] = Field(
        "ib", description="ib: classes are service levels mapped to virtual lanes by the subnet manager; "
        "roce: classes are DSCPs mapped to priorities and traffic classes by NICs and switches.",
    )
    kv_service_level: int = Field(
        2, ge=0, le=15, description="SL of KV transfers (UCX_IB_SL, the verbs transport's queue pairs); on RoCE "
        "the Ethernet priority kv_dscp maps to.",
    )
    collective_service_level: int = Field(
        3, ge=0, le=15, description="SL of the model's collectives (NCCL_IB_SL); on RoCE the Ethernet priority "
        "collective_dscp maps to.",
    )
    sl_to_vl: str = Field(
        "0,1,2,3,0,0,0,0,0,0,0,0,0,0,0,0", description="OpenSM qos_sl2vl: the VL of each SL 0..15 (15 = drop). "
        "SLs beyond the four the tables weigh go to VL 0, so no traffic waits on an unweighted VL.",
    )
    high_limit: int = Field(
        240, ge=0, le=255, description="OpenSM qos_high_limit: how much high-priority data (in 4 KiB units, 255 = "
        "no limit) may pass before a low-priority packet gets its turn.",
    )
    vlarb_high: str = Field("0:192,1:192,2:0,3:192", description="OpenSM qos_vlarb_high: 'VL:weight,...'.")
    vlarb_low: str = Field("0:192,1:192,2:64,3:192", description="OpenSM qos_vlarb_low: 'VL:weight,...'.")
    kv_dscp: int = Field(16, ge=0, le=63, description="RoCE: DSCP of KV transfers (UCX_IB_TRAFFIC_CLASS = DSCP << 2).")
    collective_dscp: int = Field(
        26, ge=0, le=63, description="RoCE: DSCP of the model's collectives (NCCL_IB_TC = DSCP << 2)."
    )

    @field_validator("vlarb_high", "vlarb_low")
    @classmethod
    def _arbitration_table(cls, text: str) -> str:
        return ",".join(f"{vl}:{weight}" for vl, weight in parse_arbitration(text))

    @field_validator("sl_to_vl")
    @classmethod
    def _sl2vl_table(cls, text: str) -> str:
        return ",".join(str(vl) for vl in parse_sl2vl(text))

    @model_validator(mode="after")
    def _kv_is_low_priority(self) -> QosConfig:
        """The isolation invariant: KV's VL is served by the low-priority table only, the
        collectives' VL by the high-priority one, and the two are different lanes."""
        kv_vl, collective_vl = self.kv_virtual_lane, self.collective_virtual_lane
        for field, vl in (("kv_service_level", kv_vl), ("collective_service_level", collective_vl)):
            if vl == DROP_VL:
                raise ValueError(f"sl_to_vl maps {field} {getattr(self, field)} to VL 15, which drops its packets")
        if kv_vl == collective_vl:
            raise ValueError(
                f"kv_service_level and collective_service_level both map to VL {kv_vl}; give KV a lane of its own"
            )
        high, low = self.high_table, self.low_table
        if weight_of(high, kv_vl):
            raise ValueError(f"vlarb_high gives KV's VL {kv_vl} a weight; KV must be low priority only (weight 0)")
        if not weight_of(low, kv_vl):
            raise ValueError(f"vlarb_low gives KV's VL {kv_vl} no weight, so KV would never be sent; give it one")
        if not weight_of(high, collective_vl):
            raise ValueError(f"vlarb_high gives the collectives' VL {collective_vl} no weight; they must be high priority")
        if self.fabric == "roce":
            self._check_roce()
        return self

    def _check_roce(self) -> None:
        for field in ("kv_service_level", "collective_service_level"):
            if getattr(self, field) >= ETHERNET_PRIORITIES:
                raise ValueError(f"{field} is an Ethernet priority on RoCE: it must be 0..7")
        if self.kv_dscp == self.collective_dscp:
            raise ValueError("kv_dscp and collective_dscp are equal; KV needs a DSCP of its own on RoCE")
        # On RoCE the same tables are carried over: priority p -> TC sl_to_vl[p], VL v -> TC v.
        used = [vl for vl, _ in (*self.high_table, *self.low_table)] + list(self.sl2vl[:ETHERNET_PRIORITIES])
        if max(used) >= ETHERNET_PRIORITIES:
            raise ValueError(
                "on RoCE VLs are traffic classes 0..7: use VLs 0..7 in vlarb_high, vlarb_low and for SLs 0..7 in sl_to_vl"
            )

    # ---- derived ------------------------------------------------------------------------
    @property
    def high_table(self) -> tuple[tuple[int, int], ...]:
        return parse_arbitration(self.vlarb_high)

    @property
    def low_table(self) -> tuple[tuple[int, int], ...]:
        return parse_arbitration(self.vlarb_low)

    @property
    def sl2vl(self) -> tuple[int, ...]:
        return parse_sl2vl(self.sl_to_vl)

    @property
    def kv_virtual_lane(self) -> int:
        return self.sl2vl[self.kv_service_level]

    @property
    def collective_virtual_lane(self) -> int:
        return self.sl2vl[self.collective_service_level]


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
