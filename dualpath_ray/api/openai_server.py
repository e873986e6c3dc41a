"""The actor that serves the OpenAI-compatible app (`openai-server`): uvicorn on the actor's own
event loop, on the node of the process that starts it (so `--host 127.0.0.1` means that machine).

It tells the `rollout-server` where it listens, which is what a verl replica reports as its
`server_address`. Without tokenizer files it serves token ids only (api/openai_app.py); with API
keys only their digests reach the actor (api/api_keys.py). What a client may hold of it (body,
prompts, connections, the time a head or a body takes to arrive) is bounded by its HttpLimits
(api/http_limits.py, applied by api/http_server.py and api/openai_guards.py).

Ray restarts it when its process dies (runtime.front_end_max_restarts): the new incarnation
listens again on the address the dead one bound (kept in its record, runtime/restarts/kept_state.py),
so clients keep their URL. A request in flight at the death loses its connection; HTTP clients
send it again (the `openai` client retries connection errors, `max_retries`), and a retry that
arrives before the new incarnation listens is refused (connection refused: retried the same way).
"""

from __future__ import annotations

import asyncio
import logging
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
from dualpath_ray.runtime.restarts.kept_state import KeptState
from dualpath_ray.runtime.placement.topology import front_end_options
from dualpath_ray.runtime.restarts.incarnations import was_restarted

OPENAI_SERVER_NAME = OPENAI_SERVER
START_TIMEOUT_S = 30.0
# After the grace of `stop`, the aborted requests' last chunks get this long to be sent, and
# once their connections are closed by force, the server's task this long to end.
ABORT_WAIT_S = 1.0
FORCE_WAIT_S = 0.5
LOG = logging.getLogger("dualpath_ray.openai_server")


def stop_bound_s(grace_s: float) -> float:
    """The longest `OpenAIServer.stop(grace_s)` takes, its abort call aside."""
    return grace_s + ABORT_WAIT_S + FORCE_WAIT_S


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

    async def stop(self, grace_s: float = 0.0) -> int:
        """Stop serving, bounded: listen no more and close idle connections at once, give the
        requests in flight `grace_s` to finish, then abort every turn still in flight (a stream
        ends with finish_reason "abort" and [DONE], a whole response is answered with what it
        has) and, ABORT_WAIT_S later, close what is still open. Returns the turns aborted.

        The aborts reach every caller of this deployment's rollout-server, not only this
        endpoint's: it is asked to stop when the deployment goes down with it."""
        if self.uvicorn is None or self.task is None:
            return 0
        self.uvicorn.should_exit = True  # uvicorn's loop closes the listening sockets within 0.1 s
        if await _finished(self.task, grace_s):
            return 0
        loop = asyncio.get_running_loop()
        abort_deadline = loop.time() + ABORT_WAIT_S  # the abort call and the last chunks share it
        try:
            aborted = int(await asyncio.wait_for(self.rollout_server.abort_all.remote(), ABORT_WAIT_S))
        except Exception as exc:  # noqa: BLE001 - a scheduler that cannot abort: the connections are closed below
            LOG.warning("stop: aborting the requests in flight failed: %r", exc)
            aborted = 0
        if not await _finished(self.task, max(0.0, abort_deadline - loop.time())):
            # A connection uvicorn still waits for (a request that was never a turn: a body
            # still arriving, say): force_exit ends its wait, and the tasks are cancelled.
            self.uvicorn.force_exit = True
            for task in list(self.uvicorn.server_state.tasks):
                task.cancel()
            await _finished(self.task, FORCE_WAIT_S)
        return aborted


async def _finished(task: asyncio.Task[None], timeout_s: float) -> bool:
    """Whether `task` ends within timeout_s (not cancelled by the wait)."""
    await asyncio.wait({task}, timeout=timeout_s)
    return task.done()


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
