"""Emulated hardware: the one place that knows whether NICs and GPU time are real.

Two things are emulated on a machine without the paper's hardware:
- NIC bandwidth (links.py): a token bucket per direction of each node SNIC and engine CNIC;
- engine compute (profile_compute.py): the fitted latency model's time, with stamped KV
  (stamps.py) so that every byte the decode side assembles can still be checked.
`make_link` and `make_compute` pick the real or emulated implementation from the config; the
engines only see `Link` and `EngineCompute` and never branch on which one they got.
"""

from __future__ import annotations

import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.scheduling.types import Role
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.engine.compute import EngineCompute
from dualpath_ray.runtime.emulation.links import FifoTurns, Link, TokenBucket, gbps_to_bytes_s, make_link

__all__ = ["FifoTurns", "Link", "TokenBucket", "gbps_to_bytes_s", "make_compute", "make_link"]


def make_compute(cfg: DualPathConfig, layout: KVLayout, device: torch.device, role: Role | None = None) -> EngineCompute:
    """The model on `device`, or the profile's emulated time when emulation.compute is profile;
    with engine.backend vllm, a vLLM engine of this engine's `role` (runtime/vllm_engine/compute.py)."""
    if cfg.engine.backend == "vllm":
        if role is None:
            raise ValueError("a vLLM compute is sized for a prefill or a decode engine: pass its role")
        from dualpath_ray.runtime.vllm_engine.compute import VllmCompute

        return VllmCompute(cfg, layout, device, role)
    if cfg.emulation.compute == "profile":
        from dualpath_ray.runtime.emulation.profile_compute import ProfileCompute

        return ProfileCompute(cfg, layout, device)
    from dualpath_ray.runtime.engine.compute import ModelCompute

    return ModelCompute(cfg, layout, device)
