"""GRPO's pieces, pure torch: group-relative advantages, the clipped importance-ratio loss with
the rollout's log-probs as the behaviour policy, and the rollout-vs-trainer log-prob gap.

GRPO (Shao et al., 2024, DeepSeekMath): G samples of one prompt form a group; a sample's advantage
is its reward minus the group's mean, over the group's standard deviation, and every token of the
sample carries it. The loss is PPO's clipped surrogate per agent token,
    -min(r A, clip(r, 1 - eps, 1 + eps) A),   r = exp(log pi_theta(token) - log pi_rollout(token)),
averaged over all agent tokens of the batch (token-mean, as DAPO and verl's default). No KL term:
the task's reward is verifiable and the runs are short (verl's use_kl_loss=False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[prompts, G] rewards -> [prompts, G] advantages; a group whose samples all scored the same
    gets 0 (it says nothing about which sample was better)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, G >= 2], got {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + ADVANTAGE_EPS)


@dataclass(frozen=True)
class SurrogateLoss:
    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: float  # agent tokens whose ratio the clip held
    approx_kl: float  # mean of (r - 1) - log r over agent tokens (Schulman's k3 estimator of KL(rollout || theta))


def clipped_surrogate(
    new_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, advantages: torch.Tensor, clip_eps: float,
) -> SurrogateLoss:
    """All [N] over the batch's agent tokens: the trainer's log-probs (with grad), the rollout
    engine's, and each token's advantage (its sample's)."""
    if not new_log_probs.shape == rollout_log_probs.shape == advantages.shape:
        raise ValueError(f"shapes differ: {new_log_probs.shape}, {rollout_log_probs.shape}, {advantages.shape}")
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    log_ratio = new_log_probs - rollout_log_probs
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        held = ((ratio - clipped).abs() > 0) & ((clipped * advantages) < (ratio * advantages))
        kl = ((ratio - 1) - log_ratio).mean()
    return SurrogateLoss(per_token.mean(), float(held.float().mean()), float(kl))


@dataclass(frozen=True)
class GapStats:
    """|rollout log-prob - trainer log-prob| over sampled tokens, float32."""

    max: float
    p99: float
    mean: float
    tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return {"max": self.max, "p99": self.p99, "mean": self.mean, "tokens": self.tokens}


def logprob_gap(rollout: torch.Tensor, trainer: torch.Tensor) -> GapStats:
    """The gap of two [N] log-prob vectors of the same tokens, both taken in float32."""
    if rollout.shape != trainer.shape or rollout.dim() != 1:
        raise ValueError(f"need two [N] vectors, got {tuple(rollout.shape)} and {tuple(trainer.shape)}")
    if rollout.numel() == 0:
        return GapStats(0.0, 0.0, 0.0, 0)
    gap = (rollout.detach().float().cpu() - trainer.detach().float().cpu()).abs()
    return GapStats(float(gap.max()), float(torch.quantile(gap.double(), 0.99)), float(gap.double().mean()), gap.numel())
