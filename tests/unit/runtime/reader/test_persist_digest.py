"""The end-to-end guard of persisted KV (issue 31 item 3): each persisted block carries the
digest of the KV its engine computed (PersistedBlock.digest, runtime.kv_digests), and the
reader's write publishes it only if the bytes the store wrote match; a block whose buffer went
bad between its engine and the store (a stale read into the extent, a bad copy) is not
published and is counted, and its turn is served all the same. Never a published block with
wrong content and a checksum that passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dualpath_ray.faults.plan import FaultMode, FaultSite
from dualpath_ray.kv.block_store import BlockCheck
from dualpath_ray.kv.digest import full_block_digest
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.kv.memory_store import MemoryStore
from dualpath_ray.protocol.messages import PersistedBlock
from tests.engine_harness import EngineHarness, Request, served_alone
from tests.fakes import ScriptedFaults
from tests.unit.runtime.prefill.test_prefill_core import BLOCK, config, tokens
from tests.unit.runtime.reader.test_reader_core import reader_core


class CorruptingStore(LocalDirStore):
    """A local store whose `nth` put (1-based) first flips one byte of the buffer it was handed:
    the block's bytes went bad after its engine computed them, before the store wrote them."""

    def __init__(self, root: Path, layout: KVLayout, nth: int) -> None:
        super().__init__(root, layout)
        self.nth = nth
        self.puts = 0
        self.corrupted: list[str] = []

    def put(self, key: str, block: torch.Tensor, parent: str | None = None, verify: BlockCheck | None = None) -> bool:
        self.puts += 1
        if self.puts == self.nth:
            block.view(-1)[block.numel() // 2] ^= 0xFF
            self.corrupted.append(key)
        if verify is None:
            return super().put(key, block, parent)
        return super().put(key, block, parent, verify)


def expected_blocks(h: EngineHarness, sequence: list[int]) -> dict[str, torch.Tensor]:
    """Every full block of `sequence` (whose KV exists: all tokens but the last), recomputed from
    scratch by the engines' compute, by key."""
    keys = block_keys(sequence[: len(sequence) - 1], BLOCK, h.namespace)
    pages = torch.zeros((len(keys), *h.layout.full_block_shape), dtype=torch.uint8)
    h.compute.fill_pages(np.asarray(sequence, dtype=np.int64), 0, len(keys) * BLOCK, pages, list(range(len(keys))))
    return dict(zip(keys, pages))


def test_a_block_corrupted_between_its_engine_and_the_store_is_not_published_and_the_turn_is_served(
    tmp_path: Path,
) -> None:
    prompt = tokens(50, 5)
    want = served_alone(config(), tmp_path / "reference", Request("r", prompt, "pe", max_new_tokens=60))
    h = EngineHarness(config(), tmp_path / "run")
    try:
        store = CorruptingStore(h.store.root, h.layout, nth=4)  # the first block filled while decoding
        for core in h.readers.cores.values():
            core.store.close()
            core.store = store
        (result,) = h.serve([Request("r", prompt, "pe", max_new_tokens=60)])
        expected = expected_blocks(h, prompt + list(result.output_tokens))
        out = h.layout.empty_full_block()
        for key in store.keys():
            store.get_into(key, out)  # verified: its checksum passes
            assert torch.equal(out, expected[key]), f"stored block {key} holds the KV its chain computes, byte for byte"
        (bad,) = store.corrupted
        assert not store.contains(bad), "the block whose bytes went bad is not published"
        assert not any(p.name.endswith(".tmp") for p in Path(store.root).rglob("*")), "nor is its temporary left"
        assert result.error is None and result.output_tokens == want.output_tokens, (
            "its turn is served, with the tokens of a run without the fault"
        )
        chain = list(expected)
        assert [b.key for b in result.persisted] == chain[: chain.index(bad)], (
            "the turn publishes its chain only up to the refused block"
        )
        assert h.readers.cores["d0"].persist_mismatches == 1, "the reader counts the block it refused"
        (again,) = h.serve([Request("again", prompt, "de", max_new_tokens=60)])
        assert again.error is None and again.output_tokens == want.output_tokens, (
            "the next turn over the same prefix misses the refused block, recomputes it, same tokens"
        )
        h.assert_idle()
    finally:
        h.close()


@pytest.mark.parametrize("store_kind", ["local", "memory"])
def test_the_store_publishes_only_bytes_its_check_accepts(tmp_path: Path, store_kind: str) -> None:
    """BlockStore.put's `verify`: called with the block as written, before publish; a raise
    publishes nothing, and a later put of the right bytes publishes them."""
    core = reader_core(tmp_path)
    layout = core.layout
    store = LocalDirStore(tmp_path / "s", layout) if store_kind == "local" else MemoryStore(layout)
    (key,) = block_keys(list(range(layout.block_size)), layout.block_size, namespace_for("verify", 0))
    block = torch.full(layout.full_block_shape, 7, dtype=torch.uint8)
    seen: list[torch.Tensor] = []

    def refuse(written: torch.Tensor) -> None:
        seen.append(written.clone())
        raise RuntimeError("refused by the check")

    with pytest.raises(RuntimeError, match="refused by the check"):
        store.put(key, block, verify=refuse)
    assert len(seen) == 1 and torch.equal(seen[0], block), "the check saw the block's bytes as written"
    assert not store.contains(key), "a block its check refused is not published"
    assert store.put(key, block, verify=lambda _: None), "a block its check accepts is published"
    core.store.close()


def test_write_block_refuses_a_block_whose_bytes_differ_from_its_digest(tmp_path: Path) -> None:
    """store_publish corrupt (faults/plan.py): a byte of the buffer flips just before the write;
    the block carries the digest of what its engine computed, so the write is refused (not an
    OSError: not the store's fault), counted, and the blocks after it are not tried."""
    core = reader_core(tmp_path, faults=ScriptedFaults({FaultSite.STORE_PUBLISH: [FaultMode.CORRUPT, None]}))
    layout = core.layout
    keys = block_keys(list(range(2 * layout.block_size)), layout.block_size, namespace_for("digest", 0))
    extent = core.lease("r#0", 2)
    blocks = []
    for i, key in enumerate(keys):
        data = core.pool.full_block(extent.slots[i])
        data.fill_(i + 3)
        blocks.append((i, PersistedBlock(key, keys[i - 1] if i else None, full_block_digest(data))))
    assert core.write_extent(extent.extent_id, blocks) == 0, "no block of the chain is stored"
    assert not core.store.contains(keys[0]) and not core.store.contains(keys[1]), (
        "the corrupted block is not published, nor is the one after it"
    )
    assert core.persist_mismatches == 1 and core.store_faults() == ([], 0), (
        "counted as a digest mismatch, not as a write the store refused"
    )
    assert core.pool.check_integrity().free == core.pool.capacity, "the extent is freed in any case"
    clean = core.lease("r#1", 1)
    core.pool.full_block(clean.slots[0]).fill_(3)
    assert core.write_extent(clean.extent_id, [(0, blocks[0][1])]) == 1, "the same block with its right bytes is stored"
    core.store.close()
