"""Every other proposer (suffix chains and trees, EAGLE, EAGLE-3, the MLP speculator) samples the
target's distribution through the whole engine, unseeded, with tokens enough for a 2% TV error
(tests/helpers/sampling_law.py), each beside a broken sampler that the same check must reject in the
same run."""

from __future__ import annotations

import pytest
import sampling_law
import torch
from bigram_model import build_bigram_checkpoint
from sampling_law import (
    FULL_OTHER_EPSILON,
    OTHER_EPSILON,
    TARGET_LOGITS,
    VOCAB,
    Case,
    K,
    assert_follows_target,
    chain_verdict,
    recover_from_p,
    reference_probs,
    sample,
)

import kernels.rejection_reference as reference_module

# the bigram model and its logits (tests/helpers/sampling_law.py), as this module's fixtures
restore_threads = sampling_law.restore_threads
target = sampling_law.target
target_logits = sampling_law.target_logits


# ---- every other proposer, unseeded, each beside a broken sampler that must fail -------------
# NOTE: these catch a 2% TV error with 95% power (a quarter of the tokens a 1% error needs, since
# N grows as 1 / eps^2): the drafters' Python per request and step makes each token dearer here.
# Unseeded: seeded requests with one-hot drafts are decided by their keyed inverse CDF, not
# by rejection sampling; the rejection sampler is what these cases check, draft by draft
@pytest.fixture(scope="module")
def deep_target(tmp_path_factory) -> str:
    """The same bigram model with 3 (inert) layers: EAGLE-3 reads three layers' streams."""
    return build_bigram_checkpoint(tmp_path_factory.mktemp("bigram_deep"), TARGET_LOGITS,
                                   num_layers=3)


def drafter_folder(method: str, target: str, folder: str) -> str | None:
    """A random head of `method` for the bigram target (q far from p: both outcomes are common)."""
    from engine.models.arch import DecoderArch
    from engine.models.loader import load_checkpoint
    from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head
    from engine.proposers.eagle_head import EagleConfig, EagleHead
    from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

    arch = DecoderArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)
    torch.manual_seed(5)
    if method == "eagle":
        head = EagleHead(EagleConfig.for_target(arch, VOCAB), arch)
        head.draft_token_ids.copy_(torch.arange(VOCAB))
        head.save(folder)
    elif method == "eagle3":
        config = Eagle3Config.for_target(arch, VOCAB, (0, 1, 2))
        head3 = Eagle3Head(config, config.layer_arch(arch), has_embeddings=False)
        head3.draft_token_ids.copy_(torch.arange(VOCAB))
        head3.save(folder, "test")
    elif method == "mlp_speculator":
        MLPSpeculator(MLPSpeculatorConfig(arch.hidden_size, VOCAB, K)).save(folder)
    else:
        return None
    return folder


OTHER_SPEC_CASES = {
    # one-hot drafts from the suffix trees of the prompt and the output so far
    "suffix": (Case(temperature=1.0), {"method": "suffix", "num_speculative_tokens": K}),
    # one-hot trees: several continuations verified at once, multi-draft rejection sampling
    "suffix_tree": (Case(temperature=1.3, top_k=3),
                    {"method": "suffix", "num_speculative_tokens": 6, "draft_tree": True}),
    # drafts sampled from the heads' own q
    "eagle": (Case(temperature=0.7), {"method": "eagle", "num_speculative_tokens": K}),
    "eagle3": (Case(temperature=1.0, top_k=3), {"method": "eagle3", "num_speculative_tokens": K}),
    "mlp_speculator": (Case(temperature=1.0),
                       {"method": "mlp_speculator", "num_speculative_tokens": K}),
}


@pytest.mark.promise("sampling-law", "sampling-law-canaries")
@pytest.mark.parametrize("method", OTHER_SPEC_CASES)
def test_every_proposer_samples_the_target_and_a_broken_sampler_is_caught(
        deep_target, target_logits, tmp_path, monkeypatch, method):
    """Unseeded speculative sampling follows the target (the check of test_sampling_distribution.py, with tokens
    enough to catch a 2% TV error with 95% power), most tokens come through verification with
    both outcomes common, and in the same run the same check rejects a sampler that draws a
    rejected draft's replacement from p instead of the residual (a 7-10% TV error, on a fifth of
    the tokens)."""
    case, config = OTHER_SPEC_CASES[method]
    folder = drafter_folder(method, deep_target, str(tmp_path / "drafter"))
    config = {**config, "model": folder} if folder else config
    probs = reference_probs(target_logits, case)
    result = sample(deep_target, case, probs, seed=None, speculative_config=config,
                    epsilon=OTHER_EPSILON)
    assert_follows_target(result, probs, OTHER_EPSILON)
    num_rejected = result.num_draft_tokens - result.num_accepted_tokens
    num_tokens = int(result.counts.sum())
    assert result.num_accepted_tokens > 0.1 * num_tokens, result
    assert num_rejected > 0.1 * num_tokens, result

    import kernels.tree_rejection as tree_module

    is_tree = config.get("draft_tree", False)
    monkeypatch.setattr(tree_module if is_tree else reference_module, "recovery_weights",
                        recover_from_p)
    broken = sample(deep_target, case, probs, seed=None, speculative_config=config,
                    fraction=0.2, epsilon=FULL_OTHER_EPSILON)
    verdict = chain_verdict(broken.counts, probs)
    assert verdict.rejects, f"{method}: recovering from p went unnoticed: {verdict}"
