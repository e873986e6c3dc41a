"""Emulated hardware: the one place that knows whether NICs and GPU time are real.

Two things are emulated on a machine without the paper's hardware:
- NIC bandwidth (links.py): a token bucket per direction of each node SNIC and engine CNIC;
- engine compute (profile_compute.py): the fitted latency model's time, with stamped KV
  (stamps.py) so that every byte the decode side assembles can still be checked.
`make_link` picks the real or emulated link from the config; runtime/engine/compute_choice.py
`make_compute` picks the emulated compute when `emulation.compute` is profile. The engines only
see `Link` and `EngineCompute` and never branch on which one they got.
"""

from __future__ import annotations

from dualpath_ray.runtime.emulation.links import FifoTurns, Link, TokenBucket, gbps_to_bytes_s, make_link

__all__ = ["FifoTurns", "Link", "TokenBucket", "gbps_to_bytes_s", "make_link"]
