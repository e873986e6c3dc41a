"""The trainer's forward: logits of whole sequences with autograd, through the engines' own code.

`DecoderModel`'s layerwise API runs under inference mode (no graph); an RL trainer needs the same
numbers with gradients. `packed_logits` is the engines' prefill of sequences packed in one batch
(`forward_layer_spans` with nothing cached): one projection and MLP over all rows, RoPE from each
sequence's positions, causal attention per sequence (model/attention.py's `sequence_attention`),
the final norm and lm_head. Every op is the one the engines run, so the log-probs a trainer takes
from it differ from the rollout's by kernel rounding only (docs/rl.md, "The log-prob gap").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dualpath_ray.model.attention import sequence_attention
from dualpath_ray.model.llama import DecoderModel


def packed_logits(model: DecoderModel, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """[sum of lengths, vocab] float32 logits of `sequences` packed in order (row i of sequence s
    predicts its token i + 1), each from scratch; differentiable where the parameters require grad."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("packed_logits needs at least one sequence, none of them empty")
    lengths = [len(s) for s in sequences]
    if max(lengths) > model.cfg.max_context:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds model.max_context={model.cfg.max_context}")
    device = model.device
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    if int(ids.min()) < 0 or int(ids.max()) >= model.cfg.vocab_size:
        raise ValueError(f"token ids must be in [0, model.vocab_size={model.cfg.vocab_size})")
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    hidden = F.embedding(ids, model.model.embed_tokens.weight)
    for layer in range(model.n_layer):
        block = model.model.layers[layer]
        q, kv = model._project(block, hidden, positions)
        attended = torch.cat([
            sequence_attention(q_seq, kv_seq) for q_seq, kv_seq in zip(q.split(lengths), kv.split(lengths))
        ])
        hidden = model._finish(block, hidden, attended)
    return F.linear(model.model.norm(hidden), model.lm_head_weight).float()


def trainable(model: DecoderModel) -> list[torch.nn.Parameter]:
    """The model's parameters, switched to require gradients (they are built frozen for serving)."""
    params = list(model.parameters())
    for param in params:
        param.requires_grad_(True)
    return params
