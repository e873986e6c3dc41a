"""OpenAI's /v1/completions and /v1/chat/completions request bodies, checked into one
`GenerationRequest`, and the response, chunk and error objects (pure: no Ray, no HTTP).

A field this server cannot honour is a 400 naming it, never silently ignored: `n` samples of
each prompt are n turns of their own (sample j seeded `seed` + j, not streamed, not in a session;
sent together, so with scheduler.share_in_flight one computes the prompt and the others read it),
at most `max_prompts` turns in all; sampled-token log-probs only (`logprobs` 0 /
`top_logprobs` 0), no presence/frequency penalties, no string stops (stops are token ids:
`stop_token_ids`). vLLM's extra sampling fields `top_k`, `min_p` and `repetition_penalty` are
honoured (checked by api/validation.py, as the token API checks them). A completions `prompt` is one string, one
list of token ids, or a list of token-id lists (one choice each, not streamed, not in a session).
`session_id` (or OpenAI's `conversation_id`) puts the request on its conversation's request ids
(api/sessions.py). `return_token_ids` (vLLM's field) adds `token_ids` (the generated ids) and, on
a whole response, `prompt_token_ids` to every choice; a server without a tokenizer always does.
`cache_salt` (vLLM's field) keeps the request's cached prefixes apart from those of requests with
another salt (api/cache_salt.py). A completions batch holds at most `max_prompts` prompts (the
endpoint's --max-prompts): each prompt is a turn of its own on the cluster.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dualpath_ray.api.http_limits import DEFAULT_MAX_PROMPTS
from dualpath_ray.api.sessions import check_session_id
from dualpath_ray.api.validation import RequestError, check_cache_salt, validate_next_turn_hint

# Fields accepted only at the value that means "off".
_NEUTRAL = {
    "best_of": (1, None), "echo": (False, None), "suffix": (None, ""),
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None,),
    "stop": (None,), "tools": (None,), "tool_choice": (None, "none"), "top_logprobs": (0, None),
    "parallel_tool_calls": (None, False),
}
# vLLM's sampling fields beyond OpenAI's, passed to api/validation.py as they are sent.
_EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty")
_NEUTRAL_HINTS = {
    "stop": " (stops are token ids here: use stop_token_ids)",
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", *_EXTRA_SAMPLING, "seed", "stream", "stream_options", "user",
           "metadata", "store", "session_id", "conversation_id", "stop_token_ids", "return_token_ids", "expect_next_turn_s",
           "cache_salt", "n", *_NEUTRAL}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "max_completion_tokens", "response_format"}
ROLES = ("system", "user", "assistant", "tool", "developer")


class APIError(ValueError):
    """An OpenAI-shaped error: HTTP status, message, the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: a text prompt or token-id prompts, and how to sample them."""

    chat: bool
    model: str
    prompt_text: str | None
    prompt_ids: tuple[tuple[int, ...], ...] | None  # one or more token-id prompts, one choice each
    sampling: dict[str, Any]  # api/validation.py's sampling keys
    stream: bool
    include_usage: bool
    session_id: str | None
    log_probs: bool
    return_token_ids: bool = False
    # The caller's hint that the session sends its next turn about this many seconds after this
    # one ends (its tool runs meanwhile): the next turn's KV is staged (scheduling/staging.py).
    expect_next_turn_s: float | None = None
    cache_salt: str | None = None  # the request's own salt (the tenant's is added by the endpoint)
    samples: int = 1  # `n`: choices per prompt, each a turn of its own seeded seed + j


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise APIError(f"{key} must be a number in [{low}, {high}] (got {value!r})", key)
    return float(value)


def _int_or_none(body: Mapping[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise APIError(f"{key} must be an integer >= {low} (got {value!r})", key)
    return value


def _check_fields(body: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(f"unknown field {unknown[0]!r}; this server accepts {sorted(allowed)}", unknown[0])
    for key, values in _NEUTRAL.items():
        if key in body and body[key] not in values:
            hint = _NEUTRAL_HINTS.get(key, "")
            raise APIError(f"{key} = {body[key]!r} is not supported; send {values[0]!r} or leave it out{hint}", key)


def _session(body: Mapping[str, Any]) -> str | None:
    if body.get("session_id") is not None and body.get("conversation_id") is not None:
        raise APIError("send session_id or conversation_id, not both", "conversation_id")
    for key in ("session_id", "conversation_id"):
        if body.get(key) is not None:
            try:
                return check_session_id(body[key], key)
            except ValueError as exc:
                raise APIError(str(exc), key) from None
    return None


def _next_turn_hint(body: Mapping[str, Any]) -> float | None:
    try:
        return validate_next_turn_hint(body.get("expect_next_turn_s"))
    except ValueError as exc:
        raise APIError(str(exc), "expect_next_turn_s") from None


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    try:
        return check_cache_salt(body.get("cache_salt"))
    except RequestError as exc:
        raise APIError(str(exc), "cache_salt") from None


def _stream_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
        raise APIError("stream_options must be {'include_usage': bool}", "stream_options")
    return bool(options.get("include_usage", False))


def _request_seed(body: Mapping[str, Any]) -> int:
    """The request's seed, or one drawn for it when it sends none (OpenAI's and vLLM's meaning of
    no seed): with a fixed default, every unseeded request of one prompt at temperature > 0
    sampled the same tokens, so n clients' samples (or GRPO's group) were one sample."""
    seed = _int_or_none(body, "seed", 0)
    return secrets.randbits(62) if seed is None else seed


def _sampling(body: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any]:
    stops = body.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise APIError(f"stop_token_ids must be a list of token ids (got {stops!r})", "stop_token_ids")
    sampling: dict[str, Any] = {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0), "top_p": _number(body, "top_p", 1.0, 1e-9, 1.0),
        "seed": _request_seed(body), "stop_token_ids": list(stops),
    }
    sampling.update({key: body[key] for key in _EXTRA_SAMPLING if body.get(key) is not None})
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    return sampling


def _model(body: Mapping[str, Any], served: str) -> str:
    model = body.get("model")
    if model != served:
        raise APIError(f"model {model!r} does not exist; this server serves {served!r}", "model", 404,
                       code="model_not_found")
    return served


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(body: Mapping[str, Any], max_prompts: int) -> tuple[str | None, tuple[tuple[int, ...], ...] | None]:
    """A completions prompt: (text, None) or (None, token-id prompts). The count of a batch is
    checked before any of its prompts is looked at."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt, None
    if _is_token_list(prompt):
        return None, (tuple(prompt),)
    if isinstance(prompt, list) and len(prompt) > max_prompts:
        raise APIError(f"prompt holds {len(prompt)} prompts, over this server's limit of {max_prompts} per request "
                       "(each is a turn of its own); send them in several requests, or restart `dualpath serve` "
                       "with a larger --max-prompts", "prompt")
    if isinstance(prompt, list) and prompt and all(_is_token_list(p) for p in prompt):
        if len(prompt) > 1 and body.get("stream"):
            raise APIError("a streamed request takes one prompt; send each token-id list as its own request", "stream")
        if len(prompt) > 1 and _session(body) is not None:
            raise APIError("a session's turn is one prompt; send each token-id list as its own request", "prompt")
        return None, tuple(tuple(p) for p in prompt)
    raise APIError("prompt must be one non-empty string, one non-empty list of token ids, or a list of such lists",
                   "prompt")


