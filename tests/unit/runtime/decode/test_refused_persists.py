"""A store that refuses block writes (a full disk) never fails a turn: the decode engine serves
its tokens, publishes its chain only up to the first block the store refused, persists nothing
after it once it knows, and frees everything; the node's reader counts the refusals."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from dualpath_ray.kv.index import block_keys
from dualpath_ray.kv.block_store import BlockCheck
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.protocol.messages import TurnResult
from tests.engine_harness import EngineHarness, Request
from tests.unit.runtime.prefill.test_prefill_core import BLOCK, config, tokens


class RefusingStore(LocalDirStore):
    """A local store whose puts raise ENOSPC while `full`, or for the keys of `refused`."""

    def __init__(self, root: Path, layout: KVLayout) -> None:
        super().__init__(root, layout)
        self.refused: set[str] = set()
        self.full = False
        self.attempts: list[str] = []

    def put(self, key: str, block: torch.Tensor, parent: str | None = None, verify: BlockCheck | None = None) -> bool:
        self.attempts.append(key)
        if self.full or key in self.refused:
            raise OSError(errno.ENOSPC, f"No space left on device writing block {key}")
        return super().put(key, block, parent, verify)


@pytest.fixture
def make(tmp_path: Path):
    built: list[EngineHarness] = []

    def build() -> EngineHarness:
        h = EngineHarness(config(), tmp_path / f"h{len(built)}")
        built.append(h)
        return h

    yield build
    for h in built:
        h.close()


def refusing_store(h: EngineHarness) -> RefusingStore:
    """Swap the store both readers write through for a RefusingStore at the same root."""
    store = RefusingStore(h.store.root, h.layout)
    for core in h.readers.cores.values():
        core.store.close()
        core.store = store
    return store


def refusals(h: EngineHarness) -> int:
    return sum(core.store_faults()[1] for core in h.readers.cores.values())


PROMPT = tokens(50, 5)  # 3 full prompt blocks, written from the extent
NEW_TOKENS = 110  # KV of 159 tokens: 9 full blocks, 6 of them filled while decoding


def chain_of(h: EngineHarness, result: TurnResult) -> list[str]:
    """The keys of every full block of PROMPT + the result's output that has KV."""
    sequence = PROMPT + list(result.output_tokens)
    return block_keys(sequence[: len(sequence) - 1], BLOCK, h.namespace)


def test_a_refused_prompt_block_publishes_only_the_chain_before_it(make) -> None:
    (reference,) = make().serve([Request("r", PROMPT, "pe", max_new_tokens=NEW_TOKENS)])
    h = make()
    store = refusing_store(h)
    chain = chain_of(h, reference)
    store.refused.add(chain[1])
    (result,) = h.serve([Request("r", PROMPT, "pe", max_new_tokens=NEW_TOKENS)])
    assert result.error is None, f"a refused block write never fails the turn: {result.error}"
    assert result.output_tokens == reference.output_tokens, "the turn's tokens are those of a run with room"
    assert [b.key for b in result.persisted] == chain[:1], "only the chain before the refused block is published"
    assert not store.contains(chain[1]) and chain[2] not in store.attempts, (
        "the refused block is not stored and the block after it in the same persist is not tried"
    )
    assert chain[-1] not in store.attempts, "once the refusal is known, no later block of the turn is persisted"
    assert h.decode.stats.unpublished_blocks == len(chain) - 1, "every block after the refusal is counted unpublished"
    assert refusals(h) == 1, "the reader counted the refused write"
    assert h.index.match(PROMPT, h.namespace).hit_blocks == 1, "the next turn hits the published prefix only"
    h.assert_idle()


def test_a_full_disk_serves_every_turn_and_a_disk_with_room_again_persists(make) -> None:
    h = make()
    store = refusing_store(h)
    store.full = True
    requests = [Request(f"r{i}", tokens(50, 20 + i), "pe" if i % 2 else "de", max_new_tokens=40) for i in range(4)]
    results = h.serve(requests)
    assert all(r.error is None and len(r.output_tokens) == 40 for r in results), (
        f"a full disk fails no turn: {[r.error for r in results]}"
    )
    assert all(r.persisted == () for r in results), "nothing is published while the disk is full"
    assert refusals(h) >= len(requests), "each turn's refused write is counted"
    store.full = False
    (again,) = h.serve([Request("again", tokens(50, 20), "pe", max_new_tokens=40)])
    assert again.error is None and again.hit_tokens == 0, "the earlier turn published nothing, so this one misses"
    assert len(again.persisted) == (50 + 40 - 1) // BLOCK, "with room again every full block is published"
    h.assert_idle()


@pytest.mark.parametrize("path", ["pe", "de"])
def test_a_refused_decode_block_keeps_the_prompt_blocks_published(make, path: str) -> None:
    (reference,) = make().serve([Request("p", PROMPT, path, max_new_tokens=NEW_TOKENS)])
    h = make()
    store = refusing_store(h)
    chain = chain_of(h, reference)
    store.refused.add(chain[4])  # the second block filled while decoding
    (result,) = h.serve([Request("r", PROMPT, path, max_new_tokens=NEW_TOKENS)])
    assert result.error is None, f"the turn is served: {result.error}"
    assert [b.key for b in result.persisted] == chain[:4], "the prompt blocks and the first decode block are published"
    assert chain[-1] not in store.attempts, "blocks filled after the refusal was known are not persisted"
    h.assert_idle()
