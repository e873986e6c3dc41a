"""The engine-time model: what a prefill layer, a decode step and a token's KV cost.

One model, two drivers: the runtime's profile-compute emulation (runtime/emulation/
profile_compute.py) sleeps these times, and the cluster simulator (dualpath_ray/sim/) advances
its clock by them; prefill engines of both pack their batches with `prefill_layer_ms` as the
compute-quota predictor. Two sources of numbers:

- `ProfileCost`: a hardware profile fitted on this machine by `dualpath profile`
  (model/profile.py), whose layer form (model/latency.py) gives prefill layers and decode steps.
- `GpuCost`: a GPU-class node and model described by data files (cluster_configs/profiles/),
  derived from FLOPs and bytes at stated efficiencies (sim/profiles.py loads them):

    prefill layer of a batch of (cached, bsz) pairs, per layer, in ms:
        per_request_ms * n + per_token_ms * sum(bsz) + per_context_ms * sum(bsz * (cached + bsz))
      per_token_ms   = (2 * active params per layer + sparse attention FLOPs per query) / (peak * MFU)
      per_context_ms = attention FLOPs per (query, key) pair / (peak * MFU)
        (dense attention: every key; sparse (DSA) attention: the indexer's, at its own dtype's peak)
    decode step of `batch` requests over `context` cached tokens in total, all layers, in ms:
        fixed_ms + per_seq_ms * batch + per_context_ms * context
      fixed_ms       = weight bytes on the GPU / (HBM bandwidth * MBU)
      per_seq_ms     = 2 * active params / (peak * MFU) + KV bytes each query reads / (HBM * MBU)
      per_context_ms = KV (dense) or indexer (sparse) bytes per cached token / (HBM * MBU)

Both implement `EngineCost`; nothing else in the code knows which one it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dualpath_ray.model.latency import LayerModel, Pairs

if TYPE_CHECKING:
    from dualpath_ray.model.profile import HardwareProfile


class EngineCost(Protocol):
    """Engine time and KV size of one model on one kind of accelerator."""

    @property
    def n_layer(self) -> int: ...

    @property
    def kv_bytes_per_token_per_layer(self) -> int: ...

    def prefill_layer_ms(self, pairs: Pairs) -> float:
        """Predicted time of one layer over a batch of (cached, bsz): the compute-quota predictor."""
        ...

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """One decode step (all layers) of `batch` requests attending to `context_tokens` in total."""
        ...


def kv_bytes_per_token(cost: EngineCost) -> int:
    """All layers of one token: the unit of SNIC reads, read queues and Full Blocks."""
    return cost.n_layer * cost.kv_bytes_per_token_per_layer


def prefill_forward_ms(cost: EngineCost, pairs: Pairs) -> float:
    """A whole prefill forward (every layer) of a batch, compute only."""
    return cost.n_layer * cost.prefill_layer_ms(pairs)


def prefill_tokens_per_second(cost: EngineCost, cached: int, bsz: int) -> float:
    """Computed (new) tokens one engine prefills per second of such requests back to back: the
    unit of a prefill engine's tok (scheduling/loads.py, prefill_tokens), and so of beta."""
    return bsz / (prefill_forward_ms(cost, [(cached, bsz)]) / 1000.0)


def derive_beta_tokens(cost: EngineCost, beta_seconds: float, typical: tuple[int, int]) -> int:
    """beta (paper section 6): tokens one engine prefills (computes) in `beta_seconds` of typical
    requests; the same definition as model/profile.py's derive_beta, for any EngineCost."""
    if beta_seconds <= 0:
        raise ValueError(f"beta_seconds must be > 0 (got {beta_seconds})")
    return int(beta_seconds * prefill_tokens_per_second(cost, *typical))


@dataclass(frozen=True)
class ProfileCost:
    """A fitted hardware profile of this machine: the runtime's emulated compute time."""

    profile: HardwareProfile
    kv_bytes_per_token_per_layer: int

    @property
    def n_layer(self) -> int:
        return self.profile.n_layer

    def prefill_layer_ms(self, pairs: Pairs) -> float:
        return self.profile.attention_ms(pairs)

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        return self.profile.decode_step_ms(batch, context_tokens)


