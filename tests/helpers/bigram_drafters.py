"""Drafters that are often right, built from a target's own weights: each one drafts the token its
last token's favourite would be if the target's layers added nothing, argmax lm_head(norm(embed(x))).

On a "mostly bigram" target (tiny_models.build_tiny_checkpoint with layer_scale ~0.01) that guess is
the target's greedy token 60-85% of the time, so greedy tests see long accepted blocks, partial
blocks and rejections (rollback) alike, not only the rejection path a random head exercises."""

from __future__ import annotations

from dataclasses import replace

import torch
import transformers

from engine.models.arch import DecoderArch
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head
from engine.proposers.eagle_head import EagleConfig, EagleHead
from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

# q = k = SELF_ATTENTION_SCALE * the token's normalised embedding: the score of a position with
# itself beats every other position's by a wide margin, so attention returns the token's own value
SELF_ATTENTION_SCALE = 3.0


def _target(checkpoint: str) -> tuple[DecoderArch, transformers.PreTrainedModel]:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return DecoderArch.from_hf_config(model.config), model


def write_bigram_eagle_head(checkpoint: str, folder: str) -> str:
    """EAGLE-1: fc passes the token's embedding through and drops the feature; the layer adds
    nothing (o_proj = down_proj = 0), so h = embed(x) and the draft is argmax lm_head(embed(x)),
    the target's bigram favourite (its final norm only rescales the row)."""
    arch, _ = _target(checkpoint)
    hidden = arch.hidden_size
    head = EagleHead(EagleConfig.for_target(arch, arch.vocab_size, "bigram drafter"), arch)
    head.draft_token_ids.copy_(torch.arange(arch.vocab_size))
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    head.save(folder)
    return folder


def final_norm_gain(arch: DecoderArch, model: transformers.PreTrainedModel) -> torch.Tensor:
    """What the target's final norm multiplies each normalised feature by: [hidden] (Gemma
    stores gain - 1)."""
    weight = model.model.norm.weight.detach().float()
    return 1.0 + weight if arch.gemma_norms else weight


def write_bigram_eagle3_head(checkpoint: str, folder: str,
                             feature_layers: tuple[int, ...] = (0, 2, 3)) -> str:
    """EAGLE-3 (speculators layout): fc and hidden_norm are zero, so the feature side and the
    residual vanish; attention (one KV head per query head, heads sized so q, k and v span the
    hidden size, whatever the target's head_dim) attends to its own position and passes the
    token's normalised embedding through o_proj = I; the MLP adds nothing. The state is
    norm(embed(x)), scored with the target's final norm gain and LM head."""
    arch, target = _target(checkpoint)
    hidden = arch.hidden_size
    config = Eagle3Config.for_target(arch, arch.vocab_size, feature_layers)
    config = replace(config, layer={**config.layer, "num_key_value_heads": arch.num_heads,
                                    "head_dim": hidden // arch.num_heads})
    head = Eagle3Head(config, config.layer_arch(arch), has_embeddings=False)
    head.draft_token_ids.copy_(torch.arange(arch.vocab_size))
    eye = torch.eye(hidden)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.hidden_norm.weight.zero_()
        qkv = head.self_attn.qkv_proj.weight  # [3 * hidden, 2 * hidden]: q, k, v rows
        qkv.zero_()
        qkv[:hidden, :hidden] = SELF_ATTENTION_SCALE * eye
        qkv[hidden:2 * hidden, :hidden] = SELF_ATTENTION_SCALE * eye
        qkv[2 * hidden:, :hidden] = eye
        head.self_attn.o_proj.weight.copy_(eye)
        head.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(final_norm_gain(arch, target))
        head.lm_head.weight.copy_(target.lm_head.weight)
    head.save(folder, "bigram drafter")
    return folder


def write_bigram_mlp_speculator(checkpoint: str, folder: str, num_stages: int = 3) -> str:
    """MLP speculator: each stage ignores the state (state_proj = 0) and reads the token's
    embedding; a tiny LayerNorm gain keeps GELU in its linear range (gelu(z) ~ z / 2), so the
    stage's state is ~ a scaled, centred embedding and the draft its bigram favourite."""
    arch, _ = _target(checkpoint)
    hidden = arch.hidden_size
    speculator = MLPSpeculator(MLPSpeculatorConfig(hidden, arch.vocab_size, num_stages))
    with torch.no_grad():
        for stage in range(num_stages):
            speculator.state_proj[stage].weight.zero_()
            speculator.embed_proj[stage].weight.copy_(torch.eye(hidden))
            speculator.norms[stage].weight.fill_(1e-3)
            speculator.norms[stage].bias.zero_()
    speculator.save(folder)
    return folder


def build_mostly_bigram_checkpoint(path) -> str:
    """The target these drafters fit: 4 layers (EAGLE-3 reads 0, 2 and 3), layer_scale 0.01. With
    k = 3 on tests' short prompts the drafters above get ~60% of their drafts accepted (float64)."""
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(path, "llama", seed=41, num_hidden_layers=4, layer_scale=0.01)


def assert_often_right(outs, at_least: float = 0.3) -> float:
    """Pooled acceptance >= at_least, and some drafts rejected (so rollback ran too)."""
    proposed = sum(o.spec_stats.num_draft_tokens for o in outs)
    accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
    assert proposed > 0 and accepted >= at_least * proposed, (accepted, proposed)
    assert accepted < proposed, "every draft accepted: the rejection path never ran"
    return accepted / proposed


# prompts with repeats and without, for a batch mixing capped and uncapped requests
MOSTLY_RIGHT_PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60],
                        [1, 11, 12, 13, 14]]


def check_lossless_when_mostly_right(tmp_path, method: str, write_drafter) -> None:
    """A drafter `write_drafter(target, folder)` built from the mostly-bigram target's own weights
    guesses right more often than not: accepted blocks, partial ones and rejections all run, in a
    batch with capped and uncapped requests, and the tokens stay the target's."""
    from engine import LLM, SamplingParams

    target = build_mostly_bigram_checkpoint(tmp_path / "target")
    folder = write_drafter(target, str(tmp_path / "drafter"))
    requests = [{"prompt_token_ids": p} for p in MOSTLY_RIGHT_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in plain.generate(requests, greedy)]
    spec = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64,
               speculative_config={"method": method, "model": folder, "num_speculative_tokens": 3})
    outs = spec.generate(requests, [replace(greedy, num_speculative_tokens=cap)
                                    for cap in (None, 2, None, None)])
    assert [o.outputs[0].token_ids for o in outs] == want
    assert_often_right(outs)
