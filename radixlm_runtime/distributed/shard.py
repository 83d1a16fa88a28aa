"""What each tensor-parallel rank holds of a dense decoder model, and how its part is cut out of the
checkpoint.

A rank builds the model from `ShardLayout.local_config()` (its own head, MLP and vocabulary counts),
so every family's blocks come out at the rank's shapes without per-family code; `parallelize` then
makes the vocabulary-parallel embedding and hangs the collectives on the row-parallel linears and the
lm_head. Checkpoint tensors are cut by name (`tensor_shard`): column-parallel q/k/v and gate/up by
output rows, row-parallel o_proj and down_proj by input columns (their bias on rank 0 only, since the
ranks' outputs are summed), embedding and lm_head by vocabulary rows, padded to one size a rank.

Heads: each rank holds whole KV-head groups (`split_heads`), so its query heads map onto its KV heads
exactly as the full model's do and the attention kernels need no change. Where the KV heads do not
divide by the ranks the split is uneven (SmolLM2-135M's 3 KV heads, 9 query heads, on 2 ranks: rank 0
KV heads 0-1 with query heads 0-5, rank 1 KV head 2 with query heads 6-8); with fewer KV heads than
ranks each KV head is replicated on size / kv_heads ranks, which split its query heads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm_runtime.distributed.group import TPGroup
from radixlm_runtime.layers.embedding import Embedding
from radixlm_runtime.layers.quantization import CHUNK, QuantizedSource, QuantizedWeight

if TYPE_CHECKING:
    from radixlm_runtime.models.config import ModelConfig

_LAYER_TENSOR = re.compile(r"(?:model\.)?layers\.\d+\.(\w+)\.(\w+)\.(weight|bias)")


def _even(n: int, size: int, rank: int) -> range:
    """Rank's block of n items in `size` contiguous blocks, the first n % size blocks one larger."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def split_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) of rank: whole KV-head groups, or with fewer KV heads than ranks one KV
    head replicated on size // num_kv_heads ranks that split its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = _even(num_kv_heads, size, rank)
        return range(kv.start * group, kv.stop * group), kv
    replicas = size // num_kv_heads
    if size % num_kv_heads or group % replicas:
        raise ValueError(
            f"tp_size {size} does not fit {num_kv_heads} KV heads of {group} query heads each: with fewer "
            "KV heads than ranks, tp_size must be a multiple of the KV heads and divide each group"
        )
    kv_head, part = rank // replicas, group // replicas
    start = kv_head * group + (rank % replicas) * part
    return range(start, start + part), range(kv_head, kv_head + 1)


