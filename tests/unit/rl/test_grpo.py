"""GRPO's pieces (rl/grpo.py): group advantages, the clipped ratio loss, the log-prob gap."""

from __future__ import annotations

import math

import pytest
import torch

from dualpath_ray.rl.grpo import clipped_surrogate, group_advantages, logprob_gap


def test_advantages_are_relative_to_the_group_and_zero_when_it_agrees() -> None:
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]))
    assert torch.allclose(adv[0].sum(), torch.tensor(0.0), atol=1e-6), "a group's advantages sum to 0"
    assert adv[0, 0] > 0 > adv[0, 1], "above the group's mean is positive, below negative"
    assert torch.equal(adv[1], torch.zeros(4)), "a group that scored alike teaches nothing"
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))


def test_on_policy_the_loss_is_the_policy_gradient() -> None:
    old = torch.log(torch.tensor([0.5, 0.25, 0.1]))
    new = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0])
    parts = clipped_surrogate(new, old, adv, 0.2)
    parts.loss.backward()
    assert math.isclose(float(parts.loss.detach()), -float(adv.mean()), rel_tol=1e-6), "ratio 1: the loss is -mean(A)"
    assert torch.allclose(new.grad, -adv / 3), "d loss / d log-prob = -A / tokens (REINFORCE)"
    assert parts.clip_fraction == 0.0 and abs(parts.approx_kl) < 1e-7, "nothing clipped, no divergence"


def test_the_clip_stops_the_gradient_past_one_plus_eps() -> None:
    old = torch.zeros(2)
    new = torch.tensor([math.log(1.5), math.log(0.5)], requires_grad=True)
    parts = clipped_surrogate(new, old, torch.tensor([1.0, -1.0]), 0.2)
    parts.loss.backward()
    assert torch.equal(new.grad, torch.zeros(2)), "a ratio beyond the clip in the advantage's direction gets no gradient"
    assert parts.clip_fraction == 1.0 and parts.approx_kl > 0, "both tokens clipped; the policies differ"


def test_the_gap_is_taken_token_by_token() -> None:
    rollout = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    trainer = rollout + torch.tensor([0.0, 2.0**-20, -(2.0**-19), 0.0])  # exact in float32 at these magnitudes
    gap = logprob_gap(rollout, trainer)
    assert gap.tokens == 4 and gap.max == 2.0**-19, "the largest |difference|"
    assert math.isclose(gap.mean, 3 * 2.0**-20 / 4, rel_tol=1e-9), "the mean |difference|"
    assert gap.max >= gap.p99 >= gap.mean, "p99 lies between"
    assert logprob_gap(torch.zeros(0), torch.zeros(0)).tokens == 0, "no tokens, no gap"
