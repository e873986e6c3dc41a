"""The trajectory ledger of the chaos tests: every reported turn as (trajectory, turn, attempt,
digest of its output tokens), so a test proves 0 lost, 0 duplicated and every output identical
to a single-process recompute (or a fault-free run), and says which entries differ when not."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence


def output_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LedgerEntry:
    trajectory: str
    turn: int
    attempt: int
    digest: str


@dataclass
class Ledger:
    entries: list[LedgerEntry]

    @classmethod
    def of(cls, result: Any) -> Ledger:
        """From a RolloutResult: its per-turn results, in turn order per trajectory."""
        entries = []
        for trajectory, turns in result.turn_results.items():
            for turn, turn_result in enumerate(turns):
                entries.append(LedgerEntry(trajectory, turn, turn_result.attempt, output_digest(turn_result.output_tokens)))
        return cls(entries)

    @classmethod
    def of_outputs(cls, outputs: dict[str, list[tuple[int, ...]]]) -> Ledger:
        """From per-trajectory outputs (a single-process recompute's): each turn once, attempt 0."""
        return cls([LedgerEntry(trajectory, turn, 0, output_digest(tokens))
                    for trajectory, turns in outputs.items() for turn, tokens in enumerate(turns)])

    def keyed(self) -> dict[tuple[str, int], list[LedgerEntry]]:
        out: dict[tuple[str, int], list[LedgerEntry]] = {}
        for entry in self.entries:
            out.setdefault((entry.trajectory, entry.turn), []).append(entry)
        return out

    def attempts_beyond_first(self) -> int:
        return sum(e.attempt > 0 for e in self.entries)

    def compare(self, reference: Ledger) -> LedgerDiff:
        ours, theirs = self.keyed(), reference.keyed()
        lost = sorted(set(theirs) - set(ours))
        duplicated = sorted(k for k, v in ours.items() if len(v) > 1)
        extra = sorted(set(ours) - set(theirs))
        changed = sorted(k for k in set(ours) & set(theirs) if ours[k][0].digest != theirs[k][0].digest)
        return LedgerDiff(lost, duplicated, extra, changed)


@dataclass
class LedgerDiff:
    lost: list[tuple[str, int]]
    duplicated: list[tuple[str, int]]
    extra: list[tuple[str, int]]
    changed: list[tuple[str, int]]

    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.extra or self.changed)

    def __str__(self) -> str:
        return (f"lost {len(self.lost)} {self.lost[:5]}, duplicated {len(self.duplicated)} {self.duplicated[:5]}, "
                f"extra {len(self.extra)}, changed {len(self.changed)} {self.changed[:5]}")