@dataclass(frozen=True)
class DecodeModel:
    """A decode step over all layers: fixed_ms + per_seq_ms * batch + per_context_ms * context."""

    fixed_ms: float
    per_seq_ms: float
    per_context_ms: float

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_seq_ms", "per_context_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"decode model {name} must be >= 0 (got {getattr(self, name)})")

    def step_ms(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.fixed_ms + self.per_seq_ms * batch + self.per_context_ms * context_tokens


@dataclass(frozen=True)
class GpuCost:
    """A GPU-class engine: a derived per-layer prefill form and a decode step model."""

    layer: LayerModel
    decode: DecodeModel
    n_layer: int
    kv_bytes_per_token_per_layer: int
    # KV tokens one decode engine's HBM holds once the weights and a reserve are taken.
    hbm_kv_tokens: int

    def prefill_layer_ms(self, pairs: Pairs) -> float:
        return self.layer.predict_ms(pairs)

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        return self.decode.step_ms(batch, context_tokens)


def cost_of_profile(profile: HardwareProfile, kv_bytes_per_token_per_layer: int) -> ProfileCost:
    """The engine cost of a fitted hardware profile (the runtime's and the calibration's)."""
    if kv_bytes_per_token_per_layer < 1:
        raise ValueError(f"kv_bytes_per_token_per_layer must be >= 1 (got {kv_bytes_per_token_per_layer})")
    return ProfileCost(profile, kv_bytes_per_token_per_layer)


@dataclass(frozen=True)
class GpuHardware:
    """One GPU-class node (cluster_configs/profiles/hardware/*.yaml; units in the names)."""

    gpus_per_node: int
    cnic_gbps: float
    snic_gbps: float
    dram_gbs: float
    hbm_bytes: float
    hbm_gbs: float
    bf16_tflops: float
    fp8_tflops: float
    prefill_mfu: float
    decode_mbu: float
    hbm_reserve_bytes: float
    layer_overhead_ms: float


@dataclass(frozen=True)
class GpuModel:
    """One model's size and FLOPs (cluster_configs/profiles/models/*.yaml). sparse_topk 0 means
    dense attention; otherwise each query attends to sparse_topk keys a lightning indexer picks
    from all of them (DeepSeek Sparse Attention)."""

    n_layer: int
    kv_values_per_token_per_layer: int
    kv_dtype_bytes: int
    active_params: float
    total_params: float
    weight_bytes_per_param: float
    attention_pair_flops: float
    sparse_topk: int
    indexer_pair_flops: float
    indexer_bytes_per_token_per_layer: float
    expert_parallel_gpus: int
    expert_parallel_prefill: bool
    buffer_bytes_per_node: float

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.kv_values_per_token_per_layer * self.kv_dtype_bytes

    @property
    def sparse(self) -> bool:
        return self.sparse_topk > 0


def weight_bytes_per_gpu(model: GpuModel, decode_gpus: int) -> float:
    """Weights one decode GPU holds: experts spread over min(EP degree, decode GPUs)."""
    spread = max(1, min(model.expert_parallel_gpus, decode_gpus))
    return model.total_params * model.weight_bytes_per_param / spread


def derive_gpu_cost(hw: GpuHardware, model: GpuModel, decode_gpus: int) -> GpuCost:
    """The engine-time model of `model` on `hw` from FLOPs and bytes (module docstring)."""
    ms = 1000.0
    bf16 = hw.bf16_tflops * 1e12 * hw.prefill_mfu
    fp8 = hw.fp8_tflops * 1e12 * hw.prefill_mfu
    hbm = hw.hbm_gbs * 1e9 * hw.decode_mbu
    n_layer = model.n_layer
    kv_token = model.kv_bytes_per_token_per_layer * n_layer
    dense_token_flops = 2 * model.active_params
    if model.sparse:
        token_flops_per_layer = dense_token_flops / n_layer + model.sparse_topk * model.attention_pair_flops
        context_ms = model.indexer_pair_flops / fp8 * ms
        per_seq_read = model.sparse_topk * kv_token
        context_read = model.indexer_bytes_per_token_per_layer * n_layer
    else:
        token_flops_per_layer = dense_token_flops / n_layer
        context_ms = model.attention_pair_flops / bf16 * ms
        per_seq_read = 0.0
        context_read = kv_token
    layer = LayerModel(hw.layer_overhead_ms, token_flops_per_layer / bf16 * ms, context_ms)
    weights = weight_bytes_per_gpu(model, decode_gpus)
    decode = DecodeModel(
        fixed_ms=weights / hbm * ms + n_layer * hw.layer_overhead_ms,
        per_seq_ms=dense_token_flops / bf16 * ms + per_seq_read / hbm * ms,
        per_context_ms=context_read / hbm * ms,
    )
    free = hw.hbm_bytes - weights - hw.hbm_reserve_bytes
    if free < kv_token:
        raise ValueError(
            f"no KV fits a decode GPU: {hw.hbm_bytes / 1e9:.0f} GB HBM - {weights / 1e9:.1f} GB weights "
            f"- {hw.hbm_reserve_bytes / 1e9:.0f} GB reserve; use more decode GPUs (cluster.decode_nodes) or a smaller model"
        )
    return GpuCost(layer, decode, n_layer, model.kv_bytes_per_token_per_layer, int(free // kv_token))


@dataclass(frozen=True)
class WithDecode:
    """Another cost's prefill with a measured decode step (a machine whose decode steps the
    prefill-layer form does not predict: the runtime's CPU engines, see benchmarks/sim/calibrate.py)."""

    base: EngineCost
    decode: DecodeModel

    @property
    def n_layer(self) -> int:
        return self.base.n_layer

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.base.kv_bytes_per_token_per_layer

    def prefill_layer_ms(self, pairs: Pairs) -> float:
        return self.base.prefill_layer_ms(pairs)

    def decode_step_ms(self, batch: int, context_tokens: int) -> float:
        return self.decode.step_ms(batch, context_tokens)
