"""Synthetic agentic traces: the paper's statistics, MaxLen truncation, determinism, arrivals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dualpath_ray.config import ConfigError
from dualpath_ray.workload.stats import (
    expected_cached_tokens,
    shapes_of,
    trace_stats,
)
from dualpath_ray.workload.synth import (
    SynthParams,
    param_doc,
    parse_token_count,
    synthesize,
    synthesize_trajectories,
)
from dualpath_ray.workload.trace import TrajectoryShape, trace_shapes

BLOCK = 64
K = 1024


def _stats(**params: object):
    return trace_stats(trace_shapes(synthesize(SynthParams(agents=96, **params))), BLOCK)


@pytest.mark.parametrize("max_len", [32 * K, 64 * K, 128 * K])
def test_synthetic_trace_matches_the_paper(max_len: int) -> None:
    stats = _stats(max_len=max_len)
    assert abs(stats.appended_mean - 429) / 429 < 0.05, (
        f"mean appended tokens per turn within 5% of the paper's 429, got {stats.appended_mean}"
    )
    assert 100 <= stats.gen_len_mean < 1000, (
        f"generation lengths are in the hundreds, got {stats.gen_len_mean}"
    )
    assert 10 <= stats.turns_per_trajectory_mean <= 170, (
        f"tens to ~157 turns per trajectory, got {stats.turns_per_trajectory_mean}"
    )
    assert stats.steady_hit_rate >= 0.95, (
        f"steady-state hit rate >= 95% as in the paper, got {stats.steady_hit_rate}"
    )
    assert stats.final_context_max <= max_len, "no trajectory's context exceeds MaxLen"
    assert stats.final_context_mean >= 10_000, "contexts reach tens of thousands of tokens"


def test_untruncated_trajectories_average_157_turns() -> None:
    stats = _stats(max_len=4096 * K)
    assert abs(stats.turns_per_trajectory_mean - 157) / 157 < 0.10, (
        f"before truncation a trajectory has ~157 turns, got {stats.turns_per_trajectory_mean}"
    )
    assert abs(stats.appended_mean - 429) / 429 < 0.03, "untruncated appended mean is 429"


def test_maxlen_truncation_scales_turns() -> None:
    means = [_stats(max_len=n * K).turns_per_trajectory_mean for n in (16, 32, 64, 128)]
    assert means == sorted(means), f"a larger MaxLen keeps more turns, got {means}"
    assert means[0] >= 10, f"even 16K MaxLen keeps tens of turns, got {means[0]}"
    short = _stats(max_len=16 * K)
    assert short.final_context_max <= 16 * K, "16K truncation holds"
    # With 429 appended tokens per turn and ~8K average prompts a 16K trace cannot reach 95%:
    # its steady hit rate is about 1 - (429 + block_size / 2) / 8K.
    assert 0.93 < short.steady_hit_rate < 0.95, f"16K hit rate as analysed, got {short}"


def test_same_seed_same_trace_and_agent_prefix_stability() -> None:
    small = synthesize(SynthParams(agents=8, seed=3))
    assert small.equals(synthesize(SynthParams(agents=8, seed=3))), "synthesis is deterministic"
    assert not small.equals(synthesize(SynthParams(agents=8, seed=4))), "the seed matters"
    large = synthesize(SynthParams(agents=16, seed=3)).slice(0, small.num_rows)
    assert small.column("token_seed").equals(large.column("token_seed")), (
        "agent i's trajectory depends only on (seed, i): N agents are a prefix of N + M"
    )


def test_rows_use_the_seeded_form_and_expand_in_range() -> None:
    table = synthesize(SynthParams(agents=3, max_len=4 * K))
    assert table.column("appended").null_count == table.num_rows, "synth stores no explicit ids"
    trajectories = synthesize_trajectories(SynthParams(agents=3, max_len=4 * K), 100)
    tokens = np.concatenate([np.asarray(t.appended) for tr in trajectories for t in tr.turns])
    assert tokens.min() >= 0 and tokens.max() < 100, "expanded ids lie in the vocabulary"
    lengths = [len(t.appended) for t in trajectories[0].turns]
    assert lengths == list(trace_shapes(table)[0].appended_lens), "expansion keeps lengths"


def test_offline_and_poisson_arrivals() -> None:
    offline = trace_shapes(synthesize(SynthParams(agents=5)))
    assert {s.arrival_s for s in offline} == {0.0}, "arrival_rate 0 is offline: all at 0"
    shapes = trace_shapes(synthesize(SynthParams(agents=800, max_len=2 * K, arrival_rate=4.0)))
    arrivals = np.array([s.arrival_s for s in shapes])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0), "arrivals start at 0, in order"
    mean_gap = float(np.diff(arrivals).mean())
    assert abs(mean_gap - 0.25) / 0.25 < 0.12, f"Poisson rate 4/s has 0.25 s mean gaps: {mean_gap}"


def test_tool_latency() -> None:
    table = synthesize(SynthParams(agents=20, max_len=8 * K, mean_tool_latency_s=2.0))
    latency = np.asarray(table.column("tool_latency_s"))
    first = np.asarray(table.column("turn")) == 0
    assert np.all(latency[first] == 0), "the first turn has no tool latency (arrival covers it)"
    assert abs(latency[~first].mean() - 2.0) < 0.3, "later turns wait ~mean_tool_latency_s"
    default = synthesize(SynthParams(agents=2))
    assert np.all(np.asarray(default.column("tool_latency_s")) == 0), "default latency is 0"


def test_every_parameter_has_a_documented_default() -> None:
    for spec in dataclasses.fields(SynthParams):
        assert spec.default is not dataclasses.MISSING, f"{spec.name} has a default"
        assert len(param_doc(spec.name)) > 10, f"{spec.name} has a documentation line"


@pytest.mark.parametrize(
    ("text", "tokens"), [("64K", 65536), ("65536", 65536), ("128k", 131072), ("1M", 1 << 20)]
)
def test_parse_token_count(text: str, tokens: int) -> None:
    assert parse_token_count(text) == tokens, f"{text} means {tokens} tokens"


@pytest.mark.parametrize("text", ["64Q", "-1", "0", "1.5K", ""])
def test_parse_token_count_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="token count"):
        parse_token_count(text)


@pytest.mark.parametrize(
    ("field", "value"), [("agents", 0), ("max_len", 1), ("mean_appended", 0.0), ("arrival_rate", -1.0)]
)
def test_bad_parameters_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"synth.{field}"):
        SynthParams(**{field: value})


def test_expected_hit_model() -> None:
    assert expected_cached_tokens(128, 64) == 64, "the last generated token has no KV yet"
    assert expected_cached_tokens(129, 64) == 128, "every other full block is stored"
    shape = TrajectoryShape("x", appended_lens=(100, 10), gen_lens=(29, 5), arrival_s=0.0)
    stats = trace_stats([shape], 64)
    assert (stats.prompt_tokens, stats.cached_tokens) == (100 + 139, 128), (
        "turn 1's prompt is 100 + 29 + 10 tokens and hits 2 blocks of the 129-token context"
    )
    assert stats.steady_hit_rate == 128 / 139, "steady state leaves out turn 0"
    assert trace_stats(shapes_of(synthesize_trajectories(SynthParams(agents=2, max_len=4 * K), 50)),
                       64) == trace_stats(
        trace_shapes(synthesize(SynthParams(agents=2, max_len=4 * K))), 64
    ), "stats of expanded trajectories equal stats of the table"
