"""A request that fails fails alone: faults injected into one request of a batch of 8 (its grammar,
its drafting, its logits) end that request with an error, while the other 7 finish with exactly the
tokens of a run without the fault and no KV block stays allocated."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_chat_model import build_tiny_chat_checkpoint
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.core import EngineCore

pytestmark = [pytest.mark.promise("failure-isolation")]

NUM_REQUESTS = 8
VICTIM = 3
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


class InjectedFault(RuntimeError):
    pass


def run(llm: LLM, prompts: list, params: SamplingParams) -> list:
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def assert_nothing_left(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.drafts
    pool = scheduler.block_manager
    assert pool.num_free_blocks == pool.num_blocks


def assert_victim_failed_alone(outputs: list, expected: list, phrase: str) -> None:
    victim = outputs[VICTIM]
    assert victim.finish_reason == "error"
    assert phrase in victim.error and "InjectedFault" in victim.error
    for index, (output, baseline) in enumerate(zip(outputs, expected)):
        if index != VICTIM:
            assert output.token_ids == baseline.token_ids, f"request {index} changed"
            assert output.finish_reason == baseline.finish_reason


def inject_on_add(monkeypatch, llm: LLM, is_victim, inject) -> None:
    """Call inject(request) for the victim's Request right after the engine admits it."""
    original = EngineCore.add_request

    def add_request(core, request_id, prompt_token_ids, params, cache_salt=None):
        original(core, request_id, prompt_token_ids, params, cache_salt)
        if is_victim(prompt_token_ids):
            inject(core.scheduler.requests[request_id])

    monkeypatch.setattr(llm.engine, "add_request",
                        lambda *args, **kwargs: add_request(llm.engine, *args, **kwargs))


# ---------------------------------------------------------------- a grammar that breaks mid-request

@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory) -> LLM:
    checkpoint = build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))
    return LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=96,
               speculative_config=SUFFIX)


def json_requests(llm: LLM) -> tuple[list[dict], SamplingParams]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    prompts = [{"prompt_token_ids": llm.tokenizer.encode(f"Give {w} {w} {w} as JSON.")}
               for w in words]
    params = SamplingParams(temperature=0.0, max_tokens=16,
                            response_format={"type": "json_object"})
    return prompts, params


@pytest.fixture(scope="module")
def json_expected(chat_llm) -> list:
    """The batch's outputs without a fault."""
    return run(chat_llm, *json_requests(chat_llm))


@pytest.mark.parametrize("failing_call", [2, 7])
def test_a_grammar_that_raises_ends_its_request_alone(chat_llm, json_expected, monkeypatch,
                                                      failing_call):
    """The victim's grammar raises at its n-th plan: in the sampler's masks, in drafting's cut or in
    commit, whichever comes n-th."""
    prompts, params = json_requests(chat_llm)
    expected = json_expected
    victim_prompt = prompts[VICTIM]["prompt_token_ids"]

    def break_grammar(request) -> None:
        state, calls = request.grammar, [0]
        original_plan = state._plan

        def plan(draft):
            calls[0] += 1
            if calls[0] >= failing_call:
                raise InjectedFault("the grammar broke")
            return original_plan(draft)

        state._plan = plan

    inject_on_add(monkeypatch, chat_llm, lambda ids: ids == victim_prompt, break_grammar)
    outputs = run(chat_llm, prompts, params)
    assert_victim_failed_alone(outputs, expected, "failed")
    assert_nothing_left(chat_llm)


def test_a_grammar_commit_that_raises_keeps_the_batch_going(chat_llm, json_expected, monkeypatch):
    prompts, params = json_requests(chat_llm)
    expected = json_expected
    victim_prompt = prompts[VICTIM]["prompt_token_ids"]

    def break_commit(request) -> None:
        state, original_commit = request.grammar, request.grammar.commit

        def commit(token_ids):
            if state.num_committed >= 4:
                raise InjectedFault("commit refused")
            original_commit(token_ids)

        state.commit = commit

    inject_on_add(monkeypatch, chat_llm, lambda ids: ids == victim_prompt, break_commit)
    outputs = run(chat_llm, prompts, params)
    assert_victim_failed_alone(outputs, expected, "commit failed")
    assert_nothing_left(chat_llm)


