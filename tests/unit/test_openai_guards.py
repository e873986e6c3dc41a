"""The OpenAI-compatible app's front door without Ray: the API key (401 without it or with
another, 200 with it, /health open), the body limit (413), a text too long for any context
refused before the tokenizer runs, and token-ids mode (no tokenizer: token-id prompts answered
with their token ids, text prompts a 400 naming the tokenizer). The app runs on Starlette's test
client over a fake rollout-server; the tokenizer is the real tiny one of tests/tokenizer_factory.py
behind a proxy that records every encode."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

pytest.importorskip("starlette")
pytest.importorskip("tokenizers")

from starlette.testclient import TestClient  # noqa: E402

from dualpath_ray.api.openai_app import OpenAIEndpoint, build_app  # noqa: E402
from dualpath_ray.api.api_keys import ApiKey, ApiKeys  # noqa: E402
from dualpath_ray.api.http_limits import HttpLimits  # noqa: E402
from dualpath_ray.api.tokenizer import HFTokenizer  # noqa: E402
from dualpath_ray.config import parse_config  # noqa: E402
from dualpath_ray.protocol.messages import StreamDelta  # noqa: E402
from tests.tokenizer_factory import train_tokenizer  # noqa: E402

MODEL = "dualpath-tiny"
KEY = "sk-test-key"
GENERATED = [11, 12, 13]


@dataclass
class FakeOutput:
    token_ids: list[int]
    log_probs: list[float] | None
    extra_fields: dict[str, Any]


class FakeMethod:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class FakeRolloutServer:
    """The rollout-server's generate / generate_stream / abort, recording each prompt."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.hints: list[float | None] = []  # each request's expect_next_turn_s
        self.salts: list[str | None] = []  # each request's cache_salt
        self.generate = FakeMethod(self._generate)
        self.generate_stream = FakeMethod(self._stream)
        self.abort = FakeMethod(lambda request_id: None)

    async def _generate(self, request_id: str, prompt: list[int], sampling: dict[str, Any], session: Any,
                        expect_next_turn_s: float | None = None, cache_salt: str | None = None) -> FakeOutput:
        self.prompts.append(list(prompt))
        self.hints.append(expect_next_turn_s)
        self.salts.append(cache_salt)
        tokens = GENERATED[: sampling["max_tokens"]]
        return FakeOutput(tokens, [-0.5] * len(tokens), {"finish_reason": "length", "hit_tokens": 0})

    async def _stream(self, request_id: str, prompt: list[int], sampling: dict[str, Any], session: Any,
                      expect_next_turn_s: float | None = None, cache_salt: str | None = None) -> AsyncIterator[Any]:
        self.prompts.append(list(prompt))
        self.hints.append(expect_next_turn_s)
        self.salts.append(cache_salt)
        for start, token in enumerate(GENERATED):
            yield _ready(StreamDelta(start, (token,), (-0.5,)))
        yield _ready(FakeOutput(GENERATED, None, {"finish_reason": "length", "hit_tokens": 0}))


async def _ready(item: Any) -> Any:
    return item


