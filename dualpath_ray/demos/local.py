"""Single-process demo of KV reuse across the turns of one conversation (issue 2, item 7).

Each turn looks up the longest stored prefix of its prompt in the prefix index, reads those
Full Blocks from the store into one host buffer, slices each layer's Layer Blocks out of it, and
runs the model layer by layer over only the tokens after the hit. It then decodes greedily and
persists every new full block of KV (prompt and generated tokens) as a Full Block, so the next
turn hits it. Every turn is also recomputed from scratch; the two must agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import PrefixIndex, block_keys
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import BlockStore, open_store
from dualpath_ray.model.llama import DecoderModel, sample_token

# Appended user tokens per turn: not block multiples, so every turn ends in a partial block.
DEFAULT_USER_TOKENS = (150, 70, 45)
# Reuse reorders float reductions only; logits must agree to this fraction of their magnitude.
LOGIT_RTOL = 1e-5


@dataclass(frozen=True)
class LocalTurn:
    turn: int
    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    bytes_read: int
    blocks_written: int
    generated: list[int]
    tokens_match: bool
    max_abs_logit_diff: float
    max_abs_logit: float


@dataclass(frozen=True)
class LocalDemoResult:
    turns: list[LocalTurn]
    hit_tokens: int
    bytes_read: int
    bytes_written: int
    max_abs_logit_diff: float
    max_abs_logit: float
    tokens_match: bool

    @property
    def within_tolerance(self) -> bool:
        return self.tokens_match and self.max_abs_logit_diff <= LOGIT_RTOL * self.max_abs_logit

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"within_tolerance": self.within_tolerance}


@dataclass(frozen=True)
class _Turn:
    """What the reuse path of one turn produced."""

    prefill_logits: torch.Tensor  # [computed_tokens, vocab]
    generated: list[int]
    kv: list[torch.Tensor]  # per layer: prompt + generated tokens except the last


def read_hit_kv(store: BlockStore, layout: KVLayout, keys: Sequence[str]) -> list[torch.Tensor]:
    """Read Full Blocks into one buffer and return each layer's KV, [hit_tokens, 2, kv, d].

    A layer's KV is its Layer Blocks (dim-0 slices of each Full Block) laid end to end: the
    buffer -> HBM copy a prefill engine does per layer.
    """
    buffer = torch.empty((len(keys), *layout.full_block_shape), dtype=torch.uint8)
    store.get_many_into(keys, [buffer[slot] for slot in range(len(keys))])
    return [
        layout.bytes_as_kv(torch.cat([layout.layer_block(full, layer)[0] for full in buffer]))
        for layer in range(layout.n_layer)
    ]


def full_block_of(layout: KVLayout, kv: Sequence[torch.Tensor], block: int) -> torch.Tensor:
    """Full Block `block` of per-layer KV: each layer's tokens as bytes, stacked on dim 0."""
    span = slice(block * layout.block_size, (block + 1) * layout.block_size)
    return torch.stack([layout.kv_as_bytes(layer_kv[span]) for layer_kv in kv])


def persist_blocks(
    store: BlockStore,
    index: PrefixIndex,
    layout: KVLayout,
    keys: Sequence[str],
    kv: Sequence[torch.Tensor],
) -> int:
    """Write every full block of `kv` the index lacks (keys: the chain of these tokens).

    Returns how many blocks the store newly wrote.
    """
    written = 0
    for block, key in enumerate(keys):
        if key not in index:
            parent = keys[block - 1] if block else None
            written += store.put(key, full_block_of(layout, kv, block), parent=parent)
    index.insert(keys)
    return written


