"""The batched forwards the engines use equal the one-sequence reference path.

Prefill: sequences with different cached/new lengths laid out in one shared buffer, as the layer
window holds them. Decode: one step over a batch whose pages are scattered through a pool.
float32: logits within atol 1e-5 / rtol 1e-4 of the per-sequence forward (only summation order
differs); bf16: within 3e-2 relative to the logits' scale.
"""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.model.llama import DecoderModel
from tests.model_factories import random_tokens, tiny_model_config

BLOCK = 8


def _model(n_head: int = 4, n_kv_head: int = 2, dtype: str = "float32") -> DecoderModel:
    return DecoderModel(tiny_model_config(n_head=n_head, n_kv_head=n_kv_head, head_dim=8, dtype=dtype))


def _spans_prefill(model: DecoderModel, prompts: list[torch.Tensor], cached: list[int]):
    """Prefill of every prompt's tokens after `cached`, as an engine's window does it."""
    kv_shape = (2, model.cfg.n_kv_head, model.cfg.head_dim)
    device = model.device
    window = [torch.zeros((sum(len(p) for p in prompts), *kv_shape), dtype=model.dtype, device=device) for _ in range(model.n_layer)]
    offsets, position = [], 0
    for prompt in prompts:
        offsets.append(position)
        position += len(prompt)
    for prompt, c, off in zip(prompts, cached, offsets):
        if c:
            past = model.prefill(prompt[:c]).kv
            for layer in range(model.n_layer):
                window[layer][off : off + c] = past[layer]
    ids = torch.cat([p[c:] for p, c in zip(prompts, cached)])
    positions = torch.cat([torch.arange(c, len(p), device=device) for p, c in zip(prompts, cached)])
    counts = [len(p) - c for p, c in zip(prompts, cached)]
    hidden = model.embed(ids)
    for layer in range(model.n_layer):
        spans = [window[layer][off : off + len(p)] for p, off in zip(prompts, offsets)]
        hidden = model.forward_layer_spans(layer, hidden, positions, spans, counts)
    return model.logits(hidden), window, offsets, counts


@pytest.mark.parametrize("n_head, n_kv_head", [(4, 4), (4, 2), (4, 1)])
def test_packed_span_prefill_equals_each_sequence_alone(n_head: int, n_kv_head: int) -> None:
    model = _model(n_head, n_kv_head)
    prompts = [random_tokens(n, model.cfg.vocab_size, seed=n) for n in (21, 40, 9, 33)]
    cached = [0, 24, 3, 32]
    logits, window, offsets, counts = _spans_prefill(model, prompts, cached)
    row = 0
    for prompt, c, off, count in zip(prompts, cached, offsets, counts):
        alone = model.prefill(prompt)
        assert torch.allclose(logits[row : row + count], alone.logits[c:], atol=1e-5, rtol=1e-4), (
            f"GQA {n_head}/{n_kv_head}: a sequence's logits in the batch equal its own prefill"
        )
        for layer in range(model.n_layer):
            assert torch.allclose(window[layer][off : off + len(prompt)], alone.kv[layer], atol=1e-5, rtol=1e-4), (
                f"layer {layer}: the span holds the sequence's KV, cached rows and new rows alike"
            )
        row += count


def _paged_pool(model: DecoderModel, n_pages: int) -> torch.Tensor:
    return torch.zeros((n_pages, model.n_layer, BLOCK, 2, model.cfg.n_kv_head, model.cfg.head_dim), dtype=model.dtype)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_paged_decode_step_equals_each_sequence_decode_step(dtype: str, tolerance: float) -> None:
    model = _model(dtype=dtype)
    lengths = [5, 17, 8, 30, 1]
    prompts = [random_tokens(n, model.cfg.vocab_size, seed=100 + n) for n in lengths]
    pool = _paged_pool(model, 40)
    free = list(torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist())
    tables = []
    for prompt in prompts:
        pages = [free.pop() for _ in range(len(prompt) // BLOCK + 1)]
        tables.append(pages)
        kv = model.prefill(prompt[:-1]).kv if len(prompt) > 1 else None
        for layer in range(model.n_layer):
            for t in range(len(prompt) - 1):
                pool[pages[t // BLOCK], layer, t % BLOCK] = kv[layer][t]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    positions = torch.tensor([n - 1 for n in lengths])
    hidden = model.embed(torch.tensor([int(p[-1]) for p in prompts]))
    for layer in range(model.n_layer):
        hidden = model.forward_layer_paged(layer, hidden, positions, pool[:, layer], table, positions + 1)
    logits = model.logits(hidden)
    for b, prompt in enumerate(prompts):
        past = model.prefill(prompt[:-1]).kv if len(prompt) > 1 else [torch.empty(0, 2, model.cfg.n_kv_head, 8, dtype=model.dtype)] * model.n_layer
        alone = model.decode_step(int(prompt[-1]), len(prompt) - 1, past)
        scale = float(alone.logits.abs().max())
        assert float((logits[b] - alone.logits).abs().max()) <= tolerance * max(scale, 1.0), (
            f"{dtype}: sequence {b}'s logits in the paged batch equal its own decode step"
        )
        for layer in range(model.n_layer):
            position = len(prompt) - 1
            written = pool[tables[b][position // BLOCK], layer, position % BLOCK].float()
            assert torch.allclose(written, alone.kv[layer][0].float(), atol=tolerance, rtol=tolerance), (
                f"layer {layer}: the new token's KV is written into its page"
            )


def test_paged_decode_ignores_garbage_past_each_context() -> None:
    model = _model()
    pool = _paged_pool(model, 6)
    pool.fill_(float("nan"))
    prompt = random_tokens(3, model.cfg.vocab_size, seed=9)
    past = model.prefill(prompt[:-1]).kv
    for layer in range(model.n_layer):
        pool[2, layer, :2] = past[layer]
    table = torch.tensor([[2, 5]])
    hidden = model.embed(prompt[-1:])
    for layer in range(model.n_layer):
        hidden = model.forward_layer_paged(layer, hidden, torch.tensor([2]), pool[:, layer], table, torch.tensor([3]))
    assert torch.isfinite(model.logits(hidden)).all(), "rows past the context and padding pages never reach the output"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
def test_batched_forwards_on_cuda_equal_the_cpu_reference() -> None:
    model = _model()
    prompts = [random_tokens(n, model.cfg.vocab_size, seed=n) for n in (12, 20)]
    cpu_logits, *_ = _spans_prefill(model, prompts, [0, 8])
    gpu_logits, *_ = _spans_prefill(model.to("cuda"), [p.cuda() for p in prompts], [0, 8])
    assert torch.allclose(gpu_logits.cpu(), cpu_logits, atol=1e-4, rtol=1e-3), "CUDA prefill matches the CPU"