def _samples(body: Mapping[str, Any], prompts: int, max_prompts: int) -> int:
    """`n`: samples of each prompt, each a turn of its own; with the prompts, at most `max_prompts` turns."""
    n = _int_or_none(body, "n", 1)
    if n is None or n == 1:
        return 1
    if body.get("stream"):
        raise APIError("a streamed request takes one sample (n = 1); send n requests, or leave stream out", "n")
    if _session(body) is not None:
        raise APIError("a session's turn is one sample (n = 1); send n requests outside the session", "n")
    if n * prompts > max_prompts:
        raise APIError(f"n = {n} samples of {prompts} prompt(s) is {n * prompts} turns, over this server's limit of "
                       f"{max_prompts} per request; send fewer, or restart `dualpath serve` with a larger --max-prompts",
                       "n")
    return n


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value not in (None, True, False):
        raise APIError(f"{key} must be a boolean (got {value!r})", key)
    return bool(value)


def parse_completion(body: Any, served_model: str, max_prompts: int = DEFAULT_MAX_PROMPTS) -> GenerationRequest:
    """A /v1/completions body: `prompt` is one string, one list of token ids, or a list of at
    most `max_prompts` of them."""
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object", None)
    _check_fields(body, COMPLETION_FIELDS)
    model = _model(body, served_model)
    text, ids = _prompt(body, max_prompts)
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0):
        raise APIError("logprobs must be 0 (the sampled tokens' log-probs) or null; top alternatives are not "
                       "returned", "logprobs")
    max_tokens = _int_or_none(body, "max_tokens", 1)
    samples = _samples(body, 1 if ids is None else len(ids), max_prompts)
    return GenerationRequest(False, model, text, ids, _sampling(body, 16 if max_tokens is None else max_tokens),
                             bool(body.get("stream", False)), _stream_usage(body), _session(body), logprobs == 0,
                             _flag(body, "return_token_ids"), _next_turn_hint(body), _cache_salt(body), samples)


