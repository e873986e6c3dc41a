"""Bottleneck-free prefill/decode ratios (paper section 4.2).

With g GPUs per node, one CNIC of bandwidth B (GB/s) per GPU, a node SNIC of s*B and node DRAM
bandwidth M, DualPath moves KV without saturating any NIC or DRAM exactly when P/D (prefill
nodes over decode nodes) lies in

    s / (g - s)  <=  P/D  <=  min{ (g - 2s) / s,  (g - s) / (2s),  (M / (B*s) - 3) / 2 }

pe_cnic_write is the lower bound (below it the PE CNIC saturates); de_cnic_read, de_cnic_write
and de_dram are the upper bounds (above them the DE CNIC or the DE DRAM saturates). The PE CNIC
read side (2s/g <= 1) does not depend on P/D: when s > g/2 no ratio works. A bound that no
positive ratio can meet is reported as None and the range as empty with the reason, never as
a negative number. The paper's example g=8, s=1, B=50 GB/s, M=500 GB/s gives
1/7 <= P/D <= min{6, 3.5, 3.5} = 3.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOWER_CONSTRAINT = "pe_cnic_write"
UPPER_CONSTRAINTS = ("de_cnic_read", "de_cnic_write", "de_dram")
PE_CNIC_READ = "pe_cnic_read"

RESOURCE_OF = {
    PE_CNIC_READ: "PE CNIC (read)",
    LOWER_CONSTRAINT: "PE CNIC (write)",
    "de_cnic_read": "DE CNIC (read)",
    "de_cnic_write": "DE CNIC (write)",
    "de_dram": "DE DRAM",
}

_REL_TOLERANCE = 1e-12


@dataclass(frozen=True)
class PDBounds:
    """The bottleneck-free P/D range of one hardware configuration.

    constraints maps each constraint name to its bound on P/D (pe_cnic_write: a lower bound; the
    others: upper bounds), or None when no positive ratio meets it. binding names the upper
    constraints that attain `upper` (several on a tie, as in the paper's example; those that no
    ratio meets when upper is None). empty_reason is None exactly when the range is non-empty.
    """

    gpus_per_node: int
    s: float
    cnic_gbytes: float
    dram_gbs: float
    lower: float | None
    upper: float | None
    constraints: dict[str, float | None]
    binding: tuple[str, ...]
    empty_reason: str | None

    @property
    def is_empty(self) -> bool:
        return self.empty_reason is not None


@dataclass(frozen=True)
class RatioCheck:
    """Where a concrete P/D lies relative to the range; saturates names the constraints it breaks."""

    prefill_nodes: int
    decode_nodes: int
    ratio: float
    inside: bool
    saturates: tuple[str, ...]


def _require_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number (got {value!r})")


def _positive_or_none(bound: float) -> float | None:
    return bound if bound > 0 else None


def _constraint_bounds(g: int, s: float, b: float, m: float) -> dict[str, float | None]:
    return {
        LOWER_CONSTRAINT: s / (g - s) if g > s else None,
        "de_cnic_read": _positive_or_none((g - 2 * s) / s),
        "de_cnic_write": _positive_or_none((g - s) / (2 * s)),
        "de_dram": _positive_or_none((m / (b * s) - 3) / 2),
    }


def _empty_reason(
    g: int, s: float, lower: float | None, upper: float | None, constraints: dict[str, float | None]
) -> str | None:
    if 2 * s > g:
        return f"PE CNIC read saturates at any ratio: s = {s:g} > g/2 = {g / 2:g}"
    if lower is None:
        return f"PE CNIC write cannot keep up at any ratio: s = {s:g} >= g = {g}"
    unmet = [name for name in UPPER_CONSTRAINTS if constraints[name] is None]
    if unmet:
        names = ", ".join(RESOURCE_OF[name] for name in unmet)
        return f"no positive P/D keeps {names} below saturation"
    assert upper is not None
    if lower > upper * (1 + _REL_TOLERANCE):
        return f"the lower bound {lower:.4g} (PE CNIC write) exceeds the upper bound {upper:.4g}"
    return None


def pd_bounds(gpus_per_node: int, snic_gbps: float, cnic_gbps: float, dram_gbs: float) -> PDBounds:
    """The bottleneck-free P/D range; s = snic_gbps / cnic_gbps, B = cnic_gbps / 8 GB/s."""
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer (got {gpus_per_node!r})")
    _require_positive("snic_gbps", snic_gbps)
    _require_positive("cnic_gbps", cnic_gbps)
    _require_positive("dram_gbs", dram_gbs)
    g, s, b = gpus_per_node, snic_gbps / cnic_gbps, cnic_gbps / 8
    constraints = _constraint_bounds(g, s, b, dram_gbs)
    lower = constraints[LOWER_CONSTRAINT]
    known: dict[str, float] = {
        name: bound for name in UPPER_CONSTRAINTS if (bound := constraints[name]) is not None
    }
    upper: float | None
    if len(known) < len(UPPER_CONSTRAINTS):
        upper = None
        binding = tuple(name for name in UPPER_CONSTRAINTS if name not in known)
    else:
        upper = min(known.values())
        binding = tuple(
            name for name, bound in known.items() if math.isclose(bound, upper, rel_tol=_REL_TOLERANCE)
        )
    reason = _empty_reason(g, s, lower, upper, constraints)
    return PDBounds(g, s, b, dram_gbs, lower, upper, constraints, binding, reason)


def _at_most(value: float, bound: float) -> bool:
    return value <= bound or math.isclose(value, bound, rel_tol=_REL_TOLERANCE)


def classify_ratio(bounds: PDBounds, prefill_nodes: int, decode_nodes: int) -> RatioCheck:
    """Whether P/D = prefill_nodes / decode_nodes is bottleneck-free, and if not, what saturates.

    saturates lists every constraint the ratio breaks: pe_cnic_read when s > g/2 (any ratio),
    pe_cnic_write below the lower bound, each upper constraint the ratio exceeds (or that no
    ratio meets). Ratios equal to a bound, up to rounding, are inside.
    """
    for name, value in (("prefill_nodes", prefill_nodes), ("decode_nodes", decode_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer (got {value!r})")
    ratio = prefill_nodes / decode_nodes
    broken: list[str] = []
    if 2 * bounds.s > bounds.gpus_per_node:
        broken.append(PE_CNIC_READ)
    if bounds.lower is None or not _at_most(bounds.lower, ratio):
        broken.append(LOWER_CONSTRAINT)
    for name in UPPER_CONSTRAINTS:
        bound = bounds.constraints[name]
        if bound is None or not _at_most(ratio, bound):
            broken.append(name)
    return RatioCheck(prefill_nodes, decode_nodes, ratio, not broken, tuple(broken))
