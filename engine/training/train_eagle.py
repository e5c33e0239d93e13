"""Train an EAGLE head (engine/proposers/eagle_head.py) or, with --method eagle3, an EAGLE-3 head
(engine/proposers/eagle3_head.py) for a served model by self-distillation.

1. Text: the model's own answers to chat prompts (and, with --documents, standard-library
   documentation read as its answer). Any text works, because the labels come from the target:
2. one transformers forward per sequence gives the target's final-norm feature f_p at every
   position and its distribution over the next token there;
3. the head learns, at every position at once, to map (x_p, f_{p-1}) to f_p (smooth L1) and to the
   target's next-token distribution over the draft vocabulary (soft cross-entropy), as EAGLE does.
   The agreement counts only positions whose next token is part of the answer: every prompt
   opens with the same chat template, easy to predict and never drafted, and counted it flattered
   the agreement (0.73 on prompt positions against 0.47 on answers for a SmolLM2 head). The loss
   counts the prompt too: with ~43k answer positions, scoring answers only (EAGLE's practice,
   --answer-only-loss) agreed 0.03 less on fresh prompts (docs/perf.md); the prompts are useful
   text at this scale.

Drafting 2..k feeds the head its own outputs, not the target's features. Training unrolls that too
("training-time test", EAGLE-3): step s reads the head's step s-1 output at the previous position,
and attends to step-1 keys of the earlier positions and to its own chain, exactly the cache the
head sees while drafting. The decoder layer is the engine's own, so training and serving share
every line of the forward.

EAGLE-3 differs in its input and its loss: step 1 reads the target's residual streams entering three
layers (2, L // 2, L - 3), fused by the head's fc, and the head is trained on the distribution loss
alone, scored by its own LM head over the draft vocabulary (no feature regression: its state is free
to be whatever predicts the next tokens best). It is saved in vLLM's speculators layout.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from engine.models.arch import DecoderArch
from engine.models.attention import AttentionMetadata
from engine.models.llama import Attention
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head, default_feature_layers
from engine.proposers.eagle_head import EagleConfig, EagleHead
from engine.training.optimizer_step import take_step

logger = logging.getLogger("specserve.train")


@dataclass
class FeatureStream:
    """Sequences laid end to end, position by position."""

    token_ids: torch.Tensor  # [N] int64
    features: torch.Tensor  # [N, hidden] float32: the target's final-norm hidden state
    labels: torch.Tensor  # [N] int64: the target's greedy choice for the next token
    doc_ids: torch.Tensor  # [N] int64: which sequence each position belongs to
    # [N] bool: the label is an answer token (p >= prompt length - 1); only these are scored
    is_answer: torch.Tensor
    # [N, 3 * hidden] float32 for EAGLE-3: the residual streams entering its three target layers
    aux: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def previous_inputs(self) -> torch.Tensor:
        """What the head reads at each position from the one before (EAGLE: f_{p-1}; EAGLE-3: the
        three streams at p - 1); zero at the first position of a sequence."""
        values = self.features if self.aux is None else self.aux
        shifted = torch.cat([torch.zeros_like(values[:1]), values[:-1]])
        starts = torch.ones(len(self), dtype=torch.bool)
        starts[1:] = self.doc_ids[1:] != self.doc_ids[:-1]
        shifted[starts] = 0
        return shifted


@torch.no_grad()
def extract_features(reference, sequences: list[list[int]], max_len: int = 1024,
                     aux_layers: tuple[int, ...] = (),
                     prompt_lens: list[int] | None = None) -> FeatureStream:
    """One target forward per sequence; a longer one is read in pieces of max_len tokens. With
    `aux_layers` (EAGLE-3), also the residual streams entering those layers (HF's
    hidden_states[i]). `prompt_lens[i]` tokens of sequence i are prompt; without them every
    position counts as answer."""
    if prompt_lens is None:
        prompt_lens = [0] * len(sequences)
    if len(prompt_lens) != len(sequences):
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(sequences)} sequences")
    pieces = [(ids[start:start + max_len], start, prompt_len)
              for ids, prompt_len in zip(sequences, prompt_lens)
              for start in range(0, len(ids), max_len)]
    tokens, features, labels, doc_ids, is_answer, aux = [], [], [], [], [], []
    for doc, (token_ids, start, prompt_len) in enumerate(tqdm(pieces, desc="target features",
                                                              disable=None)):
        ids = torch.tensor(token_ids)
        # NOTE: positions counted in the whole sequence, not the piece: label p is token p + 1
        is_answer.append(torch.arange(start, start + len(ids)) >= prompt_len - 1)
        out = reference.model(ids[None], output_hidden_states=bool(aux_layers))
        states = out.last_hidden_state[0].float()  # [T, hidden]
        tokens.append(ids)
        features.append(states)
        labels.append(reference.lm_head(states).argmax(-1))
        doc_ids.append(torch.full((len(ids),), doc, dtype=torch.int64))
        if aux_layers:
            aux.append(torch.cat([out.hidden_states[i][0].float() for i in aux_layers], dim=-1))
    return FeatureStream(torch.cat(tokens), torch.cat(features), torch.cat(labels),
                         torch.cat(doc_ids), torch.cat(is_answer), torch.cat(aux) if aux else None)


def choose_draft_vocab(labels: torch.Tensor, size: int, always: tuple[int, ...],
                       vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` tokens the target chooses most often (plus `always`, e.g. EOS), and the share of
    the target's choices in `labels` they cover."""
    counts = torch.bincount(labels, minlength=vocab_size).float()
    counts[list(always)] = float("inf")
    ids = counts.argsort(descending=True)[:min(size, vocab_size)].sort().values
    covered = torch.isin(labels, ids).float().mean().item()
    return ids, covered


