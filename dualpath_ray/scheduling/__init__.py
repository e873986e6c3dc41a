"""The scheduling policy of DualPath (paper section 6): pure code, no Ray.

The Ray runtime calls these functions on live engine reports and the cluster simulator on
simulated ones, so nothing in this package may import Ray (a unit test checks it).
"""

from __future__ import annotations

from dualpath_ray.scheduling.batching import BatchPredictor, pack_lockstep_round, pack_prefill_batch
from dualpath_ray.scheduling.loads import Assignment, EngineLoad, QueuedRequest, prefill_tokens
from dualpath_ray.scheduling.policy import (
    assign_decode_groups,
    assign_decode_in_group,
    assign_prefill,
    choose_read_path,
)

__all__ = [
    "Assignment",
    "BatchPredictor",
    "EngineLoad",
    "QueuedRequest",
    "assign_decode_groups",
    "assign_decode_in_group",
    "assign_prefill",
    "choose_read_path",
    "pack_lockstep_round",
    "pack_prefill_batch",
    "prefill_tokens",
]
