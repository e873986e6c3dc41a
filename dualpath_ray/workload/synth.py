"""Synthetic coding-agent traces with the paper's statistics (see docs/trace-format.md).

Each agent is one trajectory. Its number of turns, the tokens each turn appends (tool output,
user message) and the tokens each turn generates are log-normal around the paper's coding-trace
means (157 turns, 429 appended tokens, generation in the hundreds); a trajectory is then cut at
MaxLen: the first turn whose context (prompt + generated tokens) would exceed `max_len` ends it.
Rows use the compact (appended_len, token_seed) form, so a 1024-agent trace is a few MB.

Agent i draws only from the stream seeded by (seed, i), so the trace of N agents is a prefix of
the trace of N + M agents with the same parameters.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa

from dualpath_ray.config import ConfigError
from dualpath_ray.workload.tokens import MAX_TOKEN_SEED
from dualpath_ray.workload.trace import Trajectory, make_table, table_to_trajectories

_AGENT_STREAM = 1
_ARRIVAL_STREAM = 2
_SIZE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class SynthParams:
    """Parameters of a synthetic agentic trace; every default reproduces the paper's trace."""

    agents: int = field(default=64, metadata=_doc("Number of agents, one trajectory each."))
    max_len: int = field(
        default=65536,
        metadata=_doc(
            "MaxLen in tokens: no trajectory's context (prompt + generated) exceeds it; the "
            "paper uses 16K, 32K, 64K and 128K."
        ),
    )
    seed: int = field(default=0, metadata=_doc("Seed of every random draw (lengths, tokens, arrivals)."))
    mean_turns: float = field(
        default=157.0, metadata=_doc("Mean turns per trajectory before MaxLen truncation (paper: ~157).")
    )
    turns_sigma: float = field(
        default=0.4, metadata=_doc("Log-space standard deviation of the log-normal turn count.")
    )
    max_turns: int = field(default=1024, metadata=_doc("Cap on turns per trajectory."))
    mean_appended: float = field(
        default=429.0, metadata=_doc("Mean tokens appended per turn (paper: 429).")
    )
    appended_sigma: float = field(
        default=1.0,
        metadata=_doc("Log-space standard deviation of appended tokens (a heavy tail of big tool outputs)."),
    )
    max_appended: int = field(default=16384, metadata=_doc("Cap on the tokens one turn appends."))
    mean_gen: float = field(
        default=256.0, metadata=_doc("Mean generated tokens per turn (paper: hundreds).")
    )
    gen_sigma: float = field(
        default=0.6, metadata=_doc("Log-space standard deviation of generated tokens per turn.")
    )
    max_gen: int = field(default=4096, metadata=_doc("Cap on the tokens one turn generates."))
    arrival_rate: float = field(
        default=0.0,
        metadata=_doc(
            "Agents per second of a Poisson arrival process (the first agent arrives at 0); "
            "0 = offline: every trajectory arrives at 0."
        ),
    )
    mean_tool_latency_s: float = field(
        default=0.0,
        metadata=_doc("Mean of the exponential tool latency before each turn after the first; 0 = none."),
    )

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"synth.{spec.name}: must be finite, got {value}")
        _at_least(self, 1, "agents", "max_turns", "max_appended", "max_gen")
        _at_least(self, 2, "max_len")
        _at_least(self, 0, "seed")
        _positive(self, "mean_turns", "mean_appended", "mean_gen")
        _non_negative(self, "turns_sigma", "appended_sigma", "gen_sigma", "arrival_rate")
        _non_negative(self, "mean_tool_latency_s")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _at_least(params: SynthParams, low: int, *names: str) -> None:
    for name in names:
        value = getattr(params, name)
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"synth.{name}: must be an integer >= {low}, got {value!r}")


def _positive(params: SynthParams, *names: str) -> None:
    for name in names:
        if getattr(params, name) <= 0:
            raise ConfigError(f"synth.{name}: must be > 0, got {getattr(params, name)!r}")


def _non_negative(params: SynthParams, *names: str) -> None:
    for name in names:
        if getattr(params, name) < 0:
            raise ConfigError(f"synth.{name}: must be >= 0, got {getattr(params, name)!r}")