class UnrolledChain:
    """Attention layouts for training-time test over a batch of windows of `window` positions.

    The cache has one block of `window` slots per (window, step): step t's keys for position j sit
    in block t-1 at offset j. Step s at position i attends to step-1 keys at j <= i - s + 1 (true
    features), and to step t's key at i - s + t for t = 2..s (its own drafted chain).
    """

    def __init__(self, batch: int, window: int, num_steps: int, doc_ids: torch.Tensor) -> None:
        self.batch, self.window, self.num_steps = batch, window, num_steps
        self.doc_ids = doc_ids  # [batch, window]
        self.tables = torch.arange(batch * num_steps).view(batch, num_steps)

    def metadata(self, step: int) -> AttentionMetadata:
        batch, window = self.batch, self.window
        slots = (self.tables[:, step - 1:step] * window + torch.arange(window)).reshape(-1)
        query = torch.arange(window)[:, None]  # [W, 1]
        key = torch.arange(window)[None, :]  # [1, W]
        regions = [key <= query - step + 1]
        regions += [key == query - step + t for t in range(2, step + 1)]
        mask = torch.cat(regions, dim=1)[None].expand(batch, -1, -1)  # [B, W, step*W]
        # NOTE: every query keeps its own key (the last region's diagonal), so no row is empty
        same_doc = self.doc_ids[:, :, None] == self.doc_ids.repeat(1, step)[:, None, :]
        mask = mask & same_doc
        return AttentionMetadata(num_seqs=batch, max_query_len=window, kv_len=step * window,
                                 slot_mapping=slots, block_gather_index=self.tables,
                                 query_pad_index=None, attn_mask=mask[:, None], is_causal=False)

    def valid(self, step: int) -> torch.Tensor:
        """[batch, window] bool: positions whose chain of `step` lies inside one document."""
        ok = torch.zeros(self.batch, self.window, dtype=torch.bool)
        first = step - 1
        ok[:, first:] = self.doc_ids[:, first:] == self.doc_ids[:, :self.window - first]
        return ok


def unrolled_hidden(head: EagleHead | Eagle3Head, embeds: torch.Tensor, features: torch.Tensor,
                    chain: UnrolledChain) -> list[torch.Tensor]:
    """The head's output at every position for steps 1..num_steps: [batch * window, hidden] each.
    embeds: x_p's embeddings; features: f_{p-1} for step 1 (true features), flattened."""
    attention = next(m for m in head.modules() if isinstance(m, Attention))  # the head's one
    kv_cache = features.new_zeros(2, attention.num_kv_heads, chain.batch * chain.num_steps,
                                  chain.window, attention.head_dim)
    positions = torch.arange(chain.window, device=features.device).repeat(chain.batch)
    outputs = []
    for step in range(1, chain.num_steps + 1):
        hidden = head(embeds, features, positions, chain.metadata(step), [kv_cache])
        outputs.append(hidden)
        # the next step reads this step's output at the previous position
        features = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
    return outputs


