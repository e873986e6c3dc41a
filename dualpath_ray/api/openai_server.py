"""The actor that serves the OpenAI-compatible app (`openai-server`): uvicorn on the actor's own
event loop, on the node of the process that starts it (so `--host 127.0.0.1` means that machine).

It tells the `rollout-server` where it listens, which is what a verl replica reports as its
`server_address`. Without tokenizer files it serves token ids only (api/openai_app.py); with API
keys only their digests reach the actor (api/api_keys.py). What a client may hold of it (body,
prompts, connections, the time a head or a body takes to arrive) is bounded by its HttpLimits
(api/http_limits.py, applied by api/http_server.py and api/openai_guards.py).

Ray restarts it when its process dies (runtime.front_end_max_restarts): the new incarnation
listens again on the address the dead one bound (kept in its record, runtime/deploy/kept_state.py),
so clients keep their URL. A request in flight at the death loses its connection; HTTP clients
send it again (the `openai` client retries connection errors, `max_retries`), and a retry that
arrives before the new incarnation listens is refused (connection refused: retried the same way).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray

from dualpath_ray.api.api_keys import ApiKeys
from dualpath_ray.api.http_limits import HttpLimits
from dualpath_ray.api.http_server import uvicorn_config
from dualpath_ray.api.openai_app import OpenAIEndpoint, build_app
from dualpath_ray.api.server import SERVER_NAME
from dualpath_ray.api.tokenizer import TOKENIZER_FILE, HFTokenizer, TokenizerError
from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.names import OPENAI_SERVER
from dualpath_ray.runtime.deploy.kept_state import KeptState
from dualpath_ray.runtime.deploy.topology import front_end_options
from dualpath_ray.runtime.engine.restarts import was_restarted

OPENAI_SERVER_NAME = OPENAI_SERVER
START_TIMEOUT_S = 30.0


def tokenizer_dir(cfg: DualPathConfig, override: str | Path | None, skip: bool = False) -> Path | None:
    """Where the tokenizer files are: `override` (which must hold them), else model.weights_dir
    when it holds a tokenizer.json. None, token-ids mode, when `skip` or when neither does."""
    if skip:
        if override is not None:
            raise TokenizerError("--tokenizer and --skip-tokenizer-init contradict each other; pass one of them")
        return None
    if override is not None:
        return Path(override)
    if cfg.model.weights_dir is not None and (Path(cfg.model.weights_dir) / TOKENIZER_FILE).is_file():
        return Path(cfg.model.weights_dir)
    return None


@ray.remote(num_cpus=0, max_concurrency=1024)
class OpenAIServer:
    def __init__(self, cfg: DualPathConfig, tokenizer_path: str | None, api_keys: ApiKeys | None = None,
                 limits: HttpLimits = HttpLimits()) -> None:
        self.cfg = cfg
        self.tokenizer = HFTokenizer.from_dir(tokenizer_path, cfg.model.vocab_size) if tokenizer_path else None
        self.api_keys = api_keys
        self.limits = limits
        self.rollout_server = ray.get_actor(SERVER_NAME, namespace=cfg.runtime.namespace)
        self.uvicorn: Any = None
        self.task: asyncio.Task[None] | None = None
        self.address: tuple[str, int] | None = None
        self.starting = asyncio.Lock()  # one start at a time (the driver's, a restart's own)
        self.record = KeptState(cfg.runtime.namespace, OPENAI_SERVER_NAME)
        kept = self.record.load() if was_restarted() else {}
        if kept.get("address"):
            host, port = kept["address"]
            # Runs once this __init__ returned: the actor's event loop serves uvicorn.
            self.relisten = ray.get_runtime_context().current_actor.start.remote(str(host), int(port))
        else:
            self.record.save({})  # replaces any record a crashed deployment left in this namespace

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (port 0: any free port); returns where it listens. Asked again for
        the address it listens on (a resent call, a restart's own), it answers that address."""
        async with self.starting:
            if self.address is None:
                self.address = await self._listen(host, port)
        if (host, port) not in (self.address, (self.address[0], 0)):
            raise RuntimeError(f"the OpenAI server already listens on {self.address[0]}:{self.address[1]}")
        return self.address

    async def _listen(self, host: str, port: int) -> tuple[str, int]:
        import uvicorn

        endpoint = OpenAIEndpoint(self.rollout_server, self.tokenizer, self.cfg, self.limits.max_prompts)
        app = build_app(endpoint, self.api_keys, self.limits)
        self.uvicorn = uvicorn.Server(uvicorn_config(app, host, port, self.limits))
        self.task = asyncio.get_running_loop().create_task(self.uvicorn.serve())
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self.uvicorn.started:
            if self.task.done():
                raise RuntimeError(f"the OpenAI server could not listen on {host}:{port}: {self.task.exception()!r}")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the OpenAI server did not start listening on {host}:{port} in {START_TIMEOUT_S} s")
            await asyncio.sleep(0.05)
        bound = int(self.uvicorn.servers[0].sockets[0].getsockname()[1])
        self.record.save({"address": [host, bound]})
        await self.rollout_server.set_server_address.remote(host, bound)
        return host, bound

    async def stop(self) -> None:
        if self.uvicorn is not None and self.task is not None:
            self.uvicorn.should_exit = True
            await self.task


def start_openai_server(cfg: DualPathConfig, host: str = "127.0.0.1", port: int = 8000,
                        tokenizer: str | Path | None = None, *, api_keys: list[str] | tuple[str, ...] = (),
                        limits: HttpLimits = HttpLimits(), skip_tokenizer_init: bool = False) -> tuple[Any, str]:
    """Start the endpoint for a deployment whose rollout-server runs (`DualPathCluster.server()`);
    returns the actor and its base URL (http://host:port/v1). `api_keys` empty: no key needed;
    several: each key is a tenant, and tenants never share cached prefixes (api/cache_salt.py)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    path = tokenizer_dir(cfg, tokenizer, skip_tokenizer_init)
    if path is not None:
        HFTokenizer.from_dir(path, cfg.model.vocab_size)  # a bad tokenizer is an error here, not in the actor
    keys = ApiKeys.of(api_keys) if api_keys else None
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    # Restarted on this node (the strategy is hard), so the address it listens on stays valid.
    actor = OpenAIServer.options(**front_end_options(cfg, OPENAI_SERVER_NAME), scheduling_strategy=here).remote(
        cfg, str(path) if path is not None else None, keys, limits
    )
    bound_host, bound_port = ray.get(actor.start.remote(host, port))
    return actor, f"http://{bound_host}:{bound_port}/v1"
