"""Medusa samples the target's distribution through the whole engine, unseeded: chains whose drafts are
drawn from each head's q (rejection sampling against q), and trees of the heads' top guesses
(one-hot drafts, multi-draft rejection sampling); each beside a broken sampler that the same check
must reject in the same run (tests/engine/test_sampling_distribution_proposers.py's check, with
tokens enough for a 2% TV error, tests/helpers/sampling_law.py)."""

from __future__ import annotations

import pytest
import sampling_law
from bigram_model import HIDDEN, build_bigram_checkpoint
from medusa_heads import random_tensors, write_authors_folder
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
import kernels.tree_rejection as tree_module

restore_threads = sampling_law.restore_threads
target_logits = sampling_law.target_logits

CASES = {
    # drafts sampled from each head's q
    "chain": (Case(temperature=0.8), {"num_speculative_tokens": K}),
    # the heads' top guesses as a tree, one-hot
    "tree": (Case(temperature=1.3, top_k=3), {"num_speculative_tokens": 6, "draft_tree": True}),
    "choices": (Case(temperature=1.0), {"num_speculative_tokens": 5, "draft_tree": True,
                                        "medusa_choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_bigram_checkpoint(tmp_path_factory.mktemp("bigram_target"), TARGET_LOGITS)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> str:
    """Random heads: q far enough from p that drafts are both accepted and rejected often."""
    folder = str(tmp_path_factory.mktemp("heads"))
    return write_authors_folder(folder, random_tensors(HIDDEN, VOCAB, num_heads=K, seed=7), K, 1)


@pytest.mark.parametrize("shape", CASES)
def test_medusa_samples_the_target_and_a_broken_sampler_is_caught(target, heads, target_logits,
                                                                  monkeypatch, shape):
    case, options = CASES[shape]
    config = {"method": "medusa", "model": heads, **options}
    probs = reference_probs(target_logits, case)
    result = sample(target, case, probs, seed=None, speculative_config=config,
                    epsilon=OTHER_EPSILON)
    assert_follows_target(result, probs, OTHER_EPSILON)
    num_rejected = result.num_draft_tokens - result.num_accepted_tokens
    num_tokens = int(result.counts.sum())
    assert result.num_accepted_tokens > 0.1 * num_tokens, result
    assert num_rejected > 0.1 * num_tokens, result

    is_tree = options.get("draft_tree", False)
    monkeypatch.setattr(tree_module if is_tree else reference_module, "recovery_weights",
                        recover_from_p)
    broken = sample(target, case, probs, seed=None, speculative_config=config, fraction=0.2,
                    epsilon=FULL_OTHER_EPSILON)
    verdict = chain_verdict(broken.counts, probs)
    assert verdict.rejects, f"medusa {shape}: recovering from p went unnoticed: {verdict}"
