"""The trainer's forward (model/training.py): the engines' numbers, with gradients.

`packed_logits` of sequences packed in one batch must give the logits the serving path gives each
sequence alone (`DecoderModel.prefill`, the reference the engines' batched paths are checked
against in test_batched.py) within float32 summation noise, and it must be differentiable.
"""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.model.training import packed_logits, trainable
from tests.model_factories import random_tokens, tiny_model_config


def test_packed_logits_equal_each_sequence_prefilled_alone() -> None:
    model = DecoderModel(tiny_model_config())
    sequences = [random_tokens(n, model.cfg.vocab_size, seed=n).tolist() for n in (5, 40, 17)]
    packed = packed_logits(model, sequences)
    alone = torch.cat([model.prefill(s).logits for s in sequences])
    assert packed.dtype == torch.float32 and packed.shape == alone.shape, "one float32 row of logits per token"
    assert torch.allclose(packed, alone, rtol=1e-5, atol=1e-6), (
        f"packed sequences score as each does alone (max diff {float((packed - alone).abs().max()):.2e})"
    )


def test_packed_logits_carry_gradients_to_every_parameter() -> None:
    model = DecoderModel(tiny_model_config())
    params = trainable(model)
    logits = packed_logits(model, [[1, 2, 3, 4], [5, 6]])
    torch.log_softmax(logits, dim=-1)[:, 0].sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert len(params) == len(list(model.parameters())) and not missing, f"every parameter gets a gradient: {missing}"


def test_packed_logits_refuse_bad_input_naming_it() -> None:
    model = DecoderModel(tiny_model_config())
    with pytest.raises(ValueError, match="vocab_size"):
        packed_logits(model, [[0, model.cfg.vocab_size]])
    with pytest.raises(ValueError, match="none of them empty"):
        packed_logits(model, [[1], []])