def param_doc(name: str) -> str:
    """The documentation line of one SynthParams field."""
    return {spec.name: spec.metadata["doc"] for spec in fields(SynthParams)}[name]


def parse_token_count(text: str | int) -> int:
    """A token count written as 65536, 64K or 1M (K = 1024, M = 1024 * 1024)."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        if match is None:
            raise ConfigError(
                f"token count {text!r}: write an integer with an optional K or M suffix, e.g. 64K"
            )
        value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ConfigError(f"token count {text!r}: must be >= 1")
    return value


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    """Log-normal draws with the given arithmetic mean."""
    return rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, size)


@dataclass(frozen=True)
class _AgentTurns:
    appended: np.ndarray
    gen: np.ndarray
    latency: np.ndarray
    seeds: np.ndarray


def _agent_turns(params: SynthParams, agent: int) -> _AgentTurns:
    rng = np.random.default_rng([params.seed, _AGENT_STREAM, agent])
    n_turns = int(np.clip(np.rint(_lognormal(rng, params.mean_turns, params.turns_sigma, 1)[0]),
                          1, params.max_turns))
    appended = np.clip(
        np.rint(_lognormal(rng, params.mean_appended, params.appended_sigma, n_turns)),
        1, params.max_appended,
    ).astype(np.int64)
    gen = np.clip(
        np.rint(_lognormal(rng, params.mean_gen, params.gen_sigma, n_turns)), 1, params.max_gen
    ).astype(np.int64)
    latency = (
        rng.exponential(params.mean_tool_latency_s, n_turns)
        if params.mean_tool_latency_s > 0
        else np.zeros(n_turns)
    )
    latency[0] = 0.0
    seeds = rng.integers(0, MAX_TOKEN_SEED, n_turns, dtype=np.int64, endpoint=True)
    # Turn 0 must fit on its own so that every trajectory keeps at least one turn.
    gen[0] = min(gen[0], params.max_len // 2)
    appended[0] = min(appended[0], params.max_len - gen[0])
    context = np.cumsum(appended + gen)
    kept = int(np.searchsorted(context, params.max_len, side="right"))
    return _AgentTurns(appended[:kept], gen[:kept], latency[:kept], seeds[:kept])


def arrival_times(params: SynthParams) -> np.ndarray:
    """Arrival second of each agent: all 0 offline, else a Poisson process starting at 0."""
    if params.arrival_rate == 0:
        return np.zeros(params.agents)
    rng = np.random.default_rng([params.seed, _ARRIVAL_STREAM])
    gaps = rng.exponential(1.0 / params.arrival_rate, params.agents)
    return np.r_[0.0, np.cumsum(gaps[:-1])]


def agent_id(agent: int, agents: int) -> str:
    """Trajectory id of an agent, zero-padded so ids sort in agent order."""
    return f"agent-{agent:0{max(5, len(str(agents - 1)))}d}"


def synthesize(params: SynthParams) -> pa.Table:
    """A synthetic trace table in the (appended_len, token_seed) form."""
    arrivals = arrival_times(params)
    parts = [_agent_turns(params, agent) for agent in range(params.agents)]
    counts = [len(part.gen) for part in parts]
    return make_table(
        {
            "trajectory_id": np.repeat(
                [agent_id(a, params.agents) for a in range(params.agents)], counts
            ).tolist(),
            "turn": np.concatenate([np.arange(n) for n in counts]),
            "appended_len": np.concatenate([part.appended for part in parts]),
            "token_seed": np.concatenate([part.seeds for part in parts]),
            "gen_len": np.concatenate([part.gen for part in parts]),
            "tool_latency_s": np.concatenate([part.latency for part in parts]),
            "arrival_s": np.repeat(arrivals, counts),
        }
    )


def synthesize_trajectories(params: SynthParams, vocab_size: int) -> list[Trajectory]:
    """A synthetic trace expanded to token ids of a vocabulary."""
    return table_to_trajectories(synthesize(params), vocab_size)
