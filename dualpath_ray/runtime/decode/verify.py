"""The decode side's check of a prompt's assembled KV (runtime.verify_kv): every byte of it.

Hit tokens must equal the store's Full Blocks byte for byte. Computed tokens are recomputed here
in one sequence (`fill_pages`); the prefill engine computed them inside a batch, whose kernels may
round differently, so they must be byte-equal or equal within float noise of the model dtype (float32: rtol 1e-4,
atol 1e-5; bfloat16 and float16: a few units in the last place, see TOLERANCES). What the KV must
be (`expected_prompt_kv`) and the check of it (`check_prompt_kv`) may run apart: a compute that
keeps the KV in vLLM's pages recomputes before the prompt lands (runtime/decode/intake.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.digest import block_digests, mismatched_tokens
from dualpath_ray.kv.errors import BlockNotFoundError
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.compute.engine_compute import EngineCompute, page_token_views
from dualpath_ray.protocol.messages import PrefillTask

RTOL, ATOL = 1e-4, 1e-5
# (rtol, atol) by KV dtype: float32 kernels differ in the last bits only; 16-bit KV is rounded
# once per value after float32 accumulation, so batch and single-sequence kernels may land one
# or two ulps apart (bf16 ulp = 2^-8 relative, fp16 2^-11).
TOLERANCES = {torch.float32: (RTOL, ATOL), torch.bfloat16: (2 ** -6, 2 ** -8), torch.float16: (2 ** -9, 2 ** -11)}


@dataclass(frozen=True)
class KVCheck:
    bytes_verified: int = 0
    mismatches: int = 0


def _layer_tokens(pages: torch.Tensor, layer: int, table: Sequence[int], start: int, end: int) -> torch.Tensor:
    return torch.cat(page_token_views(pages, layer, table, start, end))


@dataclass(frozen=True)
class ExpectedKV:
    """What a prompt's KV must be: the Full Blocks [blocks, n_layer, block_size, bytes] of its
    `tokens` tokens, the first `hit` from the store (checked bit for bit), the rest recomputed
    (checked within TOLERANCES)."""

    blocks: torch.Tensor
    tokens: int
    hit: int


def expected_prompt_kv(compute: EngineCompute, store: BlockStore, task: PrefillTask, device: torch.device) -> ExpectedKV:
    """The store's hit blocks, and the rest recomputed in one sequence by `compute` (which may
    raise ComputeBusy: runtime/compute/engine_compute.py)."""
    layout = compute.layout
    prompt = np.asarray(task.request.prompt, dtype=np.int64)
    # The read blocks' tokens are checked bit for bit against the store: a partial hit's last
    # token too (its stored bytes are what the prefill side hands over, runtime/prefill/pipeline.py).
    n, hit = len(prompt), task.read_end
    expected = torch.empty((layout.blocks_for(n), *layout.full_block_shape), dtype=torch.uint8, device=device)
    own = list(range(expected.shape[0]))
    host = layout.empty_full_block()
    for block, key in enumerate(task.hit_keys):
        try:
            store.get_into(key, host)
        except BlockNotFoundError:
            # In-flight sharing: a producer's block its decode node served from memory and the
            # store has not written yet (runtime/reader/hot_blocks.py). It and the blocks after
            # it are checked against the recompute, as computed tokens are.
            hit = block * layout.block_size
            break
        expected[block].copy_(host)
    if hit < n:
        compute.fill_pages(prompt, hit, n, expected, own)
    return ExpectedKV(expected, n, hit)


def check_prompt_kv(layout: KVLayout, expected: ExpectedKV, pages: torch.Tensor, table: Sequence[int]) -> KVCheck:
    """The prompt's KV in `pages` (its page table `table`) against what it must be."""
    n, hit = expected.tokens, expected.hit
    own = list(range(expected.blocks.shape[0]))
    exact = close = True
    for layer in range(layout.n_layer):
        if hit:
            exact &= torch.equal(_layer_tokens(pages, layer, table, 0, hit), _layer_tokens(expected.blocks, layer, own, 0, hit))
        if hit == n:
            continue
        got, want = _layer_tokens(pages, layer, table, hit, n), _layer_tokens(expected.blocks, layer, own, hit, n)
        if not torch.equal(got, want):
            got_kv, want_kv = layout.bytes_as_kv(got), layout.bytes_as_kv(want)
            rtol, atol = TOLERANCES.get(got_kv.dtype, (RTOL, ATOL))
            close &= torch.allclose(got_kv.float(), want_kv.float(), rtol=rtol, atol=atol)
    return KVCheck(bytes_verified=n * layout.bytes_per_token, mismatches=int(not exact) + int(not close))


def landed_mismatches(pages: torch.Tensor, table: Sequence[int], digests: np.ndarray) -> np.ndarray:
    """Flat (layer, token) positions where a prompt's KV in its pages differs from the digests
    [n_layer, prompt tokens] the prefill engine sent with it (runtime.kv_digests)."""
    tokens = digests.shape[1]
    blocks = pages[list(table[: -(-tokens // pages.shape[2])])]
    return mismatched_tokens(block_digests(blocks, tokens), digests)
