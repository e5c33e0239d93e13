"""A real (tiny) Llama checkpoint wired as a bigram model, for statistical tests that need the exact
next-token distribution at every position: its attention and MLP outputs are zero, so the logits
after token a are row a of a table, whatever came before."""

from __future__ import annotations

import math

import torch
import transformers

HIDDEN = 16


def build_bigram_checkpoint(path, logits_table: list[list[float]], num_layers: int = 1) -> str:
    """A Llama (1 layer unless told; EAGLE-3 heads read 3) whose attention and MLP add nothing to the residual stream (o_proj and
    down_proj are zero), so the logits at any position are lm_head(norm(embed(token there))): the
    one-hot embedding of a picks column a of the LM head, which holds row a of the table (scaled
    by 1/sqrt(hidden) to undo the RMS norm). The vocabulary is the table's size (at most HIDDEN)."""
    vocab = len(logits_table)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=128,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=1)
    model = transformers.LlamaForCausalLM(config)
    table = torch.tensor(logits_table)  # [vocab (previous), vocab (next)]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = table.T / math.sqrt(HIDDEN)
    model.save_pretrained(path)
    return str(path)
