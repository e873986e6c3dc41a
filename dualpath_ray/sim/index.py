"""Prefix indexes for the simulated store, answering the scheduler core's lookups without tokens.

The scheduler core (scheduling/scheduler.py) asks its index `match(prompt, namespace)` for the
longest stored prefix and `publish`es the (key, parent) blocks a finished turn persisted, as far
as their chain holds (kv/index.py PrefixIndex.publish). The runtime's `PrefixIndex` hashes the prompt's token ids into chained block keys;
the simulator's prompts carry their block chain instead (`SimPrompt`), so a lookup costs no
hashing, and the answer is the same longest stored prefix in whole blocks:

- `ChainIndex`: one chain per trajectory (synthetic and Parquet traces, whose trajectories share
  no tokens). Block j of chain c has key c * KEY_STRIDE + j, and the index keeps each chain's
  stored length: O(1) time and memory per trajectory, which is what lets 48K agents of 64K-token
  contexts fit in memory. The hit keys it reports are the chain's own keys, the ones a finished
  turn publishes: tool-time staging (scheduling/staging.py) names a staged chain by its last key
  and claims it for the next turn whose hits begin with it, so positions shared by every chain
  would let one trajectory claim another's.
- `TreeIndex`: explicit keys per block and a parent map (Mooncake traces, whose requests share
  prefixes named by hash ids).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dualpath_ray.kv.index import PrefixHit

KEY_STRIDE = 1 << 32


@dataclass(frozen=True, slots=True)
class SimPrompt:
    """What the simulator submits as a RequestSpec's prompt: its length in tokens and the chain
    its blocks belong to (ChainIndex), or its block keys (TreeIndex)."""

    length: int
    chain: int = 0
    keys: tuple[int, ...] = ()

    def __len__(self) -> int:
        return self.length


class ChainIndex:
    """Stored prefix length per trajectory chain (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.stored: dict[int, int] = {}
        self.blocks = 0

    def __len__(self) -> int:
        return self.blocks

    def match(self, prompt: SimPrompt, namespace: str) -> PrefixHit:
        hit = min(self.stored.get(prompt.chain, 0), prompt.length // self.block_size)
        base = prompt.chain * KEY_STRIDE
        return PrefixHit(hit, hit * self.block_size, tuple(range(base, base + hit)))  # type: ignore[arg-type]

    def chain(self, prompt: SimPrompt, namespace: str) -> range:
        """Every full block key of the prompt, stored or not."""
        base = prompt.chain * KEY_STRIDE
        return range(base, base + prompt.length // self.block_size)

    def insert_block(self, key: int, parent: int | None) -> bool:
        chain, position = divmod(key, KEY_STRIDE)
        stored = self.stored.get(chain, 0)
        if position < stored:
            return False
        if position != stored or (parent is None) != (position == 0):
            raise ValueError(f"chain {chain}: block {position} published before block {stored}")
        self.stored[chain] = stored + 1
        self.blocks += 1
        return True

    def publish(self, blocks: Iterable[tuple[int, int | None]]) -> int:
        indexed = 0
        for key, parent in blocks:
            chain, position = divmod(key, KEY_STRIDE)
            if position >= self.stored.get(chain, 0) and (
                position != self.stored.get(chain, 0) or (parent is None) != (position == 0)
            ):
                break  # its chain is not stored up to it (taken out meanwhile): not published
            self.insert_block(key, parent)
            indexed += 1
        return indexed

    def remove(self, key: int) -> int:
        chain, position = divmod(key, KEY_STRIDE)
        stored = self.stored.get(chain, 0)
        if position >= stored:
            return 0
        self.stored[chain] = position
        self.blocks -= stored - position
        return stored - position

    def clear(self) -> None:
        self.stored.clear()
        self.blocks = 0


def chain_key(chain: int, position: int) -> int:
    return chain * KEY_STRIDE + position


class TreeIndex:
    """Explicit block keys with their parents: prefixes shared between requests."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.parents: dict[int, int | None] = {}

    def __len__(self) -> int:
        return len(self.parents)

    def match(self, prompt: SimPrompt, namespace: str) -> PrefixHit:
        hit = 0
        parents = self.parents
        for key in prompt.keys:
            if key not in parents:
                break
            hit += 1
        return PrefixHit(hit, hit * self.block_size, prompt.keys[:hit])  # type: ignore[arg-type]

    def chain(self, prompt: SimPrompt, namespace: str) -> tuple[int, ...]:
        """Every full block key of the prompt, stored or not."""
        return prompt.keys

    def insert_block(self, key: int, parent: int | None) -> bool:
        if key in self.parents:
            return False
        if parent is not None and parent not in self.parents:
            raise ValueError(f"block {key}: its parent {parent} is not indexed")
        self.parents[key] = parent
        return True

    def publish(self, blocks: Iterable[tuple[int, int | None]]) -> int:
        indexed = 0
        for key, parent in blocks:
            if key not in self.parents and parent is not None and parent not in self.parents:
                break  # its parent was taken out meanwhile: not published
            self.insert_block(key, parent)
            indexed += 1
        return indexed

    def remove(self, key: int) -> int:
        """Remove a block and every block after it (they can never be hit)."""
        if key not in self.parents:
            return 0
        doomed = {key}
        changed = True
        while changed:
            changed = False
            for child, parent in self.parents.items():
                if parent in doomed and child not in doomed:
                    doomed.add(child)
                    changed = True
        for k in doomed:
            del self.parents[k]
        return len(doomed)

    def clear(self) -> None:
        self.parents.clear()
