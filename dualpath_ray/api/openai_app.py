"""The OpenAI-compatible ASGI app (Starlette): /v1/models, /v1/completions,
/v1/chat/completions (streamed as server-sent events with `stream: true`), /health.

Text becomes token ids with the model's tokenizer (api/tokenizer.py); generation goes to the
`rollout-server` actor, so a request here shares the weight version, sessions and aborts with
every other front end. A request is checked here before anything is sent, so a bad one is a 400
naming its field even when streamed. A streamed request whose client goes away is aborted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from dualpath_ray.api.openai_protocol import (
    APIError,
    GenerationRequest,
    chat_logprobs,
    completion_logprobs,
    parse_chat,
    parse_completion,
    response_object,
    usage,
    usage_chunk,
)
from dualpath_ray.api.sessions import SessionIds
from dualpath_ray.api.tokenizer import HFTokenizer, IncrementalDetokenizer, TokenizerError
from dualpath_ray.api.validation import RequestError, parse_sampling_request, validate_prompt
from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.messages import StreamDelta

LOG = logging.getLogger("dualpath_ray.openai")


@dataclass
class Prepared:
    """A checked request with its prompt ids and the sampling the rollout-server gets."""

    request: GenerationRequest
    request_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]


class OpenAIEndpoint:
    """The handlers, over a rollout-server handle and a tokenizer."""

    def __init__(self, server: Any, tokenizer: HFTokenizer, cfg: DualPathConfig) -> None:
        self.server = server
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.model = cfg.model.model_id

    # --- request preparation ----------------------------------------------------------------

    def prepare(self, body: Any, chat: bool) -> Prepared:
        if chat:
            request, messages = parse_chat(body, self.model)
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except TokenizerError as exc:
                raise APIError(str(exc), "messages") from None
            prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            request = parse_completion(body, self.model)
            prompt_ids = list(request.prompt_ids) if request.prompt_ids is not None else self.tokenizer.encode(
                request.prompt_text or ""
            )
        request_id = SessionIds.fresh("chatcmpl" if chat else "cmpl")
        sampling = dict(request.sampling)
        sampling["stop_token_ids"] = sorted(set(sampling["stop_token_ids"]) | set(self.tokenizer.stop_token_ids))
        sampling["logprobs"] = request.log_probs
        prompt_field = "messages" if chat else "prompt"
        try:  # the rollout-server checks again; here so a streamed request fails before its 200
            parsed = parse_sampling_request(request_id, sampling, self.cfg.runtime.max_new_tokens)
            validate_prompt(request_id, prompt_ids, parsed.params.max_new_tokens, self.cfg.model)
        except RequestError as exc:
            raise APIError(str(exc), prompt_field if exc.field == "prompt" else exc.field) from None
        return Prepared(request, request_id, prompt_ids, sampling)

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in token_ids]

    def _logprobs(self, request: GenerationRequest, token_ids: list[int], log_probs: list[float] | None) -> Any:
        if not request.log_probs or log_probs is None:
            return None
        texts = self._token_texts(token_ids)
        return chat_logprobs(texts, log_probs) if request.chat else completion_logprobs(texts, log_probs)

    # --- whole responses ----------------------------------------------------------------

    async def respond(self, prepared: Prepared) -> dict[str, Any]:
        request = prepared.request
        out = await self.server.generate.remote(
            prepared.request_id, prepared.prompt_ids, prepared.sampling, request.session_id
        )
        fields = out.extra_fields
        return response_object(
            request, prepared.request_id, self.tokenizer.decode(out.token_ids), fields["finish_reason"],
            self._logprobs(request, out.token_ids, out.log_probs),
            usage(len(prepared.prompt_ids), len(out.token_ids), int(fields["hit_tokens"])), chunk=False,
        )

    # --- streams ----------------------------------------------------------------------

    async def stream(self, prepared: Prepared) -> AsyncIterator[str]:
        """Server-sent events: a chunk per delta, the finishing chunk, the usage chunk (if
        asked), then [DONE]. A stream left before its end aborts the request."""
        request, rid = prepared.request, prepared.request_id
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        finished = False
        try:
            if request.chat:
                yield _event(response_object(request, rid, "", None, None, None, chunk=True, first=True))
            generator = self.server.generate_stream.remote(rid, prepared.prompt_ids, prepared.sampling, request.session_id)
            async for ref in generator:
                item = await ref
                if isinstance(item, StreamDelta):
                    text = detokenizer.push(item.tokens)
                    logprobs = self._logprobs(request, list(item.tokens), list(item.log_probs))
                    if text or logprobs:
                        yield _event(response_object(request, rid, text, None, logprobs, None, chunk=True))
                    continue
                finished = True
                fields = item.extra_fields
                tail = detokenizer.push([], final=True)
                yield _event(response_object(request, rid, tail, fields["finish_reason"], None, None, chunk=True))
                if request.include_usage:
                    used = usage(len(prepared.prompt_ids), len(item.token_ids), int(fields["hit_tokens"]))
                    yield _event(usage_chunk(request, rid, used))
        except Exception as exc:  # noqa: BLE001 - a stream already answered 200: report in-band
            finished = True
            LOG.warning("stream %s failed: %s", rid, exc)
            yield _event(APIError(f"generation failed: {exc}", None, 500, "server_error").body())
        finally:
            if not finished:
                self.server.abort.remote(rid)  # the client left: free what the request holds
        yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def build_app(endpoint: OpenAIEndpoint) -> Any:
    """The Starlette application of an endpoint."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error(APIError("the request body is not valid JSON", None))
        try:
            prepared = endpoint.prepare(body, chat)
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
    ])