@dataclass
class WindowBatch:
    """The windows of the feature stream at `starts`, flattened to [B * W] rows: what an unrolled
    head's losses read (EAGLE's, EAGLE-3's, an MTP layer's)."""

    chain: UnrolledChain
    is_answer: torch.Tensor  # [B * W] bool
    # the token at each position, embedded: [B * W, hidden]
    embeds: torch.Tensor
    # the target's feature at each position, and its distribution over the draft vocabulary
    target_features: torch.Tensor
    target_probs: torch.Tensor
    labels: torch.Tensor  # [B * W] the target's greedy next token
    # each position's previous input (the target's feature before it), with training noise
    previous: torch.Tensor

    @classmethod
    def of(cls, stream: FeatureStream, embed: nn.Module, draft_head: torch.Tensor,
           previous: torch.Tensor, starts: torch.Tensor, window: int, num_steps: int,
           noise: float) -> WindowBatch:
        index = starts[:, None] + torch.arange(window)  # [B, W]
        rows = len(starts) * window
        chain = UnrolledChain(len(starts), window, num_steps, stream.doc_ids[index])
        embeds = embed(stream.token_ids[index]).reshape(rows, -1)
        target_features = stream.features[index].reshape(rows, -1)
        with torch.no_grad():
            target_probs = (target_features @ draft_head.T).softmax(-1)
        inputs = previous[index].reshape(rows, -1)
        if noise:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * noise
        return cls(chain, stream.is_answer[index].reshape(-1), embeds, target_features,
                   target_probs, stream.labels[index].reshape(-1), inputs)


@dataclass
class StepScore:
    """One drafting step over a batch of windows: losses over its trained positions (chains
    inside one sequence, UnrolledChain.valid; answers only with answer_only_loss), agreement over
    its counted ones (those whose label is an answer token)."""

    feature_loss: torch.Tensor  # scalar: smooth L1 to the target's features (0 for EAGLE-3)
    token_loss: torch.Tensor  # scalar: soft cross-entropy against the target's distribution
    num_correct: int  # counted positions whose top draft token is the target's greedy token
    num_counted: int

    @property
    def agreement(self) -> float:
        return self.num_correct / max(1, self.num_counted)


def unrolled_losses(head: EagleHead | Eagle3Head, embed: torch.nn.Module, draft_head: torch.Tensor,
                    stream: FeatureStream, previous: torch.Tensor, starts: torch.Tensor,
                    window: int, num_steps: int, noise: float,
                    answer_only_loss: bool = False) -> list[StepScore]:
    """Per step: feature loss and distribution loss over the trained positions, top-1 agreement
    with the target's greedy token over the answer positions, of the windows at `starts`."""
    windows = WindowBatch.of(stream, embed, draft_head, previous, starts, window, num_steps, noise)
    chain, is_answer, labels = windows.chain, windows.is_answer, windows.labels
    target_features, target_probs = windows.target_features, windows.target_probs
    embeds, features = windows.embeds, windows.previous
    is_eagle3 = isinstance(head, Eagle3Head)
    if is_eagle3:
        features = head.fc(features)
    scores = []
    for step, hidden in enumerate(unrolled_hidden(head, embeds, features, chain), start=1):
        valid = chain.valid(step).reshape(-1)  # [B * W]
        trained = valid & is_answer if answer_only_loss else valid
        counted = (valid & is_answer)[trained]  # [num trained]: which of them the metric counts
        # NOTE: sums over max(1, n), not means: a batch may hold no trained position at all
        denominator = max(1, int(trained.sum()))
        if is_eagle3:
            logits = head.draft_logits(hidden[trained])
            feature_loss = hidden.new_zeros(())
        else:
            logits = hidden[trained] @ draft_head.T
            feature_loss = F.smooth_l1_loss(hidden[trained], target_features[trained],
                                            reduction="sum") / (denominator * hidden.shape[-1])
        token_loss = torch.sum(-target_probs[trained] * logits.log_softmax(-1)) / denominator
        guess = head.draft_token_ids[logits.argmax(-1)]
        correct = (guess == labels[trained]) & counted
        scores.append(StepScore(feature_loss, token_loss, int(correct.sum()), int(counted.sum())))
    return scores


