"""A rollout-server for the OpenAI app's unit tests, without Ray: `generate`, `generate_stream`,
`abort`, `abort_session` and `resume_session` as the app calls them (`.remote(...)` returns what
awaiting the Ray call would), recording each call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from dualpath_ray.protocol.messages import StreamDelta

GENERATED = [11, 12, 13]


class Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass
class Output:
    """What TokenOutput carries that the app reads."""

    token_ids: list[int]
    log_probs: list[float] | None
    extra_fields: dict[str, Any]


@dataclass
class Call:
    request_id: str
    prompt: list[int]
    session_id: str | None
    cache_salt: str | None


@dataclass
class FakeRolloutServer:
    calls: list[Call] = field(default_factory=list)
    aborted_sessions: list[str] = field(default_factory=list)
    resumed_sessions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generate = Method(self._generate)
        self.generate_stream = Method(self._stream)
        self.abort = Method(self._abort)
        self.abort_session = Method(self._abort_session)
        self.resume_session = Method(self._resume_session)

    def record(self, request_id: str, prompt: list[int], session_id: str | None, cache_salt: str | None) -> None:
        self.calls.append(Call(request_id, list(prompt), session_id, cache_salt))

    async def _generate(self, request_id: str, prompt: list[int], sampling: dict[str, Any], session_id: str | None,
                        expect_next_turn_s: float | None = None, cache_salt: str | None = None) -> Any:
        self.record(request_id, prompt, session_id, cache_salt)
        tokens = GENERATED[: sampling["max_tokens"]]
        return Output(tokens, [-0.5] * len(tokens), {"finish_reason": "length", "hit_tokens": 0})

    async def _stream(self, request_id: str, prompt: list[int], sampling: dict[str, Any], session_id: str | None,
                      expect_next_turn_s: float | None = None, cache_salt: str | None = None) -> AsyncIterator[Any]:
        self.record(request_id, prompt, session_id, cache_salt)
        for start, token in enumerate(GENERATED):
            yield _ready(StreamDelta(start, (token,), (-0.5,)))
        yield _ready(Output(GENERATED, None, {"finish_reason": "length", "hit_tokens": 0}))

    async def _abort(self, request_id: str) -> bool:
        return False

    async def _abort_session(self, session_id: str) -> int:
        self.aborted_sessions.append(session_id)
        return 0

    async def _resume_session(self, session_id: str) -> None:
        self.resumed_sessions.append(session_id)


async def _ready(item: Any) -> Any:
    return item
