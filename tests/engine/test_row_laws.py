"""A sampling knob is declared once (its SamplingParams field, and for a knob that reshapes a row, one
RowLaw): the HTTP fields, their bounds, the server's defaults, the sampling metadata, the target's
p and every drafter's q all follow from those two declarations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import ValidationError

import engine.sample.metadata as metadata_module
import engine.sample.row_laws as row_laws_module
from engine.request import Request
from engine.sample.drafting import draft_logits
from engine.sample.metadata import SamplingMetadata
from engine.sample.row_laws import ROW_LAWS, RowLaw
from engine.sample.sampler import draft_probs, target_probs
from engine.sampling_params import SamplingParams, sampling_knobs
from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.responses_api import ResponsesRequest
from server.sampling_defaults import DEFAULTABLE_FIELDS

VOCAB = 12


def request(**params: object) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params), frozenset({0}))


def test_every_row_law_reads_a_knob_whose_default_is_its_neutral_value() -> None:
    """A step with only default requests builds no tensor for any law and changes no bit."""
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    for law in ROW_LAWS:
        assert law.name in sampling_knobs(), law.name
        assert law.value(SamplingParams()) == law.neutral == defaults[law.name]
    metadata = SamplingMetadata.for_draft_rows([request()], [[]], torch.device("cpu"))
    assert metadata.row_laws == []


@pytest.mark.parametrize("model, minimal", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
    (CompletionRequest, {"prompt": "hi"}),
    (ResponsesRequest, {"input": "hi"}),
], ids=lambda value: getattr(value, "__name__", ""))
def test_every_knob_is_an_http_field_bounded_as_declared(model, minimal) -> None:
    for name, (kind, declaration) in sampling_knobs().items():
        interval = declaration.api
        assert getattr(model.model_validate(minimal), name) is None  # unset: the default
        assert getattr(model.model_validate({**minimal, name: kind(interval.high)}), name) \
            == interval.high
        with pytest.raises(ValidationError, match=name):
            model.model_validate({**minimal, name: kind(interval.high + 1)})
        low = {**minimal, name: kind(interval.low)}
        if interval.low_open:
            with pytest.raises(ValidationError, match=name):
                model.model_validate(low)
        else:
            assert getattr(model.model_validate(low), name) == interval.low
    assert set(DEFAULTABLE_FIELDS) == set(sampling_knobs())


def test_a_knob_out_of_its_range_names_the_range() -> None:
    for name, (kind, declaration) in sampling_knobs().items():
        with pytest.raises(ValueError, match=f"{name} must be in \\{str(declaration.valid)[0]}"):
            SamplingParams(**{name: kind(declaration.valid.high * 2 + 1)})


def test_a_changed_law_shapes_the_targets_p_and_the_drafters_q_alike(monkeypatch) -> None:
    """Swap min_p's law for one that keeps only the two likeliest tokens: the target's rows and a
    drafting pass's rows both take it, from the table alone."""
    def two_likeliest(logits, min_p, _):
        second = logits.topk(2, dim=-1).values[:, -1:]
        return torch.where((min_p[:, None] > 0) & (logits < second), float("-inf"), logits)

    laws = tuple(RowLaw("min_p", 0.0, torch.float32, two_likeliest) if law.name == "min_p"
                 else law for law in ROW_LAWS)
    monkeypatch.setattr(row_laws_module, "ROW_LAWS", laws)
    monkeypatch.setattr(metadata_module, "ROW_LAWS", laws)
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    requests = [request(temperature=0.8, min_p=0.01), request(temperature=0.8)]
    metadata = SamplingMetadata.build(requests, [0, 0], [0, 1], torch.device("cpu"))
    p = target_probs(logits, metadata)
    processed, draft_metadata = draft_logits(logits, requests, [[], []])
    q = draft_probs(processed, draft_metadata)
    for probs in (p, q):
        assert (probs[0] > 0).sum() == 2  # the swapped law, where the request uses min_p
        assert (probs[1] > 0).sum() == VOCAB  # and not where it does not
    assert torch.equal(p, q)
