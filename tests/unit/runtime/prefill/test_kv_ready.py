"""A layer's KV is complete before the transport reads it (runtime/prefill/kv_ready.py): the
pipeline records an event after each layer's compute and waits on it before posting that layer's
write, also with `runtime.kv_digests: false`, where no digest's copy to the host orders them.
Here a fake event records the order; the CUDA event itself is checked by
tests/gpu/test_kv_ready_cuda.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualpath_ray.config import parse_config
from dualpath_ray.runtime.prefill.kv_ready import HostKVReady, kv_ready_for
from tests.engine_harness import EngineHarness, Request


class _LoggedEvent:
    """One layer's event: says when it is recorded and waited on, into the shared log."""

    def __init__(self, log: list[tuple[str, int]], number: int) -> None:
        self.log = log
        self.number = number

    def record(self) -> None:
        self.log.append(("record", self.number))

    def wait(self) -> None:
        self.log.append(("wait", self.number))


def test_every_write_waits_for_the_event_recorded_after_its_layer(tmp_path: Path) -> None:
    cfg = parse_config({
        "model": {"n_layer": 3, "max_context": 512},
        "cluster": {"hbm_tokens_per_engine": 4096, "buffer_blocks_per_node": 256, "prefill_hbm_tokens": 2048},
        "store": {"block_size": 16},
        "emulation": {"enabled": False, "compute": "profile"},
        "runtime": {"verify_kv": True, "kv_digests": False},
    })
    h = EngineHarness(cfg, tmp_path)
    try:
        log: list[tuple[str, int]] = []
        h.prefill.kv_ready = lambda: _LoggedEvent(log, sum(1 for op, _ in log if op == "record"))
        write = h.pe_transport.write

        def logged_write(peer: str, moves: Any) -> Any:
            log.append(("write", -1))
            return write(peer, moves)

        h.pe_transport.write = logged_write  # type: ignore[method-assign]
        prompt = [int(t) for t in np.random.default_rng(4).integers(0, 512, 100)]
        (result,) = h.serve([Request("r", prompt, "pe")])
        assert result.error is None and result.kv_mismatches == 0, "the turn is served and its KV arrives exactly"
        records = [n for op, n in log if op == "record"]
        assert records == list(range(cfg.model.n_layer)), f"one event recorded per layer, after its compute: {log}"
        writes = [i for i, (op, _) in enumerate(log) if op == "write"]
        assert len(writes) == cfg.model.n_layer, f"one write per layer to the decode node's reader: {log}"
        for i in writes:
            recorded = [n for op, n in log[:i] if op == "record"]
            waited = [n for op, n in log[:i] if op == "wait"]
            assert recorded and waited and waited[-1] == recorded[-1], (
                f"the write at {i} follows a wait on the event of the layer computed last: {log}"
            )
    finally:
        h.close()


def test_on_the_cpu_the_event_is_a_no_op() -> None:
    factory = kv_ready_for(torch.device("cpu"))
    event = factory()
    assert isinstance(event, HostKVReady), "a CPU window needs no event: the compute ran when it returned"
    event.record()
    event.wait()
