"""Full Block and Layer Block layouts of KV bytes (paper: "Block layouts").

A Full Block is a uint8 tensor [n_layer, block_size, bytes_per_token_per_layer]; a Layer Block
is `full[l:l+1]`, a zero-copy dim-0 view, so n_layer Layer Blocks concatenated along dim 0 are the
Full Block byte for byte. The model's KV of one layer is token-major, [T, 2, n_kv_head, head_dim]
(K then V per token), so a contiguous KV tensor reinterprets as [T, bytes_per_token_per_layer]
bytes without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are made or checked, not at module load: the scheduler and the
# simulator use the byte geometry only and must start without it.
_ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name."""
    import torch

    if name not in _ITEMSIZES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(_ITEMSIZES)}")
    return getattr(torch, name)


class SlotSegment(NamedTuple):
    """A run of bytes inside one Full Block slot: where it starts, how long, its first token."""

    offset: int
    nbytes: int
    token: int


@dataclass(frozen=True)
class KVLayout:
    """Byte geometry of one model's KV blocks."""

    n_layer: int
    block_size: int
    n_kv_head: int
    head_dim: int
    dtype: str = "float32"

    @classmethod
    def from_model(cls, model: object, block_size: int) -> KVLayout:
        """Layout from a ModelConfig-like object (n_layer, n_kv_head, head_dim, dtype)."""
        return cls(
            n_layer=model.n_layer,  # type: ignore[attr-defined]
            block_size=block_size,
            n_kv_head=model.n_kv_head,  # type: ignore[attr-defined]
            head_dim=model.head_dim,  # type: ignore[attr-defined]
            dtype=model.dtype,  # type: ignore[attr-defined]
        )

    @property
    def key_tag(self) -> str:
        """The layout's part of a block key namespace (kv/index.py `namespace_for`): every field
        that changes a Full Block's bytes, so blocks of two layouts never share a key. It holds
        no '@' or '#' (dtype names are fixed), which keeps namespaces 1:1 with their parts."""
        return f"{self.dtype}.l{self.n_layer}.h{self.n_kv_head}.d{self.head_dim}.b{self.block_size}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZES[self.dtype]

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.n_kv_head * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """All layers of one token: the unit the read queue and SNIC accounting count in."""
        return self.n_layer * self.bytes_per_token_per_layer

    @property
    def layer_block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token_per_layer

    @property
    def full_block_bytes(self) -> int:
        return self.n_layer * self.layer_block_bytes

    @property
    def full_block_shape(self) -> tuple[int, int, int]:
        return (self.n_layer, self.block_size, self.bytes_per_token_per_layer)

    @property
    def kv_token_shape(self) -> tuple[int, int, int]:
        """Shape of one token's KV in one layer, in model elements."""
        return (2, self.n_kv_head, self.head_dim)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens (the last one may be partial)."""
        return -(-tokens // self.block_size)

    def empty_full_block(self) -> torch.Tensor:
        import torch

        return torch.empty(self.full_block_shape, dtype=torch.uint8)

    def check_full_block(self, block: torch.Tensor) -> None:
        """Raise ValueError unless `block` is a contiguous uint8 Full Block of this layout."""
        import torch

        if block.dtype != torch.uint8 or tuple(block.shape) != self.full_block_shape:
            raise ValueError(
                f"expected a uint8 Full Block of shape {self.full_block_shape}, "
                f"got {block.dtype} {tuple(block.shape)}"
            )
        if not block.is_contiguous():
            raise ValueError("a Full Block must be contiguous")

    def layer_block(self, full: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer Block `layer` of a Full Block: a [1, block_size, bytes] view sharing its storage."""
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} outside [0, {self.n_layer})")
        return full[layer : layer + 1]

    def slot_byte_offset(self, slot: int, layer: int, token: int) -> int:
        """Byte offset of (layer, token) of slot `slot` in a pool of Full Block slots."""
        return ((slot * self.n_layer + layer) * self.block_size + token) * self.bytes_per_token_per_layer

    def slot_segments(self, slots: tuple[int, ...], layer: int, start: int, end: int) -> list[SlotSegment]:
        """Byte runs of tokens [start, end) of one layer of an extent whose blocks sit in `slots`.

        One run per block the range touches; `token` is the first token of the run, so a caller
        pairs it with the same tokens of a contiguous local buffer.
        """
        if end > len(slots) * self.block_size:
            raise ValueError(f"tokens [{start}, {end}) exceed an extent of {len(slots)} blocks")
        runs = []
        for block, lo, hi in block_segments(start, end, self.block_size):
            runs.append(
                SlotSegment(
                    self.slot_byte_offset(slots[block], layer, lo),
                    (hi - lo) * self.bytes_per_token_per_layer,
                    block * self.block_size + lo,
                )
            )
        return runs

    def kv_as_bytes(self, kv: torch.Tensor) -> torch.Tensor:
        """One layer's KV [T, 2, n_kv_head, head_dim] as [T, bytes_per_token_per_layer] uint8."""
        import torch

        if tuple(kv.shape[1:]) != self.kv_token_shape or kv.dtype != self.torch_dtype:
            raise ValueError(
                f"expected KV [T, {self.kv_token_shape}] {self.dtype}, got {tuple(kv.shape)} {kv.dtype}"
            )
        return kv.contiguous().view(torch.uint8).reshape(kv.shape[0], self.bytes_per_token_per_layer)

    def bytes_as_kv(self, data: torch.Tensor) -> torch.Tensor:
        """Inverse of kv_as_bytes: [T, bytes] uint8 -> [T, 2, n_kv_head, head_dim] view."""
        import torch

        if data.dtype != torch.uint8 or data.shape[-1] != self.bytes_per_token_per_layer:
            raise ValueError(f"expected [T, {self.bytes_per_token_per_layer}] uint8, got {tuple(data.shape)}")
        tokens = data.shape[0]
        return data.contiguous().view(self.torch_dtype).reshape(tokens, *self.kv_token_shape)


def block_segments(start: int, end: int, block_size: int) -> list[tuple[int, int, int]]:
    """Split the token range [start, end) at block boundaries: (block index, lo, hi) per block
    touched, with lo/hi offsets inside that block. Engines split their contiguous KV the same way
    so both sides of a transfer hold tensors of equal shapes."""
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end})")
    segments = []
    position = start
    while position < end:
        block = position // block_size
        lo = position - block * block_size
        hi = min(block_size, end - block * block_size)
        segments.append((block, lo, hi))
        position = block * block_size + hi
    return segments


def split_by_blocks(data: torch.Tensor, start: int, block_size: int) -> list[torch.Tensor]:
    """Views of `data` (tokens [start, start + len) on dim 0) cut where block_segments cuts."""
    pieces = []
    offset = 0
    for _, lo, hi in block_segments(start, start + data.shape[0], block_size):
        pieces.append(data[offset : offset + hi - lo])
        offset += hi - lo
    return pieces
