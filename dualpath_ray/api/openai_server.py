"""The actor that serves the OpenAI-compatible app (`openai-server`): uvicorn on the actor's own
event loop, on the node of the process that starts it (so `--host 127.0.0.1` means that machine).

It tells the `rollout-server` where it listens, which is what a verl replica reports as its
`server_address`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray

from dualpath_ray.api.openai_app import OpenAIEndpoint, build_app
from dualpath_ray.api.server import SERVER_NAME
from dualpath_ray.api.tokenizer import HFTokenizer, TokenizerError
from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.names import OPENAI_SERVER

OPENAI_SERVER_NAME = OPENAI_SERVER
START_TIMEOUT_S = 30.0


def tokenizer_dir(cfg: DualPathConfig, override: str | Path | None) -> Path:
    """Where the tokenizer files are: `override`, else model.weights_dir."""
    if override is not None:
        return Path(override)
    if cfg.model.weights_dir is None:
        raise TokenizerError(
            "model.weights_dir is not set, so there are no tokenizer files; set it to the model's Hugging Face "
            "directory or pass --tokenizer DIR"
        )
    return Path(cfg.model.weights_dir)


@ray.remote(num_cpus=0, max_concurrency=1024)
class OpenAIServer:
    def __init__(self, cfg: DualPathConfig, tokenizer_path: str) -> None:
        self.cfg = cfg
        self.tokenizer = HFTokenizer.from_dir(tokenizer_path, cfg.model.vocab_size)
        self.rollout_server = ray.get_actor(SERVER_NAME, namespace=cfg.runtime.namespace)
        self.uvicorn: Any = None
        self.task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (port 0: any free port); returns where it listens."""
        import uvicorn

        if self.uvicorn is not None:
            raise RuntimeError("the OpenAI server is already listening")
        app = build_app(OpenAIEndpoint(self.rollout_server, self.tokenizer, self.cfg))
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.task = asyncio.get_running_loop().create_task(self.uvicorn.serve())
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self.uvicorn.started:
            if self.task.done():
                raise RuntimeError(f"the OpenAI server could not listen on {host}:{port}: {self.task.exception()!r}")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the OpenAI server did not start listening on {host}:{port} in {START_TIMEOUT_S} s")
            await asyncio.sleep(0.05)
        bound = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        await self.rollout_server.set_server_address.remote(host, bound)
        return host, int(bound)

    async def stop(self) -> None:
        if self.uvicorn is not None and self.task is not None:
            self.uvicorn.should_exit = True
            await self.task


def start_openai_server(cfg: DualPathConfig, host: str = "127.0.0.1", port: int = 8000,
                        tokenizer: str | Path | None = None) -> tuple[Any, str]:
    """Start the endpoint for a deployment whose rollout-server runs (`DualPathCluster.server()`);
    returns the actor and its base URL (http://host:port/v1)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    path = tokenizer_dir(cfg, tokenizer)
    HFTokenizer.from_dir(path, cfg.model.vocab_size)  # a bad tokenizer is an error here, not in the actor
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor = OpenAIServer.options(
        name=OPENAI_SERVER_NAME, namespace=cfg.runtime.namespace, scheduling_strategy=here,
    ).remote(cfg, str(path))
    bound_host, bound_port = ray.get(actor.start.remote(host, port))
    return actor, f"http://{bound_host}:{bound_port}/v1"
