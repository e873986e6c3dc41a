"""Report channel: what one frame costs to make and to take, pickle then vs typed and tagged now.

    .venv/bin/python benchmarks/report_channel_codec.py            # about 1 min

The report channel (runtime/reporting/channel.py) once sent pickled reports under a MAC of
the handshake only; it now sends a Codec message (protocol/wire.py: msgpack of the protocol
dataclasses) with a keyed BLAKE2b tag per frame. This times, for three reports, the sender's
side (old: pickle.dumps + header; now: Codec.encode + SessionKeys.seal_frame) and the
scheduler's side, which the control-plane benchmark's ~35 us per frame includes (old: header +
pickle.loads; now: header + tag check + Codec.decode), without sockets or the event loop, which
both pay alike. CPU time of the process is measured (not wall time). Old and new are timed in
alternation, `--runs` times `--number` frames each, so a
drift of the machine falls on both; the median per frame is printed, with the minimum.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
import timeit
from typing import Any, Callable

from dualpath_ray.protocol.messages import EngineReport, Holding, PersistedBlock, ReaderReport, TokenChunk
from dualpath_ray.protocol.messages import TurnResult
from dualpath_ray.protocol.wire import Codec
from dualpath_ray.runtime.reporting.channel import REPORT_TYPES
from dualpath_ray.runtime.reporting.frames import FRAME, TAG_BYTES, Hello, SessionKeys
from dualpath_ray.protocol.types import ReadPath, StopReason


def turn(i: int, tokens: int, blocks: int) -> TurnResult:
    return TurnResult(
        f"agent-{i}-turn-3", 0, tuple(range(1000, 1000 + tokens)), tuple(-0.01 * t for t in range(tokens)),
        StopReason.LENGTH, 4096, 3968, ReadPath.DE, "prefill/p0/g1", "decode/d3/g5", 0.183, 0.021,
        persisted=tuple(PersistedBlock(f"ns/{i}/{b:016x}", f"ns/{i}/{b - 1:016x}" if b else None) for b in range(blocks)),
        epoch=1_733_400_000_000_000_123,
    )


def reports() -> dict[str, Any]:
    """The control-plane benchmark's typical frame (one turn of one token, a handoff noted), a
    decode step that ends 4 long turns and streams 8 (RL rollouts), a reader's queue."""
    return {
        "1 turn, 1 token": EngineReport("decode/d0/g1", "inc-7f3a", {}, (turn(0, 1, 1),)),
        "4 turns x 512 tokens + 8 chunks": EngineReport(
            "decode/d3/g5", "inc-7f3a", {f"agent-{i}-turn-3": Holding(0, True, 17) for i in range(4)},
            tuple(turn(i, 512, 8) for i in range(4)),
            tuple(TokenChunk(f"agent-{i}-turn-3", 0, 17, 40, (5,), (-0.3,)) for i in range(8)),
        ),
        "reader queue": ReaderReport("n3", "reader/n3", "inc-1c2d", 18_432),
    }


def old_send(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(payload), 1) + payload


def old_take(frame: bytes) -> Any:
    length, _ = FRAME.unpack_from(frame)
    return pickle.loads(frame[FRAME.size:FRAME.size + length])


def new_side(codec: Codec, keys: SessionKeys) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    def send(message: Any) -> bytes:
        return keys.seal_frame(1, codec.encode(message))

    def take(frame: bytes) -> Any:
        length, _ = FRAME.unpack_from(frame)
        end = FRAME.size + length + TAG_BYTES
        header, payload = frame[:FRAME.size], frame[FRAME.size:end - TAG_BYTES]
        if not keys.frame_verifies(header, payload, frame[end - TAG_BYTES:end]):
            raise AssertionError("a genuine frame failed its tag")
        return codec.decode(payload)

    return send, take


def per_frame_us(fn: Callable[[], Any], number: int) -> float:
    """CPU time of this process per call: on a shared VM, time other processes take from it
    is not counted (wall time varied 2x between runs here; CPU time a few %)."""
    return timeit.timeit(fn, number=number, timer=time.process_time) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--number", type=int, default=500, help="frames per timed run")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    codec = Codec(REPORT_TYPES)
    keys = SessionKeys(os.urandom(32), os.urandom(32), Hello(os.urandom(16), os.urandom(16), 1))
    new_send, new_take = new_side(codec, keys)
    figures: dict[str, dict[str, Any]] = {}
    print(f"{'report':34} {'side':9} {'bytes old/new':>14} {'old us (min)':>14} {'new us (min)':>14} {'new/old':>8}")
    for name, message in reports().items():
        old_frame, new_frame = old_send(message), new_send(message)
        assert old_take(old_frame) == message and new_take(new_frame) == message, "both round-trip"
        cases = {
            "sender": (lambda: old_send(message), lambda: new_send(message)),
            "scheduler": (lambda: old_take(old_frame), lambda: new_take(new_frame)),
        }
        for side, (old, new) in cases.items():
            times: dict[str, list[float]] = {"old": [], "new": []}
            for run in range(args.runs):
                for which in (("old", "new") if run % 2 == 0 else ("new", "old")):
                    times[which].append(per_frame_us(old if which == "old" else new, args.number))
            old_med, new_med = statistics.median(times["old"]), statistics.median(times["new"])
            figures[f"{name} / {side}"] = {
                "bytes_old": len(old_frame), "bytes_new": len(new_frame), "old_us": times["old"], "new_us": times["new"],
                "old_median_us": old_med, "new_median_us": new_med,
            }
            print(f"{name:34} {side:9} {len(old_frame):>6}/{len(new_frame):<7} {old_med:7.1f} ({min(times['old']):5.1f})"
                  f" {new_med:7.1f} ({min(times['new']):5.1f}) {new_med / old_med:8.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
