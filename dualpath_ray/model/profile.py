"""Hardware profiles: a fitted layer latency model of one model on one machine, as a file.

What `dualpath profile` writes, the runtime's profile-compute emulation
and the cluster simulator load, and `HardwareProfile.load` reads:

    {
      "format": "dualpath-hardware-profile",   # fixed
      "version": 1,                            # this layout
      "source": "measured" | "default",        # measured by `dualpath profile`, or nominal
      "device": "cpu (16 threads)",            # where it was measured, free text
      "model": {"model_id": str, "n_layer": int, "hidden_size": int, "n_head": int,
                "n_kv_head": int, "head_dim": int, "intermediate_size": int, "dtype": str},
      "layer_model": {"per_request_ms": float, "per_token_ms": float, "per_context_ms": float},
      "fit": {"rms_relative_error": float, "max_relative_error": float} | null,
      "samples": [{"pairs": [[cached, bsz], ...], "ms": float}, ...]   # one layer, measured
    }

layer_model is per layer; a forward pass is n_layer layers (embedding and logits are not in the
profile). The model section must match the configured model's shape and dtype for the profile
to be used with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from dualpath_ray.config import ConfigError, DualPathConfig, ModelConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.model.latency import (
    FitQuality,
    LayerModel,
    Pairs,
    TimedBatch,
    fit_layer_model,
    time_calls_ms,
)

PROFILE_FORMAT = "dualpath-hardware-profile"
PROFILE_VERSION = 1
MODEL_SHAPE_FIELDS = (
    "n_layer", "hidden_size", "n_head", "n_kv_head", "head_dim", "intermediate_size", "dtype",
)

# The built-in default profile: a nominal accelerator, so emulation without a measured profile
# still gives model-shaped times. Measure real hardware with `dualpath profile`.
NOMINAL_FLOPS_PER_S = 2.0e12
NOMINAL_REQUEST_OVERHEAD_MS = 0.02

# The paper's coding trace appends 429 tokens per turn to a long cached context.
TYPICAL_APPENDED_TOKENS = 429

def describe_model(model: ModelConfig) -> dict[str, Any]:
    """The model section of a profile: the id, everything that sets a layer's time, and the
    context length (which sets the typical request of beta)."""
    description: dict[str, Any] = {"model_id": model.model_id}
    description.update({name: getattr(model, name) for name in MODEL_SHAPE_FIELDS})
    description["max_context"] = model.max_context
    return description


@dataclass(frozen=True)
class HardwareProfile:
    """A fitted layer model of one model on one machine, and the engine estimates built on it."""

    layer: LayerModel
    n_layer: int
    model: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    source: str = "measured"
    fit: FitQuality | None = None
    samples: tuple[TimedBatch, ...] = ()

    def attention_ms(self, pairs: Pairs) -> float:
        """Predicted time of one layer for a batch of (cached, bsz): the compute-quota predictor."""
        return self.layer.predict_ms(pairs)

    def forward_ms(self, pairs: Pairs) -> float:
        """Predicted time of a whole forward pass (all layers) of a batch."""
        return self.n_layer * self.layer.predict_ms(pairs)

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """One decode step (all layers) of `batch` requests attending to `context_tokens` cached
        tokens in total: each request computes one token, so the form needs only the two sums."""
        if batch < 0 or context_tokens < 0:
            raise ValueError(f"batch and context_tokens must be >= 0 (got {batch}, {context_tokens})")
        layer = self.layer
        per_layer = (
            (layer.per_request_ms + layer.per_token_ms) * batch
            + layer.per_context_ms * (context_tokens + batch)
        )
        return self.n_layer * per_layer

    def prefill_tokens_per_second(self, cached: int, bsz: int) -> float:
        """Computed (new) tokens per second of one engine prefilling such requests back to back."""
        return bsz / (self.forward_ms([(cached, bsz)]) / 1000.0)

    def prompt_tokens_per_second(self, cached: int, bsz: int) -> float:
        """Prompt tokens (cached + new) per second (what `dualpath profile` prints beside the
        new-token rate; tok and beta count computed tokens, prefill_tokens_per_second)."""
        return (cached + bsz) / (self.forward_ms([(cached, bsz)]) / 1000.0)

    def check_matches(self, model: ModelConfig, where: str = "profile") -> None:
        """Raise ConfigError unless this profile was made for a model of the same shape."""
        expected = describe_model(model)
        wrong = [
            f"{name}: profile {self.model.get(name)!r}, config {expected[name]!r}"
            for name in MODEL_SHAPE_FIELDS
            if self.model.get(name) != expected[name]
        ]
        if wrong:
            raise ConfigError(
                f"{where}: the hardware profile is for another model shape ({'; '.join(wrong)}); "
                "run `dualpath profile --config <this config> --out <file>` to measure this one"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "source": self.source,
            "device": self.device,
            "model": dict(self.model),
            "layer_model": {
                "per_request_ms": self.layer.per_request_ms,
                "per_token_ms": self.layer.per_token_ms,
                "per_context_ms": self.layer.per_context_ms,
            },
            "fit": None if self.fit is None else self.fit._asdict(),
            "samples": [{"pairs": [list(p) for p in s.pairs], "ms": s.ms} for s in self.samples],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<profile>") -> HardwareProfile:
        try:
            return _profile_from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: not a valid hardware profile ({exc})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read hardware profile ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: hardware profile is not JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))


def _profile_from_dict(data: Any) -> HardwareProfile:
    if not isinstance(data, dict):
        raise TypeError("the top level must be an object")
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(f"version must be {PROFILE_VERSION}, got {data.get('version')!r}")
    layer = data["layer_model"]
    model = dict(data["model"])
    n_layer = model["n_layer"]
    if not isinstance(n_layer, int) or n_layer < 1:
        raise ValueError(f"model.n_layer must be a positive integer, got {n_layer!r}")
    fit = data.get("fit")
    return HardwareProfile(
        layer=LayerModel(
            float(layer["per_request_ms"]), float(layer["per_token_ms"]), float(layer["per_context_ms"])
        ),
        n_layer=n_layer,
        model=model,
        device=str(data.get("device", "")),
        source=str(data.get("source", "measured")),
        fit=None if fit is None else FitQuality(float(fit["rms_relative_error"]), float(fit["max_relative_error"])),
        samples=tuple(
            TimedBatch(tuple((int(c), int(b)) for c, b in s["pairs"]), float(s["ms"]))
            for s in data.get("samples", [])
        ),
    )


def default_profile(model: ModelConfig) -> HardwareProfile:
    """The built-in profile: the model's FLOPs on a nominal accelerator (NOMINAL_FLOPS_PER_S)."""
    q_width, kv_width = model.n_head * model.head_dim, model.n_kv_head * model.head_dim
    projection_macs = model.hidden_size * (2 * q_width + 2 * kv_width)
    mlp_macs = 3 * model.hidden_size * model.intermediate_size
    # Scores and the weighted sum of values: two MACs per head and dimension per attended token.
    attention_macs = 2 * q_width
    ms_per_mac = 2 * 1000.0 / NOMINAL_FLOPS_PER_S
    layer = LayerModel(
        per_request_ms=NOMINAL_REQUEST_OVERHEAD_MS,
        per_token_ms=(projection_macs + mlp_macs) * ms_per_mac,
        per_context_ms=attention_macs * ms_per_mac,
    )
    return HardwareProfile(
        layer, model.n_layer, describe_model(model), device="nominal accelerator", source="default"
    )


