"""Emulated hardware: the one place that knows whether NICs and GPU time are real.

Three things are emulated on a machine without the paper's hardware:
- NIC bandwidth: a `TokenBucket` per node SNIC (reads and writes share it) and per engine CNIC
  (one per direction, since a NIC is full duplex). With emulation off, `Link.take` returns at
  once and the real hardware sets the pace.
- Engine compute: `ModelCompute` runs the real decoder; `ProfileCompute` sleeps the time the
  fitted latency model predicts and produces tokens from a deterministic function of the token
  prefix, and KV bytes stamped with a pattern of (token prefix, layer, position), so every byte
  the decode side assembles can still be checked.
- `make_compute` / `make_links` pick the implementation from the config; the engines only see the
  `EngineCompute` interface and `Link`, and never branch on which one they got.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class TokenBucket:
    """A byte-rate limiter: `take(n)` blocks until n bytes of credit have accrued.

    Credit accrues at `rate_bytes_s` up to `burst_bytes`; a take larger than the burst is paid in
    full (the bucket goes into debt), so large transfers are not starved and the long-run rate is
    exact. Thread-safe: the reader and engine actors call it from several threads.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: float) -> None:
        if rate_bytes_s <= 0 or burst_bytes <= 0:
            raise ValueError("rate_bytes_s and burst_bytes must be positive")
        self.rate = float(rate_bytes_s)
        self.burst = float(burst_bytes)
        self._credit = self.burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        """Reserve nbytes and sleep until they are paid for; returns seconds waited."""
        if nbytes <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._credit = min(self.burst, self._credit + (now - self._stamp) * self.rate)
            self._stamp = now
            self._credit -= nbytes
            wait = -self._credit / self.rate if self._credit < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait


@dataclass
class Link:
    """One NIC direction: an optional bucket plus an exact byte counter."""

    name: str
    bucket: TokenBucket | None = None
    bytes_total: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_total += nbytes
        if self.bucket is not None:
            self.bucket.take(nbytes)


def gbps_to_bytes_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def make_link(cfg: DualPathConfig, name: str, gbps: float) -> Link:
    """A NIC direction at `gbps`, paced only when emulation is enabled."""
    if not cfg.emulation.enabled:
        return Link(name)
    rate = gbps_to_bytes_s(gbps)
    return Link(name, TokenBucket(rate, rate * cfg.emulation.burst_seconds))


