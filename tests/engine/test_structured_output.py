"""response_format in the engine, with every proposer: outputs always parse and match their schema,
greedy output is token-identical with and without speculation, and the draft's q is masked as p is.

The target is a tiny random Llama with the embedded model's tokenizer: its tokens are noise, so only
the grammar makes the output JSON. The schemas bound every string, number and array, so each output
ends within max_tokens (whitespace between JSON tokens is capped by the grammar)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import transformers
from tiny_chat_model import build_tiny_chat_checkpoint

from engine import LLM, SamplingParams
from engine.drafting import cut_drafts_at_grammar
from engine.models.arch import DecoderArch
from engine.models.loader import load_checkpoint
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head
from engine.proposers.eagle_head import EagleConfig, EagleHead
from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from engine.request import Request
from engine.step.layout import DraftProposal
from engine.structured import GrammarCompiler, UnsupportedSchemaError, parse_response_format
from kernels.rejection_reference import rejection_sample as rejection_sample_reference

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"}},
        "required": ["name", "age", "admin"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "status": {"enum": ["new", "paid", "shipped"]},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["status", "items"], "additionalProperties": False},
    "choice": {"anyOf": [{"type": "boolean"}, {"$ref": "#/$defs/small"}],
               "$defs": {"small": {"type": "integer", "minimum": -5, "maximum": 5}}},
}
PROMPTS = ["Reply in JSON.", "Describe an order.", "Pick one."]
MAX_TOKENS = 160
# NOTE: EAGLE-3 trees run in test_stop_in_block.py and the embedded model's tests; here, over the
# embedded tokenizer's 49k vocabulary, a sampled EAGLE-3 tree spends ~1 s drafting per step
METHODS = ["ngram", "suffix", "draft_model", "eagle", "mlp_speculator", "eagle3", "suffix_tree"]


def formats() -> list[dict]:
    return [{"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
            for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    # NOTE: 3 layers, the fewest an EAGLE-3 head reads (its first, middle and last)
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"), num_hidden_layers=3)


@pytest.fixture(scope="module")
def speculative_configs(target, tmp_path_factory) -> dict[str, dict]:
    arch = DecoderArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)
    torch.manual_seed(0)
    eagle = str(tmp_path_factory.mktemp("eagle"))
    head = EagleHead(EagleConfig.for_target(arch, arch.vocab_size), arch)
    head.draft_token_ids.copy_(torch.arange(arch.vocab_size))
    head.save(eagle)
    mlp = str(tmp_path_factory.mktemp("mlp"))
    MLPSpeculator(MLPSpeculatorConfig(arch.hidden_size, arch.vocab_size, 3)).save(mlp)
    eagle3 = str(tmp_path_factory.mktemp("eagle3"))
    config = Eagle3Config.for_target(arch, arch.vocab_size, (0, 1, 2))
    head3 = Eagle3Head(config, config.layer_arch(arch), has_embeddings=False)
    head3.draft_token_ids.copy_(torch.arange(arch.vocab_size))
    head3.save(eagle3, "test")
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8, "adaptive": True},
        # the target as its own draft: q is p, so a masked q is accepted every time
        "draft_model": {"method": "draft_model", "model": target, "num_speculative_tokens": 3},
        "eagle": {"method": "eagle", "model": eagle, "num_speculative_tokens": 3},
        "mlp_speculator": {"method": "mlp_speculator", "model": mlp, "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 3},
        # a tree: every node's one-hot draft checked against the grammar along its own path
        "suffix_tree": {"method": "suffix", "num_speculative_tokens": 8, "draft_tree": True},
    }


def engine(target: str, speculative_config: dict | None = None) -> LLM:
    return LLM(target, dtype="float32", max_model_len=512, num_kv_blocks=256,
               speculative_config=speculative_config)


def run(llm: LLM, temperature: float) -> list:
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=MAX_TOKENS,
                             response_format=fmt) for i, fmt in enumerate(formats())]
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    llm.last_spec_stats = [o.spec_stats for o in outs]
    return [o.outputs[0] for o in outs]


def assert_valid(outputs: list) -> None:
    for output, schema in zip(outputs, SCHEMAS.values()):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)


@pytest.fixture(scope="module")
def plain_greedy(target) -> list:
    outputs = run(engine(target), 0.0)
    assert_valid(outputs)
    return outputs


@pytest.mark.parametrize("method", METHODS)
def test_outputs_match_their_schema_and_greedy_keeps_the_tokens(target, speculative_configs,
                                                                 plain_greedy, method):
    llm = engine(target, speculative_configs[method])
    greedy = run(llm, 0.0)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in plain_greedy]
    drafted = sum(s.num_draft_tokens for s in llm.last_spec_stats)
    accepted = sum(s.num_accepted_draft_tokens for s in llm.last_spec_stats)
    sampled = run(llm, 1.0)
    assert_valid(sampled)
    drafted += sum(s.num_draft_tokens for s in llm.last_spec_stats)
    accepted += sum(s.num_accepted_draft_tokens for s in llm.last_spec_stats)
    assert drafted > 0
    if method == "draft_model":
        # q masked exactly as p: every sampled and greedy draft accepted
        assert accepted == drafted


def test_a_draft_is_cut_where_the_grammar_rejects_it(target):
    """Deterministic drafts (n-gram, suffix, a greedy request's) end before the first token the
    grammar rejects; a sampled draft keeps that token, which verification then rejects for sure
    (p(x) = 0 under the mask) and replaces from norm(max(0, p - q)), as lossless sampling needs."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    compiler = GrammarCompiler(tokenizer, [2])
    fmt = parse_response_format(formats()[0])
    valid = tokenizer.encode('{"name": "ab", "age"', add_special_tokens=False)
    draft = valid[:3] + tokenizer.encode(" hello", add_special_tokens=False)[:1] + valid[3:5]
    q = torch.full((len(draft), len(tokenizer)), 1.0 / len(tokenizer))

    def request(temperature: float) -> Request:
        params = SamplingParams(temperature=temperature, response_format=fmt)
        return Request("r", [1], params, frozenset([2]), grammar=compiler.new_state(fmt))

    one_hot, sampled, greedy_q, none_valid = cut_drafts_at_grammar(
        [request(1.0), request(1.0), request(0.0), request(1.0)],
        [DraftProposal(draft), DraftProposal(draft, q), DraftProposal(draft, q),
         DraftProposal(draft[3:4])])
    assert one_hot.token_ids == draft[:3] and one_hot.probs is None
    assert sampled.token_ids == draft[:4] and torch.equal(sampled.probs, q[:4])
    assert greedy_q.token_ids == draft[:3]
    assert none_valid.token_ids == [] and none_valid.probs is None


def test_unsupported_schemas_and_combinations_are_refused(target):
    llm = engine(target)
    unsupported = {"type": "json_schema",
                   "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        llm.generate(["x"], SamplingParams(response_format=unsupported))
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, response_format={"type": "json_object"})
    assert SamplingParams(response_format={"type": "text"}).response_format is None


class InvalidTokens:
    """A grammar stand-in that rejects the given token ids anywhere (for the statistics below)."""

    def __init__(self, invalid: set[int]) -> None:
        self.invalid = invalid

    def valid_draft_prefix(self, draft: list[int]) -> int:
        return next((i for i, t in enumerate(draft) if t in self.invalid), len(draft))


@pytest.mark.parametrize("cut_rule", ["engine", "cut_before_sampled"])
def test_the_cut_rule_keeps_sampling_lossless(cut_rule):
    """Drafts x ~ q where q puts half its mass on tokens the grammar forbids (p = 0 there), cut by
    cut_drafts_at_grammar, then verified by the rejection sampler: the first emitted token must
    follow p. The engine's rule (a sampled draft keeps its first rejected token) passes; cutting a
    sampled draft before that token, as for one-hot drafts, draws from p exactly where q was
    invalid and must fail (expected first-token law [0.15, 0.23, 0.27, 0.35] against p's
    [0.1, 0.2, 0.3, 0.4])."""
    chisquare = pytest.importorskip("scipy.stats").chisquare
    num_rows = 20_000
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])  # masked: 4 and 5 are invalid
    q = torch.tensor([0.3, 0.1, 0.05, 0.05, 0.25, 0.25])
    draws = torch.multinomial(q, num_rows, replacement=True, generator=gen).tolist()
    grammar = InvalidTokens({4, 5})
    if cut_rule == "engine":
        requests = [Request(str(i), [1], SamplingParams(temperature=1.0), frozenset([2]),
                            grammar=grammar) for i in range(num_rows)]
        proposals = cut_drafts_at_grammar(requests, [DraftProposal([x], q[None]) for x in draws])
    else:  # the wrong rule: drop the first rejected token of a sampled draft too
        proposals = [DraftProposal([x], q[None]) if x < 4 else DraftProposal([]) for x in draws]
    num_drafts = [len(proposal.token_ids) for proposal in proposals]
    kept = [t for proposal in proposals for t in proposal.token_ids]
    num_rows_total = len(kept) + num_rows
    out = rejection_sample_reference(
        draft_token_ids=torch.tensor(kept, dtype=torch.int64),
        cu_num_draft_tokens=torch.tensor(num_drafts).cumsum(0),
        draft_probs=q.expand(len(kept), -1).contiguous(),
        target_probs=p.expand(num_rows_total, -1).contiguous(),
        target_argmax=torch.zeros(num_rows_total, dtype=torch.int64),
        is_greedy=torch.zeros(num_rows, dtype=torch.bool),
        acceptance_uniforms=torch.rand(len(kept), generator=gen, dtype=torch.float64),
        sample_uniforms=torch.rand(num_rows_total, generator=gen, dtype=torch.float64),
        max_spec_len=1)
    first = out[:, 0]
    assert not (first >= 4).any()  # a forbidden token is never emitted, under either rule
    counts = torch.bincount(first, minlength=4)[:4].double()
    expected = p[:4].double() / p[:4].double().sum() * counts.sum()
    pvalue = chisquare(counts.numpy(), expected.numpy()).pvalue
    if cut_rule == "engine":
        assert pvalue > 1e-3
    else:
        assert pvalue < 1e-9
