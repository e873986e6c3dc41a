"""Attention over the three KV shapes the model meets, all through one SDPA call site.

* one sequence: the new tokens' queries over [P + T] KV rows (cached, then new);
* packed spans: several sequences' new tokens in one [T] batch, each over its own KV span;
* paged: one new token per sequence over KV pages of a pool, addressed by block tables.

KV rows are token-major [S, 2, n_kv_head, head_dim] (K after RoPE, then V), as everywhere in the
package. Queries never see a key after their own position, and a key padding position never
contributes (its probability is exactly 0, so whatever a padding row holds is harmless as long
as it is finite, which pool pages and spans always are: they are zero-filled or written KV).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# enable_gqa appeared in torch 2.5; before it the KV heads are repeated for every query head.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q [B, n_head, L, d], k/v [B, n_kv_head, S, d] (any strides) -> [B, n_head, L, d].

    `mask` (bool, True = may attend) broadcasts to [B, n_head, L, S]; `causal` is the
    top-left-aligned causal mask, right only when L == S (no cached keys).
    """
    group = q.shape[1] // k.shape[1]
    if group > 1 and not _SDPA_HAS_GQA:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if group > 1 and _SDPA_HAS_GQA:
        # Measured on CPU: enable_gqa beats repeat_interleave at every size we run (no copy).
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[S, heads, d] -> [1, heads, S, d], a view."""
    return x.transpose(0, 1).unsqueeze(0)


def _tokens_first(out: torch.Tensor) -> torch.Tensor:
    """[1, heads, L, d] -> [L, heads, d], a view."""
    return out[0].transpose(0, 1)


def prefix_causal_mask(new_tokens: int, past_tokens: int, device: torch.device) -> torch.Tensor:
    """[T, P+T] bool, True = may attend: every cached token, and new tokens up to itself."""
    keys = torch.arange(past_tokens + new_tokens, device=device)
    last_visible = torch.arange(past_tokens, past_tokens + new_tokens, device=device)
    return keys[None, :] <= last_visible[:, None]


def sequence_attention(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """q [T, n_head, d] of the last T rows of kv [S, 2, n_kv_head, d] -> [T, n_head * d]."""
    tokens, past = q.shape[0], kv.shape[0] - q.shape[0]
    mask = None if past == 0 else prefix_causal_mask(tokens, past, q.device)
    out = attend(
        _heads_first(q), _heads_first(kv[:, 0]), _heads_first(kv[:, 1]), mask=mask, causal=past == 0
    )
    return _tokens_first(out).reshape(tokens, -1)


def span_attention(
    q: torch.Tensor, new_kv: torch.Tensor, spans: Sequence[torch.Tensor], new_counts: Sequence[int]
) -> torch.Tensor:
    """Write each sequence's new KV at the end of its span, then attend per sequence.

    q [T, n_head, d] and new_kv [T, 2, n_kv_head, d] hold the sequences' new tokens packed in
    order; spans[i] is [P_i + N_i, 2, n_kv_head, d] with the cached KV in rows [0, P_i). One SDPA
    per sequence over its span view: the cached KV is read where it lies, never copied.
    Returns [T, n_head * d].
    """
    starts = [0]
    for count in new_counts:
        starts.append(starts[-1] + count)
    longest = max(span.shape[0] for span in spans)
    widest = max(new_counts)
    # key index - query index, once for the batch: query j of a sequence with P cached tokens
    # may see key c iff c - j <= P, so each sequence's mask is one comparison on a slice.
    offsets = (
        torch.arange(longest, device=q.device)[None, :] - torch.arange(widest, device=q.device)[:, None]
    )
    outs = []
    for span, count, start in zip(spans, new_counts, starts):
        past = span.shape[0] - count
        span[past:] = new_kv[start : start + count]
        mask = None if past == 0 else offsets[:count, : span.shape[0]] <= past
        out = attend(
            _heads_first(q[start : start + count]),
            _heads_first(span[:, 0]),
            _heads_first(span[:, 1]),
            mask=mask,
            causal=past == 0,
        )
        outs.append(_tokens_first(out))
    return torch.cat(outs).reshape(q.shape[0], -1)


def write_paged(
    pool_layer: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, new_kv: torch.Tensor
) -> None:
    """Store each sequence's new KV [B, 2, n_kv_head, d] at token context_lens - 1 of its pages."""
    block_size = pool_layer.shape[1]
    token = context_lens - 1
    slots = block_tables.gather(1, (token // block_size)[:, None])[:, 0]
    pool_layer[slots, token % block_size] = new_kv


def paged_attention(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    shortest: int,
    longest: int,
) -> torch.Tensor:
    """q [B, n_head, d], one token per sequence, over its first context_lens[b] pooled tokens.

    `shortest`/`longest` are min/max of context_lens (the caller has them from validation).
    Gathers only the block-table columns `longest` needs, in one index_select for the batch, and
    runs one SDPA with a key padding mask. Returns [B, n_head * d].
    """
    batch, block_size = q.shape[0], pool_layer.shape[1]
    n_blocks = -(-longest // block_size)
    keys = n_blocks * block_size
    table = block_tables[:, :n_blocks]
    padded = shortest < keys
    if padded:
        table = _fill_padding_columns(table, context_lens, block_size)
    kv = pool_layer.index_select(0, table.reshape(-1)).view(batch, keys, *pool_layer.shape[2:])
    mask = None
    if padded:
        visible = torch.arange(keys, device=q.device)[None, :] < context_lens[:, None]  # [B, S]
        _zero_tail_rows(kv, visible, context_lens, block_size)
        mask = visible[:, None, None, :]
    out = attend(q[:, :, None, :], kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), mask=mask)
    return out.reshape(batch, -1)


# Why padding is sanitised: a masked key gets probability 0, but SDPA still computes its score
# and 0 * its value, so a NaN, an inf or a huge value there turns the whole row into NaN. Pool
# pages start as torch.empty memory and prompt pages carry whatever their producer left past
# the prompt, so rows after a sequence's context, and padding block-table entries, may hold any
# bit pattern. Cheapest fix measured (B=32, 256 keys): point padding columns at a block that
# is fully written, and zero only the rows after each context inside its own last block
# (< block_size rows per sequence), instead of zeroing every padding row.


def _fill_padding_columns(table: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """`table` with columns past each sequence's last block replaced by a fully written block."""
    used = (context_lens + block_size - 1) // block_size
    # Block 0 of the longest sequence is full whenever there is more than one column; with one
    # column no sequence has a padding column.
    filler = table[context_lens.argmax(), 0]
    columns = torch.arange(table.shape[1], device=table.device)
    return torch.where(columns[None, :] < used[:, None], table, filler)


def _zero_tail_rows(kv: torch.Tensor, visible: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> None:
    """Zero the gathered rows after each context within its last block (kv is contiguous)."""
    ends = (context_lens + block_size - 1) // block_size * block_size
    keys = torch.arange(visible.shape[1], device=kv.device)
    tail = ~visible & (keys[None, :] < ends[:, None])
    rows = tail.reshape(-1).nonzero().squeeze(1)
    kv.view(visible.numel(), -1).index_fill_(0, rows, 0)
