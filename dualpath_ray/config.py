"""The one configuration tree of dualpath_ray, loaded from YAML.

Every section is a pydantic model with `extra="forbid"`, so a misspelt key is an error, and
`load_config` turns pydantic's errors into `ConfigError` lines that name the YAML path of the
bad field (`cluster.snic_gbps`) and what is allowed there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names each bad field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Section):
    """The decoder whose KV is stored and moved (a small Llama/Qwen2-style model by default)."""

    model_id: str = Field("dualpath-tiny", min_length=1, description="Namespace of every block key.")
    vocab_size: int = Field(512, ge=2, description="Token ids are in [0, vocab_size).")
    hidden_size: int = Field(64, ge=1)
    n_layer: int = Field(4, ge=1, description="Decoder layers; a Full Block holds all of them.")
    n_head: int = Field(4, ge=1, description="Query heads.")
    n_kv_head: int = Field(2, ge=1, description="KV heads (grouped-query attention).")
    head_dim: int = Field(16, ge=2, description="Per-head dimension; must be even for RoPE.")
    intermediate_size: int = Field(128, ge=1, description="SwiGLU hidden width.")
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    max_context: int = Field(4096, ge=1, description="Longest prompt + output in tokens.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = Field(0, description="Seed of the deterministic random weights.")
    weights_dir: Path | None = Field(
        None, description="Local directory of HF-style safetensors (Qwen2/Llama names); None = random."
    )
    weight_version: int = Field(0, ge=0, description="Policy version; part of every block key.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
        return self


class ClusterConfig(_Section):
    """The P/D topology and the hardware rates of each node (paper section 4)."""

    prefill_nodes: int = Field(1, ge=1)
    decode_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(2, ge=1, description="g: engines per node, one per GPU.")
    snic_gbps: float = Field(400.0, gt=0, description="Per-node storage NIC, Gbit/s (shared by reads and writes).")
    cnic_gbps: float = Field(400.0, gt=0, description="Per-GPU compute NIC, Gbit/s.")
    dram_gbs: float = Field(500.0, gt=0, description="Per-node DRAM bandwidth, GB/s.")
    hbm_tokens_per_engine: int = Field(
        65536, ge=1, description="KV capacity of one engine's HBM, in tokens."
    )
    buffer_blocks_per_node: int = Field(
        1024, ge=1, description="Host staging buffer of each node, in Full Blocks."
    )
    cpus_per_node: float = Field(2.0, gt=0, description="Ray CPUs of each embedded node.")
    prefill_hbm_tokens: int = Field(
        65536,
        ge=1,
        description="KV tokens one prefill engine holds per layer of its window (hit + computed "
        "tokens of a whole batch); must be >= model.max_context so any prompt fits alone.",
    )
    pin_host_buffers: bool = Field(
        True, description="Pin the host buffers of nodes that have a GPU (never without CUDA)."
    )


class StoreConfig(_Section):
    """Where Full Blocks persist."""

    backend: Literal["local_dir", "memory"] = Field(
        "local_dir", description="local_dir (default; also a shared NFS/3FS mount) or memory (tests)."
    )
    root: Path | None = Field(None, description="Directory of local_dir; None = a fresh temporary folder.")
    block_size: int = Field(64, ge=1, description="Tokens per block.")


class SchedulerConfig(_Section):
    """Scheduler constants of paper section 6."""

    alpha_seconds: float = Field(3.0, gt=0, description="alpha = tokens the SNIC reads in this many seconds.")
    beta_seconds: float = Field(5.0, gt=0, description="beta = tokens one GPU prefills in this many seconds.")
    compute_quota_ms: float = Field(300.0, gt=0, description="Per-batch predicted attention time.")
    z_margin: float = Field(1.05, ge=1.0, description="Z margin of the in-group decode assignment.")
    fetch_interval_ms: float = Field(5.0, gt=0, description="How often an idle group leader pulls.")


class EmulationConfig(_Section):
    """Emulated hardware for one machine; off on real hardware."""

    enabled: bool = Field(True, description="Token buckets for SNIC/CNIC at the cluster rates.")
    compute: Literal["model", "profile"] = Field(
        "model", description="model: the real model computes; profile: time from the latency model."
    )
    profile_path: Path | None = Field(
        None, description="Hardware profile JSON (`dualpath profile`); None = the built-in default."
    )
    burst_seconds: float = Field(0.05, gt=0, description="Token-bucket depth in seconds of rate.")


class RuntimeConfig(_Section):
    """How the runtime runs a workload."""

    mode: Literal["dualpath", "basic", "oracle"] = "dualpath"
    transport: Literal["nixl", "gloo"] = Field("nixl", description="KV transport between nodes.")
    namespace: str = Field("dualpath", min_length=1, description="Ray namespace of all actors.")
    max_new_tokens: int = Field(16, ge=1, description="Default generation length per turn.")
    placement_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for the P/D placement groups before failing."
    )
    verify_kv: bool = Field(
        False, description="Decode engines check every assembled KV byte (tests; costs a recompute)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where engines compute: auto = the GPU Ray gave the actor, else the CPU."
    )
    compute_threads: int = Field(1, ge=1, description="torch CPU threads of each engine on the CPU.")
    transfer_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for one KV transfer before it fails."
    )
    max_persists_in_flight: int = Field(
        64, ge=1, description="Full Blocks one decode engine may have on their way to the store."
    )


class DualPathConfig(_Section):
    """The root of the configuration tree."""

    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    store: StoreConfig = StoreConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    emulation: EmulationConfig = EmulationConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="after")
    def _prefill_window_holds_a_prompt(self) -> DualPathConfig:
        if self.cluster.prefill_hbm_tokens < self.model.max_context:
            raise ValueError(
                f"cluster.prefill_hbm_tokens ({self.cluster.prefill_hbm_tokens}) must be >= "
                f"model.max_context ({self.model.max_context}) so that any prompt fits a prefill engine"
            )
        return self

    def with_overrides(self, **sections: dict[str, Any]) -> DualPathConfig:
        """A copy with some fields of some sections replaced, validated like a file."""
        data = self.model_dump()
        for name, fields in sections.items():
            if name not in data:
                raise ConfigError(f"{name}: unknown section; allowed: {', '.join(data)}")
            data[name].update(fields)
        return parse_config(data, source="<overrides>")


def _describe(error: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in error["loc"]) or "<root>"
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key; remove it or check its spelling"
    return f"{path}: {error['msg']} (got {error.get('input')!r})"


def parse_config(data: Any, source: str = "<dict>") -> DualPathConfig:
    """Validate a parsed mapping; raise ConfigError naming every bad YAML path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    try:
        return DualPathConfig.model_validate(data)
    except ValidationError as exc:
        lines = "\n  ".join(_describe(e) for e in exc.errors())
        raise ConfigError(f"{source}: invalid configuration\n  {lines}") from None


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
    return parse_config(data, source=str(path))
