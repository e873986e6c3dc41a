"""The engines' compute: a decode step's oracle handoffs filled into their pages in one batched
forward (`fill_pages_many`) give the KV each would get alone (`fill_pages`)."""

from __future__ import annotations

import numpy as np
import torch

from dualpath_ray.config import parse_config
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.runtime.compute.engine_compute import ModelCompute, PageFill, page_token_views

BLOCK = 16


def test_fill_pages_many_equals_each_sequence_alone() -> None:
    cfg = parse_config({"model": {"n_layer": 3, "max_context": 512}, "store": {"block_size": BLOCK}})
    layout = KVLayout.from_model(cfg.model, BLOCK)
    compute = ModelCompute(cfg, layout, torch.device("cpu"))
    rng = np.random.default_rng(3)
    lengths, cached = (40, 23, 70, 9), (32, 0, 48, 8)  # whole blocks of past KV, or none
    prompts = [rng.integers(0, cfg.model.vocab_size, n) for n in lengths]
    alone, batched = PagedKVPool(64, layout, torch.device("cpu")), PagedKVPool(64, layout, torch.device("cpu"))
    fills = []
    for i, (prompt, start) in enumerate(zip(prompts, cached)):
        owner = f"r{i}"
        for pool in (alone, batched):
            pool.reserve(owner, pool.pages_for(len(prompt)))
            table = pool.ensure(owner, len(prompt))
            if start:  # the past KV, as the store's hit blocks would put it there
                compute.fill_pages(prompt, 0, start, pool.tensor, table)
        compute.fill_pages(prompt, start, len(prompt), alone.tensor, alone.table(owner))
        fills.append(PageFill(prompt, start, len(prompt), batched.table(owner)))
    compute.fill_pages_many(fills, batched.tensor)
    for i, prompt in enumerate(prompts):
        for layer in range(layout.n_layer):
            want = torch.cat(page_token_views(alone.tensor, layer, alone.table(f"r{i}"), 0, len(prompt)))
            got = torch.cat(page_token_views(batched.tensor, layer, batched.table(f"r{i}"), 0, len(prompt)))
            assert torch.allclose(got.view(torch.float32), want.view(torch.float32), atol=1e-5, rtol=1e-4), (
                f"sequence {i}, layer {layer}: its pages hold the KV of its own prefill "
                "(batch kernels differ only in rounding)"
            )
