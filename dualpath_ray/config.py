"""The one configuration tree of dualpath_ray, loaded from YAML.

Every section is a pydantic model with `extra="forbid"`, so a misspelt key is an error, and
`load_config` turns pydantic's errors into `ConfigError` lines that name the YAML path of the
bad field (`cluster.snic_gbps`) and what is allowed there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from dualpath_ray.faults.plan import FaultMode, FaultPlan, FaultSite
from dualpath_ray.runtime.deploy.qos import QosConfig
from dualpath_ray.runtime.transport.verbs_config import VerbsConfig
from dualpath_ray.scheduling.types import Mode


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names each bad field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


ROPE_SCALING_TYPES = ("llama3", "linear")
_LLAMA3_ROPE_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class RopeScaling(_Section):
    """RoPE frequency scaling of a long-context checkpoint (Hugging Face `rope_scaling`).

    `llama3` is Llama 3.1's per-frequency scaling: wavelengths shorter than
    original_max_position_embeddings / high_freq_factor keep their frequency, those longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, and the band in
    between blends the two. `linear` divides every frequency (equivalently every position) by
    `factor`. Other types (yarn, dynamic, longrope, ...) are not implemented, and are an error
    rather than silently computing a different model.
    """

    rope_type: str = Field(description="llama3 or linear.")
    factor: float = Field(gt=0, description="How much longer the context is than in pre-training.")
    low_freq_factor: float | None = Field(None, gt=0, description="llama3 only.")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3 only.")
    original_max_position_embeddings: int | None = Field(
        None, ge=1, description="llama3 only: the pre-training context length."
    )

    @field_validator("rope_type")
    @classmethod
    def _supported_type(cls, rope_type: str) -> str:
        if rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)} "
                "(a checkpoint that needs another scaling cannot run on this model)"
            )
        return rope_type

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> RopeScaling:
        given = [name for name in _LLAMA3_ROPE_FIELDS if getattr(self, name) is not None]
        if self.rope_type == "llama3":
            missing = [name for name in _LLAMA3_ROPE_FIELDS if name not in given]
            if missing:
                raise ValueError(f"rope_type llama3 needs {', '.join(missing)}")
            assert self.low_freq_factor is not None and self.high_freq_factor is not None
            if self.high_freq_factor <= self.low_freq_factor:
                # The blend divides by their difference, and the bands would be inverted.
                raise ValueError(
                    f"high_freq_factor ({self.high_freq_factor}) must be > low_freq_factor "
                    f"({self.low_freq_factor})"
                )
        elif given:
            raise ValueError(f"rope_type {self.rope_type} takes only factor; remove {', '.join(given)}")
        return self


class ModelConfig(_Section):
    """The decoder whose KV is stored and moved (a small Llama/Qwen2-style model by default).

    With `weights_dir` holding a Hugging Face config.json, `load_config` fills the fields the
    YAML leaves out from it and rejects those that disagree with it.
    """

    model_id: str = Field("dualpath-tiny", min_length=1, description="Namespace of every block key.")
    vocab_size: int = Field(512, ge=2, description="Token ids are in [0, vocab_size).")
    hidden_size: int = Field(64, ge=1)
    n_layer: int = Field(4, ge=1, description="Decoder layers; a Full Block holds all of them.")
    n_head: int = Field(4, ge=1, description="Query heads.")
    n_kv_head: int = Field(2, ge=1, description="KV heads (grouped-query attention).")
    head_dim: int = Field(16, ge=2, description="Per-head dimension; must be even for RoPE.")
    intermediate_size: int = Field(128, ge=1, description="SwiGLU hidden width.")
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(
        None, description="RoPE scaling of long-context checkpoints (llama3 or linear); None = plain RoPE."
    )
    rms_norm_eps: float = Field(1e-6, gt=0)
    max_context: int = Field(4096, ge=1, description="Longest prompt + output in tokens.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = Field(0, description="Seed of the deterministic random weights.")
    weights_dir: Path | None = Field(
        None, description="Local directory of HF-style safetensors (Qwen2/Llama names); None = random."
    )
    weight_version: int = Field(0, ge=0, description="Policy version; part of every block key.")

    def kv_namespace(self, weight_version: int | None = None) -> str:
        """Namespace of the block keys these weights write: model id, weight version, and the
        seed of random weights (a checkpoint's KV does not depend on it)."""
        from dualpath_ray.kv.index import namespace_for

        version = self.weight_version if weight_version is None else weight_version
        return namespace_for(self.model_id, version, None if self.weights_dir is not None else self.seed)

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
    snic_gbps: float = Field(
        400.0, gt=0, description="Per-node storage NIC, Gbit/s in each direction (reads and persists do not share it)."
    )
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
    capacity_bytes: int | None = Field(
        None, ge=1,
        description="Most bytes of indexed Full Blocks the store keeps; beyond it the least recently "
        "used blocks are evicted (a later lookup misses them). None = no limit.",
    )
    stale_temporary_s: float = Field(
        600.0, gt=0,
        description="Each reader deletes, when it starts, temporaries of puts that crashed longer ago than "
        "this (younger ones may be a put still running on another node of a shared mount).",
    )


class SchedulerConfig(_Section):
    """Scheduler constants of paper section 6."""

    @model_validator(mode="before")
    @classmethod
    def _no_pull_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("fetch_interval_ms", "fetch_wait_ms"):
                if key in data:
                    raise ValueError(
                        f"{key} is gone: engines no longer pull work, the scheduler pushes it when it decides; "
                        "remove the key (scheduler.report_interval_ms sets how often read queues are reported)"
                    )
        return data

    alpha_seconds: float = Field(3.0, gt=0, description="alpha = tokens the SNIC reads in this many seconds.")
    beta_seconds: float = Field(
        5.0, gt=0,
        description="beta = tokens one GPU prefills (computes: prompt minus hits) in this many seconds of typical "
        "requests; a prefill engine with more than beta such tokens queued gets no new work.",
    )
    compute_quota_ms: float = Field(300.0, gt=0, description="Per-batch predicted attention time.")
    z_margin: float = Field(1.05, ge=1.0, description="Z margin of the in-group decode assignment.")
    report_interval_ms: float = Field(
        51.0, gt=0,
        description="A storage reader tells the scheduler its read queue when it changes, at most this often; "
        "a decode group whose loads or read queue changed is asked again at most this often (the read-path "
        "choice compares these queues). Nothing is sent while nothing changes. The default is the cadence "
        "the simulator's committed figures were made with (benchmarks/README.md).",
    )
    report_port: int = Field(
        0, ge=0, le=65535,
        description="TCP port on the scheduler's node where engines and readers send their reports (the report "
        "channel: authenticated with a per-incarnation secret handed out through Ray). 0 picks a free port at "
        "each start; set one where a firewall must allow it between the nodes.",
    )
    read_split: Literal["whole", "proportional"] = Field(
        "whole",
        description="How one request's hit blocks are read: whole = all through the side with the shorter read "
        "queue (the paper's); proportional = split between the prefill-side and decode-side readers in proportion "
        "to their read-queue headroom below alpha (the paper's future work; so far the simulator only).",
    )


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


class SimConfig(_Section):
    """The cluster simulator (`dualpath sim`, dualpath_ray/sim/); the runtime ignores this section.

    With both profiles given, the simulator models that GPU-class node and model (engine time from
    FLOPs and bytes, model/cost.py), and the cluster section's hardware fields it leaves out are
    filled from the hardware profile. Without them it models this machine: engine time from the
    emulation profile (emulation.profile_path) and the model section's KV layout.
    """

    hardware_profile: Path | None = Field(
        None, description="GPU-class node profile YAML (cluster_configs/profiles/hardware/)."
    )
    model_profile: Path | None = Field(None, description="Model profile YAML (cluster_configs/profiles/models/).")

    @model_validator(mode="after")
    def _profiles_together(self) -> SimConfig:
        if (self.hardware_profile is None) != (self.model_profile is None):
            raise ValueError("give both hardware_profile and model_profile, or neither")
        return self


class RuntimeConfig(_Section):
    """How the runtime runs a workload."""

    mode: Mode = Field(Mode.DUALPATH, description="dualpath (both read paths), basic (the prefill side only) or oracle (no I/O).")
    transport: Literal["auto", "nixl", "gloo", "verbs"] = Field(
        "auto",
        description="KV transport between nodes: nixl (RDMA-capable, the nixl package), gloo (TCP "
        "fallback), verbs (RC queue pairs through pyverbs, the rdma extra; needs an RDMA NIC, see the "
        "verbs section), or auto = nixl when the nixl package is importable where the config is loaded, "
        "else gloo (never verbs). The loaded config always holds the resolved kind.",
    )
    hbm_moves: Literal["transport", "cuda_copy"] = Field(
        "transport",
        description="How layer blocks move into and out of a GPU engine's HBM: transport = the HBM pools are "
        "registered with the KV transport, so every move is an RDMA operation through the GPU's compute NIC "
        "(the paper's CNIC-centric rule; needs nixl or verbs, and GPUDirect RDMA to avoid staging); cuda_copy "
        "= the transport moves a pinned host mirror of each HBM pool and the engine copies it to and from HBM "
        "with CUDA copies (works with every transport; costs host memory the size of the pools). CPU engines "
        "have no HBM: both are the same there.",
    )
    namespace: str = Field("dualpath", min_length=1, description="Ray namespace of all actors.")
    max_new_tokens: int = Field(16, ge=1, description="Default generation length per turn.")
    placement_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for the P/D placement groups before failing."
    )
    verify_kv: bool = Field(
        False, description="Decode engines check every assembled KV byte (tests; costs a recompute)."
    )
    kv_digests: bool = Field(
        True,
        description="Check per-token digests of KV at every hop (buffer -> prefill window, window -> "
        "decode buffer -> HBM) before it is used; a damaged transfer is read again once, then fails the attempt.",
    )
    @field_validator("transport")
    @classmethod
    def _resolve_auto_transport(cls, kind: str) -> str:
        # Resolved once on the driver so every actor of a cluster gets the same concrete kind.
        if kind != "auto":
            return kind
        import importlib.util

        return "nixl" if importlib.util.find_spec("nixl") is not None else "gloo"

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where engines compute: auto = the GPU Ray gave the actor, else the CPU."
    )
    compute_threads: int = Field(1, ge=1, description="torch CPU threads of each engine on the CPU.")
    transfer_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for one KV transfer before it fails."
    )
    max_attempts: int = Field(
        3, ge=1, description="Tries of one turn: a retryable failure (a bad or missing hit block, a "
        "failed transfer, a dead engine or reader) is retried with attempt + 1 until this many.",
    )
    kv_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="A hit block that is missing or fails its checksum: recompute (drop it and the "
        "blocks after it from the index, delete a corrupt one, retry from the longest valid prefix) "
        "or fail (the turn ends with error_kind kv_missing / kv_corrupt).",
    )
    request_timeout_s: float = Field(
        900.0, gt=0, description="Longest a turn may take, queueing and retries included; then it "
        "ends with error_kind timeout instead of waiting on.",
    )
    heartbeat_s: float = Field(
        1.0, gt=0, description="How often the scheduler checks that the engines holding requests are alive."
    )
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="An engine that does not answer a heartbeat this long counts as dead."
    )
    max_persists_in_flight: int = Field(
        64, ge=1, description="Full Blocks one decode engine may have on their way to the store."
    )
    max_actor_restarts: int = Field(
        3, ge=0, description="How often Ray restarts a dead engine or storage reader (per actor). A "
        "restarted one rejoins with a new incarnation: what its dead incarnation held is failed and "
        "retried, and it takes work again. 0: a dead engine or reader is left out for good.",
    )
    metrics: bool = Field(
        True, description="Export the dualpath_* Ray metrics (docs/metrics.md) from every actor and driver."
    )
    metrics_interval_s: float = Field(
        1.0, gt=0, description="How often each actor turns its byte counters and loads into Ray metrics."
    )


