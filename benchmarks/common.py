"""What every benchmark shares: the model/device flags, the transformers baseline on the same weights,
timing that waits for the GPU, and a line naming the hardware."""

from __future__ import annotations

import argparse
import platform
import time

import torch
import transformers

from engine.models.reference_model import load_transformers_model


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keywords for the flags above."""
    return {"dtype": args.dtype, "device": args.device, "max_model_len": 4096,
            "num_threads": args.threads if args.device == "cpu" else None}


def load_reference(args: argparse.Namespace) -> transformers.PreTrainedModel:
    """transformers on exactly the weights the engine serves, in the same dtype, on the same device."""
    model = load_transformers_model(args.model, getattr(torch, args.dtype))
    return model.to(args.device).eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_transformers(model, prompt: list[int], max_tokens: int,
                      lookup: int | None = None) -> tuple[float, list[int]]:
    """Seconds for a greedy generate of exactly max_tokens (prompt lookup with `lookup` drafts)."""
    extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
    synchronize(str(model.device))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **extra)
    synchronize(str(model.device))
    return time.perf_counter() - start, out[0, len(prompt):].tolist()


def hardware_name(args: argparse.Namespace) -> str:
    if args.device.startswith("cuda"):
        return f"GPU: {torch.cuda.get_device_name()}"
    return f"CPU: {cpu_name()}, {args.threads} threads"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
