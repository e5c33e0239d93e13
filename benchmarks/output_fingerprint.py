"""Every token a fixed matrix of proposers and sampling parameters produces on the embedded model, to
prove a refactor changed no output: run it before the change (--out before.json), then after
(--compare before.json), and every greedy and seeded request must give the same tokens, the same
speculation counts, and the same drafts: a digest of every proposal's tokens and q, bit for bit
(random heads' drafts are rarely accepted, so a drafter that drafts differently shows there even
where the text cannot change).

The matrix: no speculation, n-gram, suffix, the embedded model drafting for itself (a draft model
sampling every parameter below), and EAGLE, EAGLE-3 (chains and trees) and an MLP speculator with
random heads made here from a fixed seed; each over three chat prompts with greedy decoding and
four seeded sampling settings (temperature, top-k, top-p, min-p, penalties, logit bias, min_tokens).

Run: SPECSERVE_CACHE_DIR=... python -m benchmarks.output_fingerprint --out before.json
     python -m benchmarks.output_fingerprint --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile

import torch

from engine import LLM, SamplingParams
from engine.models.loader import embedded_gguf_path
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head, default_feature_layers
from engine.proposers.eagle_head import EagleConfig, EagleHead
from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

PROMPTS = ["Count from 1 to 30, separated by commas.",
           "Write a short poem about the sea.",
           "Explain in two sentences what a hash map is."]
MAX_TOKENS = 32
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    "seeded top-k, penalties": {"temperature": 1.0, "top_k": 20, "presence_penalty": 0.5,
                                "repetition_penalty": 1.1, "seed": 11},
    "seeded min-p, frequency": {"temperature": 0.9, "min_p": 0.05, "frequency_penalty": 0.3,
                                "seed": 13},
    "seeded bias, min_tokens": {"temperature": 0.7, "logit_bias": {11: 2.0, 28: -1.5},
                                "min_tokens": 20, "seed": 17},
}


def random_heads(llm: LLM, folder: str) -> dict[str, str]:
    """EAGLE, EAGLE-3 and MLP speculator heads for the embedded model, random from seed 0."""
    arch = llm.engine.worker.model.arch
    torch.manual_seed(0)
    folders = {name: f"{folder}/{name}" for name in ("eagle", "eagle3", "mlp_speculator")}
    head = EagleHead(EagleConfig.for_target(arch, arch.vocab_size), arch)
    head.draft_token_ids.copy_(torch.arange(arch.vocab_size))
    head.save(folders["eagle"])
    config = Eagle3Config.for_target(arch, arch.vocab_size, default_feature_layers(arch.num_layers))
    head3 = Eagle3Head(config, config.layer_arch(arch), has_embeddings=False)
    head3.draft_token_ids.copy_(torch.arange(arch.vocab_size))
    head3.save(folders["eagle3"], "output_fingerprint")
    MLPSpeculator(MLPSpeculatorConfig(arch.hidden_size, arch.vocab_size, 3)).save(
        folders["mlp_speculator"])
    return folders


def methods(heads: dict[str, str]) -> dict[str, dict | None]:
    return {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "draft_model": {"method": "draft_model", "model": embedded_gguf_path(),
                        "num_speculative_tokens": 3},
        "eagle": {"method": "eagle", "model": heads["eagle"], "num_speculative_tokens": 3},
        "eagle_tree": {"method": "eagle", "model": heads["eagle"], "num_speculative_tokens": 6,
                       "draft_tree": True},
        "eagle3": {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 3},
        "mlp_speculator": {"method": "mlp_speculator", "model": heads["mlp_speculator"],
                           "num_speculative_tokens": 3},
    }


def recording_drafts(llm: LLM, digest) -> None:
    """Every proposal of the engine's proposer goes into `digest`: its tokens, parents and q."""
    proposer = llm.engine.proposer
    if proposer is None:
        return
    propose = proposer.propose

    def recorded(*args, **kwargs):
        proposals = propose(*args, **kwargs)
        for proposal in proposals:
            digest.update(json.dumps([proposal.token_ids, proposal.parents]).encode())
            if proposal.probs is not None:
                digest.update(proposal.probs.float().contiguous().numpy().tobytes())
        return proposals

    proposer.propose = recorded


def fingerprint() -> dict[str, dict]:
    result: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as folder:
        plain = LLM(None, num_threads=2)
        prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        heads = random_heads(plain, folder)
        plain.close()
        for method, config in methods(heads).items():
            llm = LLM(None, num_threads=2, speculative_config=config)
            for name, params in SAMPLING.items():
                digest = hashlib.sha256()
                recording_drafts(llm, digest)
                outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, **params))
                if llm.engine.proposer is not None:
                    del llm.engine.proposer.propose  # NOTE: the class's own again
                result[f"{method} / {name}"] = {
                    "tokens": [o.outputs[0].token_ids for o in outs],
                    "spec": [None if o.spec_stats is None else
                             [o.spec_stats.num_draft_tokens, o.spec_stats.num_accepted_draft_tokens]
                             for o in outs],
                    "drafts": digest.hexdigest()}
                print(f"{method} / {name}: {[len(o.outputs[0].token_ids) for o in outs]} tokens",
                      flush=True)
            llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the fingerprint here")
    parser.add_argument("--compare", default=None, help="a fingerprint to compare with")
    args = parser.parse_args()
    result = fingerprint()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        differ = [key for key in before if before[key] != result.get(key)]
        print(f"{len(before) - len(differ)} of {len(before)} cases identical")
        for key in differ:
            print(f"DIFFERS: {key}")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
