"""How a Llama-family model splits over tensor-parallel ranks, Megatron-style, and each rank's weights.

q/k/v and gate/up are column-parallel (each rank computes some output features); o and down are
row-parallel (each rank multiplies its part of the input features, and one all-reduce per layer sums
the parts); the embedding and the LM head split by vocabulary. Attention stays whole per KV group:
a rank holds some KV heads with every query head that reads them. Where the rank count does not
divide the KV heads, the groups split as evenly as possible (SmolLM2's 9 query and 3 KV heads over
2 ranks: 2 groups + 1 group); with fewer KV heads than ranks, each rank holds one KV head (copies
of it on several ranks) and a share of its group's query heads.

    9 query heads, 3 KV heads (groups of 3), 2 ranks:
        rank 0: KV heads 0 1,  query heads 0-5     rank 1: KV head 2, query heads 6-8
    8 query heads, 2 KV heads (groups of 4), 4 ranks:
        rank 0: KV 0, q 0-1    rank 1: KV 0, q 2-3    rank 2: KV 1, q 4-5    rank 3: KV 1, q 6-7

Packed weights shard on block boundaries: rows (output features) split anywhere; a row-parallel
weight splits its columns only where a block ends, else that weight is expanded to float32.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from engine.models.arch import DecoderArch
from kernels.packed_weight import PackedWeight, block_geometry

logger = logging.getLogger(__name__)

Weight = torch.Tensor | PackedWeight


def even_split(total: int, parts: int, unit: int = 1) -> list[range]:
    """`total` cut into `parts` contiguous ranges of whole `unit`s, sizes differing by at most one
    unit, larger ones first (`total` must be a multiple of `unit`)."""
    units, extra = divmod(total // unit, parts)
    ranges, start = [], 0
    for part in range(parts):
        size = (units + (part < extra)) * unit
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class RankShard:
    """What one rank holds of every layer."""

    q_heads: range
    kv_heads: range
    intermediate: range  # of the MLP's intermediate features
    vocab: range  # of the embedding's and LM head's rows


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[RankShard, ...]

    @property
    def world_size(self) -> int:
        return len(self.shards)

    @classmethod
    def build(cls, arch: DecoderArch, world_size: int, intermediate_unit: int = 1) -> ShardPlan:
        """The split of `arch` over `world_size` ranks; `intermediate_unit`: the MLP splits in
        whole multiples of it (the down projection's block size, for packed weights)."""
        if world_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {world_size}")
        if world_size > arch.num_heads:
            raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's "
                             f"{arch.num_heads} attention heads")
        if arch.intermediate_size % intermediate_unit or (
                arch.intermediate_size // intermediate_unit < world_size):
            intermediate_unit = 1
        heads = _split_heads(arch.num_heads, arch.num_kv_heads, world_size)
        mlp = even_split(arch.intermediate_size, world_size, intermediate_unit)
        vocab = even_split(arch.vocab_size, world_size)
        return cls(tuple(RankShard(q, kv, m, v) for (q, kv), m, v in zip(heads, mlp, vocab)))

    def local_arch(self, arch: DecoderArch, rank: int) -> DecoderArch:
        """`arch` as rank `rank` holds it: its heads, its MLP features and its vocabulary rows."""
        shard = self.shards[rank]
        return dataclasses.replace(arch, num_heads=len(shard.q_heads),
                                   num_kv_heads=len(shard.kv_heads),
                                   intermediate_size=len(shard.intermediate),
                                   vocab_size=len(shard.vocab))

    def max_kv_heads(self) -> int:
        """The most KV heads any rank holds: what sizes every rank's KV cache alike."""
        return max(len(shard.kv_heads) for shard in self.shards)


def _split_heads(num_heads: int, num_kv_heads: int, world_size: int) -> list[tuple[range, range]]:
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        return [(range(kv.start * group, kv.stop * group), kv)
                for kv in even_split(num_kv_heads, world_size)]
    split: list[tuple[range, range]] = []
    for kv_head, ranks in enumerate(even_split(world_size, num_kv_heads)):
        if len(ranks) > group:
            raise ValueError(f"{len(ranks)} ranks would share KV head {kv_head}'s {group} query "
                             f"heads: use a tensor_parallel_size of at most {num_heads} that "
                             f"{num_kv_heads} KV heads split evenly")
        for q in even_split(group, len(ranks)):
            split.append((range(kv_head * group + q.start, kv_head * group + q.stop),
                          range(kv_head, kv_head + 1)))
    return split


def intermediate_unit(weights: Mapping[str, Weight]) -> int:
    """The block size the MLP split should keep whole: the largest of the packed down projections'."""
    return max((block_geometry(w.format)[0] for name, w in weights.items()
                if name.endswith("mlp.down_proj.weight") and isinstance(w, PackedWeight)),
               default=1)


def shard_spec(name: str, arch: DecoderArch, plan: ShardPlan, rank: int) -> tuple[str, range] | None:
    """Which part of the Hugging Face-named weight `name` rank `rank` holds: ("rows", range) or
    ("columns", range); None for a weight every rank holds whole (norms)."""
    shard, head_dim = plan.shards[rank], arch.head_dim
    q_rows = range(shard.q_heads.start * head_dim, shard.q_heads.stop * head_dim)
    kv_rows = range(shard.kv_heads.start * head_dim, shard.kv_heads.stop * head_dim)
    by_suffix = {
        "self_attn.q_proj.weight": ("rows", q_rows), "self_attn.q_proj.bias": ("rows", q_rows),
        "self_attn.k_proj.weight": ("rows", kv_rows), "self_attn.k_proj.bias": ("rows", kv_rows),
        "self_attn.v_proj.weight": ("rows", kv_rows), "self_attn.v_proj.bias": ("rows", kv_rows),
        "self_attn.o_proj.weight": ("columns", q_rows),
        "mlp.gate_proj.weight": ("rows", shard.intermediate),
        "mlp.up_proj.weight": ("rows", shard.intermediate),
        "mlp.down_proj.weight": ("columns", shard.intermediate),
        "embed_tokens.weight": ("rows", shard.vocab), "lm_head.weight": ("rows", shard.vocab),
    }
    return next((spec for suffix, spec in by_suffix.items() if name.endswith(suffix)), None)


def shard_weights(weights: Mapping[str, Weight], arch: DecoderArch, plan: ShardPlan,
                  rank: int, already_sharded: Collection[str] = ()) -> dict[str, Weight]:
    """Rank `rank`'s part of a checkpoint's Hugging Face-named weights (norms whole); the weights
    named in `already_sharded` were read as this rank's part (engine/models/loader.py)."""
    local: dict[str, Weight] = {}
    for name, weight in weights.items():
        spec = None if name in already_sharded else shard_spec(name, arch, plan, rank)
        if spec is None:
            local[name] = weight
            continue
        axis, keep = spec
        local[name] = _take_rows(weight, keep) if axis == "rows" else _take_columns(name, weight,
                                                                                    keep)
    return local


def _take_rows(weight: Weight, rows: range) -> Weight:
    if isinstance(weight, PackedWeight):
        return weight.select_rows(rows)
    return weight[rows.start:rows.stop].clone()


def _take_columns(name: str, weight: Weight, columns: range) -> Weight:
    if isinstance(weight, PackedWeight):
        block_size = block_geometry(weight.format)[0]
        if columns.start % block_size == 0 and columns.stop % block_size == 0:
            return weight.select_columns(columns)
        logger.warning("%s: columns %d-%d split a %s block of %d; this rank holds its part in "
                       "float32", name, columns.start, columns.stop, weight.format, block_size)
        weight = weight.dequantize()
    return weight[:, columns.start:columns.stop].clone()
