"""Prompt lookup: the longest recent n-gram match proposes what followed it; no match, no draft."""

from __future__ import annotations

import numpy as np
import pytest

from engine.proposers.ngram import lookup_continuation

CASES = [
    # tokens, min_n, max_n, k, expected draft
    ([1, 2, 3, 4, 1, 2], 1, 3, 3, [3, 4, 1]),  # "1 2" seen before: continue with "3 4 1"
    ([1, 2, 3, 4, 1, 2], 1, 3, 1, [3]),  # capped at k
    ([5, 6, 7, 8], 1, 3, 4, []),  # nothing repeats
    ([9, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1]),  # the latest earlier match wins
    ([3, 1, 2, 9, 4, 2], 2, 3, 2, []),  # only a 1-gram repeats, below min_n
    ([3, 1, 2, 9, 4, 2], 1, 3, 2, [9, 4]),  # ... found with min_n 1
    ([7, 8, 9, 1, 8, 9, 2, 7, 8, 9], 1, 3, 2, [1, 8]),  # the 3-gram beats the newer 2-gram
    ([4], 1, 3, 2, []),  # too short to match anything
]


@pytest.mark.parametrize("tokens, min_n, max_n, k, expected", CASES)
def test_lookup_continuation(tokens, min_n, max_n, k, expected):
    assert lookup_continuation(np.array(tokens), min_n, max_n, k) == expected
