"""The KV namespace across RL steps, counted from the turns' own reports.

Every step of the GRPO job serves one weight version, and a block key is the chained hash of the
token prefix under the namespace of that version (kv/index.py), so the blocks a step may hit are
the full blocks of prompts served at its own version. The ledger keeps each step's block keys
(the full blocks of every turn's prompt, under the namespace of the version the server reported
serving) and counts, for every turn:
- `stale_version_turns`: turns served at a version other than the one the trainer just published;
- `old_version_hit_blocks`: hit blocks whose key is a block of an earlier step (an older version):
  must be 0;
- `unexplained_hit_blocks`: hit blocks that are no full block of any prompt of this step under
  the published version: the hit came from somewhere the step never wrote;
- `old_version_blocks_offered`: leading blocks of the turn's prompt that the previous step
  stored under its own namespace, i.e. what a namespace that did not move would have served
  (the shared system prompt at least): shows the two counts above are not vacuous;
- later turns: whether each turn after the first hit every full block of the turn before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dualpath_ray.kv.index import block_keys
from dualpath_ray.rl.agent_loop import EpisodeRollout


@dataclass(frozen=True)
class NamespaceCounts:
    stale_version_turns: int
    old_version_hit_blocks: int
    unexplained_hit_blocks: int
    old_version_blocks_offered: int
    later_turns: int
    later_turns_hitting_earlier: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class NamespaceLedger:
    """Block keys of every step so far, by version; `namespace(version)` is the deployment's
    (DualPathConfig.kv_namespace)."""

    def __init__(self, namespace: Callable[[int], str], block_size: int) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.steps: list[tuple[int, set[str]]] = []  # (version, its block keys), oldest first

    def _keys(self, tokens: Sequence[int], version: int) -> list[str]:
        return block_keys(list(tokens), self.block_size, self.namespace(version))

    def record_step(self, version: int, episodes: Sequence[EpisodeRollout]) -> NamespaceCounts:
        turns = [turn for e in episodes for turn in e.turns]
        own = {key for turn in turns for key in self._keys(turn.prompt, version)}
        older = set().union(*(keys for _, keys in self.steps)) if self.steps else set()
        previous = self.steps[-1] if self.steps else None
        stale = old_hits = unexplained = offered = 0
        for turn in turns:
            stale += turn.weight_version != version
            # A partial-block hit reads the block of its prompt's last token whole: ceil, not floor.
            hit = self._keys(turn.prompt, turn.weight_version)[: -(-turn.hit_tokens // self.block_size)]
            old_hits += sum(key in older for key in hit)
            unexplained += sum(key not in own for key in hit)
            if previous is not None:
                for key in self._keys(turn.prompt, previous[0]):
                    if key not in previous[1]:
                        break
                    offered += 1
        later = hitting = 0
        for episode in episodes:
            for before, after in zip(episode.turns, episode.turns[1:]):
                later += 1
                hitting += after.hit_tokens >= len(before.prompt) // self.block_size * self.block_size
        self.steps.append((version, own))  # what this step could store: its prompts under its version
        return NamespaceCounts(stale, old_hits, unexplained, offered, later, hitting)
