"""A decode engine with a compute of its own (tests/engine_harness.py `decode_compute`), as a
deployment has it and benchmarks/vllm_overhead.py's prefill-engine phase uses it: the prefill
core's handoffs are decoded by the other engine, which serves the same turns as one engine
playing both roles."""

from __future__ import annotations

from pathlib import Path

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.engine.compute_choice import make_compute
from tests.engine_harness import EngineHarness, Request
from tests.unit.runtime.prefill.test_prefill_core import BLOCK, config, tokens


def test_handoffs_decoded_by_an_engine_of_their_own_serve_the_same_turns(tmp_path: Path) -> None:
    cfg = config().with_overrides(emulation={"compute": "model"})
    requests = [Request(f"r{i}", tokens(40 + 7 * i, i), "pe", max_new_tokens=6) for i in range(2)]
    results = {}
    for name in ("one", "two"):
        decode = make_compute(cfg, KVLayout.from_model(cfg.model, BLOCK), torch.device("cpu")) if name == "two" else None
        h = EngineHarness(cfg, tmp_path / name, decode_compute=decode)
        try:
            assert (h.decode.compute is h.compute) == (name == "one"), (
                f"{name}: the decode core computes on the prefill engine's compute only when given none of its own"
            )
            for oracle in (False, True):
                results[name, oracle] = h.serve([Request(f"{r.request_id}-{oracle}", r.prompt, r.path, r.max_new_tokens)
                                                 for r in requests], oracle=oracle)
            h.assert_idle()
        finally:
            h.close()
    for oracle in (False, True):
        one, two = results["one", oracle], results["two", oracle]
        assert all(r.error is None for r in one + two), f"oracle={oracle}: every turn is served"
        assert [r.output_tokens for r in two] == [r.output_tokens for r in one], (
            f"oracle={oracle}: a decode engine of its own (the same model) decodes the tokens one engine decodes"
        )
        assert [[b.key for b in r.persisted] for r in two] == [[b.key for b in r.persisted] for r in one], (
            f"oracle={oracle}: and persists the same blocks"
        )