def load_profile_for(cfg: DualPathConfig) -> HardwareProfile:
    """The profile of `cfg.emulation.profile_path`, checked against the model, or the default."""
    path = cfg.emulation.profile_path
    if path is None:
        return default_profile(cfg.model)
    profile = HardwareProfile.load(path)
    profile.check_matches(cfg.model, where=f"emulation.profile_path ({path})")
    return profile


def attention_predictor(cfg: DualPathConfig) -> Callable[[list[tuple[int, int]]], float]:
    """The per-layer batch-time predictor that prefill engines pack batches with."""
    return load_profile_for(cfg).attention_ms


def typical_request(max_context: int) -> tuple[int, int]:
    """(cached, bsz) of a typical agentic turn at this context length: half the context cached,
    TYPICAL_APPENDED_TOKENS appended (at most a quarter of the context, at least one token)."""
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1 (got {max_context})")
    bsz = max(1, min(TYPICAL_APPENDED_TOKENS, max_context // 4))
    return min(max_context // 2, max_context - bsz), bsz


def derive_alpha(snic_gbps: float, bytes_per_token: int, alpha_seconds: float = 3.0) -> int:
    """alpha: tokens of KV (all layers) the node's storage NIC reads in `alpha_seconds`."""
    if snic_gbps <= 0 or bytes_per_token <= 0 or alpha_seconds <= 0:
        raise ValueError(
            f"snic_gbps, bytes_per_token and alpha_seconds must be > 0 "
            f"(got {snic_gbps}, {bytes_per_token}, {alpha_seconds})"
        )
    return int(alpha_seconds * snic_gbps * 1e9 / 8 / bytes_per_token)


def derive_beta(
    profile: HardwareProfile, beta_seconds: float = 5.0, request: tuple[int, int] | None = None
) -> int:
    """beta: tokens one engine prefills (computes) in `beta_seconds` of typical requests.

    beta bounds a prefill engine's tok, which counts the tokens its requests compute (prompt -
    hits, scheduling/loads.py), so beta counts computed tokens too; `request` is the (cached,
    bsz) of a typical request (default: `typical_request`).
    """
    if beta_seconds <= 0:
        raise ValueError(f"beta_seconds must be > 0 (got {beta_seconds})")
    if request is None:
        max_context = profile.model.get("max_context")
        if not isinstance(max_context, int):
            raise ValueError("the profile names no model.max_context; pass request=(cached, bsz)")
        request = typical_request(max_context)
    return int(beta_seconds * profile.prefill_tokens_per_second(*request))


class SchedulerConstants(NamedTuple):
    alpha: int
    beta: int


def derive_alpha_beta(cfg: DualPathConfig, layout: KVLayout) -> SchedulerConstants:
    """alpha and beta of the configured cluster and model, as paper section 6 defines them."""
    alpha = derive_alpha(cfg.cluster.snic_gbps, layout.bytes_per_token, cfg.scheduler.alpha_seconds)
    profile = load_profile_for(cfg)
    beta = derive_beta(profile, cfg.scheduler.beta_seconds, typical_request(cfg.model.max_context))
    return SchedulerConstants(alpha, beta)


def profile_attention(
    run_layer: Callable[[int, int], object],
    samples: Sequence[tuple[int, int]],
    *,
    n_layer: int = 1,
    model: ModelConfig | None = None,
    device: str = "",
    repeats: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> HardwareProfile:
    """Time `run_layer(cached, bsz)` (one layer, one request) at each sample and fit the form.

    `run_layer` must return only when its work is done (synchronise an accelerator inside it)
    and should do no set-up it would not do in service. Each sample's time is the median of
    `repeats` runs after `warmup` untimed ones. With `model`, n_layer comes from it.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    for cached, bsz in samples:
        if cached < 0 or bsz < 1:
            raise ValueError(f"sample (cached={cached}, bsz={bsz}) needs cached >= 0 and bsz >= 1")
    calls = [partial(run_layer, cached, bsz) for cached, bsz in samples]
    medians = time_calls_ms(calls, repeats, warmup, clock)
    timed = tuple(TimedBatch(((c, b),), ms) for (c, b), ms in zip(samples, medians))
    layer, quality = fit_layer_model(timed)
    description = describe_model(model) if model is not None else {}
    if model is not None:
        n_layer = model.n_layer
    return HardwareProfile(
        layer, n_layer, description, device=device, source="measured", fit=quality, samples=timed
    )
