"""EAGLE drafting: the head (eagle_head.py) catches up on the target's new features, then rolls out k
tokens on its own, with a paged KV cache of one layer.

Per request the head's cache holds positions 0 .. num_cached-1, each computed from the committed
token and the target's true feature before it. The rollout past them (drafts 2..k) is written to the
next slots but never counted: the next catch-up overwrites those slots with true features, so
rollback is bookkeeping and nothing is ever copied back.

The target's features arrive through `record_target_hidden` after every step, prefill chunks
included; those not yet consumed wait in a small per-request buffer. They are also kept per target KV
slot (target_features.py): a request that starts after a cached prefix reads the prefix's features
from there, and the head computes its own K/V for the prefix in its first catch-up.

With `tree`, the drafts are a tree grown level by level (eagle_tree.py): one head pass per level
over the newest token and the tree's nodes as tree rows, in the slots the rollout would use, so
they too are overwritten by the next catch-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.arch import DecoderArch
from engine.models.build import optimize_for_cpu
from engine.models.native_pass import NativePass, adopt_float32_layers
from engine.proposers.base import DraftProposal, Proposer
from engine.proposers.chain import draft_chains
from engine.proposers.eagle3_head import Eagle3Head
from engine.proposers.eagle_tree import TreeGrowth
from engine.proposers.published_eagle import load_eagle_head
from engine.proposers.target_features import TargetFeatureStore
from engine.request import Request
from engine.runner.paged_runner import PagedInputs, PagedRunner
from engine.runner.target_handle import TargetHandle
from engine.step.types import SequenceRows


def optimize_head(head: nn.Module, layers: list[nn.Module], target: TargetHandle,
                  **feature_input) -> None:
    """The head's linears for the CPU, and its decoder layer as one native call where the pass can
    run it (engine/models/native_pass.py; `feature_input`: EAGLE-3's, for_layers says)."""
    adopt_float32_layers(layers)  # NOTE: before optimize_for_cpu gives the linears another layout
    optimize_for_cpu(head, target.dtype, target.device)
    if target.device.type == "cpu":
        head.native_pass = NativePass.for_layers(layers, **feature_input)


@torch.inference_mode()
def linear_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's [out, in] weight, whatever layout it keeps (the CPU path pre-packs weights
    for oneDNN and drops the plain tensor): the layer applied to the identity, exact in any float;
    a packed layer dequantizes its own."""
    if hasattr(linear, "dequantized_weight"):
        return linear.dequantized_weight()
    probe = next(linear.buffers(), None)
    if probe is None:
        probe = next(linear.parameters())
    eye = torch.eye(linear.in_features, dtype=probe.dtype, device=probe.device)
    zero = torch.zeros(1, linear.in_features, dtype=probe.dtype, device=probe.device)
    return (linear(eye) - linear(zero)).T.contiguous()


@dataclass
class _EagleState:
    # target features not yet consumed, for positions feature_start .. feature_start + len - 1;
    # position -1 (before the first token) has a zero feature
    features: torch.Tensor
    feature_start: int = -1
    # positions whose K/V, from true tokens and features, sits in the head's cache
    num_cached: int = 0

    @property
    def feature_end(self) -> int:
        return self.feature_start + len(self.features)


class EagleProposer(Proposer):
    """EAGLE-1 heads (`method` "eagle": eagle_head.py) and EAGLE-3 heads ("eagle3": eagle3_head.py)
    draft alike; they differ in the features they read and in how they score tokens."""

    needs_committed_hidden = True

    def __init__(self, folder: str, target: TargetHandle, method: str = "eagle",
                 tree: bool = False) -> None:
        # draft a tree of up to cap nodes (eagle_tree.py) instead of a chain of cap tokens
        self.tree = tree
        if method == "eagle3":
            self.head, self.target_feature_layers = Eagle3Head.load(
                folder, target.arch, target.dtype, target.device)
            # NOTE: before the head's modules are captured below: this swaps its linears
            optimize_head(self.head, [self.head], target, feature_norm=self.head.hidden_norm,
                          norm_before_residual=self.head.config.norm_before_residual)
            layer_arch = self.head.config.layer_arch(target.arch)
            # the three target layers' streams, fused once as they arrive
            self._project_features = self.head.fc
            self._draft_logits = self.head.draft_logits
            self.embed_tokens = self.head.embed_tokens or target.embed_tokens
        else:
            self.head = load_eagle_head(folder, target.arch, target.dtype, target.device)
            optimize_head(self.head, [self.head.layer], target)
            layer_arch = self.head.config.layer_arch(target.arch)
            # the LM-head rows of the draft vocabulary, a copy, laid out as the target's linears
            weight = self.head.draft_head_weight(linear_weight(target.lm_head))
            draft_head = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                                 device="meta"))
            draft_head[0].weight = nn.Parameter(weight, requires_grad=False)
            optimize_for_cpu(draft_head, target.dtype, target.device)
            self._project_features = None
            self._draft_logits = draft_head[0]
            # the target's embedding, read-only
            self.embed_tokens = target.embed_tokens
        self._start_runtime(layer_arch, target)

    def _start_runtime(self, layer_arch: DecoderArch, target: TargetHandle) -> None:
        """Around a loaded head: its paged KV cache (a layer per layer of `layer_arch`, blocks
        sized as the target's), the features kept per target KV slot, the per-request states."""
        self.feature_size = layer_arch.hidden_size
        self.runner = PagedRunner.with_own_pool(self.head, layer_arch, target.num_blocks,
                                                target.block_size, target.dtype, target.device)
        self.vocab_size = target.arch.vocab_size
        self.dtype, self.device = target.dtype, target.device
        self.target_features = TargetFeatureStore(target.num_blocks, target.block_size,
                                                  self.feature_size, target.dtype, target.device)
        self.states: dict[str, _EagleState] = {}
        # requests whose features went missing (never expected): they draft nothing from then on
        self.disabled: set[str] = set()

    def record_target_hidden(self, request: Request, start_position: int, hidden: torch.Tensor,
                             block_table: list[int]) -> None:
        if self._project_features is not None:
            hidden = self._project_features(hidden.to(self.dtype))
        # NOTE: first, and for every request: a block this request fills may be cached and read
        # by a later request, whether or not this one drafts
        self.target_features.write(block_table, start_position, hidden)
        request_id = request.request_id
        if request_id in self.disabled:
            return
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = _EagleState(
                torch.zeros(1, self.feature_size, dtype=self.dtype, device=self.device))
        end = start_position + len(hidden)
        if start_position > state.feature_end:
            # a cached prefix: its features were kept by whoever computed its blocks
            hidden = torch.cat([self.target_features.read(block_table, state.feature_end,
                                                          start_position), hidden])
            start_position = state.feature_end
        if end > state.feature_end:
            # NOTE: a preempted request recomputes features already seen; only new ones are kept
            fresh = hidden[state.feature_end - start_position:]
            state.features = torch.cat([state.features, fresh.to(self.dtype)])

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        caps = self._caps_reserved(requests, max_num_tokens)
        if self.tree:
            return self._propose_trees(requests, caps)
        # the head's h at each drafting request's newest position, row by row of `last_rows`
        last: torch.Tensor | None = None
        last_rows: list[int] = []

        def advance(step: int, rows: list[int],
                    drafts: dict[int, list[int]]) -> tuple[list[int], torch.Tensor]:
            nonlocal last, last_rows
            if step == 0:
                last = self._catch_up([requests[i] for i in rows])
            else:
                last = self._roll_out([requests[i] for i in rows], [drafts[i][-1] for i in rows],
                                      last[[last_rows.index(i) for i in rows]], step)
            last_rows = rows
            return rows, self._logits(last)

        return draft_chains(requests, caps, advance)

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.disabled.discard(request_id)
        self.runner.free(request_id)

    # ------------------------------------------------------------------ internals
    def _caps_reserved(self, requests: list[Request], max_num_tokens: list[int]) -> list[int]:
        """Each request's cap where it can draft now (its blocks reserved), else 0."""
        return [cap if cap > 0 and self._reserve(request, cap) else 0
                for request, cap in zip(requests, max_num_tokens)]

    def _reserve(self, request: Request, cap: int) -> bool:
        """Whether the request can draft now: the features its catch-up reads are here, and the head's
        cache holds blocks for the catch-up and the rollout (allocated here when they are)."""
        state = self.states.get(request.request_id)
        if state is None or request.request_id in self.disabled:
            return False
        num_tokens = request.num_tokens
        # catching up on positions num_cached .. num_tokens-1 reads features num_cached-1 .. num_tokens-2
        if not (state.num_cached < num_tokens and state.feature_start <= state.num_cached - 1
                and state.feature_end >= num_tokens - 1):
            return False
        # a chain's rollout writes up to position num_tokens + cap - 2; a tree's passes write the
        # newest token and at most cap nodes from position num_tokens - 1 on
        num_slots = num_tokens + cap if self.tree else num_tokens + cap - 1
        if not self.runner.reserve(request.request_id, num_slots):
            self._disable(request.request_id)  # the head's pool is full: no drafts for this one
            return False
        return True

    def _catch_up(self, requests: list[Request]) -> torch.Tensor:
        """Feed every committed token the head has not seen, with the target's feature before it;
        returns h at each request's newest token: [len(requests), hidden]."""
        inputs, hidden = self._catch_up_rows(requests)
        return hidden[inputs.last_rows]

    def _catch_up_rows(self, requests: list[Request]) -> tuple[PagedInputs, torch.Tensor]:
        """_catch_up's pass and h at every row of it: [num_rows, hidden]."""
        sequences, features = [], []
        for request in requests:
            state = self.states[request.request_id]
            start, end = state.num_cached, request.num_tokens
            sequences.append(SequenceRows(request.request_id, start,
                                          request.token_ids_between(start, end)))
            offset = start - 1 - state.feature_start
            features.append(state.features[offset:offset + end - start])
            state.num_cached = end
            # keep f_{end-1}: the next catch-up starts at position `end`
            state.features = state.features[end - 1 - state.feature_start:]
            state.feature_start = end - 1
        inputs = self.runner.prepare(sequences)
        return inputs, self._run(inputs, torch.cat(features))

    def _roll_out(self, requests: list[Request], tokens: list[int], features: torch.Tensor,
                  step: int) -> torch.Tensor:
        """One more draft position per request, from its last draft token and the head's own h."""
        return self._run(self.runner.prepare([
            SequenceRows(request.request_id, request.num_tokens - 1 + step, [token])
            for request, token in zip(requests, tokens)]), features)

    def _propose_trees(self, requests: list[Request], caps: list[int]) -> list[DraftProposal]:
        """Trees grown level by level, every drafting request's level in one head pass."""
        rows = [i for i, cap in enumerate(caps) if cap > 0]
        proposals = [DraftProposal([]) for _ in requests]
        if not rows:
            return proposals
        drafting = [requests[i] for i in rows]
        # NOTE: read before the catch-up consumes them: f_{num_tokens-2}, the newest token's
        # feature, which every tree pass's root row is fed again
        root_features = self._newest_features(drafting)  # [len(rows), feature]
        root_hidden = self._catch_up(drafting)  # [len(rows), hidden]
        growths = [TreeGrowth(request, caps[i], h)
                   for request, i, h in zip(drafting, rows, root_hidden)]
        for growth, logits in zip(growths, self._logits(root_hidden)):
            growth.expand([-1], logits[None])
        while growing := [g for g, growth in enumerate(growths) if growth.frontier]:
            frontier_hidden = self._tree_pass([growths[g] for g in growing],
                                              root_features[growing])
            for g, hidden in zip(growing, frontier_hidden):
                growth = growths[g]
                for node, h in zip(growth.frontier, hidden):
                    growth.nodes[node].hidden = h
                growth.expand(growth.frontier, self._logits(hidden))
        for i, growth in zip(rows, growths):
            proposals[i] = growth.proposal()
        return proposals

    def _tree_pass(self, growths: list[TreeGrowth],
                   root_features: torch.Tensor) -> list[torch.Tensor]:
        """One head pass over each tree's newest token and the nodes its frontier needs, as tree
        rows from position num_tokens - 1; returns h at each tree's frontier nodes, in order:
        [len(frontier), hidden] per tree. root_features: [len(growths), feature].

        NOTE: the rows fill slots num_tokens - 1 .. num_tokens - 1 + len(nodes). The newest token's
        K/V is rewritten from the same token and feature the catch-up used; the nodes' slots are
        past the committed tokens, and the next catch-up (from num_cached = num_tokens on) writes
        every one of them it later reads.
        """
        sequences: list[SequenceRows] = []
        features: list[torch.Tensor] = []
        frontier_rows: list[list[int]] = []
        first_row = 0
        for growth, root_feature in zip(growths, root_features):
            request, nodes = growth.request, growth.pass_rows()
            row_of = {node: 1 + r for r, node in enumerate(nodes)}
            parents = [-1] + [0 if growth.nodes[node].parent < 0
                              else row_of[growth.nodes[node].parent] for node in nodes]
            newest = request.token_ids_between(request.num_tokens - 1, request.num_tokens)
            sequences.append(SequenceRows(
                request.request_id, request.num_tokens - 1,
                newest + [growth.nodes[node].token_id for node in nodes], parents))
            features += [root_feature] + [growth.feature(node) for node in nodes]
            frontier_rows.append([first_row + row_of[node] for node in growth.frontier])
            first_row += 1 + len(nodes)
        hidden = self._run(self.runner.prepare(sequences), torch.stack(features))
        return [hidden[rows] for rows in frontier_rows]

    def _newest_features(self, requests: list[Request]) -> torch.Tensor:
        """The target feature each request's newest token is fed with, f_{num_tokens-2}:
        [len(requests), feature]."""
        return torch.stack([
            state.features[request.num_tokens - 2 - state.feature_start]
            for request, state in ((r, self.states[r.request_id]) for r in requests)])

    def _run(self, inputs: PagedInputs, features: torch.Tensor) -> torch.Tensor:
        return self.runner.run(inputs, self.embed_tokens(inputs.input_ids), features)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits, -inf outside the draft vocabulary: [rows, vocab]."""
        logits = hidden.new_full((len(hidden), self.vocab_size), float("-inf"))
        index = self.head.draft_token_ids.expand(len(hidden), -1)
        return logits.scatter_(1, index, self._draft_logits(hidden))

    def _disable(self, request_id: str) -> None:
        self.disabled.add(request_id)
        self.states.pop(request_id, None)
        self.runner.free(request_id)
