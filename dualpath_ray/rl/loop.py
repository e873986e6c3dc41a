"""The GRPO loop of jobs/grpo_tool_agent.py, on a deployed `DualPathCluster`.

Once: a supervised warm-up on the task's format (the trainer, this process), then the weights go
to every engine through the broadcast group. Every step: roll out G samples of each prompt through
the `rollout-server` (agent_loop.py), score them, take the GRPO loss with the rollout's log-probs
as the behaviour policy (grpo.py), step the optimizer, and broadcast the new weights as the next
weight version, which moves the KV namespace. Each step is reported (report.StepRecord) with the
log-prob gap of every sampled token, measured on the trainer's first forward of the step, whose
weights are the ones the rollout served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from dualpath_ray.rl.agent_loop import AgentSettings, EpisodeRollout, Shape, play_group
from dualpath_ray.rl.grpo import clipped_surrogate, group_advantages, logprob_gap
from dualpath_ray.rl.kv_ledger import NamespaceLedger
from dualpath_ray.rl.lookup_task import LookupTask
from dualpath_ray.rl.policy import Policy, Scored
from dualpath_ray.rl.report import StepRecord


@dataclass(frozen=True)
class GRPOSettings:
    steps: int = 80
    prompts: int = 8  # prompts per step
    group: int = 8  # G: samples per prompt
    temperature: float = 1.0
    lr: float = 1e-3
    clip_eps: float = 0.2
    epochs: int = 4  # optimizer passes over each step's rollout (the ratio leaves 1 after the first)
    max_grad_norm: float = 1.0
    warmup_steps: int = 60
    warmup_batch: int = 32
    tool_s: float = 0.05
    shape: Shape = "dualpath"
    seed: int = 0
    time_budget_s: float | None = None  # stop starting steps once the loop has run this long
    device: str = "cpu"  # the trainer's torch device

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.group < 2:
            raise ValueError(f"group must be >= 2: GRPO compares a prompt's samples (got {self.group})")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0: GRPO needs samples that differ (got {self.temperature})")


@dataclass(frozen=True)
class WarmUp:
    steps: int
    first_loss: float
    last_loss: float
    seconds: float


def warm_up(policy: Policy, task: LookupTask, settings: GRPOSettings, rng: np.random.Generator) -> WarmUp:
    started, losses = time.monotonic(), []
    for _ in range(settings.warmup_steps):
        examples = [task.format_example(rng) for _ in range(settings.warmup_batch)]
        losses.append(policy.warm_up([e[0] for e in examples], [e[1] for e in examples], settings.max_grad_norm))
    return WarmUp(settings.warmup_steps, losses[0] if losses else 0.0, losses[-1] if losses else 0.0,
                  time.monotonic() - started)


@dataclass(frozen=True)
class Trained:
    """A step's optimizer passes: the first's loss, gradient norm and log-prob gap (all sampled
    tokens, and by kind), the last's clip fraction and KL estimate."""

    loss: float
    grad_norm: float
    gap: dict[str, float | int]
    gap_by_kind: dict[str, dict[str, float | int]]
    clip_fraction: float
    approx_kl: float


def _gap_kinds(flat: list[EpisodeRollout]) -> list[str]:
    """Each sampled token's kind, in the order of `EpisodeRollout.rollout_log_probs`: a turn's first
    token comes from a prefill (over KV it loaded from the store when the turn hit), the others
    from decode steps."""
    kinds = []
    for episode in flat:
        for turn in episode.turns:
            first = "prefill_with_loaded_kv" if turn.hit_tokens else "prefill"
            kinds += [first] + ["decode"] * (len(turn.output) - 1)
    return kinds


def _by_path(flat: list[EpisodeRollout]) -> tuple[dict[str, int], dict[str, int]]:
    hits: dict[str, int] = {}
    turns: dict[str, int] = {}
    for turn in (t for e in flat for t in e.turns):
        hits[turn.path] = hits.get(turn.path, 0) + turn.hit_tokens
        turns[turn.path] = turns.get(turn.path, 0) + 1
    return hits, turns


