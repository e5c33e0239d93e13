"""Arrival gaps: gamma with mean 1/QPS, CV 1/sqrt(burstiness), reproducible per seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.arrivals import arrival_gaps, send_offsets

NUM_SAMPLES = 40_000


@pytest.mark.parametrize(("qps", "burstiness"), [(2.0, 1.0), (5.0, 0.5), (0.5, 4.0)])
def test_gaps_have_mean_one_over_qps_and_the_expected_spread(qps, burstiness):
    gaps = np.asarray(arrival_gaps(NUM_SAMPLES, qps, burstiness, seed=7))
    coefficient_of_variation = gaps.std() / gaps.mean()
    # standard error of the mean is CV/sqrt(n) ~ 0.7% at burstiness 0.5: 3% is > 4 sigma
    assert gaps.mean() == pytest.approx(1.0 / qps, rel=0.03)
    assert coefficient_of_variation == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.05)
    assert (gaps >= 0).all()


def test_poisson_gaps_are_exponential():
    gaps = np.asarray(arrival_gaps(NUM_SAMPLES, 1.0, 1.0, seed=3))
    # P(gap > t) = exp(-t) for an exponential with rate 1
    assert (gaps > 1.0).mean() == pytest.approx(math.exp(-1.0), abs=0.01)


def test_same_seed_same_gaps_other_seed_other_gaps():
    assert arrival_gaps(50, 3.0, 1.0, seed=1) == arrival_gaps(50, 3.0, 1.0, seed=1)
    assert arrival_gaps(50, 3.0, 1.0, seed=1) != arrival_gaps(50, 3.0, 1.0, seed=2)


def test_unpaced_runs_send_everything_at_once():
    assert arrival_gaps(4, math.inf) == [0.0] * 4
    assert send_offsets(arrival_gaps(4, math.inf)) == [0.0] * 4


def test_offsets_accumulate_gaps():
    assert send_offsets([0.5, 0.25, 1.0]) == pytest.approx([0.5, 0.75, 1.75])
    assert send_offsets([]) == []


@pytest.mark.parametrize(("qps", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0),
                                                 (1.0, math.inf), (math.nan, 1.0)])
def test_bad_rates_and_burstiness_are_refused(qps, burstiness):
    with pytest.raises(ValueError):
        arrival_gaps(3, qps, burstiness)
