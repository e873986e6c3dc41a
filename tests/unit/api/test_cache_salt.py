"""Cache salts reach the block keys (api/cache_salt.py): with two API keys the same prompt is
keyed under two namespaces (tenants never share cached prefixes, so cached_tokens tells none
about another's prompts); with one key everyone shares the unsalted namespace, as before; a
request's `cache_salt` (completions and chat, whole and streamed) separates it further, within
its tenant only; a bad `cache_salt` is a 400 naming it, at the endpoint and at the rollout-server,
whose callers without a salt are keyed as before. The OpenAI app runs on Starlette's test client;
its rollout-server is a fake whose turns go through the real RolloutServer's `_prepare`, so each
recorded namespace is the RequestSpec.namespace the scheduler would get."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("tokenizers")

from starlette.testclient import TestClient  # noqa: E402

from dualpath_ray.api.api_keys import ApiKeys  # noqa: E402
from dualpath_ray.api.validation import MAX_CACHE_SALT_CHARS  # noqa: E402
from dualpath_ray.api.openai_app import OpenAIEndpoint, build_app  # noqa: E402
from dualpath_ray.api.server import RolloutServer  # noqa: E402
from dualpath_ray.api.sessions import SessionIds  # noqa: E402
from dualpath_ray.api.tokenizer import HFTokenizer  # noqa: E402
from dualpath_ray.api.validation import RequestError  # noqa: E402
from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from dualpath_ray.kv.index import unsalted_namespace  # noqa: E402
from tests.tokenizer_factory import train_tokenizer  # noqa: E402
from tests.unit.api.fake_rollout_server import FakeRolloutServer  # noqa: E402

MODEL = "dualpath-tiny"
ALPHA, BETA = "sk-alpha", "sk-beta"
PROMPT = [5, 6, 7, 8]


def bare_server(cfg: DualPathConfig) -> Any:
    """A RolloutServer without its actor: what `_prepare` reads, nothing that needs Ray."""
    server = object.__new__(RolloutServer.__ray_actor_class__)
    server.cfg = cfg
    server.weight_version = cfg.model.weight_version
    server.sessions = SessionIds()
    server.in_flight = {}
    return server


class SpecRecorder(FakeRolloutServer):
    """Records the namespace the real `_prepare` gives each turn."""

    def __init__(self, cfg: DualPathConfig) -> None:
        super().__init__()
        self.server = bare_server(cfg)
        self.namespaces: list[str] = []

    def record(self, request_id: str, prompt: list[int], session_id: str | None, cache_salt: str | None) -> None:
        super().record(request_id, prompt, session_id, cache_salt)
        spec, _ = self.server._prepare(request_id, prompt, {"max_tokens": 2}, session_id, None, cache_salt)
        self.namespaces.append(spec.namespace)


@pytest.fixture
def tokenizer(tmp_path: Path) -> HFTokenizer:
    train_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer.from_dir(tmp_path, 512)


def endpoint(keys: list[str], tokenizer: HFTokenizer | None = None) -> tuple[TestClient, SpecRecorder]:
    cfg = parse_config({"model": {"vocab_size": 512}})
    server = SpecRecorder(cfg)
    app = build_app(OpenAIEndpoint(server, tokenizer, cfg), ApiKeys.of(keys) if keys else None)
    return TestClient(app), server


def complete(http: TestClient, key: str | None, **fields: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields},
                     headers=headers)


def test_two_api_keys_key_the_same_prompt_under_two_namespaces() -> None:
    http, server = endpoint([ALPHA, BETA])
    for key in (ALPHA, BETA, ALPHA):
        assert complete(http, key).status_code == 200
    alpha, beta, alpha_again = server.namespaces
    assert alpha != beta, "two tenants' identical prompts never share blocks (no cached_tokens across tenants)"
    assert alpha == alpha_again, "one tenant's requests share their cached prefixes"
    weights = server.server.cfg.kv_namespace(server.server.weight_version)
    assert {unsalted_namespace(alpha), unsalted_namespace(beta)} == {weights}, "the weights' namespace is still read"
    assert all(ALPHA not in ns and BETA not in ns for ns in server.namespaces), "no key travels in a namespace"
    assert all(ALPHA not in (c.cache_salt or "") for c in server.calls), "nor in the salt the rollout-server gets"


def test_one_key_or_none_shares_the_unsalted_namespace() -> None:
    for keys in ([ALPHA], []):
        http, server = endpoint(keys)
        assert complete(http, keys[0] if keys else None).status_code == 200
        weights = server.server.cfg.kv_namespace(server.server.weight_version)
        assert server.namespaces == [weights], f"keys {keys}: one tenant, every client shares the cache, as before"
        assert server.calls[0].cache_salt is None, "no salt travels"


def test_cache_salt_separates_requests_within_a_tenant_only(tokenizer: HFTokenizer) -> None:
    http, server = endpoint([ALPHA, BETA], tokenizer)
    assert complete(http, ALPHA).status_code == 200
    assert complete(http, ALPHA, cache_salt="user-1").status_code == 200
    assert complete(http, ALPHA, cache_salt="user-1", stream=True).status_code == 200
    assert complete(http, BETA, cache_salt="user-1").status_code == 200
    chat = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {ALPHA}"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": "user-1"})
    assert chat.status_code == 200, chat.text
    plain, salted, streamed, other_tenant, chatted = server.namespaces
    assert salted != plain, "a cache_salt keys its requests apart from the tenant's unsalted ones"
    assert streamed == salted, "a streamed request with the same salt shares its blocks"
    assert other_tenant != salted, "the same cache_salt from another tenant does not join its cache"
    assert chatted == salted, "chat completions take cache_salt as completions do"
    single, single_server = endpoint([])
    assert complete(single, None, cache_salt="user-1").status_code == 200
    assert single_server.namespaces[0] not in server.namespaces, "a single-tenant server salts by cache_salt too"


@pytest.mark.parametrize("bad", ["", 7, ["a"], "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_cache_salt_is_a_400_naming_it(bad: Any, tokenizer: HFTokenizer) -> None:
    http, server = endpoint([], tokenizer)
    answer = complete(http, None, cache_salt=bad)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "cache_salt", (
        f"cache_salt={bad!r:.40} is refused naming the field: {answer.text[:200]}"
    )
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "cache_salt": bad})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "cache_salt", "on chat completions too"
    assert server.calls == [], "a refused request reaches nothing"


def test_the_rollout_server_salts_the_namespace_checks_the_salt_and_its_old_callers_are_unsalted() -> None:
    cfg = parse_config({"model": {"vocab_size": 512}})
    server = bare_server(cfg)
    weights = cfg.kv_namespace(server.weight_version)
    spec, _ = server._prepare("plain", PROMPT, {"max_tokens": 2}, None)
    assert spec.namespace == weights, "a caller without cache_salt is keyed as before"
    first, _ = server._prepare("a", PROMPT, {"max_tokens": 2}, None, None, "tenant-a")
    again, _ = server._prepare("b", PROMPT, {"max_tokens": 2}, None, None, "tenant-a")
    other, _ = server._prepare("c", PROMPT, {"max_tokens": 2}, None, None, "tenant-b")
    assert first.namespace == again.namespace != weights, "one salt: one namespace of its own, shared by its turns"
    assert other.namespace != first.namespace, "another salt: another namespace (no shared cached prefix)"
    assert unsalted_namespace(other.namespace) == weights, "the weights' namespace is still read out of a salted one"
    with pytest.raises(RequestError) as refused:
        server._prepare("bad", PROMPT, {"max_tokens": 2}, "conv-1", None, 7)
    assert refused.value.field == "cache_salt", "a bad salt is the caller's error naming the field"
    assert len(server.sessions) == 0, "and the refused turn left no session turn counted"
