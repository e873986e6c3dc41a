"""The GRPO job's trainer: the policy's weights, its log-probs of sampled tokens, its optimizer.

A plain-torch trainer on its own device (this process's: the CPU here, a GPU where it has one). Its log-probs are the
rollout engines' quantity (engine.logprobs): `sampling` = log-softmax of logits / temperature
(the distribution the tokens were drawn from: top_p, top_k and min_p are off in this job, so
nothing is masked), `raw` = log-softmax of the logits. The forward is `packed_logits`, the
engines' prefill code with autograd, so the two differ by kernel rounding only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dualpath_ray.config import ModelConfig
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.model.sampling import LogProbs
from dualpath_ray.model.training import packed_logits, trainable


@dataclass(frozen=True)
class Scored:
    """Sequences to score: `targets[i]` are the positions of sequence i whose token the agent
    sampled (each predicted by the row before it)."""

    sequences: Sequence[Sequence[int]]
    targets: Sequence[Sequence[int]]


class Policy:
    """The trainer's copy of the model, with Adam; `state()` is what the engines get."""

    def __init__(self, model_cfg: ModelConfig, lr: float, temperature: float, log_probs: LogProbs,
                 device: torch.device = torch.device("cpu")) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for RL sampling (got {temperature})")
        self.model = DecoderModel(model_cfg).to(device)
        self.optimizer = torch.optim.Adam(trainable(self.model), lr=lr)
        self.temperature = temperature
        self.log_probs = log_probs

    def token_log_probs(self, batch: Scored) -> torch.Tensor:
        """[N] float32 log-probs of every target token, sequence by sequence, with grad."""
        logits = packed_logits(self.model, batch.sequences)
        starts = np.cumsum([0, *[len(s) for s in batch.sequences]])[:-1]
        device = self.model.device
        rows = torch.tensor([int(start) + p - 1 for start, ts in zip(starts, batch.targets) for p in ts], device=device)
        tokens = torch.tensor([int(s[p]) for s, ts in zip(batch.sequences, batch.targets) for p in ts], device=device)
        picked = logits[rows]
        if self.log_probs == "sampling":
            picked = picked / self.temperature
        return torch.log_softmax(picked, dim=-1).gather(1, tokens[:, None])[:, 0]

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> float:
        """One optimizer step on `loss`; returns the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        self.optimizer.step()
        return float(norm)

    def warm_up(self, sequences: Sequence[Sequence[int]], agent: Sequence[Sequence[bool]], max_grad_norm: float) -> float:
        """One supervised step: cross-entropy of the agent's tokens (teacher forcing, raw logits).
        Returns the loss."""
        logits = packed_logits(self.model, sequences)
        starts = np.cumsum([0, *[len(s) for s in sequences]])[:-1]
        rows = [int(start) + p - 1 for start, mask in zip(starts, agent) for p, own in enumerate(mask) if own and p]
        tokens = [int(s[p]) for s, mask in zip(sequences, agent) for p, own in enumerate(mask) if own and p]
        device = self.model.device
        loss = torch.nn.functional.cross_entropy(logits[torch.tensor(rows, device=device)], torch.tensor(tokens, device=device))
        self.step(loss, max_grad_norm)
        return float(loss.detach())

    def state(self) -> dict[str, torch.Tensor]:
        """The weights by checkpoint name, detached copies on the trainer's device (what the
        broadcast sends: NCCL when the trainer and every engine have a GPU, else gloo)."""
        return {name: tensor.detach().clone().contiguous() for name, tensor in self.model.checkpoint_tensors().items()}
