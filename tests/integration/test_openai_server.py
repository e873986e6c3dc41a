"""The OpenAI-compatible endpoint with the real `openai` client against an embedded 1P1D
cluster: a real tokenizer from the model's directory, completions and chat, SSE streaming,
sessions whose prefix reuse grows turn by turn, a session aborted mid-stream, and 400s that
name the bad field. A second endpoint on the same deployment runs as `dualpath serve` does on
the embedded defaults (no tokenizer files: token ids only) with two API keys: two tenants, whose
identical prompts never hit each other's cached blocks."""

from __future__ import annotations

import urllib.request

import pytest

from tests.helpers import runtime_config

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")

import ray  # noqa: E402

from dualpath_ray.api.api_keys import ApiKeys  # noqa: E402
from dualpath_ray.api.openai_server import OpenAIServer, start_openai_server, tokenizer_dir  # noqa: E402
from dualpath_ray.api.tokenizer import HFTokenizer  # noqa: E402
from tests.tokenizer_factory import SENTENCES, model_dir_with_tokenizer  # noqa: E402

pytestmark = pytest.mark.integration
MODEL = "dualpath-tiny"
# Over two 64-token blocks, so a conversation's second turn already hits stored blocks.
SYSTEM = " ".join(SENTENCES * 3)
KEY = "sk-dualpath-test"
OTHER_KEY = "sk-dualpath-other-tenant"


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory, shared_cluster):
    base = runtime_config(transport="gloo", verify_kv=False)
    model_dir = model_dir_with_tokenizer(base, tmp_path_factory.mktemp("model"))
    cfg = base.with_overrides(model={"weights_dir": str(model_dir)})
    with shared_cluster.deployed(cfg, "dualpath") as cluster:
        cluster.server()
        actor, url = start_openai_server(cfg, "127.0.0.1", 0)
        client = openai.OpenAI(base_url=url, api_key="not-checked", max_retries=0, timeout=120)
        yield cluster, client, HFTokenizer.from_dir(model_dir, cfg.model.vocab_size)
        ray.kill(actor, no_restart=True)


@pytest.fixture(scope="module")
def ids_endpoint(endpoint):
    """The base URL of an endpoint as `dualpath serve` starts it on the embedded defaults (no
    model.weights_dir, so no tokenizer) with two keys (--api-key-file): an unnamed second endpoint actor on the
    same deployment (the first holds the endpoint's name; the second also writes the restart
    record of that name, which nothing reads here: no endpoint in this module is restarted)."""
    cfg = runtime_config(transport="gloo", verify_kv=False)
    assert tokenizer_dir(cfg, None) is None, "the embedded defaults configure no tokenizer"
    actor = OpenAIServer.remote(cfg, None, ApiKeys.of([KEY, OTHER_KEY]))
    host, port = ray.get(actor.start.remote("127.0.0.1", 0))
    yield f"http://{host}:{port}"
    ray.kill(actor, no_restart=True)


def test_models_and_a_completion_match_the_token_api(endpoint) -> None:
    cluster, client, tokenizer = endpoint
    assert [m.id for m in client.models.list().data] == [MODEL], "the served model is listed under its model id"
    prompt = "tell me a story about a cat"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    direct = ray.get(cluster.server().generate.remote("direct-1", tokenizer.encode(prompt), {"max_tokens": 8}))
    choice = done.choices[0]
    assert choice.text == tokenizer.decode(direct.token_ids), "the text is the tokenizer's decoding of the generated ids"
    assert done.usage.prompt_tokens == len(tokenizer.encode(prompt)), "the prompt was tokenized by the model's tokenizer"
    assert done.usage.completion_tokens == len(direct.token_ids), "usage counts the generated tokens"
    assert choice.logprobs.token_logprobs == pytest.approx(direct.log_probs, abs=1e-5), "log-probs of the sampled tokens"
    assert choice.finish_reason in ("stop", "length"), "an OpenAI finish reason"


def test_chat_streams_the_same_text_as_a_whole_response(endpoint) -> None:
    _, client, _ = endpoint
    messages = [{"role": "system", "content": "the agent reads the file"}, {"role": "user", "content": "tell me a story"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant", "a chat response is the assistant's message"
    assert text == whole.choices[0].message.content, "the streamed deltas add up to the whole response"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1, "the text arrives in several chunks"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens, "the last chunk carries the usage"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason, (
        "the stream ends with the same finish reason"
    )


def test_a_session_reuses_its_growing_prefix(endpoint) -> None:
    _, client, _ = endpoint
    messages = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"{SENTENCES[turn]} {SENTENCES[turn + 1]} {SENTENCES[turn + 2]}"})
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"session_id": "chat-7"})
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert cached[0] == 0, "the first turn has nothing stored"
    assert cached[1] > 0 and cached[2] > cached[1], f"each later turn hits more of its growing prefix: {cached}"


