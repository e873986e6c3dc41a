"""The Python API for RL pipelines: batch rollouts, the rollout-server front end, adapters.

- `rollout_async(scheduler, cfg, trajectories) -> RolloutResult` (what `DualPathCluster.rollout`
  runs; api/rollout.py);
- `SchedulerClient` (api/client.py): `await client.generate(spec)` for many turns from one event
  loop, batched into one submit and one collect call to the scheduler;
- `RolloutServer` / `TokenOutput` (api/server.py): the `rollout-server` actor every trainer and
  adapter talks to (generate, stream, abort, sleep/wake, weights, prefix cache);
- verl: `VerlServerControl` (api/verl_server.py: verl's control methods, composed into the
  server), `dualpath_replica_class`, `register_with_verl` (api/verl_adapter.py);
- OpenRLHF: `OpenRLHFEngine`, `create_openrlhf_engine` (api/openrlhf_adapter.py);
- OpenAI-compatible HTTP: `start_openai_server` (api/openai_server.py, api/openai_app.py,
  api/openai_protocol.py, api/tokenizer.py; `dualpath serve`);
- `RequestError`, `validate_prompt`, `parse_sampling` (api/validation.py); sessions (api/sessions.py).

The HTTP modules import starlette/uvicorn/tokenizers (the `serve` extra) only when used.
"""

from __future__ import annotations

from dualpath_ray.api.client import SchedulerClient
from dualpath_ray.api.rollout import ROLLOUT_SCHEMA, RolloutResult, rollout_async
from dualpath_ray.api.server import SERVER_NAME, GenerationError, RolloutServer, TokenOutput
from dualpath_ray.api.validation import RequestError, make_spec, parse_sampling, validate_prompt

__all__ = [
    "ROLLOUT_SCHEMA", "SERVER_NAME", "GenerationError", "RequestError", "RolloutResult", "RolloutServer",
    "SchedulerClient", "TokenOutput", "make_spec", "parse_sampling", "rollout_async", "validate_prompt",
]
