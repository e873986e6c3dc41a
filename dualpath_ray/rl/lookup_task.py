"""The GRPO job's multi-turn tool task: look a key up with a tool, answer with what it returned.

An episode, in token ids (no tokenizer: the tiny model's vocabulary is ids):

    turn 0 prompt:  system prompt | document | QUERY k          (k: the asked key)
    agent turn 0:   k' CALL                                     (a tool call: argument, then the call)
    tool:           RESULT table[k']   (or ERROR ERROR when the call is malformed)
    agent turn 1:   v ANSWER                                    (the final answer, then its mark)

The table is drawn afresh for every episode, so the agent cannot memorise it: the only way to the
right value is to call the tool with the asked key and copy the tool's result into the answer.
Reward in [0, 1]: 0.5 for a call naming the asked key, plus 0.5 for an answer repeating the tool's
result (the task's "uses the tool's result"); 1.0 is a correct lookup answered correctly.

The system prompt is the same in every episode and step (as an agent's instructions are) and the
document is the episode's own, so turn 0 of every episode shares its first Full Block with every
other one, the G samples of one prompt share the whole prompt, and turn 1 extends turn 0: the
KV reuse a multi-turn RL rollout has. A supervised warm-up (`format_example`) teaches the format
only (a call with some key, an answer with some value, both drawn at random), so the policy
starts at chance, 0.5/keys + 0.5/values, and RL has to learn the lookup itself. Argument first
(postfix) puts the token to repeat at the position the agent's turn starts from, so the skill RL
must find is the tiny model's easiest (repeat the current token): a 4-layer, 64-wide model learns
it from rewards in minutes on 2 cores, where copying the token before the current one (`CALL k`)
stayed near chance for 40 steps in a single-process check (lr 3e-3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUERY, CALL, RESULT, ANSWER, ERROR = 2, 3, 4, 5, 6
FIRST_KEY, FIRST_VALUE, FIRST_FILLER = 16, 32, 64
CALL_TOKENS = 2  # what an agent turn generates: k CALL, then v ANSWER
ANSWER_TOKENS = 2
TOOL_TOKENS = 2


@dataclass(frozen=True)
class Episode:
    """One task instance: its turn-0 prompt, the asked key and the tool's table (key -> value)."""

    prompt: tuple[int, ...]
    asked: int
    table: dict[int, int]


@dataclass(frozen=True)
class Score:
    call_ok: bool
    answer_ok: bool

    @property
    def reward(self) -> float:
        return 0.5 * self.call_ok + 0.5 * self.answer_ok


@dataclass(frozen=True)
class LookupTask:
    """The task's sizes; token ids are laid out as the module constants say."""

    vocab_size: int
    keys: int = 8
    values: int = 8
    system_tokens: int = 96
    document_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.keys <= FIRST_VALUE - FIRST_KEY:
            raise ValueError(f"keys must be in [1, {FIRST_VALUE - FIRST_KEY}] (got {self.keys})")
        if not 1 <= self.values <= FIRST_FILLER - FIRST_VALUE:
            raise ValueError(f"values must be in [1, {FIRST_FILLER - FIRST_VALUE}] (got {self.values})")
        if self.vocab_size <= FIRST_FILLER + 1:
            raise ValueError(f"model.vocab_size must be > {FIRST_FILLER + 1} for the lookup task (got {self.vocab_size})")
        if self.system_tokens < 0 or self.document_tokens < 0:
            raise ValueError("system_tokens and document_tokens must be >= 0")

    @property
    def system_prompt(self) -> tuple[int, ...]:
        rng = np.random.default_rng([self.seed, 0])
        return tuple(int(t) for t in rng.integers(FIRST_FILLER, self.vocab_size, self.system_tokens))

    @property
    def key_ids(self) -> range:
        return range(FIRST_KEY, FIRST_KEY + self.keys)

    @property
    def value_ids(self) -> range:
        return range(FIRST_VALUE, FIRST_VALUE + self.values)

    def episode(self, rng: np.random.Generator) -> Episode:
        document = tuple(int(t) for t in rng.integers(FIRST_FILLER, self.vocab_size, self.document_tokens))
        asked = int(rng.integers(FIRST_KEY, FIRST_KEY + self.keys))
        table = {key: int(rng.integers(FIRST_VALUE, FIRST_VALUE + self.values)) for key in self.key_ids}
        return Episode((*self.system_prompt, *document, QUERY, asked), asked, table)

    def tool(self, episode: Episode, call: tuple[int, ...]) -> tuple[int, ...]:
        """The tool's answer to an agent turn: RESULT and the called key's value, or ERROR twice
        when the turn is not a key followed by CALL."""
        if len(call) >= 2 and call[1] == CALL and call[0] in episode.table:
            return RESULT, episode.table[call[0]]
        return ERROR, ERROR

    def score(self, episode: Episode, call: tuple[int, ...], answer: tuple[int, ...]) -> Score:
        result = self.tool(episode, call)
        call_ok = tuple(call[:2]) == (episode.asked, CALL)
        answer_ok = result[0] == RESULT and tuple(answer[:2]) == (result[1], ANSWER)
        return Score(call_ok, answer_ok)

    def format_example(self, rng: np.random.Generator) -> tuple[list[int], list[bool]]:
        """A warm-up sequence and which of its tokens are the agent's (the supervised targets):
        a well-formed call of a random key and an answer with a random value, so the format is
        learnt and the lookup is not."""
        episode = self.episode(rng)
        call = (int(rng.integers(FIRST_KEY, FIRST_KEY + self.keys)), CALL)
        answer = (int(rng.integers(FIRST_VALUE, FIRST_VALUE + self.values)), ANSWER)
        tokens = [*episode.prompt, *call, *self.tool(episode, call), *answer]
        agent = [False] * len(episode.prompt) + [True] * CALL_TOKENS + [False] * TOOL_TOKENS + [True] * ANSWER_TOKENS
        return tokens, agent

    @property
    def chance_reward(self) -> float:
        """The expected reward of a policy that has the format but picks keys and values at random."""
        return 0.5 / self.keys + 0.5 / self.values
