"""The vllm engine backend's decode overhead: dualpath_ray's decode core driving a vLLM engine
(engine.backend: vllm) against the same vLLM engine driven directly, side by side.

    .venv/bin/python benchmarks/vllm_overhead.py [--json] [--repeats 3] [--batch 8] [--context 512] [--steps 32]

Two processes, each holding one vLLM engine of the same config (cluster_configs/vllm-cpu-1p1d.yaml's
model, vLLM's dummy weights), alternate their measurements round by round:
- backend: the real prefill and decode cores in one process (tests/engine_harness.py, oracle
  mode: no storage or transport), their compute a VllmCompute; `--batch` requests of `--context`
  prompt tokens are prefilled and take their first decode step untimed, then the decode core's
  own step loop is timed for the rest of their `--steps` tokens (its page copies, persistence
  and reports included);
- direct: vllm's LLMEngine with the same arguments and no connector, the same prompts, each
  token's log-prob returned as the backend returns it (RL callers need them), timed from the step
  after the first token to the last.
Reported: decode tokens/s of each (median over the rounds) and backend / direct. The machine's
load moves both; the ratio of interleaved rounds is the figure (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = Path(__file__).resolve().parents[1] / "cluster_configs" / "vllm-cpu-1p1d.yaml"
_STATE: dict[str, object] = {}  # per worker process: its engine, built by its first call
# Pages for every sequence of the largest batch at once (the decode core admits only what its
# pages hold; vLLM gets the same number of pages either way).
HBM_TOKENS = 65536


def bench_config():  # type: ignore[no-untyped-def]
    from dualpath_ray.config import load_config

    return load_config(CONFIG).with_overrides(emulation={"enabled": False}, cluster={"hbm_tokens_per_engine": HBM_TOKENS})


def prompts(batch: int, context: int, round_: int) -> list[list[int]]:
    import numpy as np

    return [[int(t) for t in np.random.default_rng(1000 * round_ + i).integers(0, 512, context)] for i in range(batch)]


def backend_round(batch: int, context: int, steps: int, round_: int) -> float:
    """Decode tokens/s of the decode core over a VllmCompute (oracle mode, in-process ports)."""
    import torch

    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.runtime.vllm_engine.compute import VllmCompute
    from dualpath_ray.protocol.types import Role
    from tests.engine_harness import EngineHarness, Request

    if "harness" not in _STATE:
        cfg = bench_config()
        layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        # One engine per process: prefill batches and decode steps take turns on it (all
        # prefills of a round end before its decode starts, so no step mixes the two).
        compute = VllmCompute(cfg, layout, torch.device("cpu"), Role.DECODE)
        _STATE["harness"] = EngineHarness(cfg, Path(tempfile.mkdtemp(prefix="dualpath-vllm-bench-")), compute=compute)
    h = _STATE["harness"]
    requests = [Request(f"r{round_}-{i}", p, "pe", steps + 1) for i, p in enumerate(prompts(batch, context, round_))]
    before = h.decode.stats.tokens  # type: ignore[attr-defined]
    h.prefill.accept([h.task(r, oracle=True) for r in requests])  # type: ignore[attr-defined]
    while h.prefill.jobs:  # type: ignore[attr-defined]
        h.prefill.step()  # type: ignore[attr-defined]
    while h.decode.stats.tokens - before < batch:  # type: ignore[attr-defined]  # handoffs taken, every sequence decoding
        h.decode.step()  # type: ignore[attr-defined]
    first = h.decode.stats.tokens  # type: ignore[attr-defined]
    done_before = len(h.collector.results)  # type: ignore[attr-defined]
    start = time.perf_counter()
    while len(h.collector.results) - done_before < batch:  # type: ignore[attr-defined]
        h.decode.step()  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    return (h.decode.stats.tokens - first) / elapsed  # type: ignore[attr-defined]


def direct_round(batch: int, context: int, steps: int, round_: int) -> float:
    """Decode tokens/s of a plain vLLM engine on the same prompts."""
    from dualpath_ray.runtime.vllm_engine.host import configure_vllm_env, engine_kwargs
    from dualpath_ray.protocol.types import Role

    if "engine" not in _STATE:
        configure_vllm_env()
        from vllm import EngineArgs, LLMEngine

        # The backend's decode engine, built from the same arguments, without the connector.
        _STATE["engine"] = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(bench_config(), Role.DECODE)))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = _STATE["engine"]
    for i, p in enumerate(prompts(batch, context, round_)):
        engine.add_request(f"r{round_}-{i}", TokensPrompt(prompt_token_ids=p),  # type: ignore[attr-defined]
                           SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False,
                                          logprobs=0))
    produced = 0
    while produced < batch:  # every request's first token (prefill), untimed
        produced += sum(1 for out in engine.step() if len(out.outputs[0].token_ids) == 1)  # type: ignore[attr-defined]
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        tokens += len(engine.step())  # type: ignore[attr-defined]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    figures: dict[str, list[float]] = {"backend": [], "direct": []}
    with ProcessPoolExecutor(1, mp_context=spawn) as backend, ProcessPoolExecutor(1, mp_context=spawn) as direct:
        for round_ in range(args.repeats + 1):  # round 0 builds both engines and warms them, untimed
            b = backend.submit(backend_round, args.batch, args.context, args.steps, round_).result()
            d = direct.submit(direct_round, args.batch, args.context, args.steps, round_).result()
            if round_:
                figures["backend"].append(b)
                figures["direct"].append(d)
    result = {
        "batch": args.batch, "context": args.context, "steps": args.steps, "rounds": figures,
        "backend_tokens_s": statistics.median(figures["backend"]),
        "direct_tokens_s": statistics.median(figures["direct"]),
        "ratio_per_round": [b / d for b, d in zip(figures["backend"], figures["direct"])],
    }
    result["backend_over_direct"] = statistics.median(result["ratio_per_round"])
    if args.json:
        print(json.dumps(result))
        return
    print(f"decode tokens/s, batch {args.batch}, context {args.context}, {args.steps} steps, median of {args.repeats}:")
    print(f"  backend (decode core + VllmCompute): {result['backend_tokens_s']:.1f}")
    print(f"  direct (vLLM LLMEngine):             {result['direct_tokens_s']:.1f}")
    print(f"  backend / direct: {result['backend_over_direct']:.3f} (per round: "
          f"{', '.join(f'{r:.3f}' for r in result['ratio_per_round'])})")


if __name__ == "__main__":
    main()
