"""The decode core under a compute that leaves sequences out of some steps (EngineCompute's
decode_step contract: None for a sequence it did not compute, as vLLM's compute returns for one
vLLM preempted): each such sequence stays at its position and is stepped again, so tokens, stop
rules and persisted blocks are exactly those of a compute that computes every sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.messages import SamplingParams, TurnResult
from dualpath_ray.protocol.types import StopReason
from dualpath_ray.runtime.compute.engine_compute import DecodeSeq, Sampled
from dualpath_ray.runtime.emulation.profile_compute import ProfileCompute
from tests.engine_harness import EngineHarness, Request
from tests.unit.runtime.prefill.test_prefill_core import config, tokens


class LeavingOut(ProfileCompute):
    """Computes the sequences of a step but those a fixed pattern leaves out, and none at all in
    every fifth step (a compute waiting for pages); a sequence's token depends only on its
    prefix (ProfileCompute), whichever steps compute it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.calls = 0
        self.left_out = 0
        self.empty_steps = 0

    def decode_step(
        self, seqs: Sequence[DecodeSeq], pages: torch.Tensor, params: Sequence[SamplingParams],
    ) -> list[Sampled | None]:
        self.calls += 1
        keep = [i for i in range(len(seqs)) if self.calls % 5 and (self.calls + i) % 3]
        computed = super().decode_step([seqs[i] for i in keep], pages, [params[i] for i in keep]) if keep else []
        out: list[Sampled | None] = [None] * len(seqs)
        for i, token in zip(keep, computed):
            out[i] = token
        self.left_out += len(seqs) - len(keep)
        self.empty_steps += not keep
        return out


def _serve(root: Path, requests: list[Request], leaving_out: bool) -> tuple[list[TurnResult], EngineHarness]:
    cfg = config()
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    h = EngineHarness(cfg, root, compute=LeavingOut(cfg, layout, torch.device("cpu")) if leaving_out else None)
    try:
        results = h.serve(requests)
        h.assert_idle()
    finally:
        h.close()
    return results, h


def test_sequences_left_out_of_steps_decode_the_same_tokens_and_stop_the_same(tmp_path: Path) -> None:
    probe, _ = _serve(tmp_path / "probe", [Request("probe", tokens(37, 1), "pe", max_new_tokens=12)], False)
    stop = probe[0].output_tokens[6]  # a token the first request (the probe's prompt) samples mid-turn
    requests = [
        Request(f"r{i}", tokens(37, 1) if i == 0 else tokens(20 + 7 * i, 40 + i), "pe" if i % 2 else "de",
                max_new_tokens=12 + 5 * i, stop_token_ids=(stop,))
        for i in range(6)
    ]
    want, _ = _serve(tmp_path / "all", requests, leaving_out=False)
    got, h = _serve(tmp_path / "some", requests, leaving_out=True)
    compute = h.compute
    assert isinstance(compute, LeavingOut)
    assert compute.left_out > 0 and compute.empty_steps > 0, "the compute left sequences, and whole steps, out"
    assert [r.error for r in got] == [None] * len(requests), "no request is lost or failed for being left out"
    assert [r.output_tokens for r in got] == [r.output_tokens for r in want], (
        "every request's tokens equal those of a compute that computes every sequence every step"
    )
    assert [r.stop_reason for r in got] == [r.stop_reason for r in want], "the stop rules end each turn alike"
    assert got[0].stop_reason is StopReason.STOP and got[0].output_tokens[-1] == stop, (
        "the first request stops on its stop token, however many steps left it out"
    )
    assert StopReason.LENGTH in {r.stop_reason for r in got}, "other requests end on their length"
    assert [[b.key for b in r.persisted] for r in got] == [[b.key for b in r.persisted] for r in want], (
        "the same blocks are persisted under the same keys"
    )
    assert all(r.kv_mismatches == 0 for r in got), "the assembled KV checks out (runtime.verify_kv)"
    assert h.decode.stats.tokens == sum(len(r.output_tokens) - 1 for r in got), (
        "the core counts only the tokens computed: one per output token past the prefill's first"
    )
