"""Train a speculator for a served model on text the model itself generates (self-distillation):
an MLP speculator (default) or, with --method eagle / eagle3, an EAGLE or EAGLE-3 head
(engine/training/train_eagle.py), or with --method medusa, Medusa heads (train_medusa.py), or with
--method mtp, an MTP layer written with the target into one model folder (train_mtp.py).

MLP speculator:
1. The engine answers chat prompts greedily (engine/training/prompts.py), batched.
2. One transformers forward over each prompt + answer gives the target's final hidden states.
3. At each answer position t, stage i learns to predict token t + 2 + i from the state so far and the
   embedding of token t + 1 + i. On greedy text those tokens are exactly the target's own choices, so
   the speculator learns to guess what the target will say, which is what acceptance measures.
   The target's embedding and LM head are shared and frozen; only the stages train.

Run: specserve train-speculator --out DIR [--method eagle|eagle3|medusa|mtp] [--model PATH]
     [--num-prompts 96]
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import torch
import transformers
from tqdm.auto import tqdm

from engine.llm import LLM
from engine.models.reference_model import load_transformers_model
from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from engine.sampling_params import SamplingParams
from engine.training.arguments import add_arguments
from engine.training.optimizer_step import take_step
from engine.training.prompts import build_documents, build_prompts
from engine.training.train_eagle import check_eagle_arguments, run_eagle
from engine.training.train_medusa import check_medusa_arguments, run_medusa
from engine.training.train_mtp import run_mtp

# the methods train_eagle.py trains, and MTP, trained the same way by train_mtp.py
EAGLE_METHODS = ("eagle", "eagle3", "mtp")

logger = logging.getLogger("specserve.train")


@dataclass
class TrainingSet:
    """Aligned examples: the target's hidden state at t, tokens t+1..t+k (inputs), t+2..t+k+1."""

    hidden: torch.Tensor  # [examples, hidden]
    inputs: torch.Tensor  # [examples, k] int64
    labels: torch.Tensor  # [examples, k] int64


def load_reference(model: str | None) -> transformers.PreTrainedModel:
    """The target in transformers, float32, on the weights the engine serves."""
    return load_transformers_model(model, torch.float32)


def generate_answers(llm: LLM, prompts: list[str], max_tokens: int, num_sampled: int = 0,
                     seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt + answer token ids, prompt length): per prompt its greedy answer, then
    `num_sampled` answers sampled at temperature 0.8 (more text, still the target's own words)."""
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)]
    if num_sampled:
        params.append(SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                                     n=num_sampled, seed=seed))
    sequences = []
    for param in params:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], param,
                        use_tqdm=True)
        sequences += [(o.prompt_token_ids + c.token_ids, len(o.prompt_token_ids))
                      for o in outs for c in o.outputs]
    return sequences


