"""The vllm engine backend on one GPU, bf16 (tests/gpu/device_check.sh runs it when vLLM is
installed): an embedded 1P1D sharing the GPU, every engine an in-process vLLM engine, a rollout
in basic and dualpath modes. Checked: no failed turn, both read paths carry bytes into vLLM's
pages, the two modes generate the same tokens, and how many turns' tokens equal a plain vLLM
engine recomputing every prompt (bf16 kernels with other batch shapes may flip a near tie, so
the agreement is printed, and fewer than 90% of turns agreeing is a failure).

    PYTHON=.venv/bin/python tests/gpu/vllm_check.py [--agents 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import ray_test_env, trajectories  # noqa: E402

ray_test_env()

import torch  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from tests.vllm_reference import vllm_recompute_outputs  # noqa: E402

AGREEMENT = 0.9


def gpu_config(mode: str) -> DualPathConfig:
    return parse_config({
        "model": {"n_layer": 4, "hidden_size": 512, "n_head": 8, "n_kv_head": 4, "head_dim": 64,
                  "intermediate_size": 1024, "vocab_size": 4096, "max_context": 8192, "dtype": "bfloat16"},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1, "hbm_tokens_per_engine": 65536,
                    "prefill_hbm_tokens": 16384, "buffer_blocks_per_node": 1024, "cpus_per_node": 2},
        "store": {"block_size": 64},
        "emulation": {"enabled": False},
        "engine": {"backend": "vllm", "vllm_gpu_memory_utilization": 0.3},
        "runtime": {"device": "cuda", "mode": mode, "hbm_moves": "cuda_copy", "request_timeout_s": 600.0},
    }, source="<vllm_check>")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("vllm_check: no CUDA device; this check runs on a GPU machine only", file=sys.stderr)
        return 2
    trajs = trajectories(count=args.agents, turns=args.turns, first=1024, appended=64, gen=16, vocab=4096)
    failures: list[str] = []
    outputs: dict[str, dict[str, list[tuple[int, ...]]]] = {}
    for mode in ("basic", "dualpath"):
        cluster = DualPathCluster.start(gpu_config(mode))
        try:
            cluster.deploy(mode)
            started = time.monotonic()
            result = cluster.rollout(trajs, progress=False)
            elapsed = time.monotonic() - started
            counters = cluster.counters()
        finally:
            cluster.shutdown()
        pe, de = counters["p0"].snic_read["pe"], counters["d0"].snic_read["de"]
        print(f"vllm {mode}: {sum(len(t) for t in result.turn_results.values())} turns in {elapsed:.1f} s; "
              f"read PE {pe / 1e6:.1f} MB, DE {de / 1e6:.1f} MB; failures {len(result.failures)}")
        if result.failures:
            failures.append(f"{mode}: failed trajectories {result.failures}")
        if pe == 0 or (mode == "dualpath" and de == 0):
            failures.append(f"{mode}: a read path carried no bytes (PE {pe}, DE {de})")
        outputs[mode] = {tid: [turn.output_tokens for turn in turns] for tid, turns in result.turn_results.items()}
    if outputs["basic"] != outputs["dualpath"]:
        failures.append("basic and dualpath generated different tokens")
    expected = vllm_recompute_outputs(gpu_config("dualpath"), trajs)
    pairs = [(a, b) for tid in expected for a, b in zip(outputs["dualpath"].get(tid, []), expected[tid])]
    agreeing = sum(a == b for a, b in pairs) / max(1, len(pairs))
    print(f"vllm: {agreeing:.0%} of {len(pairs)} turns generate plain vLLM's tokens (bf16)")
    if agreeing < AGREEMENT:
        failures.append(f"only {agreeing:.0%} of turns agree with plain vLLM (< {AGREEMENT:.0%})")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
