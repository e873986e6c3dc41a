"""Validation of what a caller sends: prompts and sampling parameters, with errors that name the
request and the field.

Sampling keys are vLLM's names as verl's agent loop and OpenRLHF send them, with vLLM's ranges
and "off" values (`top_k` -1/0, `min_p` 0, `repetition_penalty` 1.0). `n` is accepted at 1 only
(a request id is one sample: n samples are n requests) and `ignore_eos` at false only (stops are
the caller's `stop_token_ids`); any other value is an error, never silently ignored.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.index import salted_namespace
from dualpath_ray.protocol.messages import RequestSpec, SamplingParams

# Keys that are only accepted at one value, and why.
_NEUTRAL_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1, None), ("one request id is one sample; send n samples as n requests, each with its own request id "
                      "(and seed)")),
    "ignore_eos": ((False, None), ("no eos is implied here: a request stops only at the stop_token_ids it sends "
                                   "or at max_tokens, so leave eos out of stop_token_ids instead")),
}
# Long enough for any random token (vLLM suggests 43 base64 characters, 256 bits).
MAX_CACHE_SALT_CHARS = 1024
# verl's generate passes these; a value other than None means multimodal input, which the
# decoder here does not take.
_MULTIMODAL_KWARGS = ("image_data", "video_data", "audio_data", "mm_processor_kwargs")
_SAMPLING_KEYS = {
    "max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
    "stop_token_ids", "logprobs", *_NEUTRAL_VALUES,
}


class RequestError(ValueError):
    """One request's arguments are invalid; the message names the request and the field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[RequestError], tuple[str, str | None]]:
        # Ray pickles a remote call's exception; keep the field across that.
        return (type(self), (str(self), self.field))


@dataclass(frozen=True)
class ParsedSampling:
    """SamplingParams plus whether the caller asked for log-probs (vLLM's `logprobs` key)."""

    params: SamplingParams
    want_log_probs: bool


def validate_prompt(request_id: str, prompt_ids: Sequence[int], max_new_tokens: int, model: ModelConfig) -> np.ndarray:
    if len(prompt_ids) == 0:
        raise RequestError(f"request {request_id}: prompt_ids is empty; send at least one token", "prompt")
    prompt = np.asarray(prompt_ids)
    if not np.issubdtype(prompt.dtype, np.integer):
        raise RequestError(f"request {request_id}: prompt_ids must be integers (got {prompt.dtype})", "prompt")
    bad = np.flatnonzero((prompt < 0) | (prompt >= model.vocab_size))
    if bad.size:
        i = int(bad[0])
        raise RequestError(
            f"request {request_id}: prompt_ids[{i}] = {int(prompt[i])} is outside the vocabulary "
            f"[0, {model.vocab_size})", "prompt",
        )
    if len(prompt) + max_new_tokens > model.max_context:
        raise RequestError(
            f"request {request_id}: prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) "
            f"exceeds the model's context of {model.max_context}; shorten the prompt or max_tokens", "max_tokens",
        )
    return prompt.astype(np.int32)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_neutral(request_id: str, params: Mapping[str, Any]) -> None:
    for key, (allowed, why) in _NEUTRAL_VALUES.items():
        if key in params and params[key] not in allowed:
            raise RequestError(
                f"request {request_id}: sampling_params.{key} = {params[key]!r} is not supported ({why}); "
                f"send {allowed[0]!r} or leave it out", key,
            )


def _filters(request_id: str, params: Mapping[str, Any]) -> tuple[int, float, float]:
    """top_k, min_p and repetition_penalty, None meaning off, in vLLM's ranges."""
    top_k = params.get("top_k")
    top_k = -1 if top_k is None else top_k
    if not _is_int(top_k) or top_k < -1:
        raise RequestError(
            f"request {request_id}: sampling_params.top_k must be an int, -1 or 0 for off or >= 1 tokens kept "
            f"(got {top_k!r})", "top_k",
        )
    min_p = params.get("min_p")
    min_p = 0.0 if min_p is None else min_p
    if not _is_number(min_p) or not 0.0 <= min_p <= 1.0:
        raise RequestError(
            f"request {request_id}: sampling_params.min_p must be a number in [0, 1], 0 for off (got {min_p!r})",
            "min_p",
        )
    penalty = params.get("repetition_penalty")
    penalty = 1.0 if penalty is None else penalty
    if not _is_number(penalty) or penalty <= 0:
        raise RequestError(
            f"request {request_id}: sampling_params.repetition_penalty must be a finite number > 0, 1.0 for off "
            f"(got {penalty!r})", "repetition_penalty",
        )
    return int(top_k), float(min_p), float(penalty)