# ---------------------------------------------------------------- a proposer that raises

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)


def repetitive_prompts() -> list[dict]:
    return [{"prompt_token_ids": [1] + [10 + i, 20 + i, 30 + i] * 4} for i in range(NUM_REQUESTS)]


@pytest.mark.parametrize("method", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_a_proposer_that_raises_for_one_request_ends_it_alone(checkpoint, method):
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(checkpoint, dtype="float64", max_model_len=96, num_kv_blocks=96,
              speculative_config=method)
    expected = run(llm, prompts, params)
    assert sum(len(o.token_ids) for o in expected) == NUM_REQUESTS * 20
    victim_prompt = prompts[VICTIM]["prompt_token_ids"]
    proposer = llm.engine.proposer
    original_propose = proposer.propose

    def propose(requests, caps, target_hidden):
        for request in requests:
            if request.prompt_token_ids == victim_prompt and request.num_output_tokens >= 5:
                raise InjectedFault("the drafter broke")
        return original_propose(requests, caps, target_hidden)

    proposer.propose = propose
    outputs = run(llm, prompts, params)
    assert_victim_failed_alone(outputs, expected, "drafting failed")
    # the tokens it emitted before its drafting broke are kept, and are the baseline's
    victim = outputs[VICTIM].token_ids
    assert 5 <= len(victim) < 20 and victim == expected[VICTIM].token_ids[:len(victim)]
    assert_nothing_left(llm)
    if hasattr(proposer, "num_tracked_requests"):  # suffix decoding keeps a tree per request
        assert proposer.num_tracked_requests == 0


# ---------------------------------------------------------------- logits that are not numbers

@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "random"])
def test_non_finite_logits_end_their_request_alone(checkpoint, poison, temperature):
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, ignore_eos=True)
    llm = LLM(checkpoint, dtype="float64", max_model_len=96, num_kv_blocks=96,
              speculative_config=NGRAM)
    expected = run(llm, prompts, params)
    victim_prompt = prompts[VICTIM]["prompt_token_ids"]
    worker, scheduler = llm.engine.worker, llm.engine.scheduler
    original_execute, original_schedule = worker.execute, scheduler.schedule
    planned = []  # the step's SchedulerOutput (the worker only gets its ForwardInput)

    def schedule():
        planned[:] = [original_schedule()]
        return planned[0]

    def execute(forward, logits_indices=None):
        out = original_execute(forward, logits_indices)
        scheduled = planned[0]
        for index, item in enumerate(scheduled.layout.sampling):
            request = item.request
            if request.prompt_token_ids == victim_prompt and request.num_output_tokens >= 4:
                logits = out.logits.clone()  # [num_rows, vocab]
                logits[scheduled.layout.rows_of(index).start, 5] = poison
                out = dataclasses.replace(out, logits=logits)
        return out

    worker.execute, scheduler.schedule = execute, schedule
    outputs = run(llm, prompts, params)
    victim = outputs[VICTIM]
    assert victim.finish_reason == "error" and "non-finite" in victim.error
    for index, (output, baseline) in enumerate(zip(outputs, expected)):
        if index != VICTIM:
            assert output.token_ids == baseline.token_ids, f"request {index} changed"
    assert_nothing_left(llm)


def test_the_engine_goes_on_after_a_failure(checkpoint):
    """After a request failed, the same engine serves new requests as before."""
    llm = LLM(checkpoint, dtype="float64", max_model_len=96, num_kv_blocks=96,
              speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = run(llm, repetitive_prompts()[:2], params)
    original_propose = llm.engine.proposer.propose

    def always_fail(requests, caps, target_hidden):
        raise InjectedFault("every draft fails")

    llm.engine.proposer.propose = always_fail
    failed = run(llm, repetitive_prompts()[:2], params)
    assert [o.finish_reason for o in failed] == ["error", "error"]
    llm.engine.proposer.propose = original_propose
    after = run(llm, repetitive_prompts()[:2], params)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert_nothing_left(llm)
