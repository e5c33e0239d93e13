"""Train one MTP layer (DeepSeek-V3's layout, engine/proposers/mtp_head.py) on a frozen target by
self-distillation, and write the target and the layer as one Hugging Face folder that
`specserve serve --model DIR --speculative-config '{"method": "mtp", ...}'` speculates with.

The text, the target's features and the unrolled layout are EAGLE's (train_eagle.py): at every
position the layer maps (x_p, f_{p-1}) to a state whose shared_head.norm matches the target's
final-norm feature f_p (smooth L1), and whose LM-head distribution matches the target's (soft
cross-entropy). Drafting past the first token feeds the layer its own state, so training unrolls
that too (training-time test). Two shortcuts of training only: the distribution loss is taken over
the draft vocabulary (the target's most frequent choices; SmolLM2's whole 49,152-token head would
cost ~12x as much per position), while serving scores the whole vocabulary, which the feature loss
keeps in line; and the layer starts as a copy of the target's last decoder layer, with
shared_head.norm the target's final norm, so it starts out speaking the target's features.

The folder: config.json (the target's, plus num_nextn_predict_layers = 1), the tokenizer's files,
and model.safetensors with the target's weights (as the engine reads them; a GGUF's expanded to
float32) and the layer's under model.layers.{num_hidden_layers}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.models.arch import DecoderArch
from engine.models.loader import load_checkpoint
from engine.proposers.mtp_head import CONFIG_KEY, DEEPSEEK, MtpLayer, mtp_layer_tensors
from engine.training.train_eagle import (
    FeatureStream,
    StepScore,
    UnrolledChain,
    WindowBatch,
    choose_draft_vocab,
    extract_features,
    fit_on_windows,
    hold_out_prompts,
    unrolled_hidden,
)

logger = logging.getLogger("specserve.train")


def new_mtp_layer(reference, arch: DecoderArch) -> MtpLayer:
    """A DeepSeek-layout layer started from the target: its last decoder layer, its final norm
    before the LM head, unit input norms, a random projection."""
    layer = MtpLayer(arch, DEEPSEEK)
    last = reference.model.layers[-1]
    attention, mlp = last.self_attn, last.mlp
    with torch.no_grad():
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
        layer.layer.self_attn.qkv_proj.weight.copy_(torch.cat([p.weight for p in qkv]))
        if layer.layer.self_attn.qkv_proj.bias is not None:
            layer.layer.self_attn.qkv_proj.bias.copy_(torch.cat([p.bias for p in qkv]))
        layer.layer.self_attn.o_proj.weight.copy_(attention.o_proj.weight)
        layer.layer.mlp.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight,
                                                             mlp.up_proj.weight]))
        layer.layer.mlp.down_proj.weight.copy_(mlp.down_proj.weight)
        layer.layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        layer.head_norm.weight.copy_(reference.model.norm.weight)
    return layer


def mtp_losses(layer: MtpLayer, embed: torch.nn.Module, draft_head: torch.Tensor,
               draft_ids: torch.Tensor, stream: FeatureStream, previous: torch.Tensor,
               starts: torch.Tensor, window: int, num_steps: int, noise: float) -> list[StepScore]:
    """Per unrolled step, over the windows at `starts`: both losses at every position whose chain
    lies in one sequence, the agreement at answer positions (draft vocabulary)."""
    windows = WindowBatch.of(stream, embed, draft_head, previous, starts, window, num_steps, noise)
    chain, is_answer, labels = windows.chain, windows.is_answer, windows.labels
    target_features, target_probs = windows.target_features, windows.target_probs
    scores = []
    for step, hidden in enumerate(unrolled_hidden(layer, windows.embeds, windows.previous, chain),
                                  start=1):
        trained = chain.valid(step).reshape(-1)  # [B * W]
        denominator = max(1, int(trained.sum()))
        normed = layer.head_input(hidden[trained])  # what the LM head reads
        feature_loss = F.smooth_l1_loss(normed, target_features[trained], reduction="sum") \
            / (denominator * normed.shape[-1])
        logits = normed @ draft_head.T
        token_loss = torch.sum(-target_probs[trained] * logits.log_softmax(-1)) / denominator
        counted = is_answer[trained]
        correct = (draft_ids[logits.argmax(-1)] == labels[trained]) & counted
        scores.append(StepScore(feature_loss, token_loss, int(correct.sum()), int(counted.sum())))
    return scores


def train_layer(layer: MtpLayer, embed, draft_head: torch.Tensor, draft_ids: torch.Tensor,
                stream: FeatureStream, epochs: int, batch_size: int, window: int, num_steps: int,
                learning_rate: float, feature_weight: float, seed: int) -> None:
    def losses(starts: torch.Tensor, previous: torch.Tensor, noise: float
               ) -> tuple[torch.Tensor, str]:
        scores = mtp_losses(layer, embed, draft_head, draft_ids, stream, previous, starts, window,
                            num_steps, noise)
        return (sum(feature_weight * s.feature_loss + s.token_loss for s in scores),
                "/".join(f"{s.agreement:.2f}" for s in scores))

    fit_on_windows(layer, stream, epochs, batch_size, window, learning_rate, seed, losses)


@torch.no_grad()
def whole_vocab_accuracy(layer: MtpLayer, embed, lm_head: torch.Tensor, stream: FeatureStream,
                         window: int, num_steps: int) -> list[float]:
    """Per drafting step: how often the layer's top token over the WHOLE vocabulary (as served)
    is the target's greedy token at answer positions, the steps before it teacher-forced."""
    previous = stream.previous_inputs()
    num_correct, num_counted = [0] * num_steps, [0] * num_steps
    for chunk in torch.arange(0, len(stream) - window + 1, window).split(16):
        index = chunk[:, None] + torch.arange(window)
        chain = UnrolledChain(len(chunk), window, num_steps, stream.doc_ids[index])
        embeds = embed(stream.token_ids[index]).reshape(-1, lm_head.shape[1])
        states = previous[index].reshape(-1, lm_head.shape[1])
        is_answer, labels = stream.is_answer[index].reshape(-1), stream.labels[index].reshape(-1)
        for step, hidden in enumerate(unrolled_hidden(layer, embeds, states, chain)):
            counted = chain.valid(step + 1).reshape(-1) & is_answer
            guess = (layer.head_input(hidden[counted]) @ lm_head.T).argmax(-1)
            num_correct[step] += int((guess == labels[counted]).sum())
            num_counted[step] += int(counted.sum())
    return [c / max(1, n) for c, n in zip(num_correct, num_counted)]


