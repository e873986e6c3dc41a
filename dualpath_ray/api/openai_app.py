"""The OpenAI-compatible ASGI app (Starlette): /v1/models, /v1/completions,
/v1/chat/completions (streamed as server-sent events with `stream: true`), /health.

Text becomes token ids with the model's tokenizer (api/tokenizer.py); without one the endpoint
serves token ids only (vLLM's --skip-tokenizer-init). Generation goes to the `rollout-server`
actor, so a request here shares the weight version, sessions and aborts with every other front
end. A request is checked here before anything is sent, so a bad one is a 400 naming its field
even when streamed; a text too long for any context is refused before it is tokenized. A
streamed request whose client goes away is aborted. A batch of prompts whose turn fails (a full
queue's 429 among them) is aborted whole before the error is answered: the client gets no part
of it, so no part of it keeps the cluster busy. The API keys and the body's limits:
api/openai_guards.py; the tenant's and the request's cache salts: api/cache_salt.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from dualpath_ray.api.api_keys import ApiKeys
from dualpath_ray.api.cache_salt import combined_salt
from dualpath_ray.api.http_limits import DEFAULT_MAX_PROMPTS, HttpLimits
from dualpath_ray.api.openai_guards import TENANT_SALT, BearerAuth, read_limited_body
from dualpath_ray.api.openai_protocol import (
    APIError,
    GenerationRequest,
    batch_response,
    chat_logprobs,
    completion_logprobs,
    no_tokenizer,
    parse_chat,
    parse_completion,
    prompt_too_long,
    response_object,
    usage,
    usage_chunk,
)
from dualpath_ray.api.sessions import SessionIds
from dualpath_ray.api.tokenizer import HFTokenizer, IncrementalDetokenizer, TokenizerError
from dualpath_ray.api.validation import RequestError, parse_sampling_request, validate_prompt
from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.messages import ErrorKind, StreamDelta

LOG = logging.getLogger("dualpath_ray.openai")
# What a 429 tells the client to wait before it sends the request again (Retry-After, seconds):
# the scheduler's queue drains at the cluster's turn rate, so a second is a fair first pause.
RETRY_AFTER_S = 1


@dataclass
class Prepared:
    """A checked request with its prompts' ids and the sampling the rollout-server gets: one
    prompt, or (a completions batch of token-id lists) several, each its own request id
    "<request_id>/<i>": a batch shares the prefix the rollout-server aborts as one session's."""

    request: GenerationRequest
    request_id: str  # the response's id
    request_ids: list[str]  # one per prompt
    prompts: list[list[int]]
    sampling: dict[str, Any]
    cache_salt: str | None = None  # the tenant's and the request's, combined (api/cache_salt.py)


