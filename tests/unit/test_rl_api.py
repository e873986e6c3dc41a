"""The RL front ends' pure parts: sampling keys as verl/vLLM send them, session request ids, the
OpenAI request checks and response shapes, the tokenizer's chat template and incremental
detokenizing, OpenRLHF's per-sample seeds, verl's control methods on a fake server. No Ray."""

from __future__ import annotations

import asyncio

import pytest

from dualpath_ray.api.openai_protocol import APIError, parse_chat, parse_completion, response_object, usage
from dualpath_ray.api.openrlhf_adapter import sample_seeds, sampling_dict
from dualpath_ray.api.sessions import SessionIds, check_session_id
from dualpath_ray.api.validation import RequestError, parse_sampling_request, with_request_seed
from dualpath_ray.api.verl_server import VerlServerControl

MODEL = "dualpath-tiny"


def test_verl_agent_loop_sampling_is_accepted_and_log_probs_follow_vllm() -> None:
    verl = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    parsed = parse_sampling_request("r", verl, 16)
    assert parsed.params.max_new_tokens == 16 and not parsed.want_log_probs, "verl's logprobs=False: none returned"
    assert parse_sampling_request("r", {"logprobs": 0}, 16).want_log_probs, "vLLM's logprobs=0: the sampled token's"
    assert parse_sampling_request("r", {}, 16).want_log_probs, "by default log-probs are returned"


def test_a_server_request_without_a_seed_draws_its_own_as_vllm_does() -> None:
    verl = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    seeds = {parse_sampling_request(f"r{i}", with_request_seed(verl), 16).params.seed for i in range(8)}
    assert len(seeds) == 8, "verl's G samples of one prompt send no seed: each request gets its own, so they differ"
    assert with_request_seed({**verl, "seed": None})["seed"] not in seeds, "seed None is no seed"
    assert with_request_seed({**verl, "seed": 7})["seed"] == 7, "a seed sent is kept (reproducible)"
    assert "seed" not in verl and with_request_seed(None)["seed"] >= 0, "the caller's dict is not changed; None is {}"


def test_top_k_min_p_and_repetition_penalty_reach_the_sampling_params() -> None:
    parsed = parse_sampling_request("r", {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "n": 1}, 16).params
    assert (parsed.top_k, parsed.min_p, parsed.repetition_penalty) == (5, 0.05, 1.2), "each knob as sent"
    off = parse_sampling_request("r", {"top_k": None, "min_p": None, "repetition_penalty": None}, 16).params
    assert (off.top_k, off.min_p, off.repetition_penalty) == (-1, 0.0, 1.0), "None is vLLM's off, our defaults"
    assert parse_sampling_request("r", {"top_k": 0}, 16).params.top_k == 0, "top_k 0 is vLLM's off too"


@pytest.mark.parametrize("params, field, fix", [
    ({"top_k": -2}, "top_k", "-1 or 0 for off"), ({"top_k": 2.5}, "top_k", "must be an int"),
    ({"min_p": 1.5}, "min_p", "in \\[0, 1\\]"), ({"min_p": "0.1"}, "min_p", "a number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty", "finite"),
    ({"repetition_penalty": True}, "repetition_penalty", "number"),
    ({"n": 2}, "n", "send n samples as n requests"), ({"ignore_eos": True}, "ignore_eos", "stop_token_ids"),
    ({"temperature": True}, "temperature", "in \\[0, 100\\]"), ({"logprobs": "yes"}, "logprobs", "bool or an int"),
    ({"beam": 1}, "beam", "allowed"),
])
def test_a_bad_sampling_value_is_an_error_naming_the_field_and_the_fix(params, field, fix) -> None:
    with pytest.raises(RequestError, match=fix) as caught:
        parse_sampling_request("r", params, 16)
    assert caught.value.field == field, "the error carries the field it is about"
    assert f"{field}" in str(caught.value), "the message names the field"


def test_session_turns_share_one_prefix_and_never_repeat() -> None:
    ids = SessionIds()
    turns = [ids.next_turn("chat-1") for _ in range(3)]
    assert turns == ["chat-1/t0", "chat-1/t1", "chat-1/t2"], "one request id per turn under the session's prefix"
    assert ids.next_turn("chat-2") == "chat-2/t0", "sessions are numbered separately"
    with pytest.raises(RequestError, match="session_id"):
        check_session_id("a/b")


