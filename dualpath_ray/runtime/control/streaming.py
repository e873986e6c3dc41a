"""Token streams of the turns served by `Scheduler.generate_stream` (runtime/control/scheduler.py).

The decode engine reports the tokens it sampled (TokenChunks in its EngineReport); the scheduler
passes those of the attempt in flight to the stream's queue, and the stream sends each output
position once: a retried attempt streams from its first token again, and since sampling is seeded
by (seed, position) its tokens equal the ones already sent, so only new positions go out. A chunk
lost on the way is made up from the final result.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Awaitable, Callable, Mapping

from dualpath_ray.protocol.messages import RequestSpec, StreamDelta, TokenChunk, TurnResult
from dualpath_ray.scheduling.requests import Request

# Serves one turn to its result (the actor's `generate`, refusals included).
Generate = Callable[[RequestSpec], Awaitable[TurnResult]]


class TokenStreams:
    """The queue of each request being streamed (request id -> its tokens as sampled)."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[TokenChunk]] = {}

    def __len__(self) -> int:
        return len(self.queues)

    async def serve(self, spec: RequestSpec, generate: Generate) -> AsyncIterator[StreamDelta | TurnResult]:
        """Serve `spec` with `generate`, streamed: StreamDeltas in order with no token twice,
        then the TurnResult. The queue lives exactly as long as the stream is read."""
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self.queues[spec.request_id] = queue
        served = asyncio.ensure_future(generate(dataclasses.replace(spec, stream=True)))
        sent = 0
        try:
            while not served.done() or not queue.empty():
                chunk = await self._next_chunk(queue, served)
                if chunk is None:
                    continue
                delta = StreamDelta.after(chunk, sent)
                if delta is not None:
                    sent += len(delta.tokens)
                    yield delta
            result = served.result()
            if len(result.output_tokens) > sent:
                yield StreamDelta(sent, result.output_tokens[sent:], result.log_probs[sent:])
            yield result
        finally:
            self.queues.pop(spec.request_id, None)
            if not served.done():
                served.cancel()

    @staticmethod
    async def _next_chunk(queue: asyncio.Queue[TokenChunk], served: asyncio.Future[TurnResult]) -> TokenChunk | None:
        """The next chunk, or None once the request was served (and nothing is queued)."""
        if not queue.empty():
            return queue.get_nowait()
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, served}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        return None

    def pass_on(self, chunks: tuple[TokenChunk, ...], requests: Mapping[str, Request]) -> None:
        """Streamed tokens of one step; only the attempt in flight (`requests`: the core's) is
        passed on."""
        for chunk in chunks:
            queue = self.queues.get(chunk.request_id)
            request = requests.get(chunk.request_id)
            if queue is not None and request is not None and (request.spec.attempt, request.spec.epoch) == (
                chunk.attempt, chunk.epoch
            ):
                queue.put_nowait(chunk)
