"""Start-up calibration is measured once per machine, model and configuration, then read back: the
cache is keyed (another CPU, model or setting measures again), a damaged or busy-machine measurement
is never reused, and an engine started twice calibrates once."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import build_tiny_checkpoint

import engine.adaptive.calibration as calibration
import engine.adaptive.calibration_cache as calibration_cache
from engine import LLM
from engine.adaptive.calibration_cache import cached_calibration, calibration_path, engine_fields
from engine.config import CacheConfig, ModelConfig

FIELDS = {"cpu": "model name: Some CPU | flags: avx2 fma", "torch_threads": 2, "sizes": [1, 2]}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration_cache.RECALIBRATE_ENV, raising=False)
    return tmp_path / "cache"


class Measure:
    """A stand-in for the timed passes: counts its calls."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.calls = 0

    def __call__(self) -> dict[int, float]:
        self.calls += 1
        return dict(self.seconds)


def test_measured_once_then_read_back(monkeypatch):
    monkeypatch.setattr(calibration_cache, "MIN_CPU_SHARE", 0.0)
    measure = Measure({1: 0.01, 2: 0.015})
    assert cached_calibration(FIELDS, measure) == {1: 0.01, 2: 0.015}
    assert cached_calibration(FIELDS, measure) == {1: 0.01, 2: 0.015}
    assert measure.calls == 1


@pytest.mark.parametrize("change", [{"cpu": "model name: Another CPU | flags: avx2 fma"},
                                    {"torch_threads": 1}, {"sizes": [1, 2, 3]}])
def test_another_machine_or_setting_measures_again(monkeypatch, change):
    monkeypatch.setattr(calibration_cache, "MIN_CPU_SHARE", 0.0)
    measure = Measure({1: 0.01, 2: 0.015})
    cached_calibration(FIELDS, measure)
    cached_calibration({**FIELDS, **change}, measure)
    assert measure.calls == 2
    assert calibration_path(FIELDS) != calibration_path({**FIELDS, **change})


def test_the_cache_keeps_the_most_recently_used_calibrations(monkeypatch, cache_dir):
    """One file per model and setting would pile up (every temporary test model has its own):
    past MAX_CACHED_CALIBRATIONS the least recently used go, and a read counts as a use."""
    monkeypatch.setattr(calibration_cache, "MIN_CPU_SHARE", 0.0)
    monkeypatch.setattr(calibration_cache, "MAX_CACHED_CALIBRATIONS", 3)
    measure = Measure({1: 0.01, 2: 0.015})
    clock = iter(range(1_000_000, 2_000_000, 10))

    def calibrate(sizes: list[int]) -> None:
        cached_calibration({**FIELDS, "sizes": sizes}, measure)
        path = calibration_path({**FIELDS, "sizes": sizes})
        stamp = next(clock)  # NOTE: distinct times, whatever the file system's resolution
        os.utime(path, (stamp, stamp))

    for sizes in ([1], [2], [3]):
        calibrate(sizes)
    calibrate([1])  # read back: now the most recent
    assert measure.calls == 3
    calibrate([4])  # a fourth: [2], the least recently used, goes
    kept = sorted(p.name for p in (cache_dir / "calibration").iterdir())
    assert kept == sorted(os.path.basename(calibration_path({**FIELDS, "sizes": s}))
                          for s in ([1], [3], [4]))
    calibrate([2])
    assert measure.calls == 5  # measured again


def test_recalibrate_variable_measures_again_and_replaces_the_file(monkeypatch):
    monkeypatch.setattr(calibration_cache, "MIN_CPU_SHARE", 0.0)
    cached_calibration(FIELDS, Measure({1: 0.5, 2: 0.6}))
    monkeypatch.setenv(calibration_cache.RECALIBRATE_ENV, "1")
    assert cached_calibration(FIELDS, Measure({1: 0.01, 2: 0.015})) == {1: 0.01, 2: 0.015}
    monkeypatch.delenv(calibration_cache.RECALIBRATE_ENV)
    assert cached_calibration(FIELDS, Measure({1: 9.0, 2: 9.0})) == {1: 0.01, 2: 0.015}


@pytest.mark.parametrize("damage", ["{not json", json.dumps({"fields": {}, "seconds": {"1": 1}}),
                                    json.dumps({"fields": FIELDS, "seconds": {"1": -1.0}})])
def test_a_damaged_or_foreign_file_is_not_read(monkeypatch, damage):
    monkeypatch.setattr(calibration_cache, "MIN_CPU_SHARE", 0.0)
    path = calibration_path(FIELDS)
    cached_calibration(FIELDS, Measure({1: 0.01, 2: 0.015}))
    with open(path, "w") as file:
        file.write(damage)
    measure = Measure({1: 0.02, 2: 0.03})
    assert cached_calibration(FIELDS, measure) == {1: 0.02, 2: 0.03}
    assert measure.calls == 1


def test_a_calibration_taken_while_the_cores_were_shared_is_not_kept(monkeypatch):
    # NOTE: a share no process can reach: every measurement counts as taken on a busy machine
    monkeypatch.setattr(calibration_cache, "MIN_CPU_SHARE", 1e9)
    measure = Measure({1: 0.01, 2: 0.015})
    cached_calibration(FIELDS, measure)
    cached_calibration(FIELDS, measure)
    assert measure.calls == 2


def test_the_key_follows_the_machine_the_model_file_and_the_configuration(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x" * 10)

    def fields(**model_settings) -> dict:
        return engine_fields(ModelConfig(**model_settings), CacheConfig(), None, str(model),
                             "torch", (), torch.device("cpu"))

    base = fields()
    assert base["cpu"] and base["torch"] == torch.__version__ and base["kernel_sources"]
    assert calibration_path(fields()) == calibration_path(base)
    assert calibration_path(fields(dtype="float64")) != calibration_path(base)
    model.write_bytes(b"y" * 11)  # another file at the same path
    assert calibration_path(fields()) != calibration_path(base)


def test_an_engine_started_twice_calibrates_once(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration_cache, "MIN_CPU_SHARE", 0.0)
    measured = []
    real_measure = calibration.measure_verify_cost

    def counting_measure(*args, **kwargs):
        measured.append(1)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(calibration, "measure_verify_cost", counting_measure)
    checkpoint = build_tiny_checkpoint(tmp_path / "model", "llama")
    spec = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": True}
    costs = []
    for _ in range(2):
        llm = LLM(checkpoint, dtype="float64", max_model_len=64, num_kv_blocks=16,
                  speculative_config=spec)
        costs.append(llm.engine.adaptive.cost.verify_seconds([1, 2, 4]).tolist())
    assert len(measured) == 1
    assert costs[0] == costs[1]
