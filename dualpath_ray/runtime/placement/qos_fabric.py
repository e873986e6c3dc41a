"""The fabric side of KV traffic isolation: what to install on the subnet manager or switches.

InfiniBand: an OpenSM configuration snippet (opensm.conf or the cached options file; opensm
doc/qos-config.txt). `qos TRUE` turns QoS on; qos_sl2vl maps each SL to a VL; qos_vlarb_high /
qos_vlarb_low are the two weighted round-robin tables of (VL, weight) and qos_high_limit bounds
the high-priority data sent before a low-priority packet gets its turn (IBA 7.6.9); qos_max_vls
is the number of data VLs the tables use. The generic `qos_` options apply to every port type
(HCAs, switch ports, routers) unless a `qos_ca_` / `qos_swe_` / ... option overrides them.

RoCE: the paper gives no numbers ("the same is done with DSCP -> traffic classes"), so the IB
policy is carried over: DSCP -> priority (the service levels of runtime/placement/qos.py are the Ethernet
priorities on RoCE), priority -> traffic class through the same SL2VL table, and ETS shares
that mirror the arbitration: while the high-priority lanes have traffic they get high_limit/256
of the link (the paper's "~94%" for 240), split by their vlarb_high weights, and the KV lane the
rest. ETS shares are minimum guarantees: a class uses any bandwidth the others leave. The
commands are NVIDIA's mlnx_qos for the NIC ports (docs.nvidia.com/networking, "Quality of
Service"); the switches on the path need the same mapping in their own CLI.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dualpath_ray.config.qos import DROP_VL, ETHERNET_PRIORITIES, QosConfig, weight_of

VL_CAPACITIES = (1, 2, 4, 8, 15)  # the data-VL counts a port can be configured with (VLCap)
HIGH_LIMIT_SCALE = 256  # qos_high_limit 240 gives high priority ~240/256 of the link
NETDEV = "<netdev>"  # the RoCE port's Ethernet interface, filled in by the operator


@dataclass(frozen=True)
class OpenSmPolicy:
    """opensm.conf lines that make the subnet manager program the paper's arbitration."""

    lines: tuple[str, ...]


@dataclass(frozen=True)
class RocePolicy:
    """The RoCE counterpart: DSCP -> priority -> traffic class, ETS shares and PFC, per port."""

    dscp_to_priority: tuple[tuple[int, int], ...]  # (DSCP, priority), KV first
    priority_to_tc: tuple[int, ...]  # TC of priorities 0..7
    tc_bandwidth: tuple[int, ...]  # ETS minimum share (percent) of TCs 0..7, summing to 100
    pfc: tuple[int, ...]  # 1 = priority flow control on for priority 0..7 (lossless RDMA)
    commands: tuple[str, ...]


def data_vls(qos: QosConfig) -> int:
    """qos_max_vls: the smallest VL capacity that holds every VL the tables use."""
    used = [vl for vl, _ in (*qos.high_table, *qos.low_table)] + [vl for vl in qos.sl2vl if vl != DROP_VL]
    return next(capacity for capacity in VL_CAPACITIES if capacity > max(used))


def opensm_policy(qos: QosConfig) -> OpenSmPolicy:
    return OpenSmPolicy(
        (
            "qos TRUE",
            f"qos_max_vls {data_vls(qos)}",
            f"qos_high_limit {qos.high_limit}",
            f"qos_vlarb_high {qos.vlarb_high}",
            f"qos_vlarb_low {qos.vlarb_low}",
            f"qos_sl2vl {qos.sl_to_vl}",
        )
    )


def ets_shares(qos: QosConfig) -> tuple[int, ...]:
    """Percent of the link per TC 0..7: high-table lanes share high_limit/256 by weight, lanes
    only the low table serves share the rest (everything, if there are none or no limit)."""
    high = {vl: weight_of(qos.high_table, vl) for vl in range(ETHERNET_PRIORITIES)}
    low = {vl: weight_of(qos.low_table, vl) for vl in range(ETHERNET_PRIORITIES)}
    high = {vl: weight for vl, weight in high.items() if weight}
    low_only = {vl: weight for vl, weight in low.items() if weight and vl not in high}
    high_share = 1.0 if not low_only or qos.high_limit == 255 else qos.high_limit / HIGH_LIMIT_SCALE
    exact = [0.0] * ETHERNET_PRIORITIES
    for vl, weight in high.items():
        exact[vl] = 100.0 * high_share * weight / sum(high.values())
    for vl, weight in low_only.items():
        exact[vl] = 100.0 * (1.0 - high_share) * weight / sum(low_only.values())
    return largest_remainder(exact)


def largest_remainder(exact: list[float]) -> tuple[int, ...]:
    """Integers with the same total (rounded) as `exact`, each the floor or ceiling of its value;
    the leftover units go to the largest fractional parts, lower index first on ties."""
    floors = [math.floor(value + 1e-9) for value in exact]
    leftover = round(sum(exact)) - sum(floors)
    order = sorted(range(len(exact)), key=lambda index: (-(exact[index] - floors[index]), index))
    for index in order[:leftover]:
        floors[index] += 1
    return tuple(floors)


def roce_policy(qos: QosConfig) -> RocePolicy:
    mapping = ((qos.kv_dscp, qos.kv_service_level), (qos.collective_dscp, qos.collective_service_level))
    priority_to_tc = qos.sl2vl[:ETHERNET_PRIORITIES]
    shares = ets_shares(qos)
    lossless = {qos.kv_service_level, qos.collective_service_level}
    pfc = tuple(int(priority in lossless) for priority in range(ETHERNET_PRIORITIES))
    commands = (
        f"mlnx_qos -i {NETDEV} --trust dscp",
        *(f"mlnx_qos -i {NETDEV} --dscp2prio set,{dscp},{priority}" for dscp, priority in mapping),
        f"mlnx_qos -i {NETDEV} --prio_tc {_csv(priority_to_tc)}",
        f"mlnx_qos -i {NETDEV} --tsa {_csv(['ets'] * ETHERNET_PRIORITIES)} --tcbw {_csv(shares)}",
        f"mlnx_qos -i {NETDEV} --pfc {_csv(pfc)}",
    )
    return RocePolicy(mapping, priority_to_tc, shares, pfc, commands)


def _csv(values: Iterable[object]) -> str:
    return ",".join(str(value) for value in values)
