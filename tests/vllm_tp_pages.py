"""The KV pages a real vLLM engine computes under tensor parallelism, read out of every rank:
each rank's token-major block-layers of a prompt's full blocks, read back from its own pages by
its BlockLayerMap in the rank's worker process (vLLM's collective_rpc), for the rank logic's
checks against vLLM's own sharding (tests/integration/test_vllm_tensor_parallel.py). Each engine
runs in a spawned process of its own (a process holds one vLLM engine)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from dualpath_ray.config import DualPathConfig


def rank_block_layers(worker: Any, blocks: list[int]) -> torch.Tensor:
    """In a vLLM worker: its rank's token-major block-layers of `blocks`, uint8
    [layers, blocks, rank block-layer bytes], read from the pages vLLM allocated for its heads
    (its model runner's per-layer views, model order)."""
    from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap, backing_buffer
    from dualpath_ray.runtime.vllm_engine.pages import PageCodec

    layers = list(worker.model_runner.kv_caches)
    heads, head_dim = layers[0].shape[1], layers[0].shape[3] // 2
    codec = PageCodec.detect(layers[0], None, heads, head_dim, worker.vllm_config.cache_config.block_size)
    block_map = BlockLayerMap.of(layers, codec)
    buffer = backing_buffer(layers[0])
    return torch.stack([block_map.unsettle(buffer, layer, blocks) for layer in range(len(layers))]).clone()


def _prefill_pages(cfg: DualPathConfig, tp: int, prompt: list[int], blocks: list[int]) -> tuple[list[torch.Tensor], int]:
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.vllm_engine.host import engine_kwargs

    # The decode engine's arguments, no connector and no prefix cache, at `tp` ranks (the config
    # refuses TP > 1 for a DualPath engine; plain vLLM runs it).
    kwargs = {**engine_kwargs(cfg, Role.DECODE), "enable_prefix_caching": False, "tensor_parallel_size": tp}
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    engine.add_request("p", TokensPrompt(prompt_token_ids=prompt), SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
    ))
    token = -1
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                token = output.outputs[0].token_ids[0]
    pages = engine.collective_rpc(rank_block_layers, args=(blocks,))
    engine.engine_core.shutdown()
    return pages, token


def _engines_pages(cfg: DualPathConfig, sizes: list[int], prompt: list[int], blocks: list[int]) -> list[tuple[list[torch.Tensor], int]]:
    from dualpath_ray.runtime.vllm_engine.host import configure_vllm_env

    configure_vllm_env()
    return [_prefill_pages(cfg, tp, prompt, blocks) for tp in sizes]


def vllm_rank_pages(cfg: DualPathConfig, sizes: list[int], prompt: list[int], blocks: list[int]) -> list[tuple[list[torch.Tensor], int]]:
    """For each TP size, one after the other in one spawned process: every rank's block-layers of
    `blocks` after a fresh engine of that many ranks prefilled `prompt` (rank order), and the
    token it sampled."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_engines_pages, cfg, sizes, prompt, blocks).result(timeout=600)