def parse_sampling_request(request_id: str, params: Mapping[str, Any] | None, default_max_new: int) -> ParsedSampling:
    """Every sampling key checked; errors name the field and what it must be."""
    params = dict(params or {})
    unknown = set(params) - _SAMPLING_KEYS
    if unknown:
        raise RequestError(
            f"request {request_id}: unknown sampling_params {sorted(unknown)}; allowed: {sorted(_SAMPLING_KEYS)}",
            sorted(unknown)[0],
        )
    _check_neutral(request_id, params)
    max_new = params.get("max_tokens", params.get("max_new_tokens", default_max_new))
    temperature = params.get("temperature", 0.0)
    top_p = params.get("top_p", 1.0)
    if max_new is None:
        max_new = default_max_new
    if not _is_int(max_new) or max_new < 1:
        raise RequestError(
            f"request {request_id}: sampling_params.max_tokens must be an int >= 1 (got {max_new!r})", "max_tokens"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0.0 <= temperature <= 100.0:
        raise RequestError(
            f"request {request_id}: sampling_params.temperature must be in [0, 100] (got {temperature!r})", "temperature"
        )
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise RequestError(f"request {request_id}: sampling_params.top_p must be in (0, 1] (got {top_p!r})", "top_p")
    seed = params.get("seed", 0)
    if seed is None:
        seed = 0
    if not _is_int(seed):
        raise RequestError(f"request {request_id}: sampling_params.seed must be an int (got {seed!r})", "seed")
    stops = params.get("stop_token_ids") or ()
    if not all(_is_int(t) for t in stops):
        raise RequestError(
            f"request {request_id}: sampling_params.stop_token_ids must be ints (got {stops!r})", "stop_token_ids"
        )
    logprobs = params.get("logprobs", True)
    if logprobs is not None and not isinstance(logprobs, (bool, int)):
        raise RequestError(
            f"request {request_id}: sampling_params.logprobs must be a bool or an int (got {logprobs!r})", "logprobs"
        )
    top_k, min_p, repetition_penalty = _filters(request_id, params)
    sampling = SamplingParams(int(max_new), float(temperature), float(top_p), seed, tuple(int(t) for t in stops),
                              top_k, min_p, repetition_penalty)
    # vLLM: logprobs=0 or True returns the sampled token's log-prob; None/False returns none.
    return ParsedSampling(sampling, logprobs is not None and logprobs is not False)


def with_request_seed(params: Any) -> Any:
    """`params` with a seed of its own when it has none (absent or None), as vLLM draws one for
    such a request. The `rollout-server` applies it: verl's agent loop sends no seed for each of
    a prompt's G samples, which must differ (with one default seed they were the same tokens, and
    GRPO learnt nothing). The spec carries the seed drawn, so the scheduler's retries of the
    request reproduce its tokens; a caller wanting the same tokens again sends a seed."""
    if params is not None and not isinstance(params, Mapping):
        return params  # not sampling params at all: parse_sampling_request names the error
    filled = dict(params or {})
    if filled.get("seed") is None:
        filled["seed"] = secrets.randbits(62)
    return filled


def parse_sampling(request_id: str, params: Mapping[str, Any] | None, default_max_new: int) -> SamplingParams:
    return parse_sampling_request(request_id, params, default_max_new).params


def make_spec(
    request_id: str, prompt: np.ndarray, sampling: SamplingParams, namespace: str, attempt: int = 0,
    expect_next_turn_s: float | None = None,
) -> RequestSpec:
    return RequestSpec(request_id, attempt, prompt, sampling, namespace, time.time(),
                       expect_next_turn_s=validate_next_turn_hint(expect_next_turn_s))


def validate_next_turn_hint(value: Any) -> float | None:
    """expect_next_turn_s: None, or seconds >= 0 until the session's next turn (a finite number)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"expect_next_turn_s must be a finite number of seconds >= 0 until the session's next turn, or "
            f"left out (got {value!r})"
        )
    return float(value)


def check_cache_salt(value: object, field: str = "cache_salt") -> str | None:
    """A `cache_salt` as sent: None (no salt) or a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT_CHARS:
        shown = value[:40] + "..." if isinstance(value, str) and len(value) > 40 else value
        raise RequestError(
            f"{field} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, or left out "
            f"(got {shown!r}); requests with the same {field} share cached prefixes, others never do", field,
        )
    return value


def salt_namespace(namespace: str, cache_salt: object) -> str:
    """The key namespace of a turn with `cache_salt` (checked; None: `namespace` itself): its
    blocks are never hit by a turn of another salt (api/cache_salt.py)."""
    return salted_namespace(namespace, check_cache_salt(cache_salt))


def check_verl_kwargs(request_id: str, kwargs: Mapping[str, Any]) -> None:
    """The keyword arguments verl's generate adds beyond the rollout-server's own: accepted when
    empty (`image_data`, ... None) or harmless (`priority`); anything else names itself."""
    multimodal = [k for k in _MULTIMODAL_KWARGS if kwargs.get(k) is not None]
    unknown = sorted(set(kwargs) - set(_MULTIMODAL_KWARGS) - {"priority"})
    if multimodal or unknown:
        name = (multimodal or unknown)[0]
        raise RequestError(
            f"request {request_id}: {name} is not supported (text-only decoder; known arguments: "
            "request_id, prompt_ids, sampling_params, session_id, expect_next_turn_s, cache_salt)", name,
        )
