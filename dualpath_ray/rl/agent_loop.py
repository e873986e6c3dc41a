"""The agent that plays the lookup task through the `rollout-server`, one episode per sample.

Two call shapes, the same actor and the same task:
- `dualpath`: each episode is a session (`session_id`), every turn carries its own seed, and the
  turn before a tool call hints the tool time (`expect_next_turn_s`), so the scheduler stages
  the turn's KV for the next one while the tool runs (docs/architecture.md, "Tool-time staging");
- `verl`: the calls verl 0.9.1's `ToolAgentLoop` makes through `LLMServerClient`: one request id
  (uuid hex) for the whole trajectory, the whole prompt every turn, verl's agent-loop sampling
  keys and no seed, `image_data`/`video_data` None, no session and no hint.
Between the turns the tool runs for `tool_s` seconds (a sleep: a real tool's latency).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from dualpath_ray.rl.lookup_task import ANSWER_TOKENS, CALL_TOKENS, Episode, LookupTask, Score

Shape = Literal["dualpath", "verl"]


@dataclass(frozen=True)
class TurnRecord:
    """One agent turn as the server reported it."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    log_probs: tuple[float, ...]
    hit_tokens: int
    path: str
    weight_version: int


@dataclass(frozen=True)
class EpisodeRollout:
    """A played episode: the whole token sequence, which of its tokens the agent sampled (the
    trainer's targets), the rollout's log-prob of each of them, and the score."""

    episode: Episode
    turns: tuple[TurnRecord, ...]
    score: Score

    @property
    def tokens(self) -> list[int]:
        last = self.turns[-1]
        return [*last.prompt, *last.output]

    @property
    def agent_positions(self) -> list[int]:
        return [len(t.prompt) + i for t in self.turns for i in range(len(t.output))]

    @property
    def rollout_log_probs(self) -> list[float]:
        return [lp for t in self.turns for lp in t.log_probs]


@dataclass(frozen=True)
class AgentSettings:
    temperature: float
    tool_s: float
    shape: Shape


def _record(prompt: list[int], out: Any) -> TurnRecord:
    if out.stop_reason != "completed" or out.log_probs is None:
        raise RuntimeError(f"turn {out.extra_fields.get('request_id')} ended {out.stop_reason!r} without log-probs")
    extra = out.extra_fields
    return TurnRecord(tuple(prompt), tuple(out.token_ids), tuple(float(x) for x in out.log_probs),
                      int(extra["hit_tokens"]), str(extra["path"]), int(extra["weight_version"]))


async def play(server: Any, task: LookupTask, episode: Episode, name: str, seed: int, settings: AgentSettings) -> EpisodeRollout:
    """One episode: agent turn, tool, agent turn. `name` is unique in the run (the session id)."""
    params: dict[str, Any] = {"temperature": settings.temperature, "top_p": 1.0, "logprobs": True}
    prompt = list(episode.prompt)
    turns: list[TurnRecord] = []
    if settings.shape == "verl":
        request_id = uuid.uuid4().hex  # ToolAgentLoop: one id for every turn of the trajectory
        params |= {"top_k": -1, "repetition_penalty": 1.0}
    for turn, max_tokens in enumerate((CALL_TOKENS, ANSWER_TOKENS)):
        last = turn == 1
        if settings.shape == "verl":
            out = await server.generate.remote(request_id=request_id, prompt_ids=prompt,
                                               sampling_params={**params, "max_tokens": max_tokens},
                                               image_data=None, video_data=None)
        else:
            out = await server.generate.remote(
                f"{name}-turn{turn}", prompt, {**params, "max_tokens": max_tokens, "seed": seed + turn},
                session_id=name, expect_next_turn_s=None if last else settings.tool_s,
            )
        turns.append(_record(prompt, out))
        prompt = [*prompt, *out.token_ids]
        if not last:
            await asyncio.sleep(settings.tool_s)
            prompt += task.tool(episode, tuple(out.token_ids))
    return EpisodeRollout(episode, tuple(turns), task.score(episode, turns[0].output, turns[1].output))


async def play_group(server: Any, task: LookupTask, episodes: list[Episode], group: int, step: int,
                     settings: AgentSettings, seed: int) -> list[list[EpisodeRollout]]:
    """Every prompt's `group` samples at once; [prompt][sample]."""
    calls = [
        play(server, task, episode, f"grpo-s{step}-p{p}-g{g}", seed + 1000 * (step * len(episodes) * group + p * group + g),
             settings)
        for p, episode in enumerate(episodes) for g in range(group)
    ]
    flat = await asyncio.gather(*calls)
    return [list(flat[p * group : (p + 1) * group]) for p in range(len(episodes))]
