"""The `qos` config section: traffic classes of KV transfers and model collectives (paper
section 5), and the fabric's arbitration that keeps KV traffic from delaying the collectives.

A class is a service level (SL, InfiniBand) or a DSCP (RoCE). The subnet manager maps each SL to
a virtual lane (VL, the SL2VL table) and arbitrates VLs by a two-level weighted round robin (a
high- and a low-priority table of (VL, weight), and a high limit on how much high-priority data
may pass before low priority gets a turn; OpenSM's qos_sl2vl, qos_vlarb_high, qos_vlarb_low,
qos_high_limit, IBA 7.6.6 and 7.6.9). On RoCE the same tables are carried over to DSCP ->
priority -> traffic class. The section validates the isolation invariant (KV low priority only,
the collectives high priority, on different lanes); what each process and the fabric are given
from it is runtime/placement/qos.py's and qos_fabric.py's.

Defaults reproduce the paper: KV on SL 2 -> VL 2, collectives on SL 3 -> VL 3 (the paper's
high-priority VLs are 0, 1 and 3), qos_high_limit 240, qos_vlarb_high 0:192,1:192,2:0,3:192,
qos_vlarb_low 0:192,1:192,2:64,3:192. On RoCE the KV class is DSCP 16 (priority 2) and the
collectives' DSCP 26 (priority 3), mirroring the VLs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DROP_VL = 15  # in an SL2VL table: packets of this SL are dropped
MAX_DATA_VL = 14
MAX_ARBITRATION_ENTRIES = 64  # IBA 7.6.9: a VL arbitration table has at most 64 entries
ETHERNET_PRIORITIES = 8


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