class GRPORun:
    """The loop's state: the trainer, the weight sender, the version served, the ledger."""

    def __init__(self, cluster: Any, settings: GRPOSettings) -> None:
        self.cluster = cluster
        self.settings = settings
        cfg = cluster.cfg
        self.task = LookupTask(cfg.model.vocab_size, seed=settings.seed)
        self.policy = Policy(cfg.model, settings.lr, settings.temperature, cfg.engine.logprobs, torch.device(settings.device))
        self.rng = np.random.default_rng(settings.seed)
        self.server = cluster.server()
        self.sender = cluster.attach_weight_sender(group_name="grpo")
        self.version = int(ray.get(self.server.get_weight_version.remote()))
        self.ledger = NamespaceLedger(cfg.kv_namespace, cfg.store.block_size)
        self.agent = AgentSettings(settings.temperature, settings.tool_s, settings.shape)

    def sync(self, global_steps: int) -> float:
        """The trainer's weights to every engine as the next version; returns the seconds."""
        started = time.monotonic()
        self.version += 1
        self.cluster.update_weights_from_group(self.sender, self.version, self.policy.state())
        if self.settings.shape == "verl":
            ray.get(self.server.set_global_steps.remote(global_steps))
        return time.monotonic() - started

    def warm_up(self) -> WarmUp:
        result = warm_up(self.policy, self.task, self.settings, self.rng)
        self.sync(0)
        return result

    def _train(self, batch: Scored, flat: list[EpisodeRollout], advantages: torch.Tensor) -> Trained:
        """`epochs` optimizer passes over the step's batch; the gap is taken on the first, whose
        weights are the ones the rollout served."""
        device = self.policy.model.device
        rollout_lp = torch.tensor([lp for e in flat for lp in e.rollout_log_probs], dtype=torch.float32, device=device)
        advantages = advantages.to(device)
        kinds = _gap_kinds(flat)
        results: dict[str, Any] = {}
        for epoch in range(self.settings.epochs):
            trainer_lp = self.policy.token_log_probs(batch)
            parts = clipped_surrogate(trainer_lp, rollout_lp, advantages, self.settings.clip_eps)
            if epoch == 0:
                results["gap"] = logprob_gap(rollout_lp, trainer_lp).as_dict()
                results["gap_by_kind"] = {
                    kind: logprob_gap(rollout_lp[idx], trainer_lp[idx]).as_dict()
                    for kind in sorted(set(kinds))
                    for idx in [torch.tensor([i for i, k in enumerate(kinds) if k == kind], device=device)]
                }
                results["loss"] = float(parts.loss.detach())
            norm = self.policy.step(parts.loss, self.settings.max_grad_norm)
            results.setdefault("grad_norm", norm)
        # The clip and the KL estimate of the last pass: the first is on-policy (ratio ~1).
        return Trained(clip_fraction=parts.clip_fraction, approx_kl=parts.approx_kl, **results)

    def step(self, step: int, loop_started: float) -> StepRecord:
        s = self.settings
        episodes = [self.task.episode(self.rng) for _ in range(s.prompts)]
        started = time.monotonic()
        groups = asyncio.run(play_group(self.server, self.task, episodes, s.group, step, self.agent, s.seed))
        rollout_s = time.monotonic() - started
        flat = [e for g in groups for e in g]
        rewards = torch.tensor([[e.score.reward for e in g] for g in groups], dtype=torch.float32)
        per_episode = group_advantages(rewards).reshape(-1)
        advantages = torch.cat([per_episode[i].expand(len(e.agent_positions)) for i, e in enumerate(flat)])
        started = time.monotonic()
        trained = self._train(Scored([e.tokens for e in flat], [e.agent_positions for e in flat]), flat, advantages)
        train_s = time.monotonic() - started
        counts = self.ledger.record_step(self.version, flat)
        served = self.version
        sync_s = self.sync(step + 1)
        hits, turns = _by_path(flat)
        return StepRecord(
            step=step, weight_version=served, mean_reward=float(rewards.mean()),
            call_accuracy=float(np.mean([e.score.call_ok for e in flat])),
            answer_accuracy=float(np.mean([e.score.answer_ok for e in flat])),
            groups_with_signal=int((rewards.max(dim=1).values > rewards.min(dim=1).values).sum()), loss=trained.loss,
            clip_fraction=trained.clip_fraction, approx_kl=trained.approx_kl, grad_norm=trained.grad_norm,
            rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, elapsed_s=time.monotonic() - loop_started,
            episodes=len(flat), prompt_tokens=sum(len(t.prompt) for e in flat for t in e.turns),
            hit_tokens=sum(t.hit_tokens for e in flat for t in e.turns), hit_tokens_by_path=hits, turns_by_path=turns,
            logprob_gap=trained.gap, logprob_gap_by_kind=trained.gap_by_kind, namespace=counts.as_dict(),
        )

    def run(self, on_step: Callable[[StepRecord], None]) -> list[StepRecord]:
        records: list[StepRecord] = []
        loop_started = time.monotonic()
        for step in range(self.settings.steps):
            if self.settings.time_budget_s is not None and time.monotonic() - loop_started > self.settings.time_budget_s:
                break
            record = self.step(step, loop_started)
            records.append(record)
            on_step(record)
        return records
