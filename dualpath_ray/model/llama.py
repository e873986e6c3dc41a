"""A small Llama/Qwen2-style decoder with a layerwise API (RMSNorm, RoPE, GQA, SwiGLU).

The prefill and decode engines drive the model one layer at a time: `forward_layer` takes the
hidden states of the new tokens and that layer's cached KV of the P tokens before them, and
returns the new hidden states and the layer's KV of the new tokens only. Full prefill, decode
steps and generation are built on it, so the engines and the reference path share one kernel.

KV of one layer is token-major `[T, 2, n_kv_head, head_dim]` (K after RoPE, then V), contiguous
and in the model dtype: exactly what `KVLayout.kv_as_bytes` reinterprets as bytes. Module names
follow the Hugging Face Qwen2/Llama checkpoints, so `state_dict()` keys are the checkpoint names.
Random weights come from a private `torch.Generator(cfg.seed)`, never the global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.layout import torch_dtype
from dualpath_ray.model.weights import (
    Architecture,
    WeightsError,
    detect_architecture,
    read_checkpoint,
    validate_checkpoint,
)


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


class _Linear(nn.Module):
    """y = x W^T (+ b); parameters start uninitialised so construction touches no RNG."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Embedding(nn.Module):
    def __init__(self, vocab: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, width, dtype=dtype), requires_grad=False)


class _RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, dtype: torch.dtype):
        super().__init__()
        q_width, kv_width = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.q_proj = _Linear(cfg.hidden_size, q_width, bias, dtype)
        self.k_proj = _Linear(cfg.hidden_size, kv_width, bias, dtype)
        self.v_proj = _Linear(cfg.hidden_size, kv_width, bias, dtype)
        self.o_proj = _Linear(q_width, cfg.hidden_size, False, dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.up_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, False, dtype)
        self.down_proj = _Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.self_attn = _Attention(cfg, bias, dtype)
        self.mlp = _MLP(cfg, dtype)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(_Layer(cfg, bias, dtype) for _ in range(cfg.n_layer))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _causal_mask(new_tokens: int, past_tokens: int, device: torch.device) -> torch.Tensor:
    """[T, P+T] bool, True = may attend: every cached token, and new tokens up to itself."""
    past = torch.ones(new_tokens, past_tokens, dtype=torch.bool, device=device)
    own = torch.ones(new_tokens, new_tokens, dtype=torch.bool, device=device).tril()
    return torch.cat((past, own), dim=1)


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
        self.model = _Backbone(cfg, self.arch.attention_bias, self.dtype)
        self.lm_head = (
            None
            if self.arch.tie_word_embeddings
            else _Linear(cfg.hidden_size, cfg.vocab_size, False, self.dtype)
        )
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
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
    def _load(self, checkpoint: dict[str, torch.Tensor]) -> None:
        validate_checkpoint(checkpoint, self.cfg, self.arch)
        for name, param in self.named_parameters():
            param.copy_(checkpoint[name].to(self.dtype))

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
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} outside [0, {self.n_layer})")
        tokens = hidden.shape[0]
        self._check_layer_inputs(hidden, positions, past_kv)
        block = self.model.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        cfg = self.cfg
        q = attn.q_proj(x).view(tokens, cfg.n_head, cfg.head_dim)
        k = attn.k_proj(x).view(tokens, cfg.n_kv_head, cfg.head_dim)
        v = attn.v_proj(x).view(tokens, cfg.n_kv_head, cfg.head_dim)
        cos, sin = self._rope(positions)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        new_kv = torch.stack((k, v), dim=1).contiguous()
        all_kv = new_kv if past_kv is None else torch.cat((past_kv, new_kv), dim=0)
        past_tokens = all_kv.shape[0] - tokens
        out = self._attention(q, all_kv[:, 0], all_kv[:, 1], _causal_mask(tokens, past_tokens, hidden.device))
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + block.mlp(block.post_attention_layernorm(hidden))
        return hidden, new_kv

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

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim], broadcasting over heads."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [T, n_head, d], k/v [S, n_kv_head, d], mask [T, S] -> [T, n_head * d]."""
        group = self.cfg.n_head // self.cfg.n_kv_head
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        return out.transpose(0, 1).reshape(q.shape[0], -1)

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


def sample_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[int, float]:
    """Choose a token from [vocab] logits; temperature 0 is greedy (argmax, lowest id on ties).

    Returns the token and its log-probability under softmax(logits / temperature) (raw logits
    when greedy), before top-p truncation: the policy's log-prob an RL trainer expects.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0.0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    probs = log_probs.exp()
    sorted_probs, order = probs.sort(descending=True)
    # Keep the smallest head of the sorted distribution whose mass reaches top_p.
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    token = int(order[torch.multinomial(kept / kept.sum(), 1, generator=generator)])
    return token, float(log_probs[token])