def document_sequences(tokenizer, documents: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(chat prompt + document text token ids, prompt length): the text read as the answer."""
    sequences = []
    for question, answer in documents:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        sequences.append((prompt_ids + tokenizer.encode(answer, add_special_tokens=False),
                          len(prompt_ids)))
    return sequences


@torch.no_grad()
def agreeing_documents(reference: transformers.PreTrainedModel, tokenizer,
                       documents: list[tuple[str, str]], num_stages: int) -> TrainingSet:
    """Examples from text the target reads as its own answer, kept only where the next
    num_stages + 1 tokens are exactly what the target would have chosen greedily: there the text
    *is* the target's greedy continuation, as in generated answers, at the cost of a forward pass."""
    hidden, inputs, labels = [], [], []
    for token_ids, prompt_len in tqdm(document_sequences(tokenizer, documents), desc="documents",
                                      disable=None):
        ids = torch.tensor(token_ids)
        states = reference.model(ids[None]).last_hidden_state[0]  # [T, hidden]
        agrees = reference.lm_head(states).argmax(-1)[:-1] == ids[1:]  # [T - 1]: greedy = text
        window = num_stages + 1
        for t in range(prompt_len - 1, len(ids) - window - 1):
            if bool(agrees[t:t + window].all()):
                hidden.append(states[t])
                inputs.append(ids[t + 1:t + 1 + num_stages])
                labels.append(ids[t + 2:t + 2 + num_stages])
    if not hidden:
        return TrainingSet(torch.empty(0, reference.config.hidden_size),
                           torch.empty(0, num_stages, dtype=torch.int64),
                           torch.empty(0, num_stages, dtype=torch.int64))
    return TrainingSet(torch.stack(hidden), torch.stack(inputs), torch.stack(labels))


@torch.no_grad()
def build_training_set(reference: transformers.PreTrainedModel,
                       sequences: list[tuple[list[int], int]], num_stages: int) -> TrainingSet:
    hidden, inputs, labels = [], [], []
    for token_ids, prompt_len in tqdm(sequences, desc="target features", disable=None):
        ids = torch.tensor(token_ids)
        states = reference.model(ids[None]).last_hidden_state[0]  # [T, hidden], final-norm
        # t = prompt_len - 1 is the position whose hidden state produced the first answer token
        for t in range(prompt_len - 1, len(token_ids) - num_stages - 1):
            hidden.append(states[t])
            inputs.append(ids[t + 1:t + 1 + num_stages])
            labels.append(ids[t + 2:t + 2 + num_stages])
    if not hidden:
        raise ValueError("the answers are too short to train on; raise --max-tokens")
    return TrainingSet(torch.stack(hidden), torch.stack(inputs), torch.stack(labels))


def stage_logits(speculator: MLPSpeculator, embed: torch.nn.Module, head: torch.nn.Module,
                 hidden: torch.Tensor, inputs: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced logits of every stage: [batch, vocab] each."""
    state, out = hidden, []
    for stage in range(speculator.config.num_stages):
        state = speculator.stage(stage, state, embed(inputs[:, stage]))
        out.append(head(state))
    return out


@torch.no_grad()
def stage_accuracy(speculator: MLPSpeculator, embed, head, data: TrainingSet,
                   batch_size: int = 512) -> list[float]:
    """Per stage: how often its top token equals the target's next token (teacher-forced)."""
    correct = torch.zeros(speculator.config.num_stages)
    for start in range(0, len(data.hidden), batch_size):
        part = slice(start, start + batch_size)
        for stage, logits in enumerate(stage_logits(speculator, embed, head, data.hidden[part],
                                                    data.inputs[part])):
            correct[stage] += (logits.argmax(-1) == data.labels[part, stage]).sum()
    return (correct / max(1, len(data.hidden))).tolist()


def train(speculator: MLPSpeculator, embed, head, data: TrainingSet, epochs: int, batch_size: int,
          learning_rate: float, seed: int) -> None:
    optimizer = torch.optim.AdamW(speculator.parameters(), lr=learning_rate, weight_decay=0.01)
    num_steps = epochs * ((len(data.hidden) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, learning_rate, total_steps=num_steps)
    generator = torch.Generator().manual_seed(seed)
    progress = tqdm(total=num_steps, desc="training", disable=None)
    speculator.train()
    for _ in range(epochs):
        order = torch.randperm(len(data.hidden), generator=generator)
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            logits = stage_logits(speculator, embed, head, data.hidden[batch], data.inputs[batch])
            loss = sum(torch.nn.functional.cross_entropy(stage, data.labels[batch, i])
                       for i, stage in enumerate(logits)) / len(logits)
            take_step(loss, optimizer, schedule, progress)
    progress.close()
    speculator.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve train-speculator",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.num_stages < 1 or args.epochs < 1 or args.num_prompts < 1:
        raise ValueError("--num-stages, --epochs and --num-prompts must be at least 1")
    if args.batch_size is None:
        args.batch_size = 8 if args.method in EAGLE_METHODS else 128
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.method in EAGLE_METHODS:
        check_eagle_arguments(args)
    if args.method == "medusa":
        check_medusa_arguments(args)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    llm = LLM(args.model, dtype="float32", device="cpu", num_threads=args.threads,
              max_model_len=2048)
    num_sampled = args.answers_per_prompt - 1 if args.method in EAGLE_METHODS else 0
    sequences = generate_answers(llm, build_prompts(args.num_prompts, args.seed), args.max_tokens,
                                 num_sampled, args.seed)
    tokenizer = llm.tokenizer
    del llm
    reference = load_reference(args.model)
    for module in reference.parameters():
        module.requires_grad_(False)
    trained_for = (f"{args.model or 'embedded SmolLM2-135M-Instruct'}: {args.num_prompts} prompts "
                   f"x {args.max_tokens} tokens{' + documents' if args.documents else ''}, "
                   f"{args.epochs} epochs")
    if args.method in EAGLE_METHODS:
        if args.documents:
            sequences += document_sequences(tokenizer, build_documents())
        if args.method == "mtp":
            print(run_mtp(args, reference, tokenizer, sequences))
            return 0
        print(run_eagle(args, reference, tokenizer, sequences, trained_for))
        return 0
    if args.method == "medusa":
        if args.documents:
            sequences += document_sequences(tokenizer, build_documents())
        print(run_medusa(args, reference, sequences, trained_for))
        return 0
    embed, head = reference.get_input_embeddings(), reference.get_output_embeddings()
    # NOTE: held out by whole answers: positions of one answer are too alike to test on each other
    cut = max(1, len(sequences) // 10)
    train_set = build_training_set(reference, sequences[cut:], args.num_stages)
    held_out = build_training_set(reference, sequences[:cut], args.num_stages)
    if args.documents:
        extra = agreeing_documents(reference, tokenizer, build_documents(), args.num_stages)
        logger.info("documents add %d agreeing positions", len(extra.hidden))
        train_set = TrainingSet(torch.cat([train_set.hidden, extra.hidden]),
                                torch.cat([train_set.inputs, extra.inputs]),
                                torch.cat([train_set.labels, extra.labels]))
    config = MLPSpeculatorConfig(hidden_size=reference.config.hidden_size,
                                 vocab_size=reference.config.vocab_size,
                                 num_stages=args.num_stages, trained_for=trained_for)
    speculator = MLPSpeculator(config)
    train(speculator, embed, head, train_set, args.epochs, args.batch_size, args.learning_rate,
          args.seed)
    accuracy = stage_accuracy(speculator, embed, head, held_out)
    speculator.save(args.out)
    print(f"trained on {len(train_set.hidden)} positions in {time.perf_counter() - started:.0f} s; "
          f"held-out top-1 agreement per stage: {', '.join(f'{a:.2f}' for a in accuracy)}; "
          f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
