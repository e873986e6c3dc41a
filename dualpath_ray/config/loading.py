"""Loading a YAML config file, filling the model fields it leaves out from the checkpoint's
Hugging Face config.json (config/hf.py) and rejecting those that disagree with it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from dualpath_ray.config.hf import WeightsError, model_fields_from_hf_config
from dualpath_ray.config.model import ModelConfig
from dualpath_ray.config.section import ConfigError
from dualpath_ray.config.tree import DualPathConfig, parse_config


def load_config(path: str | Path | None = None) -> DualPathConfig:
    """Load a YAML config file; None gives the embedded defaults."""
    if path is None:
        return DualPathConfig()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(_with_checkpoint_model_fields(data, path), source=str(path))


# Fields the YAML may set differently from config.json: the compute dtype (weights are
# converted on load), and a shorter context than the checkpoint supports.
_CHOSEN_FIELDS = ("dtype",)
_BOUNDED_FIELDS = ("max_context",)


def _with_checkpoint_model_fields(data: Any, source: Path) -> Any:
    """`data` with the model fields the YAML leaves out read from `weights_dir`/config.json.

    A field the YAML gives that disagrees with config.json is a ConfigError naming both values:
    the checkpoint's architecture is a fact, and running it with another one would compute a
    different model without any error.
    """
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("weights_dir") is None:
        return data
    hf_path = Path(str(model["weights_dir"])) / "config.json"
    if not hf_path.is_file():
        return data
    try:
        from_hf = model_fields_from_hf_config(hf_path.parent)
    except WeightsError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    conflicts = [
        line
        for name, value in from_hf.items()
        if name in model and (line := _disagreement(name, model[name], value, hf_path))
    ]
    if conflicts:
        raise ConfigError(f"{source}: the YAML disagrees with the checkpoint\n  " + "\n  ".join(conflicts))
    return {**data, "model": {**from_hf, **model}}


def _disagreement(name: str, ours: Any, theirs: Any, hf_path: Path) -> str | None:
    """The error line when the YAML's `ours` and config.json's `theirs` differ, else None."""
    if name in _CHOSEN_FIELDS:
        return None
    # Compare validated values, so YAML 1e-6 (a string to YAML 1.1) equals JSON 1e-06.
    adapter: TypeAdapter[Any] = TypeAdapter(ModelConfig.model_fields[name].annotation)
    try:
        theirs_value = adapter.validate_python(theirs)
    except ValidationError:
        theirs_value = theirs  # not runnable here; only an identical YAML value agrees with it
    try:
        ours_value = adapter.validate_python(ours)
    except ValidationError:
        return None  # parse_config reports the YAML's invalid value by its path
    if name in _BOUNDED_FIELDS:
        if ours_value <= theirs_value:
            return None
        return f"model.{name}: YAML says {ours!r}, above the {theirs!r} that {hf_path} allows"
    if isinstance(ours_value, float) and isinstance(theirs_value, float):
        agree = math.isclose(ours_value, theirs_value, rel_tol=1e-9)
    else:
        agree = ours_value == theirs_value
    return None if agree else f"model.{name}: YAML says {ours!r}, {hf_path} says {theirs!r}"
