"""Each engine's load as the scheduler's own records make it (no report needed).

The paper's engines report seq_e (unfinished requests) and tok_e (their tokens). Every request
an engine holds was put there by the scheduler, and the scheduler learns when it leaves (a
handoff takes it off its prefill engine, a result off its decode engine), so the scheduler can
keep both counts itself, exactly and without a round trip:

- a prefill engine holds a request from its prefill placement until its KV is handed to its
  decode engine; its weight is `prefill_tokens` (tokens to compute);
- a decode engine holds a request from its decode placement until the turn ends (done or
  failed); its weight is `decode_tokens` (prompt + max new tokens in whole pages), which is also
  the HBM the engine reserves for it, so free HBM = capacity - tok.

The dispatcher keeps one book per role as requests move (scheduling/dispatcher.py); the runtime
reports loads from it, the simulator from its simulated engines (which hold the same numbers).
"""

from __future__ import annotations

from collections import defaultdict


class EngineBook:
    """seq and tok per engine of one role."""

    def __init__(self) -> None:
        self._seq: defaultdict[str, int] = defaultdict(int)
        self._tok: defaultdict[str, int] = defaultdict(int)

    def add(self, engine: str, tokens: int) -> None:
        self._seq[engine] += 1
        self._tok[engine] += tokens

    def remove(self, engine: str, tokens: int) -> None:
        seq = self._seq[engine] - 1
        tok = self._tok[engine] - tokens
        if seq < 0 or tok < 0:
            raise AssertionError(f"engine {engine}: removing a request it does not hold (seq {seq}, tok {tok})")
        if seq:
            self._seq[engine], self._tok[engine] = seq, tok
        else:
            del self._seq[engine], self._tok[engine]

    def seq(self, engine: str) -> int:
        return self._seq.get(engine, 0)

    def tok(self, engine: str) -> int:
        return self._tok.get(engine, 0)

    def engines(self) -> set[str]:
        """Engines that hold at least one request."""
        return set(self._seq)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """engine -> (seq, tok) of every engine that holds something."""
        return {engine: (seq, self._tok[engine]) for engine, seq in self._seq.items()}