def window_starts(stream: FeatureStream, window: int, generator: torch.Generator) -> torch.Tensor:
    """Every window of the stream once, in random order, from a random offset."""
    offset = int(torch.randint(window, (1,), generator=generator))
    starts = torch.arange(offset, len(stream) - window + 1, window)
    return starts[torch.randperm(len(starts), generator=generator)]


# (window starts of a batch, every position's previous input, the noise scale) -> (the batch's
# loss, its per-step top-1 agreement in words)
WindowLosses = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, str]]


def fit_on_windows(module: nn.Module, stream: FeatureStream, epochs: int, batch_size: int,
                   window: int, learning_rate: float, seed: int, losses: WindowLosses) -> None:
    """The training loop of every head that learns over windows of the feature stream (EAGLE,
    EAGLE-3, an MTP layer): every window once per epoch in random order, AdamW under a one-cycle
    schedule, gradients clipped at 1; noise on the previous inputs at a tenth of their scale."""
    generator = torch.Generator().manual_seed(seed)
    previous = stream.previous_inputs()
    noise = 0.1 * previous.pow(2).mean().sqrt().item()
    optimizer = torch.optim.AdamW(module.parameters(), lr=learning_rate, weight_decay=0.0)
    batches_per_epoch = max(1, (len(stream) // window) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, learning_rate,
                                                   total_steps=epochs * batches_per_epoch,
                                                   pct_start=0.1)
    progress = tqdm(total=epochs * batches_per_epoch, desc="training", disable=None)
    module.train()
    for _ in range(epochs):
        starts = window_starts(stream, window, generator)
        for batch in range(batches_per_epoch):
            loss, agreement = losses(starts[batch * batch_size:(batch + 1) * batch_size],
                                     previous, noise)
            take_step(loss, optimizer, schedule, progress, clip=module.parameters(),
                      top1=agreement)
    progress.close()
    module.eval()


def train_head(head: EagleHead | Eagle3Head, embed, draft_head: torch.Tensor, stream: FeatureStream,
               epochs: int, batch_size: int, window: int, num_steps: int, learning_rate: float,
               feature_weight: float, seed: int, answer_only_loss: bool = False) -> None:
    def losses(starts: torch.Tensor, previous: torch.Tensor, noise: float
               ) -> tuple[torch.Tensor, str]:
        scores = unrolled_losses(head, embed, draft_head, stream, previous, starts, window,
                                 num_steps, noise, answer_only_loss)
        return (sum(feature_weight * s.feature_loss + s.token_loss for s in scores),
                "/".join(f"{s.agreement:.2f}" for s in scores))

    fit_on_windows(head, stream, epochs, batch_size, window, learning_rate, seed, losses)


@torch.no_grad()
def chain_accuracy(head: EagleHead | Eagle3Head, embed, draft_head: torch.Tensor, stream: FeatureStream,
                   window: int, num_steps: int) -> list[float]:
    """Per drafting step: how often the head's top token is the target's greedy token at answer
    positions, when the steps before it guessed right (teacher-forced tokens, the head's own
    features)."""
    previous = stream.previous_inputs()
    starts = torch.arange(0, len(stream) - window + 1, window)
    num_correct, num_counted = [0] * num_steps, [0] * num_steps
    for chunk in starts.split(16):
        scores = unrolled_losses(head, embed, draft_head, stream, previous, chunk, window,
                                 num_steps, 0.0)
        for step, score in enumerate(scores):
            num_correct[step] += score.num_correct
            num_counted[step] += score.num_counted
    return [c / max(1, n) for c, n in zip(num_correct, num_counted)]


def hold_out_prompts(sequences: list[tuple[list[int], int]],
                     ) -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    """(held out, training): every answer to the first tenth of the distinct prompts is held out.
    NOTE: by prompt, not by sequence: a prompt's sampled answers are near copies of its greedy
    one, so holding out only some of them tests the head on text it trained on."""
    keys = [tuple(ids[:prompt_len]) for ids, prompt_len in sequences]
    distinct = list(dict.fromkeys(keys))
    if len(distinct) < 2:  # one prompt (or none marked): whole sequences are all there is
        keys, distinct = list(range(len(sequences))), list(range(len(sequences)))
    held = set(distinct[:max(1, len(distinct) // 10)])
    return ([seq for seq, key in zip(sequences, keys) if key in held],
            [seq for seq, key in zip(sequences, keys) if key not in held])


def check_eagle_arguments(args: argparse.Namespace) -> None:
    """Before the slow part: bad numbers fail at once, naming the flag."""
    for flag, value, least in (("--draft-vocab-size", args.draft_vocab_size, 1),
                               ("--unroll-steps", args.unroll_steps, 1),
                               ("--window", args.window, 8),
                               ("--answers-per-prompt", args.answers_per_prompt, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if args.unroll_steps >= args.window:
        raise ValueError(f"--unroll-steps ({args.unroll_steps}) must be below --window "
                         f"({args.window})")


def run_eagle(args: argparse.Namespace, reference, tokenizer,
              sequences: list[tuple[list[int], int]], trained_for: str) -> str:
    """Train and save a head from (prompt + answer token ids, prompt length) pairs; returns the
    summary line."""
    started = time.perf_counter()
    arch = DecoderArch.from_hf_config(reference.config)
    aux_layers = default_feature_layers(arch.num_layers) if args.method == "eagle3" else ()

    def features(part: list[tuple[list[int], int]]) -> FeatureStream:
        return extract_features(reference, [ids for ids, _ in part], aux_layers=aux_layers,
                                prompt_lens=[prompt_len for _, prompt_len in part])

    held_out_sequences, training_sequences = hold_out_prompts(sequences)
    held_out = features(held_out_sequences)
    stream = features(training_sequences)
    num_answer = int(stream.is_answer.sum())
    if len(stream) < args.window * 2 or len(held_out) < args.window or num_answer == 0:
        raise ValueError("too little text to train on: raise --num-prompts or --max-tokens")
    # the draft vocabulary serves answers: chosen, and its coverage measured, on answer labels
    draft_ids, coverage = choose_draft_vocab(stream.labels[stream.is_answer],
                                             args.draft_vocab_size, arch.eos_token_ids,
                                             arch.vocab_size)
    if aux_layers:
        config3 = Eagle3Config.for_target(arch, len(draft_ids), aux_layers)
        head = Eagle3Head(config3, config3.layer_arch(arch), has_embeddings=False)
    else:
        head = EagleHead(EagleConfig.for_target(arch, len(draft_ids), trained_for=trained_for),
                         arch)
    head.draft_token_ids.copy_(draft_ids)
    embed = reference.get_input_embeddings()
    # the teacher: the target's LM-head rows of the draft vocabulary
    draft_head = reference.get_output_embeddings().weight.detach()[draft_ids]
    if aux_layers:
        # NOTE: EAGLE-3's own LM head starts as the target's rows: its state starts near the
        # target's final feature, so the first epochs refine rather than discover the mapping
        with torch.no_grad():
            head.lm_head.weight.copy_(draft_head)
    logger.info("%d training positions, %d of them answer tokens; the draft vocabulary of %d "
                "covers %.1f%% of the target's choices there", len(stream), num_answer,
                len(draft_ids), 100 * coverage)
    train_head(head, embed, draft_head, stream, args.epochs, args.batch_size, args.window,
               args.unroll_steps, args.learning_rate, args.feature_weight, args.seed,
               args.answer_only_loss)
    accuracy = chain_accuracy(head, embed, draft_head, held_out, args.window, args.unroll_steps)
    if aux_layers:
        head.save(args.out, trained_for)
    else:
        head.save(args.out)
    name = "an EAGLE-3" if aux_layers else "an EAGLE"
    return (f"trained {name} head on {len(stream)} positions ({num_answer} of them answer tokens) "
            f"in {time.perf_counter() - started:.0f} s (draft vocabulary covers "
            f"{100 * coverage:.1f}% of the target's answer choices); held-out top-1 agreement on "
            f"answer tokens per drafting step: {', '.join(f'{a:.2f}' for a in accuracy)}; "
            f"saved to {args.out}")
