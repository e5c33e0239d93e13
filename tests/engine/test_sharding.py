"""engine/runner/sharding.py: how heads, MLP features and the vocabulary split over ranks, and that a
rank's weights put back together are the model's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.models.arch import DecoderArch
from engine.runner.sharding import ShardPlan, even_split, intermediate_unit, shard_weights
from kernels.packed_weight import PackedWeight


def arch(num_heads: int, num_kv_heads: int, **overrides) -> DecoderArch:
    return DecoderArch(**{
        "vocab_size": 101, "hidden_size": num_heads * 8, "intermediate_size": 96, "num_layers": 1,
        "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": 8, "rms_norm_eps": 1e-6,
        "rope_inv_freq": (1.0,) * 4, "rope_attention_scaling": 1.0, "max_position_embeddings": 64,
        "tie_word_embeddings": False, "qkv_bias": True, "sliding_window": None,
        "eos_token_ids": (0,), "bos_token_id": 1, **overrides})


def test_even_split_keeps_units_whole_and_sizes_within_one_unit():
    assert even_split(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert even_split(96, 2, 32) == [range(0, 64), range(64, 96)]
    assert even_split(5, 5) == [range(i, i + 1) for i in range(5)]


def test_smollm2_heads_split_two_groups_and_one():
    plan = ShardPlan.build(arch(9, 3), 2)
    assert [(s.q_heads, s.kv_heads) for s in plan.shards] == [
        (range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    assert plan.max_kv_heads() == 2
    local = plan.local_arch(arch(9, 3), 1)
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (3, 1, 50)


def test_fewer_kv_heads_than_ranks_copies_each_kv_head_and_splits_its_queries():
    plan = ShardPlan.build(arch(8, 2), 4)
    assert [(s.q_heads, s.kv_heads) for s in plan.shards] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]
    uneven = ShardPlan.build(arch(6, 1), 4)
    assert [len(s.q_heads) for s in uneven.shards] == [2, 2, 1, 1]
    assert all(s.kv_heads == range(0, 1) for s in uneven.shards)


@pytest.mark.parametrize("num_heads, num_kv_heads, world", [(4, 2, 8), (4, 4, 5)])
def test_more_ranks_than_heads_is_refused(num_heads, num_kv_heads, world):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ShardPlan.build(arch(num_heads, num_kv_heads), world)


def test_mlp_splits_on_the_down_projections_blocks():
    assert [len(s.intermediate) for s in ShardPlan.build(arch(4, 2), 2, 32).shards] == [64, 32]
    # a unit that does not divide the features falls back to single features
    assert [len(s.intermediate) for s in ShardPlan.build(
        arch(4, 2, intermediate_size=100), 2, 32).shards] == [50, 50]


def random_weights(a: DecoderArch) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    q, kv, hidden, inner = a.q_size, a.kv_size, a.hidden_size, a.intermediate_size
    shapes = {"model.embed_tokens.weight": (a.vocab_size, hidden), "lm_head.weight": (a.vocab_size,
                                                                                       hidden),
              "model.layers.0.self_attn.q_proj.weight": (q, hidden),
              "model.layers.0.self_attn.q_proj.bias": (q,),
              "model.layers.0.self_attn.k_proj.weight": (kv, hidden),
              "model.layers.0.self_attn.k_proj.bias": (kv,),
              "model.layers.0.self_attn.v_proj.weight": (kv, hidden),
              "model.layers.0.self_attn.v_proj.bias": (kv,),
              "model.layers.0.self_attn.o_proj.weight": (hidden, q),
              "model.layers.0.mlp.gate_proj.weight": (inner, hidden),
              "model.layers.0.mlp.up_proj.weight": (inner, hidden),
              "model.layers.0.mlp.down_proj.weight": (hidden, inner),
              "model.layers.0.input_layernorm.weight": (hidden,)}
    return {name: torch.randn(shape, dtype=torch.float64) for name, shape in shapes.items()}


@pytest.mark.parametrize("heads, world", [((9, 3), 2), ((8, 2), 4), ((6, 1), 4)])
def test_the_ranks_weights_make_the_models_outputs(heads, world):
    """Column-parallel outputs stacked in rank order are the whole layer's; row-parallel partial
    products summed are the whole product; the vocabulary's rows cover it once."""
    model = arch(*heads)
    weights = random_weights(model)
    plan = ShardPlan.build(model, world)
    shards = [shard_weights(weights, model, plan, rank) for rank in range(world)]
    x = torch.randn(3, model.hidden_size, dtype=torch.float64)
    prefix = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"):
        # NOTE: with KV heads copied on several ranks, q still splits without overlap
        stacked = torch.cat([s[prefix + name] for s in shards])
        torch.testing.assert_close(stacked, weights[prefix + name], rtol=0, atol=0)
    kv_rows = {tuple(plan.shards[r].kv_heads): shards[r][prefix + "self_attn.k_proj.weight"]
               for r in range(world)}
    torch.testing.assert_close(torch.cat([kv_rows[k] for k in sorted(kv_rows)]),
                               weights[prefix + "self_attn.k_proj.weight"], rtol=0, atol=0)
    inner = torch.randn(3, model.intermediate_size, dtype=torch.float64)
    partial = sum(inner[:, plan.shards[r].intermediate.start:plan.shards[r].intermediate.stop]
                  @ shards[r][prefix + "mlp.down_proj.weight"].T for r in range(world))
    torch.testing.assert_close(partial, inner @ weights[prefix + "mlp.down_proj.weight"].T)
    attended = torch.randn(3, model.q_size, dtype=torch.float64)
    head_dim = model.head_dim
    partial = sum(attended[:, plan.shards[r].q_heads.start * head_dim:
                           plan.shards[r].q_heads.stop * head_dim]
                  @ shards[r][prefix + "self_attn.o_proj.weight"].T for r in range(world))
    torch.testing.assert_close(partial, attended @ weights[prefix + "self_attn.o_proj.weight"].T)
    torch.testing.assert_close(torch.cat([s["lm_head.weight"] for s in shards]) @ x.T,
                               weights["lm_head.weight"] @ x.T, rtol=0, atol=0)
    assert all(s[prefix + "input_layernorm.weight"] is weights[prefix + "input_layernorm.weight"]
               for s in shards)