def test_aborting_a_session_ends_its_stream(endpoint) -> None:
    cluster, client, tokenizer = endpoint
    server = cluster.server()
    # As many new tokens as the context holds, and the abort goes out at the first chunk: on a
    # loaded 2-core CI runner chunks reach the client late, and a 600-token turn was once done
    # before its third chunk was read.
    prompt = "the agent reads the file"
    longest = cluster.cfg.model.max_context - len(tokenizer.encode(prompt)) - 8
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=longest,
                                       temperature=0, stream=True, extra_body={"conversation_id": "conv-abort"})
    finish = None
    for index, chunk in enumerate(stream):
        if index == 0:
            assert ray.get(server.abort_session.remote("conv-abort")) == 1, "the session's turn was in flight"
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "abort", "the stream ends with the abort as its finish reason"
    refused = client.completions.create(model=MODEL, prompt="the agent", max_tokens=4,
                                        extra_body={"conversation_id": "conv-abort"})
    assert refused.choices[0].finish_reason == "abort", "an aborted conversation's later turns are refused"
    ray.get(server.resume_session.remote("conv-abort"))
    again = client.completions.create(model=MODEL, prompt="the agent", max_tokens=4, extra_body={"conversation_id": "conv-abort"})
    assert again.choices[0].finish_reason in ("stop", "length"), "a resumed conversation runs again"


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 100_000}, "n"),  # n samples are turns of their own, at most --max-prompts of them
    ({"stop": ["\n"]}, "stop"),
    ({"extra_body": {"beam_width": 2}}, "beam_width"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"extra_body": {"cache_salt": ""}}, "cache_salt"),
])
def test_a_bad_request_is_a_400_naming_the_field(endpoint, kwargs, field) -> None:
    _, client, _ = endpoint
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="the agent", **{"max_tokens": 4, **kwargs})
    assert caught.value.status_code == 400, "bad input is the client's error"
    assert caught.value.body["param"] == field, f"the error names the field {field}"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="the agent", max_tokens=4)


def test_token_ids_mode_behind_an_api_key_with_the_openai_client(endpoint, ids_endpoint) -> None:
    cluster = endpoint[0]
    client = openai.OpenAI(base_url=f"{ids_endpoint}/v1", api_key=KEY, max_retries=0, timeout=120)
    prompt = [5, 17, 42, 99, 3, 250]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    direct = ray.get(cluster.server().generate.remote("ids-direct", prompt, {"max_tokens": 6}))
    choice = done.choices[0]
    assert choice.token_ids == list(direct.token_ids), "the key was accepted and the choice carries the generated ids"
    assert choice.prompt_token_ids == prompt and choice.text == "", "no tokenizer: ids, and an empty text"
    batch = client.completions.create(model=MODEL, prompt=[prompt, prompt[:3]], max_tokens=2, temperature=0)
    assert [len(c.token_ids) for c in batch.choices] == [2, 2], "a list of token-id lists: one choice per prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="tell me a story", max_tokens=2)
    assert caught.value.body["code"] == "tokenizer_not_configured", "a text prompt is a 400 naming the tokenizer"
    wrong = openai.OpenAI(base_url=f"{ids_endpoint}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    with urllib.request.urlopen(f"{ids_endpoint}/health", timeout=60) as health:
        assert health.status == 200, "/health answers without the key"


def test_two_tenants_never_hit_each_others_cached_prefix(ids_endpoint) -> None:
    """usage.cached_tokens tells a tenant only about its own prompts: the same prompt, cached for
    one key, is all misses for the other."""
    prompt = [(i * 7) % 240 + 5 for i in range(200)]  # over three 64-token blocks
    tenants = {key: openai.OpenAI(base_url=f"{ids_endpoint}/v1", api_key=key, max_retries=0, timeout=120)
               for key in (KEY, OTHER_KEY)}

    def cached(key: str) -> int:
        done = tenants[key].completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        return done.usage.prompt_tokens_details.cached_tokens

    assert cached(KEY) == 0, "the first sending has nothing stored"
    assert cached(KEY) > 0, "the same tenant's second sending hits its stored prefix"
    assert cached(OTHER_KEY) == 0, "another tenant's identical prompt hits none of it"
