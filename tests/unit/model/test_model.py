"""The layerwise decoder: cached-prefix prefill equals prefill from scratch, and its weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.model.llama import DecoderModel, sample_token
from dualpath_ray.config.hf import WeightsError
from dualpath_ray.model.weights import INDEX_FILE, Architecture, read_checkpoint, write_checkpoint
from tests.model_factories import random_tokens, tiny_model_config

BLOCK = 16
RTOL = 1e-5


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest magnitude of the reference."""
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(tiny_model_config())


@pytest.mark.parametrize("prefix", [BLOCK, 2 * BLOCK, 13, 2 * BLOCK + 5], ids=["1-block", "2-blocks", "unaligned-13", "unaligned-37"])
def test_cached_prefix_prefill_matches_prefill_from_scratch(model: DecoderModel, prefix: int) -> None:
    tokens = random_tokens(prefix + 21, model.cfg.vocab_size, seed=prefix)
    full = model.prefill(tokens)
    cached = model.prefill(tokens[:prefix])
    rest = model.prefill(tokens[prefix:], cached.kv)
    err = relative_error(rest.logits, full.logits[prefix:])
    assert err <= RTOL, f"logits of new tokens after a {prefix}-token cached prefix must match a full prefill (rel err {err:.2e})"
    for layer in range(model.n_layer):
        kv_err = relative_error(rest.kv[layer], full.kv[layer][prefix:])
        assert kv_err <= RTOL, f"layer {layer} KV of the new tokens must match a full prefill (rel err {kv_err:.2e})"
        assert rest.kv[layer].shape[0] == 21, "prefill returns KV of the new tokens only"


def test_forward_layer_driven_by_hand_matches_prefill(model: DecoderModel) -> None:
    tokens = random_tokens(40, model.cfg.vocab_size, seed=3)
    full = model.prefill(tokens)
    past = [kv[:24] for kv in full.kv]
    hidden = model.embed(tokens[24:])
    positions = torch.arange(24, 40)
    for layer in range(model.n_layer):
        hidden, layer_kv = model.forward_layer(layer, hidden, positions, past[layer])
        assert layer_kv.is_contiguous(), f"layer {layer} KV must be contiguous for kv_as_bytes"
        assert layer_kv.dtype == model.dtype, f"layer {layer} KV must be in the model dtype"
        assert tuple(layer_kv.shape) == (16, 2, model.cfg.n_kv_head, model.cfg.head_dim), (
            f"layer {layer} KV must be token-major [T, 2, n_kv_head, head_dim]"
        )
    err = relative_error(model.logits(hidden), full.logits[24:])
    assert err <= RTOL, f"layer-by-layer forward over cached KV must match prefill (rel err {err:.2e})"


def test_kv_is_k_after_rope_then_v(model: DecoderModel) -> None:
    # Layer 0 sees only the embedding, so one token at two positions has the same V, and K
    # rotated by RoPE: different values, the same norm per head.
    token = torch.tensor([5])
    _, at_0 = model.forward_layer(0, model.embed(token), torch.tensor([0]), None)
    _, at_9 = model.forward_layer(0, model.embed(token), torch.tensor([9]), None)
    assert torch.equal(at_0[:, 1], at_9[:, 1]), "V (index 1) must not depend on the position"
    assert not torch.allclose(at_0[:, 0], at_9[:, 0]), "K (index 0) must carry the RoPE rotation"
    torch.testing.assert_close(
        at_0[:, 0].norm(dim=-1), at_9[:, 0].norm(dim=-1), msg="RoPE must preserve each K head's norm"
    )


def test_decode_step_equals_prefill_last_logits(model: DecoderModel) -> None:
    tokens = random_tokens(30, model.cfg.vocab_size, seed=4)
    full = model.prefill(tokens)
    step = model.decode_step(int(tokens[-1]), 29, model.prefill(tokens[:-1]).kv)
    err = relative_error(step.logits, full.logits[-1])
    assert err <= RTOL, f"a decode step must give the prefill's last logits (rel err {err:.2e})"
    assert all(kv.shape[0] == 1 for kv in step.kv), "decode_step returns one token of KV per layer"


