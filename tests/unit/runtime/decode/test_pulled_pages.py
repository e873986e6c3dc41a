"""A decode engine's pages stay its own while its reader may still pull them (issue 31 item 2,
decode side).

A filled page is persisted by the node's reader pulling it (D2H) and writing it under the
block's key. When the job fails, the engine waits for its pulls for transfer_timeout_s; a wait
that times out says nothing about the reader having stopped, so the pages stay reserved until
every pull replied. Before, they were released at once: a next request's KV landed in a page the
reader then copied and stored under the failed job's key, with a checksum that passes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from dualpath_ray.protocol.messages import PersistedBlock, attempt_owner
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.transport.moves import Region
from tests.engine_harness import DE, EngineHarness, Request
from tests.unit.runtime.prefill.test_prefill_core import config, tokens

INTRUDER_BYTE = 0xAB  # the KV a next request writes into the pages it gets


def step_until(h: EngineHarness, done: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if not (h.prefill.step() | h.decode.step()):
            time.sleep(0.001)
        assert time.monotonic() < deadline, "the engines did not get there in time"


def test_pages_a_timed_out_pull_may_still_read_stay_reserved_until_it_ends(tmp_path: Path) -> None:
    h = EngineHarness(config(transfer_timeout_s=0.2), tmp_path)
    gate = threading.Event()
    try:
        h.readers.pull_gate = gate
        pulled: list[tuple[PersistedBlock, torch.Tensor]] = []  # each pulled block, as the engine had it
        pulls: list[Any] = []
        post = h.readers.persist_pages

        def recording(node_id: str, owner: str, blocks: Sequence[tuple[int, PersistedBlock]], paged: Any = None) -> Any:
            size = h.layout.full_block_bytes
            for page, block in blocks:
                pulled.append((block, h.fabric.view(DE, Region(Pool.HBM, page * size, size)).clone()))
            pulls.append(post(node_id, owner, blocks, paged))
            return pulls[-1]

        h.readers.persist_pages = recording  # type: ignore[method-assign]
        request = Request("a", tokens(50, 5), "pe", max_new_tokens=40)
        owner = attempt_owner("a", 0)
        h.prefill.accept([h.task(request)])
        step_until(h, lambda: bool(pulled))  # a block filled while decoding; its pull waits at the gate

        h.decode.abort(owner)
        step_until(h, lambda: owner not in h.decode.jobs)  # _fail's wait for the pull times out
        held = h.pages.check_integrity()
        # A next request takes every page it can get and writes its own KV into them.
        room = h.pages.unreserved_pages
        h.pages.reserve("intruder", room)
        intruder_pages = h.pages.allocate("intruder", room)
        for page in intruder_pages:
            h.pages.page(page).fill_(INTRUDER_BYTE)
        gate.set()
        step_until(h, lambda: all(p.future.done() for p in pulls))  # the reader's pulls ended
        step_until(h, lambda: not h.decode.busy())  # and the engine let the pages go

        for block, as_computed in pulled:
            if h.store.contains(block.key):
                stored = h.layout.empty_full_block()
                h.store.get_into(block.key, stored)
                assert torch.equal(stored.view(-1), as_computed), (
                    f"block {block.key} is stored with the KV its job computed, never a later request's"
                )
        assert held.reserved > 0 and held.allocated > 0, (
            f"the failed job's pages stay reserved while its pull may still read them: {held}"
        )
        h.pages.release("intruder")
        h.assert_idle()  # every page and buffer slot free again, integrity checked
    finally:
        gate.set()  # a failed assertion must not leave the pull waiting (close joins it)
        h.close()
