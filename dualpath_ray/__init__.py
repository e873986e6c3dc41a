"""dualpath_ray: DualPath KV-cache loading for P/D-disaggregated agentic inference on Ray."""

from __future__ import annotations

from typing import Any

from dualpath_ray.config import ConfigError, DualPathConfig, load_config

__all__ = [
    "ConfigError", "DualPathCluster", "DualPathConfig", "RolloutResult", "TokenOutput", "load_config", "read_trace",
]

# Ray and torch load only when the runtime is used, so `dualpath bounds` and config checks stay light.
_LAZY = {
    "DualPathCluster": "dualpath_ray.cluster",
    "RolloutResult": "dualpath_ray.api",
    "TokenOutput": "dualpath_ray.api",
    "read_trace": "dualpath_ray.workload.trace",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dualpath_ray' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
__version__ = "0.1.0"