def test_completion_and_chat_bodies_are_checked_into_one_request() -> None:
    request = parse_completion({"model": MODEL, "prompt": "hi", "max_tokens": 3, "session_id": "s1", "seed": 4}, MODEL)
    assert (request.prompt_text, request.sampling["max_tokens"], request.session_id) == ("hi", 3, "s1")
    assert request.sampling["seed"] == 4 and request.sampling["temperature"] == 1.0, "OpenAI's default temperature"
    chat, messages = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                 "max_completion_tokens": 2, "conversation_id": "c"}, MODEL)
    assert messages == [{"role": "user", "content": "a"}] and chat.sampling["max_tokens"] == 2, "text parts joined"
    assert chat.session_id == "c", "conversation_id is the session"


@pytest.mark.parametrize("body, field, status", [
    ({"model": "other", "prompt": "x"}, "model", 404),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt", 400),
    ({"model": MODEL, "prompt": "x", "logprobs": 3}, "logprobs", 400),
    ({"model": MODEL, "prompt": "x", "stop": "\n"}, "stop", 400),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, "temperature", 400),
    ({"model": MODEL, "prompt": "x", "session_id": "s", "conversation_id": "c"}, "conversation_id", 400),
    ({"model": MODEL, "prompt": "x", "stream_options": {"x": 1}}, "stream_options", 400),
    ({"model": MODEL, "prompt": "x", "n": 2, "stream": True}, "n", 400),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n", 400),
])
def test_a_bad_body_is_an_openai_error_naming_the_field(body, field, status) -> None:
    with pytest.raises(APIError) as caught:
        parse_completion(body, MODEL)
    error = caught.value.body()["error"]
    assert (error["param"], caught.value.status) == (field, status), "OpenAI's error shape names the field"


def test_openai_bodies_carry_vllms_extra_sampling_fields_and_n_samples_where_a_request_may_be_several_turns() -> None:
    request = parse_completion({"model": MODEL, "prompt": "x", "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1}, MODEL)
    assert {k: request.sampling[k] for k in ("top_k", "min_p", "repetition_penalty")} == {
        "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1}, "vLLM's extra fields go on to api/validation.py as sent"
    assert "top_k" not in parse_completion({"model": MODEL, "prompt": "x"}, MODEL).sampling, "absent stays absent"
    assert parse_completion({"model": MODEL, "prompt": "x", "n": 3}, MODEL).samples == 3, "n samples, a turn each"
    with pytest.raises(APIError, match="send n requests") as caught:
        parse_completion({"model": MODEL, "prompt": "x", "n": 3, "stream": True}, MODEL)
    assert caught.value.param == "n", "n > 1 in a stream (one turn) is refused by name, with the fix"


def test_openrlhf_vllm_sampling_objects_carry_every_knob() -> None:
    class VllmLike:
        temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, seed, n = 0.7, 0.9, 20, 0.05, 1.1, 7, 3, 1

    parsed = parse_sampling_request("r", sampling_dict(VllmLike()), 16).params
    assert (parsed.top_k, parsed.min_p, parsed.repetition_penalty) == (20, 0.05, 1.1), (
        "a vLLM SamplingParams' top_k, min_p and repetition_penalty reach ours"
    )


def test_responses_have_openai_shapes_and_report_cached_tokens() -> None:
    chat, _ = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "session_id": "s"}, MODEL)
    whole = response_object(chat, "id1", "hello", "stop", None, usage(10, 2, 8), chunk=False)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 8, "hits are reported as cached tokens"
    assert whole["session_id"] == "s", "the session is echoed"
    first = response_object(chat, "id1", "", None, None, None, chunk=True, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}, "a chat stream opens with the role"


def test_openrlhf_sampling_objects_and_per_sample_seeds() -> None:
    class Params:
        temperature, top_p, max_tokens, seed = 0.5, 0.9, 7, 3

    assert sampling_dict(Params()) == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "seed": 3}
    assert sample_seeds(3, 10, None) == [10, 11, 12], "by default each sample gets base + index"
    assert sample_seeds(2, 0, [5, 5]) == [5, 5], "explicit seeds are kept"
    with pytest.raises(RequestError, match="seeds"):
        sample_seeds(2, 0, [1])