class DualPathConfig(_Section):
    """The root of the configuration tree."""

    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    store: StoreConfig = StoreConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    emulation: EmulationConfig = EmulationConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    faults: FaultPlan = FaultPlan()
    sim: SimConfig = SimConfig()
    qos: QosConfig = QosConfig()
    verbs: VerbsConfig = VerbsConfig()

    @model_validator(mode="after")
    def _prefill_window_holds_a_prompt(self) -> DualPathConfig:
        if self.cluster.prefill_hbm_tokens < self.model.max_context:
            raise ValueError(
                f"cluster.prefill_hbm_tokens ({self.cluster.prefill_hbm_tokens}) must be >= "
                f"model.max_context ({self.model.max_context}) so that any prompt fits a prefill engine"
            )
        return self

    @model_validator(mode="after")
    def _store_faults_need_files(self) -> DualPathConfig:
        damages_files = any(f.site is FaultSite.STORE_READ and f.mode is FaultMode.CORRUPT for f in self.faults.faults)
        if damages_files and self.store.backend != "local_dir":
            raise ValueError("faults: store_read corrupt damages block files; it needs store.backend: local_dir")
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
    # Imported here: weights.py imports ModelConfig from this module, and loading a config
    # without a checkpoint should not import torch.
    from dualpath_ray.model.weights import WeightsError, model_fields_from_hf_config

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
