"""The token streams of `generate_stream` (runtime/control/streaming.py), without Ray."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np

from dualpath_ray.protocol.messages import (
    ReadPath,
    RequestSpec,
    SamplingParams,
    StopReason,
    StreamDelta,
    TokenChunk,
    TurnResult,
)
from dualpath_ray.runtime.control.streaming import TokenStreams

OUTPUT = (11, 12, 13, 14, 15)


def spec_of(request_id: str = "t/0") -> RequestSpec:
    return RequestSpec(request_id, 0, np.arange(4), SamplingParams(), "ns", 0.0, epoch=7)


def result_of(spec: RequestSpec, attempt: int) -> TurnResult:
    return TurnResult(
        request_id=spec.request_id, attempt=attempt, output_tokens=OUTPUT, log_probs=tuple(-float(t) for t in OUTPUT),
        stop_reason=StopReason.LENGTH, prompt_tokens=len(spec.prompt), hit_tokens=0, path=ReadPath.PE,
        prefill_engine="prefill/p0/g0", decode_engine="decode/d0/g0", ttft_s=0.0, tpot_s=0.0, epoch=spec.epoch,
    )


def chunk_of(spec: RequestSpec, attempt: int, start: int, stop: int) -> TokenChunk:
    tokens = OUTPUT[start:stop]
    return TokenChunk(spec.request_id, attempt, spec.epoch, start, tokens, tuple(-float(t) for t in tokens))


def in_flight(spec: RequestSpec, attempt: int) -> dict[str, Any]:
    """The core's requests as `pass_on` reads them: only the attempt in flight counts."""
    return {spec.request_id: SimpleNamespace(spec=dataclasses.replace(spec, attempt=attempt))}


async def read_all(streams: TokenStreams, spec: RequestSpec, generate) -> list[StreamDelta | TurnResult]:
    return [item async for item in streams.serve(spec, generate)]


def test_each_position_goes_out_once_across_a_retry_and_a_lost_chunk_is_made_up() -> None:
    async def scenario() -> list[StreamDelta | TurnResult]:
        streams = TokenStreams()
        spec = spec_of()

        async def generate(asked: RequestSpec) -> TurnResult:
            assert asked.stream, "the engine is asked to stream"
            assert len(streams) == 1, "the queue exists before the turn is served"
            streams.pass_on((chunk_of(spec, 0, 0, 2),), in_flight(spec, 0))
            await asyncio.sleep(0)
            streams.pass_on((chunk_of(spec, 0, 2, 3),), in_flight(spec, 1))  # a stale attempt's: dropped
            streams.pass_on((chunk_of(spec, 1, 0, 3),), in_flight(spec, 1))  # the retry, from position 0
            await asyncio.sleep(0)
            return result_of(spec, 1)  # positions 3 and 4 never streamed

        items = await read_all(streams, spec, generate)
        assert len(streams) == 0, "the queue goes with the stream"
        return items

    *deltas, result = asyncio.run(scenario())
    assert isinstance(result, TurnResult) and result.attempt == 1
    assert [d.start for d in deltas] == [0, 2, 3], "in order, each position once"
    assert sum((d.tokens for d in deltas), ()) == OUTPUT, "the stream adds up to the result's output"


def test_a_stream_closed_early_cancels_its_serving_and_drops_its_queue() -> None:
    async def scenario() -> None:
        streams = TokenStreams()
        spec = spec_of()
        cancelled = asyncio.Event()

        async def generate(asked: RequestSpec) -> TurnResult:
            streams.pass_on((chunk_of(spec, 0, 0, 2),), in_flight(spec, 0))
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return result_of(spec, 0)

        stream = streams.serve(spec, generate)
        first = await anext(stream)
        assert isinstance(first, StreamDelta) and first.tokens == OUTPUT[:2]
        await stream.aclose()
        assert len(streams) == 0, "a reader that stops leaves no queue behind"
        await asyncio.wait_for(cancelled.wait(), 1.0)

    asyncio.run(scenario())


def test_chunks_of_requests_not_streamed_are_ignored() -> None:
    streams = TokenStreams()
    spec = spec_of()
    streams.pass_on((chunk_of(spec, 0, 0, 2),), in_flight(spec, 0))  # nobody streams it: nothing to do
    assert len(streams) == 0