def test_tokenizer_chat_template_and_incremental_detokenizer(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from dualpath_ray.api.tokenizer import DEFAULT_CHAT_TEMPLATE, HFTokenizer, IncrementalDetokenizer, TokenizerError
    from tests.tokenizer_factory import train_tokenizer

    train_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer.from_dir(tmp_path, 512)
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE, "no tokenizer_config.json: the documented template"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert text == "<|user|>\nthe cat\n<|assistant|>\n", "one block per message, then the assistant's turn"
    ids = tokenizer.encode("the agent reads the file")
    pieces = IncrementalDetokenizer(tokenizer)
    streamed = "".join(pieces.push([t]) for t in ids) + pieces.push([], final=True)
    assert streamed == tokenizer.decode(ids), "the pieces add up to the whole decoding"
    with pytest.raises(TokenizerError, match="vocab_size"):
        HFTokenizer.from_dir(tmp_path, 100)


class FakeServer:
    """The part of the rollout-server verl's control methods use (`ServerCore`), recording calls."""

    def __init__(self, in_flight: dict[str, str] | None = None) -> None:
        self.in_flight: dict[str, str] = dict(in_flight or {})
        self.calls: list[str] = []

    async def abort(self, request_id: str) -> bool:
        self.calls.append(f"abort {request_id}")
        return self.in_flight.pop(request_id, None) is not None

    async def abort_all(self) -> int:
        self.calls.append("abort_all")
        aborted = len(self.in_flight)
        self.in_flight.clear()
        return aborted

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> int:
        self.calls.append("sleep")
        return 0

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append("wake_up")


def test_verl_abort_all_requests_holds_new_requests_until_resume_generation() -> None:
    async def scenario() -> None:
        server = FakeServer({"b": "s-b", "a": "s-a"})
        verl = VerlServerControl(server)
        result = await verl.abort_all_requests()
        assert result == {"aborted_count": 2, "request_ids": ["a", "b"]}, "verl's result: the count and the ids"
        assert server.calls == ["abort_all", "reset_prefix_cache"], "the prefix cache is reset by default"
        waiting = asyncio.ensure_future(verl.admit())
        await asyncio.sleep(0.01)
        assert not waiting.done(), "a request arriving behind the closed gate waits"
        await verl.resume_generation()
        assert await asyncio.wait_for(waiting, 1.0), "resume_generation lets the waiting request run"

    asyncio.run(scenario())


def test_verl_abort_all_requests_can_reject_arrivals_and_keep_the_prefix_cache() -> None:
    async def scenario() -> None:
        server = FakeServer()
        verl = VerlServerControl(server)
        await verl.abort_all_requests(reset_prefix_cache=False, reject_request=True)
        assert server.calls == ["abort_all"], "reset_prefix_cache=False keeps the prefix cache"
        assert not await asyncio.wait_for(verl.admit(), 1.0), "reject_request: arrivals are answered at once"
        await verl.open_submission_gate()
        assert await verl.admit(), "an open gate admits"

    asyncio.run(scenario())


def test_verl_abort_request_and_the_kv_cache_hooks_go_to_the_server() -> None:
    async def scenario() -> None:
        server = FakeServer({"r": "s-r"})
        verl = VerlServerControl(server)
        missing = await verl.abort_request("x")
        assert missing == {"aborted": False, "request_id": "x", "error": "Request x not found"}
        assert await verl.abort_request("r", reset_prefix_cache=False) == {"aborted": True, "request_id": "r"}
        await verl.clear_kv_cache()
        await verl.release_kv_cache()
        await verl.resume_kv_cache()
        assert server.calls == ["abort x", "abort r", "reset_prefix_cache", "sleep", "wake_up"]

    asyncio.run(scenario())


def test_verl_drain_global_steps_and_server_address() -> None:
    async def scenario() -> None:
        server = FakeServer({"r": "s-r"})
        verl = VerlServerControl(server)
        draining = asyncio.ensure_future(verl.wait_for_requests_to_drain(poll_s=0.001))
        await asyncio.sleep(0.01)
        assert not draining.done(), "drain waits while a request is in flight"
        server.in_flight.clear()
        await asyncio.wait_for(draining, 1.0)
        assert verl.global_steps is None and verl.server_address() is None, "nothing set yet"
        verl.set_global_steps(7)
        verl.set_server_address("10.0.0.1", "8000")  # type: ignore[arg-type]
        assert verl.global_steps == 7 and verl.server_address() == ("10.0.0.1", 8000), "the port is an int"

    asyncio.run(scenario())
