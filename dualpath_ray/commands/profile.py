"""`dualpath profile`: measure the configured model's layer time here and fit the latency model.

The result is a hardware profile (format in dualpath_ray.model.profile) for
`emulation.profile_path`, the runtime's profile-compute mode and the cluster simulator.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dualpath_ray.config import DualPathConfig, ModelConfig, load_config
from dualpath_ray.config.engine import EngineBackend
from dualpath_ray.kv.layout import KVLayout, torch_dtype
from dualpath_ray.model.profile import (
    HardwareProfile,
    derive_alpha,
    derive_beta,
    profile_attention,
    typical_request,
)

CACHED_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 0.75)
BATCH_SIZES = (1, 4, 16, 64, 256, 1024)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile", help="measure the model's layer time on this machine and fit the latency model",
        description=__doc__,
    )
    parser.add_argument("--config", type=Path, help="cluster config YAML (default: embedded defaults)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per sample (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before each sample")
    parser.add_argument("--max-bsz", type=int, default=max(BATCH_SIZES), help="largest bsz sampled")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where the model runs (auto: cuda when available, else cpu)",
    )
    parser.set_defaults(func=run)


def sample_grid(max_context: int, max_bsz: int) -> list[tuple[int, int]]:
    """(cached, bsz) samples spread over the context, each within max_context."""
    cached_points = sorted({int(max_context * f) for f in CACHED_FRACTIONS})
    sizes = sorted({min(b, max_bsz) for b in BATCH_SIZES} | {1})
    return [
        (cached, bsz) for cached in cached_points for bsz in sizes if cached + bsz <= max_context
    ]


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    return torch.device(choice)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"{platform.machine() or 'unknown'} cpu, {torch.get_num_threads()} torch threads"


def layer_runner(model_cfg: ModelConfig, device: torch.device) -> Callable[[int, int], object]:
    """run_layer(cached, bsz) on layer 0 of the real model, inputs made once up front; it waits
    for the device, so a timer around it measures the layer's work."""
    from dualpath_ray.model.llama import DecoderModel

    model = DecoderModel(model_cfg).to(device)
    dtype = torch_dtype(model_cfg.dtype)
    generator = torch.Generator().manual_seed(model_cfg.seed)
    width = model_cfg.max_context
    hidden = torch.randn(width, model_cfg.hidden_size, generator=generator).to(device, dtype)
    past = torch.randn(width, 2, model_cfg.n_kv_head, model_cfg.head_dim, generator=generator).to(device, dtype)
    positions = torch.arange(width, dtype=torch.long, device=device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else None

    def run_layer(cached: int, bsz: int) -> object:
        out = model.forward_layer(
            0, hidden[:bsz], positions[cached : cached + bsz], past[:cached] if cached else None
        )
        if synchronize is not None:
            synchronize(device)
        return out

    return run_layer


def _summary(cfg: DualPathConfig, profile: HardwareProfile, out: Path) -> str:
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    cached, bsz = typical_request(cfg.model.max_context)
    layer = profile.layer
    fit = profile.fit
    lines = [
        f"profile of {cfg.model.model_id} ({profile.n_layer} layers) on {profile.device}: {out}",
        f"  layer ms = {layer.per_request_ms:.4g} * n + {layer.per_token_ms:.4g} * sum(bsz)"
        f" + {layer.per_context_ms:.4g} * sum(bsz * (cached + bsz))",
    ]
    if fit is not None:
        lines.append(
            f"  fit over {len(profile.samples)} samples: rms relative error {fit.rms_relative_error:.1%},"
            f" max {fit.max_relative_error:.1%}"
        )
    lines += [
        f"  typical request (cached {cached}, bsz {bsz}): "
        f"{profile.prefill_tokens_per_second(cached, bsz):,.0f} new tokens/s, "
        f"{profile.prompt_tokens_per_second(cached, bsz):,.0f} prompt tokens/s",
        f"  decode step, 8 requests of {cached} cached tokens: "
        f"{profile.decode_step_ms(8, 8 * cached):.3f} ms",
        f"  alpha = {derive_alpha(cfg.cluster.snic_gbps, layout.bytes_per_token, cfg.scheduler.alpha_seconds):,}"
        f" tokens, beta = {derive_beta(profile, cfg.scheduler.beta_seconds, (cached, bsz)):,} tokens to compute",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.warmup < 0 or args.max_bsz < 1:
        print("dualpath profile: --repeats and --max-bsz must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    if cfg.engine.backend is not EngineBackend.NATIVE:
        print(
            f"dualpath profile: it times the native model's layers (the simulator's and profile compute's latency "
            f"model); engine.backend is {cfg.engine.backend}, whose kernels it cannot time. Profile with "
            "engine.backend: native, or measure the vLLM engines with `dualpath bench`",
            file=sys.stderr,
        )
        return 2
    samples = sample_grid(cfg.model.max_context, args.max_bsz)
    if len(samples) < 3:
        print(
            f"dualpath profile: model.max_context={cfg.model.max_context} leaves fewer than 3 samples",
            file=sys.stderr,
        )
        return 2
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        print(f"dualpath profile: {exc}", file=sys.stderr)
        return 2
    profile = profile_attention(
        layer_runner(cfg.model, device), samples, model=cfg.model, device=describe_device(device),
        repeats=args.repeats, warmup=args.warmup,
    )
    try:
        profile.save(args.out)
    except OSError as exc:
        print(f"dualpath profile: cannot write {args.out} ({exc.strerror})", file=sys.stderr)
        return 2
    print(_summary(cfg, profile, args.out))
    return 0
