"""A small Llama/Qwen2-style decoder with a layerwise API (RMSNorm, RoPE, GQA, SwiGLU).

The engines drive the model one layer at a time, over a whole batch:
- `forward_layer_spans` (prefill): the new tokens of several sequences packed in one batch, each
  attending to its own KV span in the engine's layer window, where this layer's new KV is written;
- `forward_layer_paged` (decode): one new token per sequence, its KV written into the engine's
  pages and attention over each sequence's pages through its block table;
- `forward_layer` (one sequence, KV passed in and returned): the reference path that `prefill`,
  `decode_step` and `generate` are built on.
All three share the same projection, RoPE, attention (model/attention.py) and MLP code.

KV of one layer is token-major `[T, 2, n_kv_head, head_dim]` (K after RoPE, then V), contiguous
and in the model dtype: exactly what `KVLayout.kv_as_bytes` reinterprets as bytes. Module names
follow the Hugging Face Qwen2/Llama checkpoints, so `state_dict()` keys are the checkpoint names.
Random weights come from a private `torch.Generator(cfg.seed)`, never the global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.layout import torch_dtype
from dualpath_ray.model.attention import paged_attention, sequence_attention, span_attention, write_paged
from dualpath_ray.model.modules import Backbone, DecoderLayer, Linear
from dualpath_ray.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from dualpath_ray.model.sampling import sample_token
from dualpath_ray.config.hf import WeightsError
from dualpath_ray.model.weights import Architecture, detect_architecture, read_checkpoint, validate_checkpoint

__all__ = ["DecodeOutput", "DecoderModel", "GenerateOutput", "PrefillOutput", "sample_token"]


class PrefillOutput(NamedTuple):
    logits: torch.Tensor  # [T, vocab] float32 (or [1, vocab] with last_only)
    kv: list[torch.Tensor]  # per layer [T, 2, n_kv_head, head_dim], the new tokens only


class DecodeOutput(NamedTuple):
    logits: torch.Tensor  # [vocab] float32
    kv: list[torch.Tensor]  # per layer [1, 2, n_kv_head, head_dim]


class GenerateOutput(NamedTuple):
    token_ids: list[int]  # generated tokens
    log_probs: list[float]  # log-probability of each generated token where it was chosen
    kv: list[torch.Tensor]  # per layer, prompt + generated tokens except the last one


class DecoderModel(nn.Module):
    """The decoder; `cfg.weights_dir` set loads a checkpoint, else deterministic random weights.

    `arch` chooses the variant of random weights (default: no q/k/v bias, untied lm_head); a
    checkpoint's variant is read from its tensor names, and a different `arch` is an error.
    """

    def __init__(self, cfg: ModelConfig, *, arch: Architecture | None = None):
        super().__init__()
        self.cfg = cfg
        self.n_layer = cfg.n_layer
        self.dtype = torch_dtype(cfg.dtype)
        checkpoint = read_checkpoint(cfg.weights_dir) if cfg.weights_dir is not None else None
        if checkpoint is not None:
            found = detect_architecture(set(checkpoint))
            if arch is not None and arch != found:
                raise WeightsError(f"model.weights_dir: the checkpoint is {found}, not the requested {arch}")
            arch = found
        self.arch = arch or Architecture(attention_bias=False, tie_word_embeddings=False)
        self.model = Backbone(cfg, self.arch.attention_bias, self.dtype)
        self.lm_head = (
            None
            if self.arch.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, False, self.dtype)
        )
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if checkpoint is None:
            self._init_random()
        else:
            self._load(checkpoint)
        self.eval()

    # Weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _init_random(self) -> None:
        # Fan-in scaled weights keep activations O(1) through the layers, so random-weight
        # logits are spread out and greedy choices are not near-ties.
        generator = torch.Generator().manual_seed(self.cfg.seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            elif name.endswith(".bias"):
                values = 0.1 * torch.randn(param.shape, generator=generator)
            elif name == "model.embed_tokens.weight":
                values = torch.randn(param.shape, generator=generator)
            else:
                values = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            param.copy_(values.to(self.dtype))

    @torch.no_grad()
    def _load(self, checkpoint: Mapping[str, torch.Tensor]) -> None:
        validate_checkpoint(checkpoint, self.cfg, self.arch)
        for name, param in self.named_parameters():
            param.copy_(checkpoint[name].to(device=param.device, dtype=self.dtype))

    def load_weights(self, source: str | Path | Mapping[str, torch.Tensor]) -> Architecture:
        """New weights in place: a checkpoint directory or a state dict by checkpoint name.

        Everything is validated before the first copy, so a bad source leaves the old weights;
        the source must be the same variant (attention bias, tied lm_head) as this model.
        """
        checkpoint = read_checkpoint(source) if isinstance(source, (str, Path)) else source
        found = detect_architecture(set(checkpoint))
        if found != self.arch:
            raise WeightsError(f"update_weights: the new weights are {found}, this model is {self.arch}")
        self._load(checkpoint)
        return found

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters by Hugging Face checkpoint name (a tied lm_head is absent), for export."""
        return {name: param.detach() for name, param in self.named_parameters()}

    @property
    def device(self) -> torch.device:
        """Where the weights are; `.to(device)` moves them, and every tensor made here follows."""
        return self.inv_freq.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # Layerwise API ---------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] in the model dtype."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D [T], got shape {tuple(token_ids.shape)}")
        if token_ids.numel() and not (0 <= int(token_ids.min()) and int(token_ids.max()) < self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, model.vocab_size={self.cfg.vocab_size})")
        return F.embedding(token_ids, self.model.embed_tokens.weight)

    @torch.inference_mode()
    def forward_layer(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past_kv: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer over T new tokens after P cached ones.

        The new tokens attend to all P cached tokens and causally to each other; `positions`
        (normally P..P+T-1) only set their RoPE angles. Returns the new hidden states [T, hidden]
        and this layer's KV of the new tokens [T, 2, n_kv_head, head_dim] (contiguous).
        """
        block = self._block(layer)
        self._check_layer_inputs(hidden, positions, past_kv)
        q, new_kv = self._project(block, hidden, positions)
        all_kv = new_kv if past_kv is None else torch.cat((past_kv, new_kv), dim=0)
        return self._finish(block, hidden, sequence_attention(q, all_kv)), new_kv

    @torch.inference_mode()
    def forward_layer_spans(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        spans: Sequence[torch.Tensor],
        new_counts: Sequence[int],
    ) -> torch.Tensor:
        """One layer over the packed new tokens of several sequences (prefill of a batch).

        hidden [T, hidden] holds sequence i's new_counts[i] tokens in order, positions [T] their
        RoPE positions. spans[i] [P_i + N_i, 2, n_kv_head, head_dim] is a view of the engine's
        window: rows [0, P_i) hold the cached KV, rows [P_i, P_i + N_i) receive the new KV here.
        One projection and MLP over all T rows; attention per sequence over its span, in place.
        """
        block = self._block(layer)
        if len(spans) != len(new_counts) or sum(new_counts) != hidden.shape[0]:
            raise ValueError(f"{len(spans)} spans for {len(new_counts)} sequences of {sum(new_counts)} tokens "
                             f"but hidden has {hidden.shape[0]} rows")
        q, new_kv = self._project(block, hidden, positions)
        return self._finish(block, hidden, span_attention(q, new_kv, spans, new_counts))

    @torch.inference_mode()
    def forward_layer_paged(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        pool_layer: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        bounds: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """One layer of a decode step: one new token per sequence, its KV kept in pages.

        hidden [B, hidden], positions [B] (the new tokens' positions, context_lens - 1);
        pool_layer [n_pages, block_size, 2, n_kv_head, head_dim] (a strided view of the pages);
        block_tables [B, max_blocks] int64 page ids (padding entries any valid page);
        context_lens [B] tokens including the new one. `bounds` = (min, max) of context_lens
        when the caller knows them, to save a device sync. Writes the new KV into its page,
        then attends over each sequence's pages. Returns the new hidden [B, hidden].
        """
        block = self._block(layer)
        q, new_kv = self._project(block, hidden, positions)
        write_paged(pool_layer, block_tables, context_lens, new_kv)
        shortest, longest = bounds if bounds is not None else (int(context_lens.min()), int(context_lens.max()))
        return self._finish(block, hidden, paged_attention(q, pool_layer, block_tables, context_lens, shortest, longest))

    def _block(self, layer: int) -> DecoderLayer:
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} outside [0, {self.n_layer})")
        return self.model.layers[layer]

    def _project(self, block: DecoderLayer, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, n_head, d] and new KV [T, 2, n_kv_head, d] (K after RoPE, then V)."""
        cfg, attn, tokens = self.cfg, block.self_attn, hidden.shape[0]
        x = block.input_layernorm(hidden)
        q = attn.q_proj(x).view(tokens, cfg.n_head, cfg.head_dim)
        k = attn.k_proj(x).view(tokens, cfg.n_kv_head, cfg.head_dim)
        v = attn.v_proj(x).view(tokens, cfg.n_kv_head, cfg.head_dim)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)
        return apply_rope(q, cos, sin), torch.stack((apply_rope(k, cos, sin), v), dim=1)

    @staticmethod
    def _finish(block: DecoderLayer, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        hidden = hidden + block.self_attn.o_proj(attended)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: [T, hidden] -> [T, vocab] float32."""
        return F.linear(self.model.norm(hidden), self.lm_head_weight).float()

    def _check_layer_inputs(
        self, hidden: torch.Tensor, positions: torch.Tensor, past_kv: torch.Tensor | None
    ) -> None:
        cfg = self.cfg
        if hidden.dim() != 2 or hidden.shape[1] != cfg.hidden_size or hidden.dtype != self.dtype:
            raise ValueError(
                f"hidden must be [T, {cfg.hidden_size}] {cfg.dtype}, got {tuple(hidden.shape)} {hidden.dtype}"
            )
        if tuple(positions.shape) != (hidden.shape[0],):
            raise ValueError(f"positions must be [T={hidden.shape[0]}], got {tuple(positions.shape)}")
        past_tokens = 0
        if past_kv is not None:
            want = (2, cfg.n_kv_head, cfg.head_dim)
            if past_kv.dim() != 4 or tuple(past_kv.shape[1:]) != want or past_kv.dtype != self.dtype:
                raise ValueError(
                    f"past_kv must be [P, {', '.join(map(str, want))}] {cfg.dtype}, "
                    f"got {tuple(past_kv.shape)} {past_kv.dtype}"
                )
            past_tokens = past_kv.shape[0]
        if past_tokens + hidden.shape[0] > cfg.max_context:
            raise ValueError(
                f"{past_tokens} cached + {hidden.shape[0]} new tokens exceed model.max_context={cfg.max_context}"
            )

    # Whole-model conveniences built on forward_layer -------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor | Sequence[int],
        past_kv: Sequence[torch.Tensor] | None = None,
        *,
        last_only: bool = False,
    ) -> PrefillOutput:
        """Layer by layer over new tokens after the cached `past_kv` (one tensor per layer)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        past_tokens = self._past_tokens(past_kv)
        positions = torch.arange(past_tokens, past_tokens + token_ids.shape[0], device=self.device)
        hidden = self.embed(token_ids)
        kv = []
        for layer in range(self.n_layer):
            hidden, layer_kv = self.forward_layer(
                layer, hidden, positions, None if past_kv is None else past_kv[layer]
            )
            kv.append(layer_kv)
        return PrefillOutput(self.logits(hidden[-1:] if last_only else hidden), kv)

    @torch.inference_mode()
    def decode_step(
        self, token_id: int, position: int, past_kv: Sequence[torch.Tensor]
    ) -> DecodeOutput:
        """One token at `position` after the cached KV: logits [vocab] and its KV per layer."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        hidden = self.embed(torch.tensor([token_id]))
        positions = torch.tensor([position], device=self.device)
        kv = []
        for layer in range(self.n_layer):
            hidden, layer_kv = self.forward_layer(layer, hidden, positions, past_kv[layer])
            kv.append(layer_kv)
        return DecodeOutput(self.logits(hidden)[0], kv)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        past_kv: Sequence[torch.Tensor] | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> GenerateOutput:
        """Prefill the prompt after its cached prefix `past_kv`, then decode `max_new_tokens`.

        `past_kv` holds the KV of the first P prompt tokens (P < len(prompt)); only the rest is
        computed. The returned KV covers the whole prompt and all generated tokens but the last.
        """
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
        past_tokens = self._past_tokens(past_kv)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not past_tokens < prompt.shape[0]:
            raise ValueError(
                f"past_kv covers {past_tokens} tokens; the prompt ({prompt.shape[0]}) must be longer"
            )
        total = prompt.shape[0] + max_new_tokens - 1
        cache = [self._empty_kv(total) for _ in range(self.n_layer)]
        for layer in range(self.n_layer if past_kv is not None else 0):
            cache[layer][:past_tokens] = past_kv[layer]  # type: ignore[index]
        prefix = [c[:past_tokens] for c in cache] if past_kv is not None else None
        out = self.prefill(prompt[past_tokens:], prefix, last_only=True)
        for layer, layer_kv in enumerate(out.kv):
            cache[layer][past_tokens : prompt.shape[0]] = layer_kv
        logits, filled = out.logits[0], prompt.shape[0]
        tokens: list[int] = []
        log_probs: list[float] = []
        while True:
            token, log_prob = sample_token(logits, temperature, top_p, generator)
            tokens.append(token)
            log_probs.append(log_prob)
            if len(tokens) == max_new_tokens:
                break
            step = self.decode_step(token, filled, [c[:filled] for c in cache])
            for layer, layer_kv in enumerate(step.kv):
                cache[layer][filled] = layer_kv[0]
            logits, filled = step.logits, filled + 1
        return GenerateOutput(tokens, log_probs, cache)

    def greedy_generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        past_kv: Sequence[torch.Tensor] | None = None,
    ) -> GenerateOutput:
        return self.generate(prompt_ids, max_new_tokens, past_kv)

    def _empty_kv(self, tokens: int) -> torch.Tensor:
        shape = (tokens, 2, self.cfg.n_kv_head, self.cfg.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _past_tokens(self, past_kv: Sequence[torch.Tensor] | None) -> int:
        if past_kv is None:
            return 0
        if len(past_kv) != self.n_layer:
            raise ValueError(f"past_kv must have one tensor per layer ({self.n_layer}), got {len(past_kv)}")
        lengths = {t.shape[0] for t in past_kv}
        if len(lengths) != 1:
            raise ValueError(f"past_kv layers cover different token counts: {sorted(lengths)}")
        return lengths.pop()


