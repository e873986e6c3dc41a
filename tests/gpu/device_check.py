"""The runtime on one GPU in bf16 (tests/gpu/device_check.sh): exact KV, logits like a recompute.

An embedded 1P1D cluster whose two nodes share the machine's GPU (each offers Ray one), the
model and every engine pool on CUDA in bfloat16, real rates (no emulation). The same agent
trajectories go through basic and dualpath with layer blocks moved into and out of HBM by the
transport (runtime.hbm_moves: transport, GPU memory registered), then dualpath with CUDA copies of
a pinned host mirror (cuda_copy); it checks that
- the decode side received every hit KV byte exactly and the computed KV within bf16 rounding
  (runtime.verify_kv recomputes each prompt's KV there),
- each generated token's log-prob equals a single-sequence recompute of the whole conversation on
  the GPU within bf16 noise, and outputs are identical across modes,
and prints the runtime's prefill and decode tokens/s. Then, on the same cluster, the GPU path's
own checks (tests/gpu/gpu_path_checks.py): readers' buffers pinned, `kv_digests: false` byte-exact,
sleep/wake freeing and restoring HBM, and a trainer's weight broadcast to the CUDA engines.
Exit status 1 on any failed check.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from dualpath_ray.demos.demo import demo_trajectories  # noqa: E402
from dualpath_ray.model.llama import DecoderModel  # noqa: E402
from dualpath_ray.protocol.messages import TurnResult  # noqa: E402
from dualpath_ray.workload.trace import Trajectory  # noqa: E402
from tests.gpu import gpu_path_checks  # noqa: E402

# bf16 log-probs of a batched forward and a single-sequence one differ by rounding only.
LOGPROB_ATOL = 0.1
# (label, runtime.hbm_moves, mode) of each run on the one cluster.
RUNS = (
    ("basic", "transport", "basic"),
    ("dualpath", "transport", "dualpath"),
    ("dualpath+cuda_copy", "cuda_copy", "dualpath"),
)


def device_config(n_layer: int, hbm_moves: str = "transport", kv_digests: bool = True) -> DualPathConfig:
    return parse_config(
        {
            "model": {"n_layer": n_layer, "max_context": 8192, "dtype": "bfloat16"},
            "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1,
                        "hbm_tokens_per_engine": 65536, "prefill_hbm_tokens": 65536,
                        "buffer_blocks_per_node": 1024, "cpus_per_node": 2},
            "emulation": {"enabled": False},
            "runtime": {"device": "cuda", "verify_kv": True, "hbm_moves": hbm_moves, "kv_digests": kv_digests},
        },
        source="<device_check>",
    )


def conversation_prompts(trajectory: Trajectory, results: Sequence[TurnResult]) -> list[list[int]]:
    """Each turn's prompt: the previous prompt, its output, then the turn's appended tokens."""
    prompts: list[list[int]] = []
    context: list[int] = []
    for turn, result in zip(trajectory.turns, results):
        context = context + list(turn.appended)
        prompts.append(context)
        context = context + list(result.output_tokens)
    return prompts


def logprob_errors(model: DecoderModel, trajectories: Sequence[Trajectory], results: dict[str, list[TurnResult]]) -> list[float]:
    """Largest |log-prob(cluster) - log-prob(recompute)| of each turn's generated tokens."""
    errors = []
    for trajectory in trajectories:
        turns = results[trajectory.trajectory_id]
        for prompt, result in zip(conversation_prompts(trajectory, turns), turns):
            sequence = torch.tensor(prompt + list(result.output_tokens), device="cuda")
            logits = model.prefill(sequence).logits.float()
            steps = len(result.output_tokens)
            rows = logits[len(prompt) - 1 : len(prompt) - 1 + steps]
            picked = torch.log_softmax(rows, dim=-1).gather(1, sequence[len(prompt):, None])[:, 0]
            got = torch.tensor(result.log_probs, device="cuda")
            errors.append(float((picked - got).abs().max()))
    return errors


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("device_check: no CUDA device; this check runs on a GPU machine only", file=sys.stderr)
        return 2
    cfg = device_config(args.layers)
    trajectories = demo_trajectories(args.agents, args.turns, first=args.first_tokens, vocab=cfg.model.vocab_size)
    outputs: dict[str, dict[str, list[tuple[int, ...]]]] = {}
    failures: list[str] = []
    cluster = DualPathCluster.start(cfg)
    try:
        # Both ways into and out of HBM (runtime.hbm_moves): every mode through the transport
        # (GPU memory registered, the CNIC-centric rule), and dualpath with CUDA copies of a
        # pinned host mirror; all must generate the same tokens.
        for label, hbm_moves, mode in RUNS:
            if hbm_moves == "transport" and cfg.runtime.transport == "gloo":
                failures.append(f"{label}: hbm_moves transport needs nixl or verbs (gloo cannot register GPU "
                                "memory); install the nixl extra")
                continue
            cluster.deploy(mode, cfg=device_config(args.layers, hbm_moves))
            started = time.monotonic()
            results = cluster.run_trajectories(trajectories)
            elapsed = time.monotonic() - started
            turns = [r for rs in results.values() for r in rs]
            computed = sum(r.prompt_tokens - r.hit_tokens for r in turns)
            generated = sum(len(r.output_tokens) for r in turns)
            mismatched = sum(r.kv_mismatches for r in turns)
            verified = sum(r.kv_bytes_verified for r in turns)
            stats = cluster.engine_stats()
            devices = sorted({s.device for s in stats.values()})
            copied = sum(s.hbm_moves.h2d_bytes + s.hbm_moves.d2h_bytes for s in stats.values())
            print(f"{label}: {len(turns)} turns in {elapsed:.2f} s on {devices}; CUDA-copied {copied / 1e6:.1f} MB; prefill "
                  f"{computed / elapsed:.0f} computed tokens/s, decode {generated / elapsed:.0f} tokens/s; "
                  f"KV verified {verified / 1e6:.1f} MB, mismatches {mismatched}")
            if mismatched:
                failures.append(f"{label}: {mismatched} prompts' KV differed at the decode side")
            if any(not d.startswith("cuda") for d in devices):
                failures.append(f"{label}: engines computed on {devices}, not the GPU")
            if (copied > 0) != (hbm_moves == "cuda_copy"):
                failures.append(f"{label}: {copied} bytes went through CUDA copies; expected them only with cuda_copy")
            outputs[label] = {t: [r.output_tokens for r in rs] for t, rs in results.items()}
        model = DecoderModel(cfg.model).to("cuda")
        errors = logprob_errors(model, trajectories, results)
        print(f"log-prob vs recompute: max |diff| {max(errors):.4f} over {len(errors)} turns (tolerance {LOGPROB_ATOL})")
        if max(errors) > LOGPROB_ATOL:
            failures.append(f"log-probs differ from a recompute by {max(errors):.4f} > {LOGPROB_ATOL}")
        if len({repr(tokens) for tokens in outputs.values()}) > 1:
            failures.append(f"the runs {sorted(outputs)} did not all generate the same tokens")
        failures += gpu_path(cluster, args, transport_moves=cfg.runtime.transport != "gloo")
    finally:
        cluster.shutdown()
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def gpu_path(cluster: DualPathCluster, args: argparse.Namespace, transport_moves: bool) -> list[str]:
    """Issue 24's GPU-path checks on this cluster; each step's failures, and a step that raised."""
    steps = (
        ("readers", lambda: gpu_path_checks.check_readers(cluster)),
        ("kv_digests off", lambda: gpu_path_checks.check_no_digests(cluster, device_config, args.layers, transport_moves)),
        ("sleep/wake", lambda: gpu_path_checks.check_sleep_wake(cluster, device_config, args.layers)),
        ("weight sync", lambda: gpu_path_checks.check_weight_sync(cluster, logprob_errors, LOGPROB_ATOL)),
    )
    failures: list[str] = []
    for name, step in steps:
        print(f"== {name}")
        try:
            failures += step()
        except Exception as exc:  # noqa: BLE001 - one broken step must not hide the others' results
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    sys.exit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
