"""Train Medusa heads (engine/proposers/medusa_heads.py) for a served model, Medusa-1 style: the target
is frozen and the heads learn from its final hidden states, by self-distillation.

1. Text: the model's own greedy answers to chat prompts (train_speculator.py generates them), and
   with --documents standard-library documentation read as its answer.
2. One transformers forward per sequence (train_eagle.extract_features) gives the target's
   final-norm hidden state h_p at every position p and its greedy choice after p, labels[p].
3. Head i learns, at every position p, labels[p + 1 + i]: the token the target would choose i + 2
   places after p, given the text before it. On the model's own greedy answers that is the text
   itself, which is what a chain of accepted drafts continues. The heads' losses are weighted
   0.8^i, as the Medusa authors weight them: later heads are harder and matter less, since a
   draft is only reached when every draft before it was accepted.

By default the heads score with the target's own LM head (frozen, not saved: the heads are their
blocks alone, and drafting scores every head in one LM-head pass); --medusa-own-projections gives
each head its own, initialised from the target's as the authors do (a vocabulary-sized matrix per
head: more to train, store and read every step). Blocks start as the identity (zero weights).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from engine.proposers.medusa_heads import MedusaConfig, MedusaHeads
from engine.training.optimizer_step import take_step
from engine.training.train_eagle import FeatureStream, extract_features, hold_out_prompts

# loss weight of head i: HEAD_DECAY ** i (the Medusa authors' medusa_decay_coefficient)
HEAD_DECAY = 0.8


@dataclass
class HeadTargets:
    """What each head learns at each position: [positions, heads] token ids, and whether the label
    lies in the same sequence (and, for scoring, in its answer)."""

    labels: torch.Tensor  # [N, heads] int64
    is_valid: torch.Tensor  # [N, heads] bool
    is_answer: torch.Tensor  # [N, heads] bool


def head_targets(stream: FeatureStream, num_heads: int) -> HeadTargets:
    """Head i's label at p is labels[p + 1 + i], valid while that position is in p's sequence."""
    size = len(stream)
    offsets = torch.arange(num_heads) + 1  # [heads]
    index = torch.arange(size)[:, None] + offsets  # [N, heads]
    inside = index < size
    index = index.clamp(max=size - 1)
    is_valid = inside & (stream.doc_ids[index] == stream.doc_ids[:, None])
    return HeadTargets(stream.labels[index], is_valid, is_valid & stream.is_answer[index])


def head_losses(logits: torch.Tensor, labels: torch.Tensor, is_valid: torch.Tensor) -> torch.Tensor:
    """Per head, the mean cross-entropy over its valid positions: [heads]. logits [heads, B, vocab],
    labels and is_valid [B, heads]."""
    losses = F.cross_entropy(logits.flatten(0, 1), labels.T.flatten(), reduction="none")
    weights = is_valid.T.flatten().float()
    per_head = (losses * weights).unflatten(0, logits.shape[:2]).sum(-1)  # [heads]
    return per_head / is_valid.sum(0).clamp(min=1)


def train_heads(heads: MedusaHeads, target_lm_head: torch.nn.Module | None, stream: FeatureStream,
                targets: HeadTargets, epochs: int, batch_size: int, learning_rate: float,
                seed: int) -> None:
    num_heads = heads.config.num_heads
    weights = HEAD_DECAY ** torch.arange(num_heads, dtype=torch.float32)  # [heads]
    positions = torch.nonzero(targets.is_valid[:, 0]).squeeze(1)  # every head-0 label has a place
    optimizer = torch.optim.AdamW(heads.parameters(), lr=learning_rate, weight_decay=0.0)
    num_steps = epochs * -(-len(positions) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, learning_rate, total_steps=num_steps)
    generator = torch.Generator().manual_seed(seed)
    progress = tqdm(total=num_steps, desc="training", disable=None)
    heads.train()
    for _ in range(epochs):
        for batch in positions[torch.randperm(len(positions), generator=generator)].split(
                batch_size):
            logits = heads.logits(stream.features[batch], num_heads, target_lm_head)
            losses = head_losses(logits, targets.labels[batch], targets.is_valid[batch])
            loss = (losses * weights).sum() / weights.sum()
            take_step(loss, optimizer, schedule, progress)
    progress.close()
    heads.eval()


@torch.no_grad()
def agreement(heads: MedusaHeads, target_lm_head: torch.nn.Module | None, stream: FeatureStream,
              targets: HeadTargets, batch_size: int = 256) -> tuple[list[float], list[float]]:
    """On answer positions: per head, how often its top token is the target's choice; and per
    depth, how often heads 0..i are all right (a greedy chain's chance to reach past draft i)."""
    num_heads = heads.config.num_heads
    right = torch.zeros(len(stream), num_heads, dtype=torch.bool)
    for batch in torch.arange(len(stream)).split(batch_size):
        logits = heads.logits(stream.features[batch], num_heads, target_lm_head)
        right[batch] = (logits.argmax(-1) == targets.labels[batch].T).T
    scored = targets.is_answer
    per_head = ((right & scored).sum(0) / scored.sum(0).clamp(min=1)).tolist()
    chain_scored = scored.cumprod(1).bool()  # every label up to head i in the answer
    chained = (right.cumprod(1).bool() & chain_scored).sum(0) / chain_scored.sum(0).clamp(min=1)
    return per_head, chained.tolist()


def initial_heads(reference, num_heads: int, num_layers: int, own_projections: bool,
                  trained_for: str) -> MedusaHeads:
    """Blocks at the identity (zero weights and biases); own projections start as the target's LM
    head, as the authors start them."""
    config = MedusaConfig(hidden_size=reference.config.hidden_size,
                          vocab_size=reference.config.vocab_size, num_heads=num_heads,
                          num_layers=num_layers, has_block_bias=True,
                          vocab_projection="per_head" if own_projections else "target",
                          trained_for=trained_for)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.zero_()
                layer.bias.zero_()
        if heads.lm_heads is not None:
            for projection in heads.lm_heads:
                projection.weight.copy_(reference.get_output_embeddings().weight)
    return heads


def check_medusa_arguments(args: argparse.Namespace) -> None:
    """Before the slow part: bad numbers fail at once, naming the flag."""
    if args.medusa_layers < 0:
        raise ValueError(f"--medusa-layers must be at least 0, got {args.medusa_layers}")


def run_medusa(args: argparse.Namespace, reference, sequences: list[tuple[list[int], int]],
               trained_for: str) -> str:
    """Train and save heads from (prompt + answer token ids, prompt length) pairs; returns the
    summary line."""
    started = time.perf_counter()

    def features(part: list[tuple[list[int], int]]) -> FeatureStream:
        return extract_features(reference, [ids for ids, _ in part],
                                prompt_lens=[prompt_len for _, prompt_len in part])

    held_out_sequences, training_sequences = hold_out_prompts(sequences)
    stream, held_out = features(training_sequences), features(held_out_sequences)
    targets = head_targets(stream, args.num_stages)
    if not bool(targets.is_valid.any()):
        raise ValueError("too little text to train on: raise --num-prompts or --max-tokens")
    heads = initial_heads(reference, args.num_stages, args.medusa_layers,
                          args.medusa_own_projections, trained_for)
    target_lm_head = None if args.medusa_own_projections else reference.get_output_embeddings()
    train_heads(heads, target_lm_head, stream, targets, args.epochs, args.batch_size,
                args.learning_rate, args.seed)
    per_head, chained = agreement(heads, target_lm_head, held_out,
                                  head_targets(held_out, args.num_stages))
    heads.save(args.out)
    return (f"trained {args.num_stages} Medusa heads on {len(stream)} positions in "
            f"{time.perf_counter() - started:.0f} s; held-out top-1 agreement on answer tokens "
            f"per head: {', '.join(f'{a:.2f}' for a in per_head)} (heads 0..i all right: "
            f"{', '.join(f'{a:.2f}' for a in chained)}); saved to {args.out}")