def test_greedy_tokens_over_three_turns_identical_with_and_without_reuse(model: DecoderModel) -> None:
    conversation: list[int] = []
    cache: list[torch.Tensor] | None = None
    for turn, user_len in enumerate((37, 20, 11)):
        conversation += random_tokens(user_len, model.cfg.vocab_size, seed=100 + turn).tolist()
        scratch = model.greedy_generate(conversation, 6)
        # Reuse only whole blocks, as the store does: a trailing partial block is recomputed.
        hit = None if cache is None else [kv[: (kv.shape[0] // BLOCK) * BLOCK] for kv in cache]
        reused = model.greedy_generate(conversation, 6, hit)
        assert reused.token_ids == scratch.token_ids, f"turn {turn + 1}: greedy tokens must not change with KV reuse"
        for a, b in zip(reused.log_probs, scratch.log_probs):
            assert abs(a - b) <= 1e-4, f"turn {turn + 1}: token log-probs must match with KV reuse"
        expected_len = len(conversation) + 6 - 1
        assert all(kv.shape[0] == expected_len for kv in reused.kv), "generate returns KV of prompt + generated - 1"
        conversation += reused.token_ids
        cache = reused.kv


def test_generate_rejects_a_cache_covering_the_whole_prompt(model: DecoderModel) -> None:
    tokens = random_tokens(8, model.cfg.vocab_size)
    with pytest.raises(ValueError, match="must be longer"):
        model.greedy_generate(tokens, 2, model.prefill(tokens).kv)


def test_forward_layer_rejects_wrong_past_kv_shape(model: DecoderModel) -> None:
    bad = torch.zeros(4, 2, model.cfg.n_kv_head + 1, model.cfg.head_dim)
    with pytest.raises(ValueError, match="past_kv"):
        model.forward_layer(0, model.embed(torch.tensor([1])), torch.tensor([4]), bad)


def test_random_weights_come_from_the_seed_only() -> None:
    before = torch.get_rng_state()
    torch.manual_seed(1)
    first = DecoderModel(tiny_model_config(seed=11)).state_dict()
    torch.manual_seed(2)
    second = DecoderModel(tiny_model_config(seed=11)).state_dict()
    other = DecoderModel(tiny_model_config(seed=12)).state_dict()
    assert all(torch.equal(first[n], second[n]) for n in first), "same seed must give identical weights whatever the global RNG"
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"]), "another seed must give other weights"
    torch.set_rng_state(before)
    DecoderModel(tiny_model_config())
    assert torch.equal(torch.get_rng_state(), before), "building a model must not consume the global RNG"


def test_random_weights_of_a_bfloat16_model_give_bfloat16_kv() -> None:
    model = DecoderModel(tiny_model_config(dtype="bfloat16"))
    out = model.prefill(random_tokens(10, model.cfg.vocab_size))
    layout = KVLayout.from_model(model.cfg, BLOCK)
    assert out.kv[0].dtype == torch.bfloat16, "KV must be in the model dtype"
    assert layout.kv_as_bytes(out.kv[0]).shape == (10, layout.bytes_per_token_per_layer), "bf16 KV must turn into layout bytes"
    assert out.logits.dtype == torch.float32, "logits are float32 whatever the model dtype"


@pytest.mark.parametrize(
    ("arch", "shards"),
    [
        (Architecture(attention_bias=False, tie_word_embeddings=False), 1),
        (Architecture(attention_bias=True, tie_word_embeddings=True), 3),
    ],
    ids=["llama-single-file", "qwen2-tied-sharded"],
)
def test_safetensors_round_trip_gives_the_same_logits(tmp_path: Path, arch: Architecture, shards: int) -> None:
    source = DecoderModel(tiny_model_config(), arch=arch)
    write_checkpoint(source.checkpoint_tensors(), tmp_path, shards=shards)
    assert (tmp_path / INDEX_FILE).is_file() == (shards > 1), "sharded checkpoints carry an index"
    names = set(read_checkpoint(tmp_path))
    assert ("lm_head.weight" in names) != arch.tie_word_embeddings, "a tied lm_head is not written"
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == arch.attention_bias, "q/k/v biases follow the variant"
    loaded = DecoderModel(tiny_model_config(seed=99, weights_dir=tmp_path))
    assert loaded.arch == arch, "the variant is read from the checkpoint's tensor names"
    tokens = random_tokens(25, source.cfg.vocab_size)
    assert torch.equal(loaded.prefill(tokens).logits, source.prefill(tokens).logits), (
        "a model loaded from its own checkpoint must give bit-identical logits"
    )


def test_checkpoint_with_a_wrong_shape_names_the_tensor(tmp_path: Path) -> None:
    tensors = DecoderModel(tiny_model_config()).checkpoint_tensors()
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 32)
    write_checkpoint(tensors, tmp_path)
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight: shape \[3, 32\]"):
        DecoderModel(tiny_model_config(weights_dir=tmp_path))


def test_checkpoint_of_another_depth_names_the_extra_tensor(tmp_path: Path) -> None:
    write_checkpoint(DecoderModel(tiny_model_config(n_layer=4)).checkpoint_tensors(), tmp_path)
    with pytest.raises(WeightsError, match=r"model\.layers\.3\..*n_layer"):
        DecoderModel(tiny_model_config(n_layer=3, weights_dir=tmp_path))


def test_checkpoint_missing_a_tensor_names_it(tmp_path: Path) -> None:
    tensors = DecoderModel(tiny_model_config()).checkpoint_tensors()
    del tensors["model.norm.weight"]
    write_checkpoint(tensors, tmp_path)
    with pytest.raises(WeightsError, match=r"model\.norm\.weight: missing"):
        DecoderModel(tiny_model_config(weights_dir=tmp_path))


def test_weights_dir_without_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="model.weights_dir: no \\*.safetensors"):
        DecoderModel(tiny_model_config(weights_dir=tmp_path))


def test_sample_token_greedy_top_p_and_seeded_sampling() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample_token(logits)[0] == 1, "temperature 0 must pick the argmax"
    generator = torch.Generator().manual_seed(0)
    assert {sample_token(logits, 1.0, 0.01, generator)[0] for _ in range(20)} == {1}, "a tiny top_p keeps only the top token"
    first = [sample_token(logits, 1.0, 1.0, torch.Generator().manual_seed(5))[0] for _ in range(3)]
    second = [sample_token(logits, 1.0, 1.0, torch.Generator().manual_seed(5))[0] for _ in range(3)]
    assert first == second, "sampling must be reproducible from the generator"
    token, log_prob = sample_token(logits, 1.0, 1.0, generator)
    assert abs(log_prob - float(torch.log_softmax(logits, -1)[token])) < 1e-6, "log-prob is of the chosen token"
