"""Small simulator set-ups whose times can be worked out by hand.

Every case uses the same hardware: the tiny model (2 layers, 2 KV heads of dim 16, float32: 256
bytes per token per layer, 512 per token, 32 KiB per 64-token block), SNICs of 1 MB/s, DRAM of
1 TB/s, and an engine-time profile where a prefill layer takes 1 ms per computed token and a
decode step 2 ms per request (2 layers x 1 ms), nothing else. Token buckets are off (emulation
disabled), so every link is a plain FIFO queue at its rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.model.latency import LayerModel
from dualpath_ray.model.profile import HardwareProfile, describe_model
from dualpath_ray.workload.trace import Trajectory, Turn

BLOCK = 64
PER_TOKEN_LAYER_BYTES = 256
SNIC_BYTES_S = 1e6


def case_config(tmp_path: Path, prefill_gpus: int = 1, decode_gpus: int = 1, cnic_gbps: float = 8.0,
                **runtime: Any) -> DualPathConfig:
    data = {
        "model": {"n_layer": 2, "max_context": 4096},
        "cluster": {
            "prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": max(prefill_gpus, decode_gpus),
            "snic_gbps": SNIC_BYTES_S * 8 / 1e9, "cnic_gbps": cnic_gbps, "dram_gbs": 1000.0,
            "hbm_tokens_per_engine": 4096, "buffer_blocks_per_node": 64,
        },
        "store": {"block_size": BLOCK},
        "emulation": {"enabled": False},
        "runtime": dict(runtime),
    }
    cfg = parse_config(data)
    profile = HardwareProfile(LayerModel(0.0, 1.0, 0.0), cfg.model.n_layer, describe_model(cfg.model), source="test")
    path = tmp_path / "profile.json"
    profile.save(path)
    return cfg.with_overrides(emulation={"profile_path": str(path)})


def two_turns(name: str) -> Trajectory:
    """Turn 0: 200 tokens, 2 generated (its 3 full blocks are stored after it); turn 1: 10 more
    tokens, so a 212-token prompt that hits 192 and computes 20, and 3 generated (2 steps)."""
    return Trajectory(name, (Turn(tuple(range(200)), 2), Turn(tuple(range(10)), 3)))
