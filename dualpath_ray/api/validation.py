"""Validation of what a caller sends: prompts and sampling parameters, with errors that name the
request and the field."""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from dualpath_ray.config import ModelConfig
from dualpath_ray.runtime.messages import RequestSpec, SamplingParams

_SAMPLING_KEYS = {"max_tokens", "max_new_tokens", "temperature", "top_p", "seed", "stop_token_ids"}


class RequestError(ValueError):
    """One request's arguments are invalid; the message names the request and the field."""


def validate_prompt(request_id: str, prompt_ids: Sequence[int], max_new_tokens: int, model: ModelConfig) -> np.ndarray:
    if len(prompt_ids) == 0:
        raise RequestError(f"request {request_id}: prompt_ids is empty; send at least one token")
    prompt = np.asarray(prompt_ids)
    if not np.issubdtype(prompt.dtype, np.integer):
        raise RequestError(f"request {request_id}: prompt_ids must be integers (got {prompt.dtype})")
    bad = np.flatnonzero((prompt < 0) | (prompt >= model.vocab_size))
    if bad.size:
        i = int(bad[0])
        raise RequestError(
            f"request {request_id}: prompt_ids[{i}] = {int(prompt[i])} is outside the vocabulary "
            f"[0, {model.vocab_size})"
        )
    if len(prompt) + max_new_tokens > model.max_context:
        raise RequestError(
            f"request {request_id}: prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) "
            f"exceeds the model's context of {model.max_context}; shorten the prompt or max_tokens"
        )
    return prompt.astype(np.int32)


def parse_sampling(request_id: str, params: Mapping[str, Any] | None, default_max_new: int) -> SamplingParams:
    params = dict(params or {})
    unknown = set(params) - _SAMPLING_KEYS
    if unknown:
        raise RequestError(
            f"request {request_id}: unknown sampling_params {sorted(unknown)}; allowed: {sorted(_SAMPLING_KEYS)}"
        )
    max_new = params.get("max_tokens", params.get("max_new_tokens", default_max_new))
    temperature = params.get("temperature", 0.0)
    top_p = params.get("top_p", 1.0)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise RequestError(f"request {request_id}: sampling_params.max_tokens must be an int >= 1 (got {max_new!r})")
    if not isinstance(temperature, (int, float)) or not 0.0 <= temperature <= 100.0:
        raise RequestError(f"request {request_id}: sampling_params.temperature must be in [0, 100] (got {temperature!r})")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise RequestError(f"request {request_id}: sampling_params.top_p must be in (0, 1] (got {top_p!r})")
    seed = params.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise RequestError(f"request {request_id}: sampling_params.seed must be an int (got {seed!r})")
    stops = params.get("stop_token_ids", ())
    if not all(isinstance(t, int) for t in stops):
        raise RequestError(f"request {request_id}: sampling_params.stop_token_ids must be ints (got {stops!r})")
    return SamplingParams(int(max_new), float(temperature), float(top_p), seed, tuple(stops))


def make_spec(request_id: str, prompt: np.ndarray, sampling: SamplingParams, namespace: str, attempt: int = 0) -> RequestSpec:
    return RequestSpec(request_id, attempt, prompt, sampling, namespace, time.time())
