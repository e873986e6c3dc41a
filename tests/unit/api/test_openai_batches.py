"""A /v1/completions batch (a list of token-id prompts) is bounded and fails whole: more prompts
than --max-prompts is a 400 naming `prompt` before anything reaches the cluster (a body of a
million one-token prompts included, which fits the body limit), `n` samples of each prompt are
turns of their own counted against the same cap, and
when one prompt's turn is refused (a full queue: 429) or fails, every other turn of the batch is
aborted, the one not yet submitted included, before the client is answered: nothing of a batch
keeps the cluster busy once its client has its error. The app runs on Starlette's test client
over fakes of the rollout-server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from dualpath_ray.api.http_limits import DEFAULT_MAX_PROMPTS, HttpLimits  # noqa: E402
from dualpath_ray.api.openai_app import OpenAIEndpoint, build_app  # noqa: E402
from dualpath_ray.api.server import GenerationError, TokenOutput  # noqa: E402
from dualpath_ray.config import parse_config  # noqa: E402
from dualpath_ray.protocol.messages import ErrorKind, RequestSpec, SamplingParams, failed_result  # noqa: E402
from tests.unit.api.fake_rollout_server import FakeRolloutServer, Method  # noqa: E402

MODEL = "dualpath-tiny"


def client(server: Any, max_prompts: int = DEFAULT_MAX_PROMPTS, raise_server_exceptions: bool = True) -> TestClient:
    cfg = parse_config({})
    endpoint = OpenAIEndpoint(server, None, cfg, max_prompts)
    return TestClient(build_app(endpoint, None, HttpLimits(max_prompts=max_prompts)),
                      raise_server_exceptions=raise_server_exceptions)


def completion(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, **fields}


def test_more_prompts_than_the_cap_is_a_400_naming_prompt_and_reaches_nothing() -> None:
    server = FakeRolloutServer()
    http = client(server, max_prompts=4)
    answer = http.post("/v1/completions", json=completion([[1], [2], [3], [4], [5]]))
    assert answer.status_code == 400, "a batch over --max-prompts is the client's error"
    error = answer.json()["error"]
    assert error["param"] == "prompt", f"the error names the field: {error}"
    assert "5 prompts" in error["message"] and "limit of 4" in error["message"], f"and the count and the cap: {error}"
    assert "--max-prompts" in error["message"], "and the flag that sets the cap"
    assert server.calls == [], "no prompt of a refused batch reached the rollout-server"
    fits = http.post("/v1/completions", json=completion([[1], [2], [3], [4]]))
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4, "a batch at the cap is served, a choice each"
    assert len(server.calls) == 4, "one turn per prompt"
    one_long = http.post("/v1/completions", json=completion(list(range(1, 50))))
    assert one_long.status_code == 200, "one prompt of many tokens is one prompt, not many"


def test_a_million_one_token_prompts_are_refused_not_fanned_out() -> None:
    server = FakeRolloutServer()
    http = client(server)
    million = b'"prompt": [' + b"[1], " * 999_999 + b"[1]]"  # written out: json.dumps of it takes seconds
    body = json.dumps(completion([])).encode().replace(b'"prompt": []', million)
    assert len(body) < HttpLimits().max_body_bytes, "the body fits the body limit: only the prompt cap stops it"
    answer = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt", (
        f"refused with 400 naming prompt: {answer.text[:200]}"
    )
    assert f"limit of {DEFAULT_MAX_PROMPTS}" in answer.json()["error"]["message"], "the default cap is named"
    assert server.calls == [], "not one of them reached the rollout-server"


def test_n_cannot_multiply_a_batch_past_the_cap() -> None:
    server = FakeRolloutServer()
    answer = client(server).post("/v1/completions", json=completion([[1], [2]], n=1000))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", "n x prompts over the cap is refused"
    assert "2000 turns" in answer.json()["error"]["message"], f"the count is named: {answer.json()}"
    assert server.calls == [], "nothing reached the rollout-server"


class SeedServer(FakeRolloutServer):
    """Records each turn's seed; a turn's tokens name its prompt's first token and its seed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seeds: list[int] = []
        self.generate = Method(self._seeded)

    async def _seeded(self, request_id: str, prompt: list[int], sampling: dict[str, Any], session_id: Any,
                      expect_next_turn_s: Any = None, cache_salt: str | None = None) -> Any:
        self.record(request_id, prompt, session_id, cache_salt)
        self.seeds.append(sampling["seed"])
        tokens = [prompt[0], sampling["seed"]]
        return type("Out", (), {"token_ids": tokens, "log_probs": None,
                                "extra_fields": {"finish_reason": "length", "hit_tokens": 0}})()


def test_n_samples_of_each_prompt_are_turns_of_their_own_seeded_apart_and_sent_together() -> None:
    server = SeedServer()
    answer = client(server).post("/v1/completions", json=completion([[5, 1], [7, 1]], n=3, seed=40))
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6)), "one choice per sample of each prompt, indexed in order"
    assert [c["token_ids"] for c in choices] == [[5, 40], [5, 41], [5, 42], [7, 40], [7, 41], [7, 42]], (
        "choice prompt * n + j is sample j of that prompt, seeded seed + j"
    )
    assert [call.prompt for call in server.calls] == [[5, 1]] * 3 + [[7, 1]] * 3, "each sample is a turn of its own"
    assert len({call.request_id for call in server.calls}) == 6, "with an id of its own"
    assert answer.json()["usage"]["prompt_tokens"] == 12, "usage adds up the six turns"


