"""engine/sample/keyed_random.py: Philox4x32-10 as published (Random123's known answers) and as
Triton computes it on a GPU (checked under the interpreter), and uniforms that are uniform,
distinct per key and the same whatever else is drawn beside them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine.sample.keyed_random import keyed_uniforms, philox4x32

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is first imported (conftest sets it too)
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def words(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def test_known_answers() -> None:
    """Random123's kat_vectors for philox4x32 with 10 rounds."""
    zero, ones32 = words(0), words(0xFFFFFFFF)
    assert [int(w[0]) for w in philox4x32(zero, (zero,) * 4)] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert [int(w[0]) for w in philox4x32(words(2**64 - 1), (ones32,) * 4)] == [
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = (words(0x243F6A88), words(0x85A308D3), words(0x13198A2E), words(0x03707344))
    key = words(0x299F31D0 << 32 | 0xA4093822)  # k0 = 0xa4093822, k1 = 0x299f31d0
    assert [int(w[0]) for w in philox4x32(key, pi)] == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@triton.jit
def _philox_kernel(out_ptr, seed, c0_ptr, c1_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    c0 = tl.load(c0_ptr + offsets).to(tl.uint32)
    c1 = tl.load(c1_ptr + offsets).to(tl.uint32)
    zero = tl.zeros([BLOCK], tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero, zero)
    for index, word in enumerate((r0, r1, r2, r3)):
        tl.store(out_ptr + index * BLOCK + offsets, word.to(tl.int64) & 0xFFFFFFFF)


def test_triton_computes_the_same_words() -> None:
    """A GPU kernel could draw the same numbers (`tl.philox(seed, position, stream, 0, 0)`)."""
    seed, block = 0x0123456789ABCDEF, 16
    positions = torch.arange(block, dtype=torch.int64) * 977 + 3
    streams = torch.arange(block, dtype=torch.int64) % 3
    out = torch.zeros(4 * block, dtype=torch.int64)
    _philox_kernel[(1,)](out, seed, positions.int(), streams.int(), BLOCK=block)
    expected = philox4x32(np.full(block, seed, dtype=np.uint64),
                          (positions.numpy(), streams.numpy(), np.zeros(block), np.zeros(block)))
    assert out.reshape(4, block).tolist() == [w.astype(np.int64).tolist() for w in expected]


def test_uniforms_are_uniform_and_distinct_per_key() -> None:
    from scipy.stats import kstest

    n = 50_000
    seeds = np.repeat(np.arange(50, dtype=np.int64), n // 50)
    positions = np.tile(np.arange(n // 50, dtype=np.int64), 50)
    uniforms = keyed_uniforms(seeds, positions, np.zeros(n, dtype=np.int64))  # [n]
    assert uniforms.min() >= 0.0 and uniforms.max() < 1.0
    assert kstest(uniforms, "uniform").pvalue > 1e-4
    assert len(np.unique(uniforms)) == n
    # neighbouring seeds and streams are not correlated
    other = keyed_uniforms(seeds + 1, positions, np.zeros(n, dtype=np.int64))
    stream = keyed_uniforms(seeds, positions, np.ones(n, dtype=np.int64))
    for a, b in ((uniforms, other), (uniforms, stream)):
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.02


def test_a_key_gives_its_number_whatever_is_drawn_beside_it() -> None:
    alone = keyed_uniforms(np.array([7]), np.array([12]), np.array([0]))
    among = keyed_uniforms(np.array([3, 7, 7]), np.array([12, 11, 12]), np.array([0, 0, 0]))
    assert among[2] == alone[0] and among[1] != alone[0] and among[0] != alone[0]
