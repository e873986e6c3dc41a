"""The GRPO job's task (rl/lookup_task.py): prompts, the tool, the reward, the warm-up's format."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_ray.rl.lookup_task import ANSWER, CALL, ERROR, QUERY, RESULT, LookupTask


def test_an_episode_asks_a_key_and_the_tool_answers_from_its_table() -> None:
    task = LookupTask(512)
    episode = task.episode(np.random.default_rng(1))
    assert episode.prompt[: task.system_tokens] == task.system_prompt, "every prompt starts with the shared system prompt"
    assert episode.prompt[-2:] == (QUERY, episode.asked), "the prompt ends asking its key"
    assert len(episode.prompt) == task.system_tokens + task.document_tokens + 2, "system, document, question"
    other = next(k for k in task.key_ids if k != episode.asked)
    assert task.tool(episode, (other, CALL)) == (RESULT, episode.table[other]), "the tool looks up the key it is called with"
    assert task.tool(episode, (other, ANSWER)) == (ERROR, ERROR), "a turn that is no call gets an error"


def test_reward_credits_the_right_call_and_an_answer_that_repeats_the_tool() -> None:
    task = LookupTask(512)
    episode = task.episode(np.random.default_rng(2))
    right = episode.table[episode.asked]
    assert task.score(episode, (episode.asked, CALL), (right, ANSWER)).reward == 1.0, "right lookup, right answer"
    wrong_key = next(k for k in task.key_ids if episode.table[k] != right)
    assert task.score(episode, (wrong_key, CALL), (episode.table[wrong_key], ANSWER)).reward == 0.5, (
        "an answer repeating the tool's result earns its half even after a wrong call"
    )
    assert task.score(episode, (episode.asked, CALL), (ERROR, ANSWER)).reward == 0.5, "a right call alone earns half"
    assert task.score(episode, (episode.asked, ANSWER), (right, ANSWER)).reward == 0.0, "no call: no tool result to repeat"


def test_the_warm_up_teaches_the_format_not_the_lookup() -> None:
    task = LookupTask(512)
    rng = np.random.default_rng(3)
    asked_called = 0
    for _ in range(200):
        tokens, agent = task.format_example(rng)
        calls = [t for t, own in zip(tokens, agent) if own]
        assert calls[1] == CALL and calls[3] == ANSWER, "the agent's turns are a call and an answer"
        asked_called += calls[0] == tokens[len(tokens) - 7]
    assert asked_called < 200 * 0.3, "the warm-up's calls name random keys, not the asked one"
    assert task.chance_reward == pytest.approx(0.5 / 8 + 0.5 / 8), "chance is a random key and a random value"


def test_sizes_that_do_not_fit_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        LookupTask(64)
    with pytest.raises(ValueError, match="keys"):
        LookupTask(512, keys=40)