# --- deterministic stamps for `profile` compute ------------------------------------------


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def prefix_hashes(token_ids: np.ndarray) -> np.ndarray:
    """h[i] = a 64-bit hash of token_ids[0..i] (order- and position-sensitive), vectorised."""
    tokens = np.asarray(token_ids, dtype=np.uint64)
    positions = np.arange(tokens.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = _splitmix64(tokens ^ (positions * np.uint64(0xD6E8FEB86659FD93)))
        return _splitmix64(np.cumsum(mixed, dtype=np.uint64))


def stamp_kv(layout: KVLayout, hashes: np.ndarray, layer: int) -> torch.Tensor:
    """KV bytes [T, bytes_per_token_per_layer] for tokens with prefix hashes `hashes` at `layer`."""
    words = -(-layout.bytes_per_token_per_layer // 8)
    with np.errstate(over="ignore"):
        seeds = hashes[:, None] ^ (np.uint64(layer + 1) * np.uint64(0xA0761D6478BD642F))
        grid = seeds + np.arange(words, dtype=np.uint64)[None, :] * np.uint64(0xE7037ED1A0B428DB)
    data = _splitmix64(grid).view(np.uint8).reshape(hashes.shape[0], words * 8)
    return torch.from_numpy(np.ascontiguousarray(data[:, : layout.bytes_per_token_per_layer]))


def stamp_token(prefix_hash: int, vocab_size: int) -> int:
    """The `profile` mode's next token after a prefix with hash `prefix_hash`."""
    mixed = _splitmix64(np.array([prefix_hash], dtype=np.uint64) ^ np.uint64(0x8EBC6AF09C88C6E3))
    return int(mixed[0] % np.uint64(vocab_size))


# --- engine compute ----------------------------------------------------------------------


@dataclass
class PrefillState:
    """Per-request compute state carried across the layers of one prefill chunk."""

    prompt: np.ndarray
    start: int
    end: int
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class Sampled:
    token: int
    log_prob: float


@dataclass(frozen=True)
class SamplingRule:
    """How to pick a token from logits; the generator is seeded by (seed, position), so the
    prefill side (first token) and the decode side pick identically for the same prefix."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def generator(self, position: int) -> torch.Generator | None:
        if self.temperature == 0.0:
            return None
        return torch.Generator().manual_seed((self.seed * 1_000_003 + position) % (1 << 62))


class EngineCompute(ABC):
    """What an engine computes; the engines never know whether it is the model or a profile."""

    layout: KVLayout

    @abstractmethod
    def begin_chunk(self, prompt: np.ndarray, start: int, end: int) -> PrefillState:
        """Start computing tokens [start, end) of `prompt` whose first `start` tokens have KV."""

    @abstractmethod
    def layer(self, state: PrefillState, layer: int, past_kv: torch.Tensor) -> torch.Tensor:
        """Compute one layer of the chunk given that layer's KV bytes [start, bpt] of the prefix;
        return the chunk's KV bytes [end - start, bpt] of that layer."""

    @abstractmethod
    def first_token(self, state: PrefillState, rule: SamplingRule) -> Sampled:
        """The token after the whole prompt (call after the last layer of the last chunk)."""

    @abstractmethod
    def decode(
        self, tokens: np.ndarray, kv_layers: list[torch.Tensor], rule: SamplingRule
    ) -> tuple[Sampled, list[torch.Tensor]]:
        """One decode step for a sequence `tokens` (prompt + generated) whose KV for all but the
        last token is `kv_layers` (per layer [len(tokens) - 1, bpt] bytes); returns the next
        token and the last token's KV bytes per layer ([1, bpt])."""

    def batch_pause(self, pairs: list[tuple[int, int]]) -> None:
        """Emulated time of one prefill layer for a batch of (cached, bsz); real compute: none."""

    def decode_pause(self, batch: int, context_tokens: int) -> None:
        """Emulated time of one decode step; real compute: none."""


class ModelCompute(EngineCompute):
    """The real decoder computes KV, logits and greedy/sampled tokens."""

    def __init__(self, cfg: DualPathConfig, layout: KVLayout) -> None:
        from dualpath_ray.model.llama import DecoderModel

        self.layout = layout
        self.model = DecoderModel(cfg.model)

    def begin_chunk(self, prompt: np.ndarray, start: int, end: int) -> PrefillState:
        ids = torch.as_tensor(np.asarray(prompt[start:end], dtype=np.int64))
        with torch.inference_mode():
            hidden = self.model.embed(ids)
        return PrefillState(prompt=prompt, start=start, end=end, hidden=hidden)

    def layer(self, state: PrefillState, layer: int, past_kv: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(state.start, state.end, dtype=torch.int64)
        past = self.layout.bytes_as_kv(past_kv) if state.start else None
        with torch.inference_mode():
            state.hidden, kv = self.model.forward_layer(layer, state.hidden, positions, past)
        return self.layout.kv_as_bytes(kv)

    def first_token(self, state: PrefillState, rule: SamplingRule) -> Sampled:
        with torch.inference_mode():
            logits = self.model.logits(state.hidden[-1:])[0]
        return _sample(logits, rule, len(state.prompt))

    def decode(
        self, tokens: np.ndarray, kv_layers: list[torch.Tensor], rule: SamplingRule
    ) -> tuple[Sampled, list[torch.Tensor]]:
        position = len(tokens) - 1
        ids = torch.tensor([int(tokens[-1])], dtype=torch.int64)
        new_kv: list[torch.Tensor] = []
        with torch.inference_mode():
            hidden = self.model.embed(ids)
            pos = torch.tensor([position], dtype=torch.int64)
            for layer, past in enumerate(kv_layers):
                hidden, kv = self.model.forward_layer(layer, hidden, pos, self.layout.bytes_as_kv(past))
                new_kv.append(self.layout.kv_as_bytes(kv))
            logits = self.model.logits(hidden)[0]
        return _sample(logits, rule, len(tokens)), new_kv


def _sample(logits: torch.Tensor, rule: SamplingRule, position: int) -> Sampled:
    from dualpath_ray.model.llama import sample_token

    token, log_prob = sample_token(logits, rule.temperature, rule.top_p, rule.generator(position))
    return Sampled(int(token), float(log_prob))


class ProfileCompute(EngineCompute):
    """Engine time from the fitted latency model; tokens and KV from deterministic stamps."""

    def __init__(self, cfg: DualPathConfig, layout: KVLayout) -> None:
        from dualpath_ray.model.cost import load_profile_for

        self.layout = layout
        self.vocab_size = cfg.model.vocab_size
        self.profile = load_profile_for(cfg)

    def begin_chunk(self, prompt: np.ndarray, start: int, end: int) -> PrefillState:
        return PrefillState(prompt=prompt, start=start, end=end)

    def layer(self, state: PrefillState, layer: int, past_kv: torch.Tensor) -> torch.Tensor:
        hashes = prefix_hashes(state.prompt[: state.end])[state.start :]
        return stamp_kv(self.layout, hashes, layer)

    def first_token(self, state: PrefillState, rule: SamplingRule) -> Sampled:
        return Sampled(stamp_token(int(prefix_hashes(state.prompt)[-1]), self.vocab_size), 0.0)

    def decode(
        self, tokens: np.ndarray, kv_layers: list[torch.Tensor], rule: SamplingRule
    ) -> tuple[Sampled, list[torch.Tensor]]:
        hashes = prefix_hashes(tokens)
        last = hashes[-1:]
        new_kv = [stamp_kv(self.layout, last, layer) for layer in range(self.layout.n_layer)]
        return Sampled(stamp_token(int(last[0]), self.vocab_size), 0.0), new_kv

    def batch_pause(self, pairs: list[tuple[int, int]]) -> None:
        time.sleep(self.profile.attention_ms(pairs) / 1000.0)

    def decode_pause(self, batch: int, context_tokens: int) -> None:
        time.sleep(self.profile.decode_step_ms(batch, context_tokens) / 1000.0)


def make_compute(cfg: DualPathConfig, layout: KVLayout) -> EngineCompute:
    if cfg.emulation.compute == "profile":
        return ProfileCompute(cfg, layout)
    return ModelCompute(cfg, layout)


def expected_kv(layout: KVLayout, prompt: np.ndarray, layer: int) -> torch.Tensor:
    """The stamped KV bytes [len(prompt), bpt] `ProfileCompute` produces for a prefix."""
    return stamp_kv(layout, prefix_hashes(prompt), layer)
