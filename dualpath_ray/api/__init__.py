"""The Python API for RL pipelines: batch rollouts, a verl-style agent-loop server, validation.

- `rollout_async(scheduler, cfg, trajectories) -> RolloutResult` (what `DualPathCluster.rollout`
  runs; api/rollout.py);
- `RolloutServer` / `TokenOutput` (api/server.py);
- `RequestError`, `validate_prompt`, `parse_sampling` (api/validation.py).
"""

from __future__ import annotations

from dualpath_ray.api.rollout import ROLLOUT_SCHEMA, RolloutResult, rollout_async
from dualpath_ray.api.server import SERVER_NAME, RolloutServer, TokenOutput
from dualpath_ray.api.validation import RequestError, make_spec, parse_sampling, validate_prompt

__all__ = [
    "ROLLOUT_SCHEMA", "SERVER_NAME", "RequestError", "RolloutResult", "RolloutServer", "TokenOutput",
    "make_spec", "parse_sampling", "rollout_async", "validate_prompt",
]
