"""MTP drafting: the target's own multi-token prediction layers (mtp_head.py) draft as an EAGLE head
does (eagle.py), each layer with its own paged KV cache over the target's committed tokens.

With N layers, draft step s runs layer min(s, N - 1) at the request's next position:

    committed x_0 .. x_{n-1}, drafts d_1, d_2, ...     h^j_p: layer j's output at position p
    catch-up  every layer j over the new committed positions p: (x_p, h^{j-1}_{p-1}), h^{-1} = f
    step 0    layer 0's h^0_{n-1} -> d_1
    step s<N  layer s over positions n .. n+s-1: (d_1..d_s, h^{s-1}_{n-1} .. h^{s-1}_{n+s-2})
              -> its last row gives d_{s+1}; the other rows fill its cache where layer s-1 drafted
    step s>=N layer N-1 at position n+s-1: (d_s, its own h at n+s-2), as vLLM reuses the last layer

so every layer attends to a cache computed from exactly the inputs its training saw: true tokens and
true states up to the newest committed token, its own chain past it. Everything past the committed
tokens is overwritten by the next catch-up (rollback is bookkeeping, as for EAGLE). The layers share
one block table per request, so one reservation covers them all. Trees (`draft_tree`) are EAGLE's,
grown by layer 0 alone.
"""

from __future__ import annotations

import torch

from engine.models.build import optimize_for_cpu
from engine.models.native_pass import NativePass, adopt_float32_layers
from engine.proposers.base import DraftProposal
from engine.proposers.chain import draft_chains
from engine.proposers.eagle import EagleProposer
from engine.proposers.mtp_head import MtpHead, mtp_layer_arch, read_mtp_head
from engine.request import Request
from engine.runner.paged_runner import PagedInputs
from engine.runner.target_handle import TargetHandle
from engine.step.types import SequenceRows


class MtpProposer(EagleProposer):
    def __init__(self, target: TargetHandle, tree: bool = False) -> None:
        # NOTE: not EagleProposer.__init__, which loads a head from a folder of its own
        self.tree = tree
        head = read_mtp_head(target.checkpoint, target.arch).placed(target.dtype, target.device)
        self.head: MtpHead = head
        self.num_layers = len(head.layers)
        decoders = [layer.layer for layer in head.layers]
        adopt_float32_layers(decoders)  # NOTE: before optimize_for_cpu gives them another layout
        optimize_for_cpu(head, target.dtype, target.device)
        if target.device.type == "cpu":
            for layer in head.layers:
                layer.native_pass = NativePass.for_layers([layer.layer])
        # what scores and embeds for each layer: its own tables where it has them, else the
        # target's (read-only)
        self._lm_heads = [layer.lm_head or target.lm_head for layer in head.layers]
        self._embeddings = [layer.embed_tokens or target.embed_tokens for layer in head.layers]
        self._project_features = None
        self._start_runtime(mtp_layer_arch(target.arch, self.num_layers), target)
        # each layer's cache, in a list of its own (a native pass keeps the list it was given)
        self._layer_caches = [[cache] for cache in self.runner.kv_caches]
        # per request, layer j-1's output at position num_cached - 1 for each layer j >= 1: the
        # state layer j's next catch-up starts from
        self._chain_tails: dict[str, list[torch.Tensor]] = {}

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        caps = self._caps_reserved(requests, max_num_tokens)
        if self.tree:
            return self._propose_trees(requests, caps)
        # per batch row: each layer's output at the newest committed token (after the catch-up),
        # and the previous step's outputs, every row of it
        newest: dict[int, list[torch.Tensor]] = {}
        previous: dict[int, torch.Tensor] = {}

        def advance(step: int, rows: list[int],
                    drafts: dict[int, list[int]]) -> tuple[list[int], torch.Tensor]:
            if step == 0:
                per_layer = self._catch_up_layers([requests[i] for i in rows])
                for position, i in enumerate(rows):
                    newest[i] = [outputs[position] for outputs in per_layer]
                    previous[i] = per_layer[0][position:position + 1]
                return rows, self._logits(per_layer[0], 0)
            if step < self.num_layers:
                # a layer not run yet this round: the drafts so far, from position n on, each
                # read with layer step-1's output one position back
                depth, num_rows = step, step
                states = [torch.cat([newest[i][depth - 1][None], previous[i]])[-num_rows:]
                          for i in rows]
            else:  # the last layer again, on its own output
                depth, num_rows = self.num_layers - 1, 1
                states = [previous[i][-1:] for i in rows]
            first_position = step - num_rows  # past the newest committed token
            sequences = [SequenceRows(requests[i].request_id,
                                      requests[i].num_tokens + first_position,
                                      drafts[i][-num_rows:]) for i in rows]
            hidden = self._run(self.runner.prepare(sequences), torch.cat(states), depth)
            outputs = hidden.view(len(rows), num_rows, -1)  # [rows, num_rows, hidden]
            for position, i in enumerate(rows):
                previous[i] = outputs[position]
            return rows, self._logits(outputs[:, -1], depth)

        return draft_chains(requests, caps, advance)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._chain_tails.pop(request_id, None)

    # ------------------------------------------------------------------ internals
    def _catch_up_layers(self, requests: list[Request]) -> list[torch.Tensor]:
        """Every layer over the committed positions it has not seen, layer j reading layer
        j-1's outputs one position back; returns each layer's output at every request's newest
        token: N x [len(requests), hidden]."""
        # NOTE: before the catch-up moves num_cached on
        tails = [self._tails(request.request_id, self.states[request.request_id].num_cached)
                 for request in requests]
        inputs, hidden = self._catch_up_rows(requests)
        newest = [hidden[inputs.last_rows]]
        first_rows = torch.cat([inputs.last_rows.new_zeros(1), inputs.last_rows[:-1] + 1])
        for depth in range(1, self.num_layers):
            states = []
            for request_tails, first, last in zip(tails, first_rows.tolist(),
                                                  inputs.last_rows.tolist()):
                states += [request_tails[depth - 1][None], hidden[first:last]]
                request_tails[depth - 1] = hidden[last]
            hidden = self._run(inputs, torch.cat(states), depth)
            newest.append(hidden[inputs.last_rows])
        return newest

    def _tails(self, request_id: str, num_cached: int) -> list[torch.Tensor]:
        """The request's chain tails; zero states before its first position."""
        if num_cached == 0 or request_id not in self._chain_tails:
            self._chain_tails[request_id] = [
                torch.zeros(self.feature_size, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers - 1)]
        return self._chain_tails[request_id]

    def _run(self, inputs: PagedInputs, features: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP layer `depth` over the pass's rows with its own cache: [num_rows, hidden]."""
        layer = self.head.layers[depth]
        return layer(self._embeddings[depth](inputs.input_ids), features.to(self.dtype),
                     inputs.positions, inputs.attn_metadata, self._layer_caches[depth])

    def _logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Full-vocabulary logits of layer `depth`'s states: [rows, vocab]."""
        return self._lm_heads[depth](self.head.layers[depth].head_input(hidden))

    def _disable(self, request_id: str) -> None:
        super()._disable(request_id)
        self._chain_tails.pop(request_id, None)
