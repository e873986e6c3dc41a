"""Reference outputs of plain vLLM for the vllm backend's tests: the same model directory and
dummy weights, no KV connector and no prefix cache, every turn's whole prompt computed from
scratch. It runs in a spawned process of its own (a process holds one vLLM engine)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from dualpath_ray.config import DualPathConfig
from dualpath_ray.workload.trace import Trajectory


def _recompute(cfg: DualPathConfig, trajs: list[Trajectory]) -> dict[str, list[tuple[int, ...]]]:
    from dualpath_ray.runtime.vllm_engine.host import VLLM_ENV_DEFAULTS
    from dualpath_ray.runtime.vllm_engine.model_dir import dummy_model_dir

    for name, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(dummy_model_dir(cfg.model)), load_format="dummy", skip_tokenizer_init=True, dtype=cfg.model.dtype,
        seed=cfg.model.seed, block_size=cfg.store.block_size, max_model_len=cfg.model.max_context,
        enable_prefix_caching=False, num_gpu_blocks_override=cfg.model.max_context // cfg.store.block_size + 4,
        async_scheduling=False, enforce_eager=True,
    ))
    outputs: dict[str, list[tuple[int, ...]]] = {}
    for traj in trajs:
        context: list[int] = []
        outputs[traj.trajectory_id] = []
        for i, turn in enumerate(traj.turns):
            context = context + list(turn.appended)
            request_id = f"{traj.trajectory_id}/{i}"
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=context), SamplingParams(
                max_tokens=turn.gen_len, temperature=0.0, ignore_eos=True, detokenize=False,
            ))
            generated: tuple[int, ...] = ()
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        generated = tuple(output.outputs[0].token_ids)
            outputs[traj.trajectory_id].append(generated)
            context = context + list(generated)
    return outputs


def vllm_recompute_outputs(cfg: DualPathConfig, trajs: list[Trajectory]) -> dict[str, list[tuple[int, ...]]]:
    """Greedy outputs of every turn by a plain vLLM engine recomputing its whole prompt."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_recompute, cfg, trajs).result(timeout=600)