@pytest.mark.parametrize(("fields", "why"), [({"stream": True}, "stream"), ({"session_id": "s1"}, "session")])
def test_n_is_one_sample_where_a_request_is_one_turn(fields: dict[str, Any], why: str) -> None:
    server = FakeRolloutServer()
    answer = client(server).post("/v1/completions", json=completion([1, 2], n=2, **fields))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", f"n > 1 with a {why} is refused"
    assert server.calls == []


class BatchServer:
    """A batch of four whose prompt 1 is refused (queue full) once prompts 0 and 2 run; prompts 0
    and 2 run until aborted; prompt 3 reaches the rollout-server only after the abort, as a turn
    still waiting to be submitted does. `abort_session(prefix)` aborts the turns in flight under
    that session's prefix and refuses later ones until `resume_session`, as the scheduler does."""

    def __init__(self, failure: str = "queue_full") -> None:
        self.failure = failure
        self.running: set[str] = set()
        self.marks: set[str] = set()
        self.refused: list[str] = []  # turns the abort mark refused before they ran
        self.aborted: list[str] = []  # turns aborted while they ran
        self.log: list[str] = []
        self.aborts = asyncio.Event()
        self.generate = Method(self._generate)
        self.abort_session = Method(self._abort_session)
        self.resume_session = Method(self._resume_session)

    async def _generate(self, request_id: str, prompt: list[int], sampling: dict[str, Any], session_id: Any,
                        expect_next_turn_s: Any = None, cache_salt: str | None = None) -> TokenOutput:
        index = int(request_id.rsplit("/", 1)[1])
        if index == 3:
            await self.aborts.wait()  # submitted late: after its sibling's refusal was answered
        if any(request_id.startswith(mark) for mark in self.marks):
            self.refused.append(request_id)
            return self._output("abort")
        if index == 1:
            while len(self.running) < 2:
                await asyncio.sleep(0)
            kind = ErrorKind.QUEUE_FULL if self.failure == "queue_full" else ErrorKind.INTERNAL
            spec = RequestSpec(request_id, 0, np.asarray(prompt), SamplingParams(), "ns", 0.0)
            raise GenerationError(request_id, failed_result(spec, "scheduler", self.failure, kind))
        self.running.add(request_id)
        while not any(request_id.startswith(mark) for mark in self.marks):
            await asyncio.sleep(0.001)
        self.running.discard(request_id)
        self.aborted.append(request_id)
        return self._output("abort")

    @staticmethod
    def _output(finish: str) -> TokenOutput:
        return TokenOutput(token_ids=[], log_probs=[], extra_fields={"finish_reason": finish, "hit_tokens": 0})

    async def _abort_session(self, session_id: str) -> int:
        self.log.append(f"abort {session_id}")
        self.marks.add(f"{session_id}/")
        self.aborts.set()
        return len(self.running)

    async def _resume_session(self, session_id: str) -> None:
        self.log.append(f"resume {session_id}")
        assert not self.running, "the mark is cleared only once no turn of the batch runs"
        self.marks.discard(f"{session_id}/")


@pytest.mark.parametrize("failure", ["queue_full", "internal"])
def test_a_failed_prompt_aborts_the_rest_of_its_batch_before_the_client_is_answered(failure: str) -> None:
    server = BatchServer(failure)
    http = client(server, raise_server_exceptions=False)
    answer = http.post("/v1/completions", json=completion([[1], [2], [3], [4]]))
    if failure == "queue_full":
        assert answer.status_code == 429, f"the client gets the refused prompt's 429: {answer.text}"
        assert answer.json()["error"]["code"] == "queue_full", "with the queue_full code, to retry after Retry-After"
    else:
        assert answer.status_code == 500, "another failure of one prompt fails the request"
    assert not server.running, "no turn of the batch still runs once the client has its answer"
    assert sorted(r.rsplit("/", 1)[1] for r in server.aborted) == ["0", "2"], "the turns in flight were aborted"
    assert [r.rsplit("/", 1)[1] for r in server.refused] == ["3"], "the turn not yet submitted never ran"
    batch = server.refused[0].rsplit("/", 1)[0]
    assert server.log == [f"abort {batch}", f"resume {batch}"], (
        "the batch is aborted as one prefix, and its mark cleared once all its turns ended"
    )


def test_a_request_without_a_seed_gets_one_drawn_and_a_sent_seed_is_kept() -> None:
    server = SeedServer()
    for _ in range(2):
        answer = client(server).post("/v1/completions", json=completion([[5, 1]], n=1))
        assert answer.status_code == 200, answer.text
    answer = client(server).post("/v1/completions", json=completion([[5, 1]], n=1, seed=7))
    assert answer.status_code == 200, answer.text
    assert server.seeds[0] != server.seeds[1], (
        f"two unseeded requests of one prompt sample differently (a seed is drawn for each): {server.seeds}")
    assert server.seeds[2] == 7, f"a seed the client sends is the one the turn uses: {server.seeds}"
