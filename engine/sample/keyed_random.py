"""Counter-based random numbers for seeded requests: one uniform per (seed, output position, stream).

A seeded request's randomness must not depend on how many numbers were drawn before (draft lengths,
batch mates, cache hits all change that), so nothing is drawn from a stream: the uniform for output
position `position` of a request seeded `seed` is a pure function of the key, Philox4x32-10 (Salmon
et al., "Parallel random numbers: as easy as 1, 2, 3"), the generator of Random123, cuRAND and
Triton's `tl.rand`, with key = the 64-bit seed and counter = (position, stream, 0, 0):

    stream 0       the sample uniform of the row that emits the token at `position`
    stream 1 + r   the acceptance uniform of the draft of sibling rank r tried at `position`

It runs on the host in numpy's exact uint64 arithmetic, vectorised over all keys of a step, so the
numbers are the same on every device (Triton's `tl.randint4x(seed, position)` gives the same words
for stream 0; tests/engine/test_keyed_random.py checks it under the interpreter).
"""

from __future__ import annotations

import numpy as np

SAMPLE_STREAM = 0
# acceptance uniforms of the draft with sibling rank r use stream FIRST_ACCEPTANCE_STREAM + r
FIRST_ACCEPTANCE_STREAM = 1

_MASK32 = np.uint64(0xFFFFFFFF)
_ROUND_MULTIPLIERS = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_KEY_INCREMENTS = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_NUM_ROUNDS = 10


def philox4x32(seeds: np.ndarray, counters: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 of each key (seeds [n] uint64: low word k0, high word k1) and counter (four [n]
    uint64 holding 32-bit words); returns the four output words, [n] uint64 each below 2^32."""
    k0, k1 = seeds & _MASK32, seeds >> np.uint64(32)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK32 for c in counters)
    for _ in range(_NUM_ROUNDS):
        # NOTE: a 32 x 32-bit product fits in uint64, so its high and low words are exact
        product0 = _ROUND_MULTIPLIERS[0] * c0
        product1 = _ROUND_MULTIPLIERS[1] * c2
        c0, c1, c2, c3 = ((product1 >> np.uint64(32)) ^ c1 ^ k0, product1 & _MASK32,
                          (product0 >> np.uint64(32)) ^ c3 ^ k1, product0 & _MASK32)
        k0 = (k0 + _KEY_INCREMENTS[0]) & _MASK32
        k1 = (k1 + _KEY_INCREMENTS[1]) & _MASK32
    return c0, c1, c2, c3


def keyed_uniforms(seeds: np.ndarray, positions: np.ndarray, streams: np.ndarray) -> np.ndarray:
    """[n] float64 uniforms in [0, 1), one per key (each argument [n], integers >= 0; positions
    and streams below 2^32): 53 random bits, the first word's 32 then the second's top 21, so the
    conversion to float64 is exact."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    zeros = np.zeros_like(seeds)
    word0, word1, _, _ = philox4x32(seeds, (positions, streams, zeros, zeros))
    bits = (word0 << np.uint64(21)) | (word1 >> np.uint64(11))  # [n] < 2^53
    return bits.astype(np.float64) * 2.0**-53
