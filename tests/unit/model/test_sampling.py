"""The native sampler's contract (dualpath_ray/model/sampling.py), which the vllm backend's
processed log-probs follow too: the distribution is penalty -> temperature -> min_p -> top_k ->
top_p, the token is drawn from it, and the "sampling" log-prob is the token's under it,
renormalised over the kept tokens; "raw" is the model's log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from dualpath_ray.model.sampling import masked_logits, penalised, sample_token
from dualpath_ray.protocol.messages import SamplingParams
from dualpath_ray.runtime.compute.engine_compute import sample_rows

LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])


def _log_prob_over(logits: torch.Tensor, kept: list[int], token: int) -> float:
    """log p(token) when only `kept` are drawn from: logit - logsumexp(kept logits)."""
    return float(logits[token] - torch.logsumexp(logits[kept], 0))


def _draws(**kwargs: object) -> set[int]:
    return {sample_token(LOGITS, generator=torch.Generator().manual_seed(s), **kwargs)[0] for s in range(200)}  # type: ignore[arg-type]


def test_without_filters_the_log_prob_is_the_tempered_softmax() -> None:
    token, log_prob = sample_token(LOGITS, 0.7, 1.0, torch.Generator().manual_seed(1))
    assert log_prob == pytest.approx(float(torch.log_softmax(LOGITS / 0.7, -1)[token]), abs=1e-6), (
        "no filter on: the log-prob is softmax(logits / T)'s, as before the filters existed"
    )
    greedy, greedy_log_prob = sample_token(LOGITS)
    assert greedy == 1 and greedy_log_prob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[1]), abs=1e-6), (
        "greedy: the argmax, with the log-softmax of the logits"
    )


def test_top_k_keeps_the_k_largest_and_renormalises() -> None:
    assert _draws(temperature=1.0, top_k=2) == {1, 3}, "top_k 2 draws only the two largest logits"
    token, log_prob = sample_token(LOGITS, 1.0, generator=torch.Generator().manual_seed(0), top_k=2)
    assert log_prob == pytest.approx(_log_prob_over(LOGITS, [1, 3], token), abs=1e-6), (
        "the sampling log-prob is renormalised over the kept tokens"
    )
    assert sample_token(LOGITS, 1.0, top_k=0, generator=torch.Generator().manual_seed(0)) == sample_token(
        LOGITS, 1.0, top_k=-1, generator=torch.Generator().manual_seed(0)
    ), "top_k 0 and -1 both mean off"


def test_top_p_keeps_the_smallest_head_reaching_p_and_renormalises() -> None:
    probs = torch.softmax(LOGITS, -1)  # ~[0.02, 0.47, 0.06, 0.42, 0.01]
    assert float(probs[1] + probs[3]) > 0.85, "the fixture: tokens 1 and 3 hold more than 0.85"
    assert _draws(temperature=1.0, top_p=0.85) == {1, 3}, "top_p 0.85 keeps tokens 1 and 3 only"
    token, log_prob = sample_token(LOGITS, 1.0, 0.85, torch.Generator().manual_seed(3))
    assert log_prob == pytest.approx(_log_prob_over(LOGITS, [1, 3], token), abs=1e-6), (
        "the log-prob is of the truncated, renormalised distribution the token was drawn from"
    )
    assert _draws(temperature=1.0, top_p=0.01) == {1}, "a tiny top_p keeps the most likely token"


def test_min_p_drops_tokens_below_a_share_of_the_top_one() -> None:
    probs = torch.softmax(LOGITS, -1)
    kept = [i for i in range(5) if probs[i] >= 0.1 * probs.max()]
    assert kept == [1, 2, 3], "the fixture: min_p 0.1 keeps tokens 1, 2 and 3"
    assert _draws(temperature=1.0, min_p=0.1) == set(kept), "min_p draws only from the tokens it keeps"
    token, log_prob = sample_token(LOGITS, 1.0, generator=torch.Generator().manual_seed(4), min_p=0.1)
    assert log_prob == pytest.approx(_log_prob_over(LOGITS, kept, token), abs=1e-6), "renormalised over min_p's set"


def test_filters_apply_after_temperature_and_in_order() -> None:
    # At T 0.5 the top two hold more of the mass; top_p is taken over what top_k kept.
    scaled = LOGITS / 0.5
    top3 = [1, 3, 2]
    head = torch.softmax(scaled[top3], -1)
    assert float(head[0]) < 0.6 < float(head[0] + head[1]), "the fixture: top_p 0.6 needs two of top_k's three"
    masked = masked_logits(LOGITS, 0.5, 3, 0.6, 0.0)
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [1, 3], "top_p measured over top_k's renormalised mass"
    token, log_prob = sample_token(LOGITS, 0.5, 0.6, torch.Generator().manual_seed(0), top_k=3)
    assert log_prob == pytest.approx(_log_prob_over(scaled, [1, 3], token), abs=1e-6), "log-prob of the tempered, masked softmax"


def test_repetition_penalty_scales_the_contexts_tokens_as_vllm_does() -> None:
    got = penalised(LOGITS, [1, 4], 2.0)
    assert got.tolist() == pytest.approx([0.0, 1.5, 1.0, 2.9, -2.0]), (
        "a token in the context: positive logit divided by the penalty, negative multiplied"
    )
    token, log_prob = sample_token(LOGITS, repetition_penalty=2.0, context=[1, 4])
    assert token == 3, "greedy picks the argmax of the penalised logits"
    assert log_prob == pytest.approx(float(torch.log_softmax(got, -1)[3]), abs=1e-6), (
        "greedy's sampling log-prob is the penalised logits' log-softmax"
    )
    raw_token, raw = sample_token(LOGITS, repetition_penalty=2.0, context=[1, 4], log_probs="raw")
    assert raw_token == 3 and raw == pytest.approx(float(torch.log_softmax(LOGITS, -1)[3]), abs=1e-6), (
        "raw: the model's own log-softmax, before the penalty"
    )


def test_raw_log_probs_ignore_every_processing_step() -> None:
    for seed in range(5):
        sampled = sample_token(LOGITS, 0.7, 0.9, torch.Generator().manual_seed(seed), top_k=3, min_p=0.05)
        token, raw = sample_token(LOGITS, 0.7, 0.9, torch.Generator().manual_seed(seed), top_k=3, min_p=0.05,
                                  log_probs="raw")
        assert token == sampled[0], "the log-prob mode never changes which token is drawn"
        assert raw == pytest.approx(float(torch.log_softmax(LOGITS, -1)[token]), abs=1e-6), "raw = log_softmax(logits)"
        assert raw != pytest.approx(sampled[1], abs=1e-3), "the fixture: the two modes differ here"


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_out_of_range_values_are_errors_naming_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sample_token(LOGITS, **kwargs)  # type: ignore[arg-type]


def test_sample_rows_applies_each_rows_params_and_context() -> None:
    logits = torch.stack([LOGITS, LOGITS, LOGITS])
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams(temperature=1.0, top_k=1, seed=3)]
    rows = sample_rows(logits, params, [4, 4, 4], [[1], [1], [1]])
    assert [r.token for r in rows] == [1, 3, 1], "greedy, greedy with the penalty on token 1, top_k 1"
    assert rows[2].log_prob == pytest.approx(0.0, abs=1e-6), "top_k 1 leaves one token: log-prob 0"
    raw = sample_rows(logits, params, [4, 4, 4], [[1], [1], [1]], "raw")
    assert [r.token for r in raw] == [1, 3, 1], "raw log-probs sample the same tokens"
    assert raw[2].log_prob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[1]), abs=1e-6), "raw: model log-softmax"
    assert math.isclose(raw[0].log_prob, rows[0].log_prob, abs_tol=1e-6), "plain greedy: both modes are one number"
