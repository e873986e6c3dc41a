"""The sections of the tree that describe the cluster and how it runs: hardware and topology
(`cluster`), the block store (`store`), the scheduler's constants (`scheduler`), emulated
hardware (`emulation`), the simulator (`sim`) and the runtime (`runtime`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dualpath_ray.config.section import Section
from dualpath_ray.protocol.types import Mode


# runtime.session_ttl_s's default, also the default of the tables built without a config (tests,
# tools; scheduling/expiry.py): an idle hour outlasts any turn (runtime.request_timeout_s defaults
# to 15 minutes) and an RL agent's tool call between two turns of its trajectory.
IDLE_TTL_DEFAULT_S = 3600.0


class ClusterConfig(Section):
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


class StoreConfig(Section):
    """Where Full Blocks persist."""

    backend: Literal["local_dir", "memory"] = Field(
        "local_dir", description="local_dir (default; also a shared NFS/3FS mount) or memory (tests)."
    )
    root: Path | None = Field(None, description="Directory of local_dir; None = a fresh temporary folder.")
    block_size: int = Field(64, ge=1, description="Tokens per block.")
    capacity_bytes: int | None = Field(
        None, ge=1,
        description="Most bytes of Full Blocks the store keeps (indexed ones, and block files no index "
        "holds that the janitor could not delete yet: see sweep_interval_s); beyond it the least recently "
        "used blocks are evicted (a later lookup misses them). None (the default) = derived: "
        "store.capacity_free_fraction of what the store's file system can hold (its block files plus its "
        "free space), when the scheduler starts and again at each of the janitor's walks, so eviction runs "
        "before the disk is full and follows other users of the disk; the memory backend has no limit. A "
        "shared file system that other writers fill may still run full: a block write it refuses is then a "
        "later miss, never a failed turn.",
    )
    capacity_free_fraction: float = Field(
        0.9, gt=0, le=1,
        description="With capacity_bytes unset, the share of the store file system's room (indexed blocks + "
        "free space at the scheduler's start) its indexed blocks may fill; the rest is headroom for blocks "
        "on their way (written, not yet indexed), temporaries, directories and other users of the disk.",
    )
    sweep_interval_s: float | None = Field(
        600.0, gt=0,
        description="How often the scheduler's store janitor (kv/janitor.py) walks the store, on a thread of "
        "its own and at a quarter of one core at most: it deletes every block file no index holds, nothing in "
        "flight hits, and published longer than runtime.request_timeout_s ago (a turn may still report a "
        "younger one), and measures what the store holds, which the capacity follows (unindexed block files "
        "count against it). The first walk runs when the scheduler starts. Blocks the scheduler unindexes "
        "itself (evicted, repaired, reset_prefix_cache) are deleted at once, sweep or not. None: no walks; "
        "set it for a store root that several deployments share, or each deletes the others' blocks.",
    )
    fsync: bool = Field(
        False,
        description="local_dir only: fsync each block file before its publishing rename and its directory "
        "after, so a block reported persisted survives a power loss or kernel crash. Without it such a crash "
        "may lose or damage the blocks of the last seconds: checksums catch a damaged one (left out of the "
        "rebuilt index, or repaired at its read), so it costs a recompute, never wrong KV. Measured on the "
        "project's 2-core VM (ext4): 3-11 ms more per put (2 MiB blocks: 1.2-1.8 ms off, 5.9-12.5 ms on; "
        "benchmarks/README.md, \"Store fsync\"); on a shared file system a flush is a round trip to its servers.",
    )
    stale_temporary_s: float = Field(
        600.0, gt=0,
        description="Each reader deletes, when it starts, temporaries of puts that crashed longer ago than "
        "this (younger ones may be a put still running on another node of a shared mount).",
    )
    io: Literal["auto", "direct", "buffered"] = Field(
        "auto",
        description="local_dir only: how block files are read and written. direct: O_DIRECT, bypassing the "
        "page cache (reads land in the reader's buffer slots with no copy, persists do not fill the page "
        "cache); the store refuses to open where the file system refuses O_DIRECT (tmpfs, some FUSE mounts). "
        "buffered: through the page cache. auto (the default): direct where a probe write and read in the "
        "store directory succeed, else buffered, logged once per process (kv/block_files.py).",
    )
    read_queue_depth: int | None = Field(
        None, ge=1,
        description="local_dir only: blocks one multi-block read reads at once (the reading thread and "
        "read_queue_depth - 1 helper threads of the store; each reads a block, verifies its checksum, then "
        "takes the next). None (the default) = 8 with direct I/O (on the project's 2-core VM the store "
        "reaches fio's O_DIRECT rate at the same depth there; benchmarks/README.md, \"Store read, cold\"), "
        "buffered 2 for blocks of 512 KiB or more and 1 below (reads from the page cache are CPU-bound). "
        "CPU per GB read on that VM: 0.05-0.08 core-seconds verifying (xxh3_64), 0.13-0.28 for the whole "
        "direct read (open, preadv, verify, bookkeeping), spread over the threads; it grows with the bytes "
        "read, so a node reading at 40 GB/s needs about 2-3 cores for verification alone and 5-11 for "
        "the reads.",
    )


class SchedulerConfig(Section):
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

    @field_validator("partial_block_hits", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare on / off as a boolean: take it as the word the user wrote."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

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
    compute_path: Literal["off", "auto", "all"] = Field(
        "off",
        description="Beyond the paper: a third path. auto = when a request's read would end later than computing "
        "part of its hit (its reader's queue is long, its prefill engine's short), read only its first hit blocks "
        "and compute the rest with its miss tokens; the split is the one that ends the request soonest by the read "
        "queues, alpha's read rate and the latency model (scheduling/compute_path.py). all = read no hit at all, "
        "compute every prompt whole (the baseline of a cluster without the store's reads). off = read every hit. "
        "Off by default until the benchmarks show auto never loses (benchmarks/README.md, \"The compute path\").",
    )
    bind_hits: Literal["late", "early"] = Field(
        "late",
        description="When a request's hits are looked up in the prefix index: late = at submit and again when it "
        "is placed on a prefill engine, so a request that waited in the queues reads every block persisted "
        "meanwhile (another request's turn with the same prefix) and its read path and read queues use that "
        "answer (scheduling/binding.py); early = at submit only (the behaviour before late binding, kept for "
        "comparison: benchmarks/README.md, \"Late binding\").",
    )
    partial_block_hits: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Whether a request's hit may include the stored block that holds its prompt's last token: on = "
        "it reads that block whole and computes only the last token (its logits), so a prompt of exactly whole blocks "
        "that another request stored computes 1 token instead of the last block (scheduling/binding.py); off = hits "
        "stop one block short of that and the request computes the whole block (vLLM's own rule: hits in whole "
        "blocks, the last one computed). auto = on for the native engine, off for engine.backend vllm, whose "
        "connector takes block-aligned hits only (on with vllm is refused).",
    )
    share_in_flight: bool = Field(
        False,
        description="Beyond the paper: a request whose next prompt blocks another request in flight is computing "
        "right now (G samples of one prompt, agents sharing a system prompt) waits for that producer's turn to "
        "publish them and reads them, instead of computing the same prefix on a second engine, when the latency "
        "model says waiting ends it sooner (scheduling/sharing.py, scheduling/share_rule.py); a producer that fails "
        "or is aborted releases its waiters at once and they compute. Uses alpha's read rate, beta's compute rate "
        "and the latency profile (emulation.profile_path, else the built-in nominal one).",
    )
    share_buffer_blocks: int = Field(
        256, ge=0,
        description="With share_in_flight in dualpath mode: how many freshly computed prompt blocks each decode "
        "node's reader keeps in memory (a hot tier in front of the store, runtime/reader/hot_blocks.py) from the "
        "prefill -> decode transfer until they are written to the store, oldest written first out. A producer's "
        "prompt is then published as soon as it is on its decode node, and a waiter decoding on that node reads it "
        "from there over the CNIC (its DE path) instead of the store over the SNIC, when the rule says that is "
        "sooner (scheduling/share_rule.py). Memory: this many Full Blocks per decode node. 0 = off: waiters read "
        "the store once the producer's turn has ended.",
    )
    stage_tool_time: bool = Field(
        True,
        description="Beyond the paper: when a turn ends with the caller's hint that its session continues "
        "(the trace's tool_latency_s in rollouts; expect_next_turn_s on the rollout server and the OpenAI "
        "endpoint), stage the next turn's hit KV on a decode node's buffer while the tool runs, behind every "
        "real read, and read that turn's hits from there (dualpath mode only; scheduling/staging.py). Without "
        "a hint nothing is staged.",
    )
    stage_slack: float = Field(
        0.5, ge=0,
        description="A staged extent is held for the hinted wait times (1 + stage_slack), plus stage_margin_s; "
        "then its reader frees it (a session that never returns costs one expired extent).",
    )
    stage_margin_s: float = Field(2.0, ge=0, description="See stage_slack.")
    stage_buffer_fraction: float = Field(
        0.5, gt=0, le=1,
        description="At most this share of a node's buffer holds staged extents; a real lease that finds the "
        "buffer full cancels the oldest staged extents first.",
    )
    max_queued_turns: int = Field(
        65536, ge=0,
        description="Most turns that may wait at the scheduler for an engine (its decode and prefill queues; "
        "turns already on engines do not count). A new turn that finds this many ends at once with error_kind "
        "queue_full, which the scheduler does not retry: the rollout API submits it again after a pause, the "
        "OpenAI endpoint answers 429 with Retry-After, other callers may resubmit. A retry of a turn already "
        "admitted is never refused. Each queued turn holds its prompt at the scheduler, so this bounds the "
        "scheduler's memory under a flood of callers. The default is above any concurrency the project runs "
        "(one turn in flight per trajectory, 48K agents at the paper's scale), so a rollout never meets it; "
        "lower it to what the scheduler's node can hold. 0 = no limit.",
    )


class EmulationConfig(Section):
    """Emulated hardware for one machine; off on real hardware (runtime/emulation/choice.py)."""

    enabled: bool | None = Field(
        None,
        description="Token buckets for SNIC/CNIC at the cluster rates. None (default): on for a cluster "
        "dualpath starts on this machine (DualPathCluster.start: `dualpath demo`, `dualpath run` without "
        "--address), off when it connects to an existing one (DualPathCluster.connect, --address); true or "
        "false decides for both. The driver's first log line and `dualpath status` say which.",
    )
    compute: Literal["model", "profile"] = Field(
        "model", description="model: the real model computes; profile: time from the latency model."
    )
    profile_path: Path | None = Field(
        None, description="Hardware profile JSON (`dualpath profile`); None = the built-in default."
    )
    burst_seconds: float = Field(0.05, gt=0, description="Token-bucket depth in seconds of rate.")

    def active(self, embedded: bool = True) -> bool:
        """Whether NICs are emulated: as configured, else exactly for a cluster started on this
        machine (a process outside any deployment, such as the simulator of this machine or the
        single-process demo, counts as one)."""
        return self.enabled if self.enabled is not None else embedded


class SimConfig(Section):
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
    quota_scope: Literal["forward", "layer"] = Field(
        "forward",
        description="What the compute quota (scheduler.compute_quota_ms) bounds when the simulator packs a prefill "
        "batch: forward = the whole forward's predicted time (every layer; the paper's reading, and what every "
        "simulator figure in benchmarks/README.md uses), layer = one layer's (what the runtime's engines pack "
        "with; for a 61-layer model it allows 61 x the quota per batch). `dualpath sim --quota-scope` overrides it.",
    )

    @model_validator(mode="after")
    def _profiles_together(self) -> SimConfig:
        if (self.hardware_profile is None) != (self.model_profile is None):
            raise ValueError("give both hardware_profile and model_profile, or neither")
        return self


class RuntimeConfig(Section):
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
    scheduler_max_restarts: int = Field(
        10, ge=0, description="How often Ray restarts the Scheduler actor over a deployment's life (0: "
        "never). Each new incarnation rebuilds the index from the store and adopts what the engines hold "
        "(docs/reliability.md, promise 7); a scheduler that died this often is in a crash loop, and staying "
        "dead (its callers get Ray's ActorDiedError) says so instead of looping for ever.",
    )
    front_end_max_restarts: int = Field(
        10, ge=0, description="How often Ray restarts each front-end actor: the rollout-server (api/server.py) "
        "and the openai-server (api/openai_server.py). A restarted one finds its weight version, verl state "
        "and listening address again (runtime/restarts/kept_state.py); 0: a dead one stays dead.",
    )
    max_call_resends: int = Field(
        3, ge=0, description="How often Ray sends a call again to a restarted scheduler or rollout-server "
        "when the process died while the call was in flight (Ray's max_task_retries), so callers ride "
        "through a restart. Bounded: a call that itself kills the actor is sent at most 1 + this many "
        "times, instead of killing every new incarnation until the restarts run out. 0: a call in flight "
        "at a death fails with Ray's ActorDiedError.",
    )
    metrics: bool = Field(
        True, description="Export the dualpath_* Ray metrics (docs/metrics.md) from every actor and driver."
    )
    metrics_interval_s: float = Field(
        1.0, gt=0, description="How often each actor turns its byte counters and loads into Ray metrics."
    )
    session_ttl_s: float = Field(
        IDLE_TTL_DEFAULT_S, gt=0,
        description="How long the rollout-server remembers an idle conversation's turn numbering (a session "
        "with a turn in flight is never idle; one forgotten numbers its turns from t0 again, which is safe), "
        "and how long the scheduler keeps an aborted trajectory's mark (abort_prefix, abort_session) after it "
        "last refused a turn (then later turns of it run again, as after clear_aborts). Bounds both tables to "
        "what callers used within this time.",
    )