def q8_0(rows: int, cols: int) -> PackedWeight:
    """A random Q8_0 weight: float16 scale then 32 int8 values per block."""
    rng = np.random.default_rng(3)
    blocks = rows * cols // 32
    scales = rng.uniform(-1, 1, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    quants = rng.integers(0, 256, (blocks, 32), dtype=np.uint8)
    data = np.concatenate([scales, quants], axis=1).reshape(rows, cols // 32 * 34)
    return PackedWeight("Q8_0", torch.from_numpy(data), (rows, cols))


def test_packed_columns_split_on_blocks_bit_for_bit():
    weight = q8_0(4, 128)
    part = weight.select_columns(range(32, 96))
    assert part.shape == (4, 64) and part.format == "Q8_0"
    assert torch.equal(part.dequantize(), weight.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="blocks of 32"):
        weight.select_columns(range(16, 96))


def test_a_packed_row_parallel_weight_off_the_block_grid_is_expanded_for_that_rank():
    model = dataclasses.replace(arch(4, 2), hidden_size=32, intermediate_size=96)
    weights = {"model.layers.0.mlp.down_proj.weight": q8_0(32, 96)}
    unit = intermediate_unit(weights)
    assert unit == 32
    on_grid = shard_weights(weights, model, ShardPlan.build(model, 2, unit), 1)
    assert isinstance(on_grid["model.layers.0.mlp.down_proj.weight"], PackedWeight)
    off_grid = shard_weights(weights, model, ShardPlan.build(model, 2), 1)  # 48 + 48
    expanded = off_grid["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(expanded, torch.Tensor)
    assert torch.equal(expanded, weights["model.layers.0.mlp.down_proj.weight"].dequantize()[:, 48:])


def test_a_safetensors_folder_is_read_part_by_part(tiny_llama):
    """A rank reads only its part of each weight (never the whole model); what it gets equals the
    whole weight sliced, and the checkpoint says which weights it holds in part."""
    from engine.models.loader import load_checkpoint

    whole = load_checkpoint(tiny_llama, torch.float32).weights
    parts = {"model.layers.0.self_attn.q_proj.weight": ("rows", range(16, 48)),
             "model.layers.1.mlp.down_proj.weight": ("columns", range(64, 128))}
    checkpoint = load_checkpoint(tiny_llama, torch.float32,
                                 part_of=lambda hf_config: parts.get)
    assert checkpoint.partial == frozenset(parts)
    q = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(checkpoint.weights[q], whole[q][16:48])
    assert torch.equal(checkpoint.weights[down], whole[down][:, 64:128])
    assert torch.equal(checkpoint.weights["lm_head.weight"], whole["lm_head.weight"])