def _message_text(message: Any, index: int) -> dict[str, str]:
    field = f"messages[{index}]"
    if not isinstance(message, Mapping) or message.get("role") not in ROLES:
        raise APIError(f"{field} must be an object with role in {list(ROLES)}", f"{field}.role")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise APIError(f"{field}.content parts must be text parts", f"{field}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(f"{field}.content must be a string or a list of text parts", f"{field}.content")
    return {"role": str(message["role"]), "content": content}


def parse_chat(
    body: Any, served_model: str, max_prompts: int = DEFAULT_MAX_PROMPTS,
) -> tuple[GenerationRequest, list[dict[str, str]]]:
    """A /v1/chat/completions body, and its messages as {role, content} text."""
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object", None)
    _check_fields(body, CHAT_FIELDS)
    model = _model(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", "messages")
    texts = [_message_text(m, i) for i, m in enumerate(messages)]
    if body.get("response_format") not in (None, {"type": "text"}):
        raise APIError("response_format must be {'type': 'text'}", "response_format")
    if body.get("logprobs") not in (None, True, False):
        raise APIError("logprobs must be a boolean", "logprobs")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise APIError("send max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int_or_none(body, key, 1)
    request = GenerationRequest(True, model, "", None, _sampling(body, max_tokens), bool(body.get("stream", False)),
                                _stream_usage(body), _session(body), bool(body.get("logprobs")),
                                _flag(body, "return_token_ids"), _next_turn_hint(body), _cache_salt(body),
                                _samples(body, 1, max_prompts))
    return request, texts


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens served from stored KV as cached_tokens."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(tokens: list[str], log_probs: list[float]) -> dict[str, Any]:
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": log_probs, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], log_probs: list[float]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, log_probs)]}


def response_object(request: GenerationRequest, request_id: str, text: str, finish: str | None,
                    logprobs: dict[str, Any] | None, usage_: dict[str, Any] | None, chunk: bool,
                    first: bool = False, token_ids: Sequence[int] | None = None,
                    prompt_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """A whole response (chunk=False) or one stream chunk, completions or chat shaped; a
    chat stream's first chunk names the role. `token_ids` / `prompt_token_ids`, when given,
    go into the choice as vLLM's return_token_ids puts them (extra fields the `openai` client
    keeps on the choice)."""
    if request.chat:
        body: dict[str, Any] = {"content": text} if chunk and not first else {"role": "assistant", "content": text}
        choice = {"index": 0, ("delta" if chunk else "message"): body, "logprobs": logprobs, "finish_reason": finish}
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        kind = "text_completion"
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    result: dict[str, Any] = {"id": request_id, "object": kind, "created": int(time.time()), "model": request.model,
                              "choices": [choice]}
    if usage_ is not None:
        result["usage"] = usage_
    if request.session_id is not None:
        result["session_id"] = request.session_id
    return result


def usage_chunk(request: GenerationRequest, request_id: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": request.model, "choices": [],
            "usage": usage_}


def batch_response(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One response of a batch of prompts: the first part's envelope, every part's choice
    indexed in prompt order, the usages added up."""
    whole = dict(parts[0])
    whole["choices"] = [{**part["choices"][0], "index": i} for i, part in enumerate(parts)]
    total = usage(0, 0, 0)
    for part in parts:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[key] += part["usage"][key]
        total["prompt_tokens_details"]["cached_tokens"] += part["usage"]["prompt_tokens_details"]["cached_tokens"]
    whole["usage"] = total
    return whole


def no_tokenizer(field: str) -> APIError:
    """A text prompt sent to a server that runs without a tokenizer (token-ids mode)."""
    return APIError(
        f"{field}: this server has no tokenizer (token-ids mode: `dualpath serve` found no tokenizer.json in "
        "model.weights_dir and got no --tokenizer), so it cannot encode text; send prompt as a list of token ids "
        "to /v1/completions, or restart `dualpath serve` with --tokenizer DIR (a Hugging Face tokenizer.json) or "
        "model.weights_dir set to the model's directory", field, code="tokenizer_not_configured",
    )


def prompt_too_long(field: str, amount: str, limit: str) -> APIError:
    """A prompt refused on its length alone, before it is tokenized or sent anywhere."""
    return APIError(f"{field} is {amount}: more than the model's context can hold ({limit}); shorten it", field,
                    code="context_length_exceeded")