def write_model_folder(out: str, model: str | None, layer: MtpLayer, tokenizer) -> None:
    """The target (config, tokenizer, weights as the engine reads them) plus the MTP layer."""
    os.makedirs(out, exist_ok=True)
    checkpoint = load_checkpoint(model, torch.float32)
    config = checkpoint.hf_config
    num_layers = int(config.num_hidden_layers)
    tensors = {name: weight.contiguous() for name, weight in checkpoint.weights.items()
               if isinstance(weight, torch.Tensor)}
    if len(tensors) != len(checkpoint.weights):
        raise ValueError(f"{model}: some weights did not expand to float32 tensors")
    tensors |= mtp_layer_tensors(layer, DEEPSEEK.prefix(num_layers, 0))
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        data = json.load(f)
    data.pop("quantization_config", None)  # NOTE: a GGUF's; the folder holds plain floats
    with open(path, "w") as f:
        json.dump({**data, CONFIG_KEY: 1}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def run_mtp(args: argparse.Namespace, reference, tokenizer,
            sequences: list[tuple[list[int], int]]) -> str:
    """Train and save from (prompt + answer token ids, prompt length) pairs; returns the summary."""
    started = time.perf_counter()
    arch = DecoderArch.from_hf_config(reference.config)
    held_out_sequences, training_sequences = hold_out_prompts(sequences)

    def features(part: list[tuple[list[int], int]]) -> FeatureStream:
        return extract_features(reference, [ids for ids, _ in part],
                                prompt_lens=[prompt_len for _, prompt_len in part])

    held_out, stream = features(held_out_sequences), features(training_sequences)
    num_answer = int(stream.is_answer.sum())
    if len(stream) < args.window * 2 or len(held_out) < args.window or num_answer == 0:
        raise ValueError("too little text to train on: raise --num-prompts or --max-tokens")
    draft_ids, coverage = choose_draft_vocab(stream.labels[stream.is_answer],
                                             args.draft_vocab_size, arch.eos_token_ids,
                                             arch.vocab_size)
    lm_head = reference.get_output_embeddings().weight.detach()
    layer = new_mtp_layer(reference, arch)
    embed = reference.get_input_embeddings()
    logger.info("%d training positions, %d of them answer tokens; the draft vocabulary of %d "
                "covers %.1f%% of the target's choices there", len(stream), num_answer,
                len(draft_ids), 100 * coverage)
    before = whole_vocab_accuracy(layer, embed, lm_head, held_out, args.window, args.unroll_steps)
    train_layer(layer, embed, lm_head[draft_ids], draft_ids, stream, args.epochs, args.batch_size,
                args.window, args.unroll_steps, args.learning_rate, args.feature_weight,
                args.seed)
    after = whole_vocab_accuracy(layer, embed, lm_head, held_out, args.window, args.unroll_steps)
    write_model_folder(args.out, args.model, layer, tokenizer)
    return (f"trained an MTP layer on {len(stream)} positions ({num_answer} of them answer tokens) "
            f"in {time.perf_counter() - started:.0f} s; held-out top-1 agreement with the "
            f"target on answer tokens per drafting step, whole vocabulary: "
            f"{', '.join(f'{a:.2f}' for a in after)} (untrained: "
            f"{', '.join(f'{a:.2f}' for a in before)}); wrote the target with it to {args.out}")
