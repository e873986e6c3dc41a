"""Choosing a token from logits: greedy or temperature / top-p, with the policy's log-prob."""

from __future__ import annotations

import torch


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
