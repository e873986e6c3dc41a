"""Engine throughput on this machine: batched decode and prefill against one request at a time.

    .venv/bin/python benchmarks/engine_throughput.py [--json] [--repeats 5]

The real engine cores (PrefillCore, DecodeCore) with the real model (the demo's tiny decoder,
float32, runtime.compute_threads of torch threads), the real readers, store, window and pages, in
one process (tests/engine_harness.py: in-process transport and ports, so only the engines are
timed). Reported, each the median over --repeats rounds with the variants interleaved:
- decode tokens/s of B requests decoding together (B = 1, 4, 8, 16, 32), each with a `--context`
  token prompt, over --decode-tokens steps (the engine's own step loop, persistence included);
- prefill tokens/s of 4 requests in one batch vs the same 4 requests one after another, each
  a turn of an agent: --prefill-cached tokens hit in the store, --prefill-new tokens to compute;
- the layer window's most layers held by a batch, and the most transfers of one layer with one
  reader (with gloo each transfer is one actor call; NIXL posts them without any).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from tests.engine_harness import EngineHarness, Request  # noqa: E402

BATCHES = (1, 4, 8, 16, 32)


def bench_config(threads: int, dtype: str = "float32") -> DualPathConfig:
    return parse_config(
        {
            "model": {"n_layer": 4, "max_context": 4096, "dtype": dtype},
            "cluster": {"hbm_tokens_per_engine": 65536, "buffer_blocks_per_node": 2048, "prefill_hbm_tokens": 65536},
            "store": {"block_size": 64},
            "emulation": {"enabled": False, "compute": "model"},
            "runtime": {"compute_threads": threads},
        },
        source="<engine_throughput>",
    )


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def decode_tokens_per_s(h: EngineHarness, batch: int, context: int, steps: int, round_: int) -> float:
    """Prefill `batch` prompts untimed (one token generated), then time the decode loop alone."""
    requests = [Request(f"d{round_}-{batch}-{i}", tokens(context, 1000 * round_ + i), "pe", steps + 1) for i in range(batch)]
    h.prefill.accept([h.task(r) for r in requests])
    while h.prefill.jobs:
        h.prefill.step()
    h.decode.step()  # takes the handoffs and loads the prompts' KV (and runs one untimed step)
    first = h.decode.stats.tokens
    start = time.perf_counter()
    done_before = len(h.collector.results)
    while len(h.collector.results) - done_before < batch:
        h.decode.step()
    elapsed = time.perf_counter() - start
    return (h.decode.stats.tokens - first) / elapsed


def prefill_tokens_per_s(h: EngineHarness, prompts: list[list[int]], new: int, together: bool, round_: int) -> float:
    """Time only the prefill core's batches of the second turns of `prompts`."""
    tag = "b" if together else "s"
    groups = [prompts] if together else [[p] for p in prompts]
    elapsed = 0.0
    for g, group in enumerate(groups):
        requests = [Request(f"{tag}{round_}-{g}-{i}", p + tokens(new, 7 * round_ + i), "pe", 1) for i, p in enumerate(group)]
        h.prefill.accept([h.task(r) for r in requests])
        start = time.perf_counter()
        while h.prefill.jobs:
            h.prefill.step()
        elapsed += time.perf_counter() - start
        while h.decode.busy():
            h.decode.step()
    return len(prompts) * new / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--prefill-cached", type=int, default=1024)
    parser.add_argument("--prefill-new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="runtime.compute_threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (tests/gpu/device_check.sh)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cfg = bench_config(args.threads, args.dtype)
    torch.set_num_threads(args.threads)
    decode: dict[int, list[float]] = {b: [] for b in BATCHES}
    prefill: dict[str, list[float]] = {"batch_of_4": [], "one_by_one": []}
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-") as root:
        h = EngineHarness(cfg, Path(root), device=args.device)
        try:
            warm = [tokens(args.prefill_cached, 50 + i) for i in range(4)]
            h.serve([Request(f"warm{i}", p, "pe", 1) for i, p in enumerate(warm)])
            stored = [p + [h.collector.results[-4 + i].output_tokens[0]] for i, p in enumerate(warm)]
            for round_ in range(args.repeats):
                for batch in BATCHES:
                    decode[batch].append(decode_tokens_per_s(h, batch, args.context, args.decode_tokens, round_))
                order = [True, False] if round_ % 2 == 0 else [False, True]
                for together in order:
                    key = "batch_of_4" if together else "one_by_one"
                    prefill[key].append(prefill_tokens_per_s(h, stored, args.prefill_new, together, round_))
            stats = h.prefill.stats.pipeline
            report = {
                "decode_tokens_per_s": {b: statistics.median(v) for b, v in decode.items()},
                "decode_batch32_over_batch1": statistics.median(decode[32]) / statistics.median(decode[1]),
                "prefill_tokens_per_s": {k: statistics.median(v) for k, v in prefill.items()},
                "prefill_batch_over_one_by_one": statistics.median(
                    [a / b for a, b in zip(prefill["batch_of_4"], prefill["one_by_one"])]
                ),
                "window_layers_held_max": stats.window_layers_held_max,
                "transfers_per_layer_and_reader_max": stats.max_transfers_per_layer_peer,
                "settings": vars(args),
            }
        finally:
            h.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for b, value in report["decode_tokens_per_s"].items():
        print(f"decode batch {b:>2}: {value:9.1f} tokens/s")
    print(f"decode batch 32 / batch 1: {report['decode_batch32_over_batch1']:.1f}x (goal >= 10x)")
    for k, value in report["prefill_tokens_per_s"].items():
        print(f"prefill {k}: {value:9.1f} computed tokens/s")
    print(f"prefill batch of 4 / one by one: {report['prefill_batch_over_one_by_one']:.2f}x (goal >= 3x)")
    print(f"window layers held at most: {report['window_layers_held_max']} (goal <= 3)")
    print(f"transfers of one layer with one reader at most: {report['transfers_per_layer_and_reader_max']} (goal <= 2)")


if __name__ == "__main__":
    main()