@dataclass(frozen=True)
class TensorShard:
    """A rank's part of one checkpoint tensor: `pieces` (ranges along `dim`) concatenated, padded with
    zero rows to `rows`; `zero`: the rank holds zeros of the same shape (a row-parallel bias, which
    only rank 0 adds)."""

    dim: int = 0
    pieces: tuple[range, ...] = ()
    rows: int | None = None
    zero: bool = False

    def take(self, tensor: Any) -> torch.Tensor:
        """The part of `tensor`: a torch tensor or a safetensors slice (only the part is read)."""
        if self.zero:
            return torch.zeros_like(tensor if isinstance(tensor, torch.Tensor) else tensor[:])
        if self.dim == 0:
            return self._stack([tensor[r.start : r.stop] for r in self.pieces])
        return self._stack([tensor[:, r.start : r.stop] for r in self.pieces], dim=1)

    def take_quantized(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The same part of a quantized weight: rows as they are; columns in whole chunks and groups
        (the kernels' layout, quantization.py), which a weight with its own input order cannot give."""
        if self.zero:
            raise ValueError("a quantized weight has no bias part")
        if self.dim == 0:
            q = self._stack([weight.qweight[r.start : r.stop] for r in self.pieces])
            scales = self._stack([weight.scales[r.start : r.stop] for r in self.pieces])
            mins = (
                None
                if weight.mins is None
                else self._stack([weight.mins[r.start : r.stop] for r in self.pieces])
            )
            return QuantizedWeight(weight.bits, q, scales, mins, weight.group_size)
        (cols,) = self.pieces
        unit = max(CHUNK, weight.group_size)
        if weight.input_order is not None:
            raise ValueError("cannot split the input columns of an act-order quantized weight across ranks")
        if cols.start % unit or cols.stop % unit:
            raise ValueError(
                f"cannot split a quantized weight's input columns at {cols.start}:{cols.stop}: it splits in "
                f"whole groups of {unit}"
            )
        per_byte = 2 if weight.bits == 4 else 1
        g = weight.group_size
        return QuantizedWeight(
            weight.bits,
            weight.qweight[:, cols.start // per_byte : cols.stop // per_byte],
            weight.scales[:, cols.start // g : cols.stop // g],
            None if weight.mins is None else weight.mins[:, cols.start // g : cols.stop // g],
            g,
        )

    def _stack(self, parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The pieces side by side, padded with zero rows to `rows`."""
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
        if self.rows is not None and out.shape[0] < self.rows:
            out = torch.cat([out, out.new_zeros(self.rows - out.shape[0], *out.shape[1:])])
        return out


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds of the model `full`."""

    full: ModelConfig
    rank: int
    size: int
    q_heads: range
    kv_heads: range
    inter: range  # MLP intermediate columns
    vocab_rows: int  # vocabulary rows a rank holds (the last rank's padded)

    @classmethod
    def of(cls, full: ModelConfig, rank: int, size: int) -> ShardLayout:
        q_heads, kv_heads = split_heads(full.num_heads, full.num_kv_heads, size, rank)
        # Whole chunks of 32 columns where the size allows: quantized down_proj shards need them.
        unit = CHUNK if full.intermediate_size % (CHUNK * size) == 0 else 1
        blocks = _even(full.intermediate_size // unit, size, rank)
        return cls(
            full,
            rank,
            size,
            q_heads,
            kv_heads,
            range(blocks.start * unit, blocks.stop * unit),
            -(-full.vocab_size // size),
        )

    @property
    def vocab(self) -> range:
        start = self.rank * self.vocab_rows
        return range(start, min(start + self.vocab_rows, self.full.vocab_size))

    def local_config(self) -> ModelConfig:
        """The config the rank builds its model from: its own heads, MLP width and vocabulary rows."""
        return dataclasses.replace(
            self.full,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.inter),
            vocab_size=self.vocab_rows,
        )

    def _rows(self, heads: range, offset: int = 0) -> range:
        d = self.full.head_dim
        return range(offset + heads.start * d, offset + heads.stop * d)

    def tensor_shard(self, name: str) -> TensorShard | None:
        """The rank's part of checkpoint tensor `name` (Hugging Face naming), or None: held whole."""
        if name.removeprefix("model.") in ("embed_tokens.weight", "lm_head.weight"):
            return TensorShard(0, (self.vocab,), rows=self.vocab_rows)
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            return None
        _, proj, kind = match.groups()
        full, d = self.full, self.full.head_dim
        q_size, kv_size = full.num_heads * d, full.num_kv_heads * d
        I = full.intermediate_size  # noqa: E741 - the usual name of the MLP width
        columns = {"o_proj": self._rows(self.q_heads), "down_proj": self.inter}
        if proj in columns:
            if kind == "bias":
                return None if self.rank == 0 else TensorShard(zero=True)
            return TensorShard(1, (columns[proj],))
        rows = {
            "q_proj": (self._rows(self.q_heads),),
            "k_proj": (self._rows(self.kv_heads),),
            "v_proj": (self._rows(self.kv_heads),),
            "qkv_proj": (
                self._rows(self.q_heads),
                self._rows(self.kv_heads, q_size),
                self._rows(self.kv_heads, q_size + kv_size),
            ),
            "gate_proj": (self.inter,),
            "up_proj": (self.inter,),
            "gate_up_proj": (self.inter, range(I + self.inter.start, I + self.inter.stop)),
        }.get(proj)
        return None if rows is None else TensorShard(0, rows)

    def quantized_source(self, source: QuantizedSource) -> QuantizedSource:
        """`source` cut to this rank (a GGUF tensor is read whole, then cut)."""

        def shard(name: str) -> QuantizedWeight | None:
            weight = source(name)
            spec = self.tensor_shard(name)
            return weight if weight is None or spec is None else spec.take_quantized(weight)

        return shard


class VocabParallelEmbedding(Embedding):
    """The rank's block of vocabulary rows: ids outside it look up zeros, and the ranks' lookups are
    summed (one all-reduce)."""

    def __init__(self, rows: int, hidden: int, start: int, group: TPGroup) -> None:
        super().__init__(rows, hidden)
        self.start = start
        self.tp = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def check_supported(model: nn.Module) -> None:
    """ValueError where the model has a block the tensor-parallel split does not cover."""
    for i, layer in enumerate(model.layers):
        if not hasattr(layer.mlp, "gate_up_proj"):  # a mixture of experts
            raise ValueError(
                f"tp_size > 1 serves dense models only: layer {i}'s MLP is {type(layer.mlp).__name__}"
            )
        if layer.self_attn.qk_norm not in (None, "head"):
            raise ValueError(
                f"tp_size > 1: layer {i} normalizes q/k over the whole projection, which spans the ranks"
            )


def parallelize(model: nn.Module, layout: ShardLayout, group: TPGroup) -> None:
    """Makes a model built from `layout.local_config()` one rank of the tensor-parallel model: the
    vocabulary-parallel embedding, an all-reduce after each o_proj and down_proj, the lm_head's logits
    gathered. Call before the weights are loaded (on the meta device, in the model's dtype)."""
    check_supported(model)
    old = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(
        layout.vocab_rows, old.embedding_dim, layout.vocab.start, group
    )
    model.embed_tokens.to(dtype=old.weight.dtype)
    for layer in model.layers:
        layer.self_attn.o_proj.collective = group.all_reduce
        layer.mlp.down_proj.collective = group.all_reduce
    vocab = layout.full.vocab_size
    model.lm_head.collective = lambda logits: group.gather_columns(logits, vocab)
