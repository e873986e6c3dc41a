"""A whole turn served from a tool-time staged extent (in-process engines, real store and pools):
the decode node's reader stages the next turn's first hit blocks while "the tool runs", the
turn's DE-path stage claims them (as the prefill engine will, from PrefillTask.staged), and the
output is what the same turn without staging gives; every buffer slot is free afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.protocol.messages import StagedRead, TurnResult
from dualpath_ray.scheduling.staging import StageOrder, stage_id_of
from tests.engine_harness import EngineHarness, Request


def config() -> DualPathConfig:
    return parse_config({
        "model": {"n_layer": 3, "max_context": 512},
        "cluster": {"hbm_tokens_per_engine": 4096, "buffer_blocks_per_node": 256, "prefill_hbm_tokens": 2048},
        "store": {"block_size": 16},
        "emulation": {"enabled": False, "compute": "profile"},
    })


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def claiming(h: EngineHarness, order: StageOrder) -> None:
    """Route the DE hit read of a request whose hits begin with the order's keys through the claim,
    as the prefill core does with PrefillTask.staged."""
    inner = h.readers.read_hits

    def read_hits(
        node_id: str, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> Any:
        if path is ReadPath.DE and tuple(keys[: order.blocks]) == order.keys:
            staged = order.read()
        return inner(node_id, owner, keys, total_blocks, path, first_block, staged)

    h.readers.read_hits = read_hits  # type: ignore[method-assign]


def two_turns(root: Path, staged_blocks: int | None) -> tuple[EngineHarness, TurnResult]:
    h = EngineHarness(config(), root)
    context = tokens(100, 1)
    (turn1,) = h.serve([Request("t1", context, "de")])
    second = Request("t2", context + list(turn1.output_tokens) + tokens(20, 2), "de")
    if staged_blocks is not None:
        hits = h.task(second).hit_keys
        keys = tuple(hits[:staged_blocks])
        order = StageOrder(stage_id_of(keys), "d0", keys, 30.0, 30.0)
        h.readers.stage_ahead([order], now=0.0)
        claiming(h, order)
    (turn2,) = h.serve([second])
    return h, turn2


def test_a_turn_served_from_a_staged_extent_gives_the_unstaged_output(tmp_path: Path) -> None:
    reference, want = two_turns(tmp_path / "ref", None)
    ref_bytes = reference.readers.cores["d0"].counters.snic_read["de"]
    reference.close()
    h, turn2 = two_turns(tmp_path / "run", 4)
    d0 = h.readers.cores["d0"]
    assert turn2.error is None and turn2.output_tokens == want.output_tokens, "the output is the unstaged one"
    counts = d0.staging_counts()
    assert (counts.staged, counts.used, counts.missed) == (4, 4, 0), "4 blocks staged and claimed"
    assert d0.counters.snic_read["de"] == ref_bytes, "each hit block was read once: staged ones are not read again"
    h.assert_idle()
    assert d0.expire(1e9) is None, "nothing is left staged"
    h.close()
