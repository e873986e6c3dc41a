"""What one simulation runs with: the config's topology and rates, the engine-time model, options.

`SimOptions` are the simulator's own knobs (ablations and reporting), not part of the config
tree: the runtime has no such switches. `settings_for` resolves a config into `SimSettings`:
- with `sim.hardware_profile` / `sim.model_profile`: a GPU-class node and model (model/cost.py's
  derived cost), alpha from the SNIC and the model's KV per token, beta from the derived cost;
- without: this machine as the runtime emulates it: the emulation profile's fitted cost, the
  model section's KV layout, alpha and beta exactly as the runtime's scheduler derives them,
  and the token buckets' burst (emulation.burst_seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from dualpath_ray.config import ConfigError, DualPathConfig
from dualpath_ray.model.cost import DecodeModel, EngineCost, WithDecode, derive_beta_tokens, derive_gpu_cost
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.staging import StagingSettings
from dualpath_ray.protocol.types import Mode

@dataclass(frozen=True)
class SimOptions:
    """Simulator-only knobs. Defaults model the runtime as it is."""

    layerwise: bool = True  # False: every layer's hit KV is loaded before the first computes (ablation)
    path_choice: Literal["read_queue", "round_robin"] = "read_queue"  # round_robin: ablation baseline
    # What the compute quota bounds: "layer" = one layer's predicted time (what the runtime's prefill
    # engines pack with: model/profile.py's attention_predictor), "forward" = the whole forward's
    # (every layer), a reading of the paper's quota that matters for many-layer models. None = the
    # config's sim.quota_scope (default forward), so the CLI, the config and the benchmark scripts
    # share one default; settings_for always resolves it.
    quota_scope: Literal["layer", "forward"] | None = None
    # When a request is bound to one engine of a lockstep (data-parallel attention) prefill node:
    # "placement" = the engine the scheduler chose runs it (the paper's); "round" = the round that
    # runs it may give it to a peer with less work (scheduling/batching.py: pack_lockstep_round).
    lockstep_binding: Literal["placement", "round"] = "placement"
    pull_delay_s: float = 0.0  # from a reason to pull to the scheduler's decision (the runtime's RPCs)
    result_delay_s: float = 0.0  # from a turn's last write to its caller having the result (RPCs)
    decode_model: DecodeModel | None = None  # a measured decode step instead of the cost model's
    snic_window_s: float = 1.0  # how finely SNIC read bytes are recorded over time (the balance's samples)
    warmup_turns: int = 0  # first turns of every trajectory run before the timed phase (benchmarks/demo_jct.py)
    record_decisions: bool = False  # keep (request, decode engine, prefill engine, path) of every request
    until_s: float = float("inf")  # stop the clock here
    # TTFT/TPOT and the path counts cover only turns submitted in [measure_from_s, measure_until_s)
    # (online runs leave out the ramp-up and the drain after the last arrival).
    measure_from_s: float = 0.0
    measure_until_s: float = float("inf")
    # Tool-time staging (sim/staged.py): a staged read takes its node's SNIC this many blocks at a
    # time, only while no real read is queued there, so a real read that comes waits at most one.
    stage_chunk_blocks: int = 32


@dataclass(frozen=True)
class SimSettings:
    mode: Mode
    block_size: int
    cost: EngineCost
    kv_bytes_per_token_per_layer: int
    quota_ms: float
    window_tokens: int
    hbm_pages: int
    buffer_blocks: int
    snic_bytes_s: float
    cnic_bytes_s: float
    dram_bytes_s: float
    burst_s: float
    lockstep_prefill: bool
    constants: Constants
    read_split: str
    report_interval_s: float
    options: SimOptions
    # Tool-time staging (scheduler.stage_tool_time, its timing; dualpath mode only), and the share
    # of a node's buffer that staged extents may hold (scheduler.stage_buffer_fraction).
    staging: StagingSettings = StagingSettings()
    stage_buffer_fraction: float = 0.5

    @property
    def n_layer(self) -> int:
        return self.cost.n_layer

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cost.n_layer * self.kv_bytes_per_token_per_layer

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token


def _gbps(gbps: float) -> float:
    return gbps * 1e9 / 8


def settings_for(cfg: DualPathConfig, mode: Mode | str, options: SimOptions = SimOptions()) -> SimSettings:
    from dualpath_ray.model.profile import derive_alpha, typical_request

    cluster = cfg.cluster
    if cfg.sim.hardware_profile is not None and cfg.sim.model_profile is not None:
        from dualpath_ray.sim.profiles import load_hardware, load_model

        hardware, model = load_hardware(cfg.sim.hardware_profile), load_model(cfg.sim.model_profile)
        cost: EngineCost = derive_gpu_cost(hardware, model, cluster.decode_nodes * cluster.gpus_per_node)
        bytes_per_layer = model.kv_bytes_per_token_per_layer
        alpha = derive_alpha(cluster.snic_gbps, bytes_per_layer * model.n_layer, cfg.scheduler.alpha_seconds)
        beta = derive_beta_tokens(cost, cfg.scheduler.beta_seconds, typical_request(cfg.model.max_context))
        lockstep, burst = model.expert_parallel_prefill, 0.0
    else:
        cost, bytes_per_layer, alpha, beta = _this_machine(cfg)
        lockstep = False
        burst = cfg.emulation.burst_seconds if cfg.emulation.active() else 0.0
    if options.decode_model is not None:
        cost = WithDecode(cost, options.decode_model)
    if options.quota_scope is None:
        options = replace(options, quota_scope=cfg.sim.quota_scope)
    if cluster.hbm_tokens_per_engine < cfg.store.block_size:
        raise ConfigError("cluster.hbm_tokens_per_engine: must hold at least one block of store.block_size tokens")
    return SimSettings(
        mode=Mode(mode), block_size=cfg.store.block_size, cost=cost, kv_bytes_per_token_per_layer=bytes_per_layer,
        quota_ms=cfg.scheduler.compute_quota_ms, window_tokens=cluster.prefill_hbm_tokens,
        hbm_pages=cluster.hbm_tokens_per_engine // cfg.store.block_size, buffer_blocks=cluster.buffer_blocks_per_node,
        snic_bytes_s=_gbps(cluster.snic_gbps), cnic_bytes_s=_gbps(cluster.cnic_gbps),
        dram_bytes_s=cluster.dram_gbs * 1e9, burst_s=burst, lockstep_prefill=lockstep,
        constants=Constants(alpha, beta, cfg.scheduler.z_margin), read_split=cfg.scheduler.read_split,
        report_interval_s=cfg.scheduler.report_interval_ms / 1000.0, options=options,
        staging=StagingSettings(cfg.scheduler.stage_tool_time and Mode(mode) is Mode.DUALPATH,
                                cfg.scheduler.stage_slack, cfg.scheduler.stage_margin_s),
        stage_buffer_fraction=cfg.scheduler.stage_buffer_fraction,
    )


def _this_machine(cfg: DualPathConfig) -> tuple[EngineCost, int, int, int]:
    """The runtime's emulated machine: its profile's cost, its KV layout, its alpha and beta."""
    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.model.cost import cost_of_profile
    from dualpath_ray.model.profile import derive_alpha_beta, load_profile_for

    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    cost = cost_of_profile(load_profile_for(cfg), layout.bytes_per_token_per_layer)
    alpha, beta = derive_alpha_beta(cfg, layout)
    return cost, layout.bytes_per_token_per_layer, alpha, beta
