"""`specserve train-speculator`'s flags, importable without torch or the trainers: `specserve serve`
builds the whole command line first, and must start its engine process before anything heavy loads."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder to write the speculator to")
    parser.add_argument("--method", choices=("mlp_speculator", "eagle", "eagle3", "medusa", "mtp"),
                        default="mlp_speculator",
                        help="what to train (the --speculative-config method it serves)")
    parser.add_argument("--model", default=None,
                        help="the target: HF folder or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    parser.add_argument("--num-stages", type=int, default=3, help="most draft tokens per step")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="examples per step (default: MLP 128 positions, EAGLE 8 windows)")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--documents", action="store_true",
                        help="also train on standard-library documentation read as the model's own "
                             "answer (more data, no generation cost): the MLP where the text agrees "
                             "with its greedy choices, EAGLE at every position of it, labelled by the "
                             "target")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    add_eagle_arguments(parser)
    add_medusa_arguments(parser)


def add_eagle_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("eagle")
    group.add_argument("--draft-vocab-size", type=int, default=4096,
                       help="tokens the head can propose: the target's most frequent choices")
    group.add_argument("--unroll-steps", type=int, default=3,
                       help="drafting steps trained together (training-time test)")
    group.add_argument("--window", type=int, default=128, help="positions per training window")
    group.add_argument("--feature-weight", type=float, default=1.0,
                       help="weight of the feature regression beside the distribution loss")
    group.add_argument("--answers-per-prompt", type=int, default=1,
                       help="answers generated per prompt: the first greedy, the rest sampled")
    group.add_argument("--answer-only-loss", action="store_true",
                       help="score only answer positions in the loss, as EAGLE does (default: "
                            "every position; the agreement counts answers either way)")


def add_medusa_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("medusa (--num-stages is the number of heads)")
    group.add_argument("--medusa-layers", type=int, default=1,
                       help="residual blocks per head (the Medusa authors' default: 1)")
    group.add_argument("--medusa-own-projections", action="store_true",
                       help="give each head its own vocabulary projection, started from the "
                            "target's LM head (default: every head scores with the target's, "
                            "frozen)")
