"""Where a decode engine's reader pulls filled blocks from when the compute keeps the KV
(runtime/decode/filled_blocks.py, StagedPulls): a block is read out as it fills, copied into a
staging slot when its persist is posted, and the slot is free again once that persist settled,
or once a failed request's pulls ended; with every slot taken a persist waits."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.messages import PersistedBlock
from dualpath_ray.runtime.decode.filled_blocks import StagedPulls
from dualpath_ray.runtime.decode.job import DecodeJob

LAYOUT = KVLayout(n_layer=2, n_kv_head=2, head_dim=4, block_size=4, dtype="float32")


class BlocksOfState:
    """A HeldKV whose sequence state is its Full Blocks (what vLLM's read_blocks returns)."""

    kv_buffer = torch.empty(0, dtype=torch.uint8)

    def read_blocks(self, state: Any, blocks: Sequence[int]) -> torch.Tensor:
        return torch.stack([state[b] for b in blocks]).clone()


def job(owner: str, n_blocks: int, fill: int) -> DecodeJob:
    request_id, attempt = owner.split("#")
    made = DecodeJob(request_id, int(attempt), n_blocks * LAYOUT.block_size, 0)
    made.compute_state = [torch.full(LAYOUT.full_block_shape, fill + b, dtype=torch.uint8) for b in range(n_blocks)]
    return made


def test_filled_blocks_are_staged_for_their_pulls_and_their_slots_come_back() -> None:
    staging = torch.zeros((2, *LAYOUT.full_block_shape), dtype=torch.uint8)
    pulls = StagedPulls(BlocksOfState(), staging)  # type: ignore[arg-type]
    a, b = job("a#0", 3, 10), job("b#0", 1, 50)
    captured = [pulls.capture(a, block) for block in range(3)]
    assert all(torch.equal(data, a.compute_state[i]) for i, (_, data) in enumerate(captured)), (
        "a filled block is read out as the compute holds it (its bytes are digested then)"
    )
    keys = [PersistedBlock(f"k{i}", None, None) for i in range(3)]
    staged = pulls.stage("a#0", [(captured[i][0], keys[i]) for i in range(2)])
    assert staged is not None and sorted(slot for slot, _ in staged) == [0, 1], "two blocks take the two slots"
    assert all(torch.equal(staging[slot], a.compute_state[i]) for i, (slot, _) in enumerate(staged)), (
        "each staged slot holds its block's bytes, which the reader pulls"
    )
    assert pulls.stage("a#0", [(captured[2][0], keys[2])]) is None, "with every slot pulled from, a persist waits"
    pulls.settled("a#0", [keys[0]])
    third = pulls.stage("a#0", [(captured[2][0], keys[2])])
    assert third is not None and torch.equal(staging[third[0][0]], a.compute_state[2]), (
        "a settled persist's slot takes the next block"
    )
    b_block, _ = pulls.capture(b, 0)
    assert pulls.stage("b#0", [(b_block, PersistedBlock("kb", None, None))]) is None, (
        "no slot is free while a's pulls run"
    )
    pulls.release("a#0")
    assert pulls.free_slots == 2, "a failed request's slots are free once its pulls ended (release)"
