"""The vllm backend's tests' config, and the reference outputs of plain vLLM: the same model
directory and weights (the model section's seeded ones, runtime/vllm_engine/model_dir.py: greedy
tokens depend on the whole prompt, so a wrong KV block shows), no KV connector and no prefix
cache, every turn's whole prompt computed from scratch. It runs in a spawned process of its own
(a process holds one vLLM engine)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.workload.trace import Trajectory


def vllm_config(mode: str) -> DualPathConfig:
    """1P1D with one engine per node, the SNICs slow enough that read queues build (so both paths
    are used), and a model vLLM's CPU attention supports (head_dim 32, block size a multiple of 32)."""
    return parse_config({
        "model": {"n_layer": 2, "max_context": 2048, "hidden_size": 128, "n_head": 4, "n_kv_head": 2, "head_dim": 32},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1, "snic_gbps": 0.064, "cnic_gbps": 8.0,
                    "hbm_tokens_per_engine": 4096, "prefill_hbm_tokens": 2048, "buffer_blocks_per_node": 128,
                    "cpus_per_node": 1},
        "store": {"block_size": 64},
        "emulation": {"enabled": True, "compute": "model"},
        "engine": {"backend": "vllm", "vllm_max_num_seqs": 32},
        "runtime": {"mode": mode, "transport": "gloo", "request_timeout_s": 300.0},
    }, source="<vllm tests>")


def _recompute(cfg: DualPathConfig, trajs: list[Trajectory]) -> dict[str, list[tuple[int, ...]]]:
    from dualpath_ray.runtime.vllm_engine.host import configure_vllm_env, engine_kwargs
    from dualpath_ray.protocol.types import Role

    configure_vllm_env()
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    # The decode engine's arguments, with no connector and no prefix cache: every prompt computed whole.
    engine = LLMEngine.from_engine_args(EngineArgs(**{**engine_kwargs(cfg, Role.DECODE), "enable_prefix_caching": False}))
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


def assert_served_exactly(result, expected: dict[str, list[tuple[int, ...]]], what: str) -> None:  # type: ignore[no-untyped-def]
    """A rollout's greedy tokens are plain vLLM's (`expected`: `vllm_recompute_outputs`), and
    runtime.verify_kv checked the loaded prompt KV of every turn with no byte differing."""
    got = {tid: [turn.output_tokens for turn in turns] for tid, turns in result.turn_results.items()}
    pairs = [(want, have) for tid, turns in expected.items() for want, have in zip(turns, got.get(tid, []))]
    differing = sum(a != b for want, have in pairs for a, b in zip(want, have)) + sum(abs(len(w) - len(h)) for w, h in pairs)
    assert got == expected and differing == 0, (
        f"{what}: greedy tokens equal plain vLLM recomputing every prompt whole ({differing} tokens differ)"
    )
    verified = [(turn.kv_bytes_verified, turn.kv_mismatches) for turns in result.turn_results.values() for turn in turns]
    assert all(nbytes > 0 and bad == 0 for nbytes, bad in verified), (
        f"{what}: runtime.verify_kv checked the loaded prompt KV of every turn, and none differed: {verified}"
    )
