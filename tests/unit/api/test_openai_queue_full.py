"""The OpenAI endpoint under a burst its backend cannot queue: a request the scheduler refused
with ErrorKind.QUEUE_FULL (the rollout-server's GenerationError of kind queue_full) is HTTP 429
with Retry-After and an OpenAI-shaped error, while the admitted requests are answered as usual.
The Starlette app with an in-process fake of the rollout-server that admits `capacity` requests
at a time, as a full scheduler queue does; tests/integration/test_bounded_load.py sends a burst
through a real cluster."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("tokenizers")
httpx = pytest.importorskip("httpx2")

from dualpath_ray.api.openai_app import RETRY_AFTER_S, OpenAIEndpoint, build_app  # noqa: E402
from dualpath_ray.api.server import GenerationError, TokenOutput  # noqa: E402
from dualpath_ray.api.tokenizer import HFTokenizer  # noqa: E402
from dualpath_ray.config import DualPathConfig  # noqa: E402
from dualpath_ray.protocol.messages import ErrorKind, RequestSpec, SamplingParams, failed_result  # noqa: E402
from tests.tokenizer_factory import train_tokenizer  # noqa: E402

BURST = 6
CAPACITY = 2


class Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class BusyServer:
    """The rollout-server's `generate`: `capacity` requests at once, the rest refused queue_full."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.release = asyncio.Event()
        self.generate = Method(self._generate)

    async def _generate(self, request_id: str, prompt_ids: list[int], sampling: dict[str, Any],
                        session_id: str | None, expect_next_turn_s: float | None = None,
                        cache_salt: str | None = None) -> TokenOutput:
        if self.in_flight >= self.capacity:
            spec = RequestSpec(request_id, 0, np.asarray(prompt_ids), SamplingParams(), "ns", 0.0)
            raise GenerationError(request_id, failed_result(spec, "scheduler", "queue full", ErrorKind.QUEUE_FULL))
        self.in_flight += 1
        await self.release.wait()
        return TokenOutput(token_ids=[5, 6], log_probs=[0.0, 0.0], stop_reason="completed",
                           extra_fields={"finish_reason": "length", "hit_tokens": 0})


def tokenizer(directory: Path, vocab_size: int) -> HFTokenizer:
    train_tokenizer(vocab_size).save(str(directory / "tokenizer.json"))  # type: ignore[attr-defined]
    return HFTokenizer.from_dir(directory, vocab_size)


def test_a_burst_beyond_the_queue_is_429_with_retry_after(tmp_path: Path) -> None:
    cfg = DualPathConfig()
    server = BusyServer(CAPACITY)
    app = build_app(OpenAIEndpoint(server, tokenizer(tmp_path, cfg.model.vocab_size), cfg))
    body = {"model": cfg.model.model_id, "prompt": [1, 2, 3, 4], "max_tokens": 2}

    async def burst() -> list[Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            sent = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(BURST)]
            while sum(task.done() for task in sent) < BURST - CAPACITY:
                await asyncio.sleep(0.001)
            server.release.set()
            return list(await asyncio.gather(*sent))

    responses = asyncio.run(asyncio.wait_for(burst(), 30))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * CAPACITY + [429] * (BURST - CAPACITY), f"admitted ones 200, the rest 429: {statuses}"
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.headers.get("retry-after") == str(RETRY_AFTER_S), "a 429 says when to retry (Retry-After)"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full"), f"OpenAI's error shape: {error}"
        assert "scheduler.max_queued_turns" in error["message"], "the message names the setting that bounds the queue"