class RecordingBackend:
    """A `tokenizers.Tokenizer` that records the texts it is asked to encode."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.encoded: list[str] = []

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.encoded.append(text)
        return self.backend.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


@pytest.fixture
def tokenizer(tmp_path: Path) -> HFTokenizer:
    train_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    loaded = HFTokenizer.from_dir(tmp_path, 512)
    loaded.backend = RecordingBackend(loaded.backend)
    return loaded


def client(tokenizer: HFTokenizer | None, api_keys: ApiKeys | None = None, max_body_bytes: int = 1 << 20,
           server: FakeRolloutServer | None = None) -> TestClient:
    cfg = parse_config({"model": {"max_context": 256}})
    endpoint = OpenAIEndpoint(server or FakeRolloutServer(), tokenizer, cfg)
    return TestClient(build_app(endpoint, api_keys, HttpLimits(max_body_bytes=max_body_bytes)))


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 3, **fields}


def test_every_route_but_health_needs_the_key(tokenizer: HFTokenizer) -> None:
    http = client(tokenizer, ApiKeys.of([KEY]))
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        for method, path, body in (("POST", "/v1/completions", completion(prompt=[1, 2])), ("GET", "/v1/models", None)):
            answer = http.request(method, path, json=body, headers=headers)
            assert answer.status_code == 401, f"{path} with {headers}: refused without the right Bearer key"
            error = answer.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error", (
                "the 401 has OpenAI's error shape"
            )
            assert answer.headers["www-authenticate"] == "Bearer", "the 401 names the scheme to use"
    assert http.get("/health").status_code == 200, "/health answers without a key (load-balancer probes)"
    good = {"Authorization": f"Bearer {KEY}"}
    assert http.get("/v1/models", headers=good).status_code == 200, "the right key opens /v1/models"
    answer = http.post("/v1/completions", json=completion(prompt="the agent reads the file"), headers=good)
    assert answer.status_code == 200, f"the right key opens /v1/completions: {answer.text}"


def test_the_key_digest_is_compared_not_the_key() -> None:
    key = ApiKey.of(KEY)
    assert KEY.encode() not in key.digest and len(key.digest) == 32, "only the key's SHA-256 digest is kept"
    assert key.accepts(f"Bearer {KEY}") and key.accepts(f"bearer  {KEY} "), "the scheme is case-insensitive"
    assert not key.accepts(f"Basic {KEY}") and not key.accepts(None), "another scheme or no header is refused"
    with pytest.raises(ValueError, match="API key is empty"):
        ApiKey.of("")


def test_an_oversized_body_is_a_413_before_it_is_parsed(tokenizer: HFTokenizer) -> None:
    server = FakeRolloutServer()
    http = client(tokenizer, max_body_bytes=200, server=server)
    body = json.dumps(completion(prompt=list(range(100)))).encode()
    answer = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 413, "a body over --max-body-bytes is refused"
    assert "--max-body-bytes" in answer.json()["error"]["message"], "the 413 says which limit and how to raise it"

    def chunked() -> Any:  # no Content-Length: the limit is counted on the bytes as they arrive
        yield body[:150]
        yield body[150:]

    answer = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert answer.status_code == 413, "a chunked body over the limit is refused while it is read"
    assert server.prompts == [], "nothing reached the rollout-server"
    assert http.post("/v1/completions", json=completion(prompt=[1, 2])).status_code == 200, "a small body passes"


def test_a_text_too_long_for_any_context_is_refused_before_the_tokenizer_runs(tokenizer: HFTokenizer) -> None:
    server = FakeRolloutServer()
    http = client(tokenizer, server=server)
    recorder = tokenizer.backend
    limit = tokenizer.max_prompt_chars(256)
    answer = http.post("/v1/completions", json=completion(prompt="a" * (limit + 1)))
    assert answer.status_code == 400, "a text longer than the context could hold is the client's error"
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded"), "OpenAI's code, naming prompt"
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "a" * (limit // 2)}, {"role": "user", "content": "a" * (limit - limit // 2 + 1)}]})
    assert chat.json()["error"]["param"] == "messages", "the messages' text counts together"
    assert recorder.encoded == [], "the tokenizer never ran on a text refused on its length"
    too_many = http.post("/v1/completions", json=completion(prompt=[1] * 257))
    assert too_many.json()["error"]["code"] == "context_length_exceeded", "a token list over the context is refused"
    assert server.prompts == [], "nothing reached the rollout-server"
    fits = http.post("/v1/completions", json=completion(prompt="the agent reads the file"))
    assert fits.status_code == 200 and recorder.encoded == ["the agent reads the file"], "a text that fits is encoded"


def test_token_ids_mode_answers_token_ids_and_refuses_text() -> None:
    server = FakeRolloutServer()
    http = client(None, server=server)
    whole = http.post("/v1/completions", json=completion(prompt=[5, 6, 7], logprobs=0)).json()
    choice = whole["choices"][0]
    assert choice["token_ids"] == GENERATED and choice["prompt_token_ids"] == [5, 6, 7], "the choice carries the ids"
    assert choice["text"] == "", "no tokenizer: no text, but a valid (string) text field"
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in GENERATED], "log-prob tokens as vLLM spells ids"
    batch = http.post("/v1/completions", json=completion(prompt=[[1, 2], [3, 4, 5]])).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1], "a list of token-id lists: one choice per prompt"
    assert [c["prompt_token_ids"] for c in batch["choices"]] == [[1, 2], [3, 4, 5]], "choices in prompt order"
    assert batch["usage"]["prompt_tokens"] == 5, "usage adds up the prompts"
    lines = http.post("/v1/completions", json=completion(prompt=[5, 6], stream=True)).text.split("\n\n")
    streamed = [t for line in lines if line.startswith("data: {")
                for t in json.loads(line[6:])["choices"][0].get("token_ids", [])]
    assert streamed == GENERATED, "a stream's chunks carry the generated ids"
    for path, body, field in (("/v1/completions", completion(prompt="hello"), "prompt"),
                              ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                               "messages")):
        error = http.post(path, json=body)
        assert error.status_code == 400, f"{path}: text without a tokenizer is the client's error"
        assert error.json()["error"]["param"] == field and error.json()["error"]["code"] == "tokenizer_not_configured"
        assert "--tokenizer" in error.json()["error"]["message"], "the 400 says how to configure a tokenizer"
    refused = http.post("/v1/completions", json=completion(prompt=[[1], [2]], stream=True))
    assert refused.json()["error"]["param"] == "stream", "a streamed batch is refused, not half served"


def test_embedded_defaults_mean_token_ids_mode_and_a_given_tokenizer_must_exist(tmp_path: Path) -> None:
    from dualpath_ray.api.openai_server import tokenizer_dir
    from dualpath_ray.api.tokenizer import TokenizerError

    assert tokenizer_dir(parse_config({}), None) is None, "no weights_dir, no --tokenizer: token-ids mode"
    no_files = parse_config({"model": {"weights_dir": str(tmp_path)}})
    assert tokenizer_dir(no_files, None) is None, "a weights_dir without tokenizer.json: token-ids mode"
    train_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    assert tokenizer_dir(no_files, None) == tmp_path, "a weights_dir with tokenizer.json is the tokenizer"
    assert tokenizer_dir(no_files, None, skip=True) is None, "--skip-tokenizer-init serves ids even then"
    with pytest.raises(TokenizerError, match="contradict"):
        tokenizer_dir(no_files, tmp_path, skip=True)


def test_the_next_turn_hint_reaches_the_rollout_server_and_a_bad_one_is_a_400_naming_it() -> None:
    server = FakeRolloutServer()
    http = client(None, server=server)
    assert http.post("/v1/completions", json=completion(prompt=[5, 6, 7], expect_next_turn_s=4.5)).status_code == 200
    assert http.post("/v1/completions", json=completion(prompt=[5, 6], stream=True, expect_next_turn_s=2)).status_code == 200
    assert http.post("/v1/completions", json=completion(prompt=[5, 6])).status_code == 200
    assert server.hints == [4.5, 2.0, None], "the hint (seconds until the session's next turn) is passed on, or None"
    for bad in ("-1", '"soon"', "1e999", "true"):  # negative, not a number, infinite (JSON's overflow), a boolean
        body = json.dumps(completion(prompt=[5]))[:-1] + f', "expect_next_turn_s": {bad}}}'
        answer = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400, f"expect_next_turn_s={bad} is refused"
        assert answer.json()["error"]["param"] == "expect_next_turn_s", "the error names the field"
    assert len(server.hints) == 3, "a refused request reaches nothing"
