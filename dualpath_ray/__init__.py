"""dualpath_ray: DualPath KV-cache loading for P/D-disaggregated agentic inference on Ray."""

from __future__ import annotations

from dualpath_ray.config import ConfigError, DualPathConfig, load_config

__all__ = ["ConfigError", "DualPathConfig", "load_config"]
__version__ = "0.1.0"