class OpenAIEndpoint:
    """The handlers, over a rollout-server handle and a tokenizer; without a tokenizer (None)
    the endpoint serves token ids only: text prompts are a 400 naming the missing tokenizer,
    and every choice carries its token ids. A completions request holds at most `max_prompts`
    prompts."""

    def __init__(self, server: Any, tokenizer: HFTokenizer | None, cfg: DualPathConfig,
                 max_prompts: int = DEFAULT_MAX_PROMPTS) -> None:
        self.server = server
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.model = cfg.model.model_id
        self.max_prompts = max_prompts

    # --- request preparation ----------------------------------------------------------------

    def prepare(self, body: Any, chat: bool, tenant_salt: str | None = None) -> Prepared:
        """The checked request of `body`, from the tenant of `tenant_salt` (None: the only one)."""
        if chat:
            request, messages = parse_chat(body, self.model, self.max_prompts)
            prompts = [self._chat_prompt(messages)]
        else:
            request = parse_completion(body, self.model, self.max_prompts)
            if request.prompt_ids is not None:
                prompts = self._token_prompts(request.prompt_ids)
            else:
                prompts = [self._text_prompt(request.prompt_text or "")]
        # n samples of each prompt, adjacent (a choice's index is prompt * n + sample), each its
        # own turn: sent together, one computes the prompt and the others can share it.
        prompts = [prompt for prompt in prompts for _ in range(request.samples)]
        request_id = SessionIds.fresh("chatcmpl" if chat else "cmpl")
        request_ids = [request_id] if len(prompts) == 1 else [f"{request_id}/{i}" for i in range(len(prompts))]
        sampling = dict(request.sampling)
        eos = self.tokenizer.stop_token_ids if self.tokenizer is not None else ()
        sampling["stop_token_ids"] = sorted(set(sampling["stop_token_ids"]) | set(eos))
        sampling["logprobs"] = request.log_probs
        prompt_field = "messages" if chat else "prompt"
        try:  # the rollout-server checks again; here so a streamed request fails before its 200
            parsed = parse_sampling_request(request_id, sampling, self.cfg.runtime.max_new_tokens)
            for rid, prompt_ids in zip(request_ids, prompts):
                validate_prompt(rid, prompt_ids, parsed.params.max_new_tokens, self.cfg.model)
        except RequestError as exc:
            raise APIError(str(exc), prompt_field if exc.field == "prompt" else exc.field) from None
        return Prepared(request, request_id, request_ids, prompts, sampling,
                        combined_salt(tenant_salt, request.cache_salt))

    @staticmethod
    def sampling_of(prepared: Prepared, turn: int) -> dict[str, Any]:
        """The sampling of one turn: sample j of a prompt is seeded seed + j."""
        sample = turn % prepared.request.samples
        return {**prepared.sampling, "seed": prepared.sampling["seed"] + sample} if sample else prepared.sampling

    def _token_prompts(self, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
        limit = self.cfg.model.max_context
        for i, prompt in enumerate(prompts):
            if len(prompt) > limit:
                field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise prompt_too_long(field, f"{len(prompt)} tokens", f"model.max_context = {limit} tokens")
        return [list(prompt) for prompt in prompts]

    def _require_tokenizer(self, field: str, chars: int) -> HFTokenizer:
        """The tokenizer, once the text's length alone shows it can fit the context: a text
        too long for any context is refused before the tokenizer spends time on it."""
        if self.tokenizer is None:
            raise no_tokenizer(field)
        context = self.cfg.model.max_context
        limit = self.tokenizer.max_prompt_chars(context)
        if chars > limit:
            raise prompt_too_long(field, f"{chars} characters", f"model.max_context = {context} tokens of at most "
                                  f"{self.tokenizer.max_token_chars} characters each: {limit} characters")
        return self.tokenizer

    def _text_prompt(self, text: str) -> list[int]:
        return self._require_tokenizer("prompt", len(text)).encode(text)

    def _chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        tokenizer = self._require_tokenizer("messages", sum(len(m["content"]) for m in messages))
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except TokenizerError as exc:
            raise APIError(str(exc), "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    # --- what a choice says ------------------------------------------------------------

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        if self.tokenizer is None:  # vLLM's spelling of a token it does not detokenize
            return [f"token_id:{t}" for t in token_ids]
        return [self.tokenizer.decode([t]) for t in token_ids]

    def _returns_ids(self, request: GenerationRequest) -> bool:
        return request.return_token_ids or self.tokenizer is None

    def _logprobs(self, request: GenerationRequest, token_ids: list[int], log_probs: list[float] | None) -> Any:
        if not request.log_probs or log_probs is None:
            return None
        texts = self._token_texts(token_ids)
        return chat_logprobs(texts, log_probs) if request.chat else completion_logprobs(texts, log_probs)

    # --- whole responses ----------------------------------------------------------------

    async def respond(self, prepared: Prepared) -> dict[str, Any]:
        request = prepared.request
        turns = [asyncio.ensure_future(self.server.generate.remote(
            rid, prompt_ids, self.sampling_of(prepared, i), request.session_id, request.expect_next_turn_s,
            cache_salt=prepared.cache_salt,
        )) for i, (rid, prompt_ids) in enumerate(zip(prepared.request_ids, prepared.prompts))]
        await asyncio.wait(turns, return_when=asyncio.FIRST_EXCEPTION)
        failed = [turn.exception() for turn in turns if turn.done() and turn.exception() is not None]
        if failed:
            if len(turns) > 1:
                await self._abort_batch(prepared.request_id, turns)
            # Only a full queue becomes the client's to retry; any other failure is the server's.
            refused = next((e for e in map(queue_full_error, failed) if e is not None), None)
            if refused is None:
                raise failed[0]
            raise refused from None
        parts = [self._whole(prepared, prompt_ids, turn.result()) for prompt_ids, turn in zip(prepared.prompts, turns)]
        return parts[0] if len(parts) == 1 else batch_response(parts)

    async def _abort_batch(self, request_id: str, turns: list[asyncio.Future[Any]]) -> None:
        """Abort every turn of a batch one of whose turns failed, and wait until none runs: the
        client gets an error, never these turns' outputs. The batch's ids share the prefix of
        a session named `request_id`, whose abort also refuses a turn not yet submitted; the
        mark is cleared once every turn ended, as no later turn has that prefix."""
        try:
            await self.server.abort_session.remote(request_id)
        finally:
            await asyncio.gather(*turns, return_exceptions=True)
        await self.server.resume_session.remote(request_id)

    def _whole(self, prepared: Prepared, prompt_ids: list[int], out: Any) -> dict[str, Any]:
        request, fields, ids = prepared.request, out.extra_fields, self._returns_ids(prepared.request)
        return response_object(
            request, prepared.request_id, self._text(out.token_ids), fields["finish_reason"],
            self._logprobs(request, out.token_ids, out.log_probs),
            usage(len(prompt_ids), len(out.token_ids), int(fields["hit_tokens"])), chunk=False,
            token_ids=out.token_ids if ids else None, prompt_token_ids=prompt_ids if ids else None,
        )

    # --- streams ----------------------------------------------------------------------

    async def stream(self, prepared: Prepared) -> AsyncIterator[str]:
        """Server-sent events: a chunk per delta, the finishing chunk, the usage chunk (if
        asked), then [DONE]. A stream left before its end aborts the request. A stream has one
        prompt (the parser refuses a streamed batch)."""
        request, rid, prompt_ids = prepared.request, prepared.request_ids[0], prepared.prompts[0]
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        with_ids = self._returns_ids(request)
        finished = False
        try:
            if request.chat:
                yield _event(response_object(request, rid, "", None, None, None, chunk=True, first=True))
            generator = self.server.generate_stream.remote(
                rid, prompt_ids, prepared.sampling, request.session_id, request.expect_next_turn_s,
                cache_salt=prepared.cache_salt,
            )
            async for ref in generator:
                item = await ref
                if isinstance(item, StreamDelta):
                    tokens = list(item.tokens)
                    text = detokenizer.push(tokens) if detokenizer is not None else ""
                    logprobs = self._logprobs(request, tokens, list(item.log_probs))
                    if text or logprobs or (with_ids and tokens):
                        yield _event(response_object(request, rid, text, None, logprobs, None, chunk=True,
                                                     token_ids=tokens if with_ids else None))
                    continue
                finished = True
                fields = item.extra_fields
                tail = detokenizer.push([], final=True) if detokenizer is not None else ""
                yield _event(response_object(request, rid, tail, fields["finish_reason"], None, None, chunk=True))
                if request.include_usage:
                    used = usage(len(prompt_ids), len(item.token_ids), int(fields["hit_tokens"]))
                    yield _event(usage_chunk(request, rid, used))
        except Exception as exc:  # noqa: BLE001 - a stream already answered 200: report in-band
            finished = True
            LOG.warning("stream %s failed: %s", rid, exc)
            failed = queue_full_error(exc) or APIError(f"generation failed: {exc}", None, 500, "server_error")
            yield _event(failed.body())
        finally:
            if not finished:
                self.server.abort.remote(rid)  # the client left: free what the request holds
        yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def queue_full_error(exc: BaseException) -> APIError | None:
    """The 429 of a turn the scheduler refused because its queue was full (the rollout-server's
    GenerationError of kind queue_full, as Ray raises it here): nothing of it ran and the client
    may send it again after Retry-After. None for any other error."""
    if getattr(exc, "kind", None) != ErrorKind.QUEUE_FULL.value:
        return None
    return APIError(
        "the server is busy: its queue of waiting requests is full (scheduler.max_queued_turns); "
        f"retry after {RETRY_AFTER_S} s", None, 429, "rate_limit_error", ErrorKind.QUEUE_FULL.value,
    )


def build_app(endpoint: OpenAIEndpoint, api_keys: ApiKeys | None = None, limits: HttpLimits = HttpLimits()) -> Any:
    """The Starlette application of an endpoint: with `api_keys`, every route but /health needs
    one of them (api/openai_guards.py); a body over limits.max_body_bytes is a 413 before it is
    parsed, and one not arrived whole within limits.body_timeout_s is a 408."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(exc: APIError) -> Response:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else {}
        if exc.status in (408, 413):
            headers["Connection"] = "close"  # the body's rest is never read: the connection is done
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = json.loads(await read_limited_body(request, limits.max_body_bytes, limits.body_timeout_s))
        except APIError as exc:
            return error(exc)
        except ValueError:
            return error(APIError("the request body is not valid JSON", None))
        try:
            prepared = endpoint.prepare(body, chat, getattr(request.state, TENANT_SALT, None))
            if prepared.request.stream:
                return StreamingResponse(endpoint.stream(prepared), media_type="text/event-stream")
            return JSONResponse(await endpoint.respond(prepared))
        except APIError as exc:
            return error(exc)
        except RequestError as exc:
            return error(APIError(str(exc), exc.field))

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": endpoint.model, "object": "model", "created": 0, "owned_by": "dualpath"}
        ]})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], middleware=[Middleware(BearerAuth, keys=api_keys)] if api_keys is not None else [])
