"""The one configuration tree of dualpath_ray, loaded from YAML.

Every section is a pydantic model with `extra="forbid"`, so a misspelt key is an error, and
`load_config` turns pydantic's errors into `ConfigError` lines that name the YAML path of the
bad field (`cluster.snic_gbps`) and what is allowed there.

The package is a pure layer (the runtime is built on it, never the other way round): section.py
the error and the sections' base; model.py the `model` section; sections.py the cluster,
store, scheduler, emulation, sim and runtime sections; qos.py and verbs.py the `qos` and `verbs`
sections; tree.py the root `DualPathConfig` and `parse_config`; loading.py `load_config`; hf.py
the reading of a checkpoint's Hugging Face config.json. The tree's public names are importable
from here, the package itself: `from dualpath_ray.config import DualPathConfig`.
"""

from dualpath_ray.config.loading import load_config
from dualpath_ray.config.model import ROPE_SCALING_TYPES, ModelConfig, RopeScaling
from dualpath_ray.config.qos import QosConfig
from dualpath_ray.config.section import ConfigError
from dualpath_ray.config.engine import EngineBackend, EngineConfig
from dualpath_ray.config.sections import (
    ClusterConfig,
    EmulationConfig,
    RuntimeConfig,
    SchedulerConfig,
    SimConfig,
    StoreConfig,
)
from dualpath_ray.config.tree import DualPathConfig, parse_config
from dualpath_ray.config.verbs import VerbsConfig

__all__ = [
    "ROPE_SCALING_TYPES", "ClusterConfig", "ConfigError", "DualPathConfig", "EmulationConfig", "EngineBackend", "EngineConfig", "ModelConfig",
    "QosConfig", "RopeScaling", "RuntimeConfig", "SchedulerConfig", "SimConfig", "StoreConfig", "VerbsConfig",
    "load_config", "parse_config",
]
