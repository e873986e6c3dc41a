"""Choosing a token from logits, with the log-prob an RL trainer gets back.

The sampling distribution, in the order vLLM's sampler (v1, 0.32) builds it, so the native and
the vllm backends sample from, and report, the same quantity:

1. repetition penalty: every token id in the context (prompt and generated so far) has its logit
   divided by the penalty where positive, multiplied where not (1.0: off);
2. greedy (temperature 0): the argmax of those logits (lowest id on ties); nothing below applies;
3. otherwise the logits divided by the temperature, then masked to -inf where
   - min_p: the token's probability is below min_p x the most likely token's (0: off),
   - top_k: the token is not among the k largest (ties at the k-th value kept; -1/0: off),
   - top_p: the token is outside the smallest most-likely head whose mass reaches top_p, the
     mass taken over what min_p and top_k kept (1.0: off);
   and the token is drawn from the softmax of what is left.

The log-prob returned (LogProbs):
- "sampling": log-softmax of the logits after step 3 (or after step 1 when greedy), at the token:
  the log-prob of the distribution the token was drawn from, renormalised over the kept tokens;
- "raw": log-softmax of the model's logits, before any of the steps.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import torch

LogProbs = Literal["sampling", "raw"]


def penalised(logits: torch.Tensor, context: Collection[int], repetition_penalty: float) -> torch.Tensor:
    """Step 1 on [vocab] float logits (a new tensor when the penalty is on)."""
    if repetition_penalty == 1.0 or not context:
        return logits
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[torch.as_tensor(sorted({int(t) for t in context}), dtype=torch.long)] = True
    # x (1 / penalty) rather than / penalty: vLLM's op, so the two round alike.
    scaled = torch.where(logits > 0, logits * (1.0 / repetition_penalty), logits * repetition_penalty)
    return torch.where(seen, scaled, logits)


def masked_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Step 3 on [vocab] float logits (temperature > 0): scaled, with the tokens it drops at -inf."""
    scaled = logits / temperature
    drop = torch.zeros_like(scaled, dtype=torch.bool)
    if min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        drop |= probs < min_p * probs.max()
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled.masked_fill(drop, -torch.inf), top_k).values[-1]
        drop |= scaled < kth
    if top_p < 1.0:
        probs = torch.softmax(scaled.masked_fill(drop, -torch.inf), dim=-1)
        ordered, order = probs.sort(descending=True)
        # The mass of the tokens more likely than each; the most likely token is always kept.
        outside = (ordered.cumsum(0) - ordered) >= top_p
        outside[0] = False
        drop |= torch.zeros_like(drop).scatter(0, order, outside)
    return scaled.masked_fill(drop, -torch.inf)


def check_sampling(temperature: float, top_p: float, top_k: int, min_p: float, repetition_penalty: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise ValueError(f"top_k must be -1 or 0 (off) or a positive count, got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if not repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")


def sample_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    *,
    top_k: int = -1,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    context: Collection[int] = (),
    log_probs: LogProbs = "sampling",
) -> tuple[int, float]:
    """Choose a token from [vocab] logits as the module docstring says; `context` is the token
    ids the repetition penalty applies to. Returns the token and its log-prob (`log_probs`)."""
    check_sampling(temperature, top_p, top_k, min_p, repetition_penalty)
    raw = logits.float()
    logits = penalised(raw, context, repetition_penalty)
    if temperature == 0.0:
        token = int(torch.argmax(logits))
        final = logits
    else:
        final = masked_logits(logits, temperature, top_k, top_p, min_p)
        probs = torch.softmax(final, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    reported = raw if log_probs == "raw" else final
    return token, float(torch.log_softmax(reported, dim=-1)[token])
