"""The GPU path's own checks, run by tests/gpu/device_check.py on its cluster after the main runs:

- readers' staging buffers are pinned on the GPU node, and the run is not emulated;
- `runtime.kv_digests: false` still moves KV byte for byte (the prefill layer's CUDA event, not a
  digest's copy to the host, orders compute before the transfer; with `hbm_moves: transport` when
  nixl is installed, where a NIC would read HBM outside the compute stream);
- sleep with `hbm_moves: cuda_copy` frees the engines' HBM (the GPU's free memory grows) and wake
  gives it back with every host mirror pinned again, and the woken engines serve exactly;
- a trainer's weight broadcast reaches CUDA engines (the backend the members agreed on is printed:
  gloo here, where the trainer and both engines share one GPU, which NCCL refuses) and the outputs
  afterwards match a recompute with the new weights.

Each returns its failures as sentences; an empty list is a pass.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.demos.demo import demo_trajectories
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.protocol.messages import TurnResult
from dualpath_ray.workload.trace import Trajectory

# Share of what sleep reports freed that must come back as free GPU memory: sleep frees every KV
# pool's HBM, its host mirror of the same size, and the weights' HBM, so HBM is at least half.
HBM_SHARE = 0.45
ConfigFor = Callable[..., DualPathConfig]
Results = dict[str, list[TurnResult]]


def small_trajectories(cfg: DualPathConfig) -> list[Trajectory]:
    return demo_trajectories(4, 2, first=1024, vocab=cfg.model.vocab_size)


def run_exact(cluster: Any, label: str, trajectories: Sequence[Trajectory]) -> tuple[Results, list[str]]:
    """Serve the trajectories; a failure unless every prompt's KV was verified byte-exact."""
    results = cluster.run_trajectories(trajectories)
    turns = [r for rs in results.values() for r in rs]
    mismatched = sum(r.kv_mismatches for r in turns)
    verified = sum(r.kv_bytes_verified for r in turns)
    print(f"{label}: {len(turns)} turns, KV verified {verified / 1e6:.1f} MB, mismatches {mismatched}")
    failures = [f"{label}: {mismatched} prompts' KV differed at the decode side"] if mismatched else []
    if not verified:
        failures.append(f"{label}: no KV was verified (runtime.verify_kv off?)")
    return results, failures


def check_readers(cluster: Any) -> list[str]:
    failures = []
    for name, reader in cluster.deployment.readers.items():
        setup = ray.get(reader.node_setup.remote())
        print(f"{name}: buffer {setup.pinning}; emulation {'on' if setup.emulation else 'off'}")
        if not setup.buffer_pinned:
            failures.append(f"{name}: its staging buffer is not pinned on a GPU node ({setup.pinning})")
        if setup.emulation:
            failures.append(f"{name}: its SNIC is emulated although the config says emulation.enabled: false")
    return failures


def check_no_digests(cluster: Any, config_for: ConfigFor, layers: int, transport_moves: bool) -> list[str]:
    hbm_moves = "transport" if transport_moves else "cuda_copy"
    cfg = config_for(layers, hbm_moves, kv_digests=False)
    cluster.deploy("dualpath", cfg=cfg)
    return run_exact(cluster, f"kv_digests off, hbm_moves {hbm_moves}", small_trajectories(cfg))[1]


def check_sleep_wake(cluster: Any, config_for: ConfigFor, layers: int) -> list[str]:
    cfg = config_for(layers, "cuda_copy", kv_digests=False)
    cluster.deploy("dualpath", cfg=cfg)
    trajectories = small_trajectories(cfg)
    _, failures = run_exact(cluster, "before sleep", trajectories)
    free_awake = torch.cuda.mem_get_info()[0]
    freed = cluster.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    cluster.wake_up()
    free_woken = torch.cuda.mem_get_info()[0]
    print(f"sleep freed {freed / 1e6:.0f} MB; GPU free {free_awake / 1e6:.0f} -> {free_asleep / 1e6:.0f} MB "
          f"asleep -> {free_woken / 1e6:.0f} MB woken")
    if free_asleep - free_awake < HBM_SHARE * freed:
        failures.append(f"sleep freed {free_asleep - free_awake} bytes of HBM, under {HBM_SHARE} of the {freed} it reported")
    if free_asleep - free_woken < HBM_SHARE * freed:
        failures.append("wake did not allocate the engines' HBM again")
    pinned = {n: s.hbm_moves.mirrors_pinned for n, s in cluster.engine_stats().items()}
    if not all(m and all(m.values()) for m in pinned.values()):
        failures.append(f"after wake not every engine's host mirror is pinned: {pinned}")
    return failures + run_exact(cluster, "after wake", trajectories)[1]


def check_weight_sync(
    cluster: Any, logprob_errors: Callable[[DecoderModel, Sequence[Trajectory], Results], list[float]], tolerance: float,
) -> list[str]:
    """On the deployment check_sleep_wake left: broadcast new weights, then serve with them."""
    new_model = cluster.cfg.model.model_copy(update={"seed": cluster.cfg.model.seed + 101})
    sender = cluster.attach_weight_sender(group_name="device-check", timeout_s=120.0)
    print(f"weight group: backend {sender.backend} (trainer on {sender.device}, {torch.cuda.device_count()} GPU(s))")
    failures = []
    if torch.cuda.device_count() == 1 and sender.backend != "gloo":
        failures.append(f"one GPU shared by trainer and engines must give gloo (NCCL refuses it), got {sender.backend}")
    cluster.update_weights_from_group(sender, 1, DecoderModel(new_model).state_dict())
    trajectories = small_trajectories(cluster.cfg)
    results, run_failures = run_exact(cluster, "after the weight broadcast", trajectories)
    errors = logprob_errors(DecoderModel(new_model).to("cuda"), trajectories, results)
    print(f"log-prob vs recompute with the broadcast weights: max |diff| {max(errors):.4f}")
    if max(errors) > tolerance:
        failures.append(f"after the weight broadcast log-probs differ from the new weights' by {max(errors):.4f}")
    return failures + run_failures