def _layerwise_prefill(
    model: DecoderModel, new_ids: torch.Tensor, past_kv: list[torch.Tensor] | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """forward_layer layer by layer over the new tokens only, as a prefill engine runs it."""
    past_tokens = 0 if past_kv is None else past_kv[0].shape[0]
    positions = torch.arange(past_tokens, past_tokens + new_ids.shape[0])
    hidden = model.embed(new_ids)
    new_kv = []
    for layer in range(model.n_layer):
        hidden, layer_kv = model.forward_layer(
            layer, hidden, positions, None if past_kv is None else past_kv[layer]
        )
        new_kv.append(layer_kv)
    return model.logits(hidden), new_kv


def _run_turn(
    model: DecoderModel, prompt: torch.Tensor, past_kv: list[torch.Tensor] | None, max_new_tokens: int
) -> _Turn:
    hit = 0 if past_kv is None else past_kv[0].shape[0]
    logits, new_kv = _layerwise_prefill(model, prompt[hit:], past_kv)
    kv = new_kv if past_kv is None else [torch.cat(p) for p in zip(past_kv, new_kv)]
    generated = [sample_token(logits[-1])[0]]
    while len(generated) < max_new_tokens:
        step = model.decode_step(generated[-1], kv[0].shape[0], kv)
        kv = [torch.cat(p) for p in zip(kv, step.kv)]
        generated.append(sample_token(step.logits)[0])
    return _Turn(logits, generated, kv)


def _conversation_turns(cfg: DualPathConfig, user_tokens: Sequence[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(cfg.model.seed)
    return [torch.randint(0, cfg.model.vocab_size, (n,), generator=generator) for n in user_tokens]


def _check_fits(cfg: DualPathConfig, user_tokens: Sequence[int], max_new_tokens: int) -> None:
    if not user_tokens or min(user_tokens) < 1:
        raise ValueError(f"user_tokens must be a non-empty list of positive counts, got {list(user_tokens)}")
    total = sum(user_tokens) + len(user_tokens) * max_new_tokens
    if total > cfg.model.max_context:
        raise ValueError(
            f"the demo conversation needs {total} tokens, over model.max_context={cfg.model.max_context}; "
            "raise model.max_context or lower runtime.max_new_tokens"
        )


@dataclass(frozen=True)
class _Demo:
    """Everything a demo turn works with."""

    model: DecoderModel
    layout: KVLayout
    store: BlockStore
    index: PrefixIndex
    namespace: str
    max_new_tokens: int


def _demo_turn(demo: _Demo, number: int, conversation: list[int]) -> tuple[LocalTurn, list[int]]:
    """One turn with reuse and from scratch; returns its result and the generated tokens."""
    block_size = demo.layout.block_size
    prompt = torch.tensor(conversation)
    hit = demo.index.match(conversation, demo.namespace)
    # At least one prompt token must be computed to produce the first output's logits.
    keys = hit.keys[: (len(conversation) - 1) // block_size]
    hit_tokens = len(keys) * block_size
    past_kv = read_hit_kv(demo.store, demo.layout, keys) if keys else None
    reused = _run_turn(demo.model, prompt, past_kv, demo.max_new_tokens)
    scratch = demo.model.greedy_generate(prompt, demo.max_new_tokens)
    reference = demo.model.prefill(prompt).logits[hit_tokens:]
    with_kv = (conversation + reused.generated)[: reused.kv[0].shape[0]]
    chain = block_keys(with_kv, block_size, demo.namespace)
    result = LocalTurn(
        turn=number,
        prompt_tokens=len(conversation),
        hit_tokens=hit_tokens,
        computed_tokens=len(conversation) - hit_tokens,
        bytes_read=len(keys) * demo.layout.full_block_bytes,
        blocks_written=persist_blocks(demo.store, demo.index, demo.layout, chain, reused.kv),
        generated=reused.generated,
        tokens_match=reused.generated == scratch.token_ids,
        max_abs_logit_diff=float((reused.prefill_logits - reference).abs().max()),
        max_abs_logit=float(reference.abs().max()),
    )
    return result, reused.generated


def run_local_demo(
    cfg: DualPathConfig,
    store_root: str | Path,
    user_tokens: Sequence[int] = DEFAULT_USER_TOKENS,
) -> LocalDemoResult:
    """A conversation of len(user_tokens) turns reusing KV through the store at `store_root`.

    The store is `cfg.store.backend` (a LocalDirStore at store_root by default); blocks already
    there (an earlier run's) are indexed first, so they are hit too.
    """
    _check_fits(cfg, user_tokens, cfg.runtime.max_new_tokens)
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    store = open_store(cfg.store, layout, root=store_root)
    conversation: list[int] = []
    turns: list[LocalTurn] = []
    try:
        demo = _Demo(
            model=DecoderModel(cfg.model),
            layout=layout,
            store=store,
            index=PrefixIndex.rebuild(store, cfg.store.block_size),
            namespace=cfg.kv_namespace(),
            max_new_tokens=cfg.runtime.max_new_tokens,
        )
        with torch.inference_mode():
            for number, user in enumerate(_conversation_turns(cfg, user_tokens), start=1):
                conversation += user.tolist()
                turn, generated = _demo_turn(demo, number, conversation)
                conversation += generated
                turns.append(turn)
    finally:
        store.close()
    return LocalDemoResult(
        turns=turns,
        hit_tokens=sum(t.hit_tokens for t in turns),
        bytes_read=sum(t.bytes_read for t in turns),
        bytes_written=sum(t.blocks_written for t in turns) * layout.full_block_bytes,
        max_abs_logit_diff=max(t.max_abs_logit_diff for t in turns),
        max_abs_logit=max(t.max_abs_logit for t in turns),
        tokens_match=all(t.tokens_match for t in turns),
    )
