"""The KV layout is part of the block key namespace: a persistent store written with one layout
(dtype, layers, KV heads, head dim, block size) never hands its blocks to another under a key."""

from __future__ import annotations

import pytest

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout

BLOCK = 4
BASE = KVLayout(n_layer=2, block_size=BLOCK, n_kv_head=2, head_dim=8, dtype="float32")
CHANGES = {
    "dtype": KVLayout(2, BLOCK, 2, 8, "bfloat16"),
    "n_layer": KVLayout(3, BLOCK, 2, 8, "float32"),
    "n_kv_head": KVLayout(2, BLOCK, 1, 8, "float32"),
    "head_dim": KVLayout(2, BLOCK, 2, 16, "float32"),
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_layout_field_separates_the_keys(field: str) -> None:
    prompt = list(range(3 * BLOCK))
    base = block_keys(prompt, BLOCK, namespace_for("m", 0, 1, BASE))
    changed = block_keys(prompt, BLOCK, namespace_for("m", 0, 1, CHANGES[field]))
    assert not set(base) & set(changed), f"a change of {field} must change every block key"


def test_the_model_config_namespace_holds_its_layout_at_the_store_block_size() -> None:
    model = ModelConfig(n_layer=2, n_kv_head=2, head_dim=8, seed=1)
    namespace = model.kv_namespace(block_size=BLOCK)
    assert namespace == namespace_for("dualpath-tiny", 0, 1, KVLayout.from_model(model, BLOCK)), (
        "kv_namespace is model id, version, seed and the model's layout at the given block size"
    )
    variants = {
        "dtype": model.model_copy(update={"dtype": "bfloat16"}).kv_namespace(block_size=BLOCK),
        "n_layer": model.model_copy(update={"n_layer": 3}).kv_namespace(block_size=BLOCK),
        "n_kv_head": model.model_copy(update={"n_kv_head": 1}).kv_namespace(block_size=BLOCK),
        "head_dim": model.model_copy(update={"head_dim": 16}).kv_namespace(block_size=BLOCK),
        "block_size": model.kv_namespace(block_size=2 * BLOCK),
    }
    for field, other in variants.items():
        assert other != namespace, f"a change of {field} must move the key namespace"
    assert len(set(variants.values())) == len(variants), "each layout change gives its own namespace"


def test_kv_namespace_takes_the_block_size_by_name_only() -> None:
    with pytest.raises(TypeError):
        ModelConfig().kv_namespace(5)  # type: ignore[call-arg]  # a version alone: no block size
    assert ModelConfig().kv_namespace(5, block_size=BLOCK) != ModelConfig().kv_namespace(block_size=BLOCK), (
        "an explicit weight version still moves the namespace"
    )


def test_namespaces_with_a_layout_stay_one_to_one() -> None:
    tagged = namespace_for("m", 0, None, BASE)
    assert tagged != namespace_for("m", 0), "a layout namespace differs from the same model's untagged one"
    assert namespace_for(f"m@w0#kv:{BASE.key_tag}", 0) != tagged, (
        "a model id that spells a layout tag must not alias the tagged namespace"
    )
    assert namespace_for("m", 1, 2, BASE) != namespace_for("m", 12, None, BASE), "version and seed must not alias"
    assert "@" not in BASE.key_tag and "#" not in BASE.key_tag, "the layout tag holds neither separator"


def test_salted_namespaces_never_share_keys_and_unsalt_back() -> None:
    from dualpath_ray.kv.index import block_keys, salted_namespace, unsalted_namespace

    base = "m@w3#kv:f32"
    a, b = salted_namespace(base, "tenant-a"), salted_namespace(base, "tenant-b")
    tokens = list(range(8))
    # Invariant: a tenant's salt separates its keys from every other tenant's and from unsalted keys.
    assert len({block_keys(tokens, 4, ns)[0] for ns in (base, a, b)}) == 3
    # Invariant: the model's namespace (what names the weights) is recovered from a salted one.
    assert unsalted_namespace(a) == base and unsalted_namespace(base) == base
    # Invariant: the secret itself never appears in a key namespace.
    assert "tenant-a" not in a
    assert salted_namespace(base, None) == base
