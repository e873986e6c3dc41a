"""Which compute an engine runs: the model, the emulated one (emulation/profile_compute.py) or vLLM.

The one place that picks it, from the config: `engine.backend: vllm` puts a vLLM engine of the
engine's role in the actor (runtime/vllm_engine/); otherwise `emulation.compute: profile` gives the
latency model's time with stamped KV, and `model` the real model on the engine's device. The
engines only see the `EngineCompute` contract (runtime/compute/engine_compute.py) and never branch
on which one they got. It sits in engine/, above the three implementations it chooses among.
"""

from __future__ import annotations

import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.config.engine import EngineBackend
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.compute.engine_compute import EngineCompute, ModelCompute
from dualpath_ray.protocol.types import Role


def make_compute(cfg: DualPathConfig, layout: KVLayout, device: torch.device, role: Role | None = None) -> EngineCompute:
    """The model on `device`, or the profile's emulated time when emulation.compute is profile;
    with engine.backend vllm, a vLLM engine of this engine's `role` (runtime/vllm_engine/compute.py)."""
    if cfg.engine.backend is EngineBackend.VLLM:
        if role is None:
            raise ValueError("a vLLM compute is sized for a prefill or a decode engine: pass its role")
        from dualpath_ray.runtime.vllm_engine.compute import VllmCompute  # imports vLLM: only when asked for

        return VllmCompute(cfg, layout, device, role)
    if cfg.emulation.compute == "profile":
        from dualpath_ray.runtime.emulation.profile_compute import ProfileCompute

        return ProfileCompute(cfg, layout, device)
    return ModelCompute(cfg, layout, device)
