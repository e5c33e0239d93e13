"""Build a draft model for the embedded SmolLM2-135M from its own weights: its first and last few layers,
its final norm and its tied embedding / LM head (a layer-skip draft; no smaller SmolLM2 is installable
here). Not trained: its guesses are what those layers already know.

Run: python -m benchmarks.make_draft --first 4 --last 2 --out /tmp/smollm2-draft
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from safetensors.torch import save_file

from engine.models.loader import load_checkpoint


def make_layer_skip_draft(num_first: int, num_last: int, out_dir: str, model: str | None = None) -> str:
    """Keep the first `num_first` and the last `num_last` decoder layers of `model` (default: the
    embedded one), renumbered in order."""
    checkpoint = load_checkpoint(model, torch.float32)
    total = checkpoint.hf_config.num_hidden_layers
    if num_first < 0 or num_last < 0 or not 1 <= num_first + num_last < total:
        raise ValueError(f"keep between 1 and {total - 1} of the {total} layers")
    kept_layers = list(range(num_first)) + list(range(total - num_last, total))
    config = copy.deepcopy(checkpoint.hf_config)
    config.num_hidden_layers = len(kept_layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in kept_layers]
    renumber = {old: new for new, old in enumerate(kept_layers)}
    kept = {}
    for name, tensor in checkpoint.weights.items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index not in renumber:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{renumber[index]}.", 1)
        kept[name] = tensor.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(kept, os.path.join(out_dir, "model.safetensors"))
    config.save_pretrained(out_dir)
    checkpoint.tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=4, help="leading layers kept")
    parser.add_argument("--last", type=int, default=2, help="trailing layers kept")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(make_layer_skip_draft(args.first, args.last, args.out))


if __name__ == "__main__":
    main()
