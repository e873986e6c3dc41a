"""What the GRPO job reports: one JSON line per step, and a PNG of the run at the end."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class StepRecord:
    """One GRPO step. Times are wall seconds of this process; `elapsed_s` counts from the start
    of the job's first rollout (warm-up and deployment before it are in the summary)."""

    step: int
    weight_version: int  # the version the step's rollout served (the sync after it publishes + 1)
    mean_reward: float
    call_accuracy: float  # share of episodes whose tool call named the asked key
    answer_accuracy: float  # share whose answer repeated the tool's result
    groups_with_signal: int  # prompts whose G samples did not all score alike (the others add no gradient)
    loss: float  # the GRPO loss of the step's first pass: ~0 on-policy, as each group's advantages sum to 0
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    rollout_s: float
    train_s: float
    sync_s: float
    elapsed_s: float
    episodes: int
    prompt_tokens: int
    hit_tokens: int
    hit_tokens_by_path: dict[str, int]  # KV read from the store per read path (pe / de / split)
    turns_by_path: dict[str, int]
    logprob_gap: dict[str, float | int]  # all sampled tokens: max, p99, mean, tokens
    logprob_gap_by_kind: dict[str, dict[str, float | int]]  # prefill / prefill_after_hit / decode
    namespace: dict[str, int] = field(default_factory=dict)  # kv_ledger.NamespaceCounts

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


def append_jsonl(path: Path, record: StepRecord) -> None:
    with path.open("a") as out:
        out.write(json.dumps(record.as_json()) + "\n")


def plot(records: Sequence[StepRecord], path: Path, title: str) -> None:
    """Four panels over steps: reward, log-prob gap, KV read per path, rollout vs train time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    ax.plot(steps, [r.mean_reward for r in records], label="mean reward", color="black")
    ax.plot(steps, [r.call_accuracy for r in records], label="tool call names the asked key", alpha=0.6)
    ax.plot(steps, [r.answer_accuracy for r in records], label="answer repeats the tool's result", alpha=0.6)
    ax.set_ylim(0, 1.02)
    ax.set_title("reward (0-1)")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.semilogy(steps, [max(r.logprob_gap["max"], 1e-12) for r in records], label="max")
    ax.semilogy(steps, [max(r.logprob_gap["p99"], 1e-12) for r in records], label="p99")
    ax.semilogy(steps, [max(r.logprob_gap["mean"], 1e-12) for r in records], label="mean")
    ax.axhline(1e-4, color="red", lw=0.8, ls="--", label="1e-4")
    ax.axhline(1e-6, color="gray", lw=0.8, ls="--", label="1e-6")
    ax.set_title("|rollout log-prob - trainer log-prob| (float32)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    paths = sorted({p for r in records for p in r.hit_tokens_by_path})
    bottom = [0.0] * len(records)
    for name in paths:
        values = [float(r.hit_tokens_by_path.get(name, 0)) for r in records]
        ax.bar(steps, values, bottom=bottom, label=f"hit tokens read via {name}")
        bottom = [b + v for b, v in zip(bottom, values)]
    twin = ax.twinx()
    twin.plot(steps, [r.hit_rate for r in records], color="black", label="hit rate")
    twin.set_ylim(0, 1)
    ax.set_title("KV hits per step, by read path")
    ax.legend(fontsize=8, loc="lower left")
    ax = axes[1][1]
    ax.plot(steps, [r.rollout_s for r in records], label="rollout")
    ax.plot(steps, [r.train_s for r in records], label="train")
    ax.plot(steps, [r.sync_s for r in records], label="weight sync")
    ax.set_title("seconds per step")
    ax.legend(fontsize=8)
    for row in axes:
        for a in row:
            a.set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
