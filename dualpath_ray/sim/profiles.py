"""GPU-class hardware and model profiles (cluster_configs/profiles/), and a config filled from them.

A profile file is YAML:

    format: dualpath-gpu-hardware | dualpath-gpu-model
    version: 1
    name: <free text>
    values:
      <field>: {value: <number or bool>, source: "<where the number comes from>"}

Every field of `GpuHardware` / `GpuModel` (model/cost.py) must be there, each with a non-empty
source: a number without a source is an error, not a default.

`load_sim_config(path)` reads a cluster config like `load_config`, and when its `sim` section
names both profiles, fills the cluster fields the YAML leaves out from them (GPUs per node,
NIC and DRAM rates, HBM KV tokens per decode engine, buffer blocks per node); a field the YAML
sets differently from the profile is an error naming both values.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dualpath_ray.config import ConfigError, DualPathConfig, parse_config
from dualpath_ray.model.cost import GpuHardware, GpuModel, derive_gpu_cost

HARDWARE_FORMAT = "dualpath-gpu-hardware"
MODEL_FORMAT = "dualpath-gpu-model"
PROFILE_VERSION = 1

Record = TypeVar("Record", GpuHardware, GpuModel)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def _load_record(path: Path, kind: type[Record], file_format: str) -> Record:
    data = _read_yaml(path)
    if not isinstance(data, dict) or data.get("format") != file_format:
        raise ConfigError(f"{path}: format must be {file_format!r}")
    if data.get("version") != PROFILE_VERSION:
        raise ConfigError(f"{path}: version must be {PROFILE_VERSION}, got {data.get('version')!r}")
    values = data.get("values")
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: 'values' must map each field to {{value, source}}")
    wanted = {spec.name: spec for spec in fields(kind)}
    unknown = sorted(set(values) - set(wanted))
    if unknown:
        raise ConfigError(f"{path}: values.{unknown[0]}: unknown field; allowed: {', '.join(wanted)}")
    parsed: dict[str, Any] = {}
    for name in wanted:
        entry = values.get(name)
        if not isinstance(entry, dict) or "value" not in entry:
            raise ConfigError(f"{path}: values.{name}: missing; give {{value: ..., source: ...}}")
        source = entry.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ConfigError(f"{path}: values.{name}.source: every number needs the source it comes from")
        parsed[name] = _typed(path, name, entry["value"], wanted[name].type)
    return kind(**parsed)


def _typed(path: Path, name: str, value: Any, annotation: Any) -> Any:
    expected = str(annotation)
    if expected == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: values.{name}.value must be true or false (got {value!r})")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{path}: values.{name}.value must be a number >= 0 (got {value!r})")
    if expected == "int":
        if value != int(value):
            raise ConfigError(f"{path}: values.{name}.value must be an integer (got {value!r})")
        return int(value)
    return float(value)


def load_hardware(path: str | Path) -> GpuHardware:
    return _load_record(Path(path), GpuHardware, HARDWARE_FORMAT)


def load_model(path: str | Path) -> GpuModel:
    return _load_record(Path(path), GpuModel, MODEL_FORMAT)


def profile_cluster_fields(
    hardware: GpuHardware, model: GpuModel, decode_gpus: int, block_size: int
) -> dict[str, Any]:
    """The cluster fields the profiles determine."""
    try:
        cost = derive_gpu_cost(hardware, model, decode_gpus)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    block_bytes = block_size * model.n_layer * model.kv_bytes_per_token_per_layer
    return {
        "gpus_per_node": hardware.gpus_per_node,
        "cnic_gbps": hardware.cnic_gbps,
        "snic_gbps": hardware.snic_gbps,
        "dram_gbs": hardware.dram_gbs,
        "hbm_tokens_per_engine": cost.hbm_kv_tokens,
        "buffer_blocks_per_node": max(1, int(model.buffer_bytes_per_node // block_bytes)),
    }


def fill_from_profiles(data: dict[str, Any], base: Path | None = None) -> dict[str, Any]:
    """`data` (a parsed config mapping) with the cluster fields it leaves out taken from the
    profiles its `sim` section names; paths in `sim` are relative to `base` (the YAML's folder)."""
    sim = data.get("sim") or {}
    if not isinstance(sim, dict) or sim.get("hardware_profile") is None or sim.get("model_profile") is None:
        return data
    resolve = (lambda p: Path(p) if base is None or Path(p).is_absolute() else base / p)
    sim = {**sim, "hardware_profile": resolve(sim["hardware_profile"]), "model_profile": resolve(sim["model_profile"])}
    hardware, model = load_hardware(sim["hardware_profile"]), load_model(sim["model_profile"])
    cluster = dict(data.get("cluster") or {})
    defaults = DualPathConfig().cluster
    gpus = cluster.get("gpus_per_node", hardware.gpus_per_node)
    decode_gpus = cluster.get("decode_nodes", defaults.decode_nodes) * gpus
    block_size = (data.get("store") or {}).get("block_size", DualPathConfig().store.block_size)
    conflicts = []
    for name, value in profile_cluster_fields(hardware, model, decode_gpus, block_size).items():
        if name not in cluster:
            cluster[name] = value
        elif cluster[name] != value:
            conflicts.append(f"cluster.{name}: YAML says {cluster[name]!r}, the profiles say {value!r}")
    if conflicts:
        raise ConfigError("the config disagrees with its sim profiles\n  " + "\n  ".join(conflicts))
    return {**data, "cluster": cluster, "sim": sim}


def load_sim_config(path: str | Path | None) -> DualPathConfig:
    """A cluster config for the simulator: `load_config`'s, filled from its sim profiles."""
    if path is None:
        return DualPathConfig()
    path = Path(path)
    data = _read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_config(fill_from_profiles(data, path.parent), source=str(path))


def sim_config(data: dict[str, Any]) -> DualPathConfig:
    """A simulator config from a mapping (benchmarks build theirs this way)."""
    return parse_config(fill_from_profiles(data), source="<sim config>")
