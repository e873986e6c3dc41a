"""The ablation's "dual path with round-robin path choice": the policy's placement, with read
paths alternating PE, DE, PE, ... instead of going to the shorter read queue.

A baseline the paper compares its scheduler with (SNIC balance: round-robin 1.53, the scheduler
1.18), not the policy: engine placement is the dispatcher's as ever; only `_path` differs.
"""

from __future__ import annotations

from dualpath_ray.scheduling.binding import HitBinder
from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.dispatcher import Constants, Dispatcher
from dualpath_ray.protocol.types import Mode, ReadPath
from dualpath_ray.scheduling.sharing import InFlightSharing


class RoundRobinPaths(Dispatcher):
    """`_path` is asked once per placement (Dispatcher.fetch_prefill), so the paths alternate
    request by request."""

    def __init__(
        self, constants: Constants, mode: Mode = Mode.DUALPATH, read_split: str = "whole",
        compute_path: ComputePathModel | None = None, binder: HitBinder | None = None,
        sharing: InFlightSharing | None = None,
    ) -> None:
        super().__init__(constants, mode, read_split, compute_path=compute_path, binder=binder, sharing=sharing)
        self._next_de = False

    def _path(self, pe_node: str, de_node: str, avoid: str = "") -> ReadPath:
        if self.mode is not Mode.DUALPATH:
            return ReadPath.PE
        path = ReadPath.DE if self._next_de else ReadPath.PE
        self._next_de = not self._next_de
        return path
