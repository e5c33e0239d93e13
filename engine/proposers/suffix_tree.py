"""A depth-limited suffix tree over token ids that grows one token at a time and counts how often
each pattern occurred: the index SuffixDecoding (arXiv 2411.04975) drafts from.

Every suffix of the inserted sequences, cut at `max_depth` tokens, is a path from the root; a node's
`count` is how many of those suffixes reach it, so count(child) / num_continued(node) estimates how
likely the child's token follows the node's pattern. Edges are compressed (a node refers to a slice
of one inserted sequence instead of holding its tokens): memory is O(tokens), not O(tokens * depth).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence


class _Node:
    """A node and the edge that leads into it: the tokens seq[start:start + length].

    NOTE: every inserted suffix ends at a node's end, never inside an edge, so the count of a node
    holds along its whole edge, and a draft never has to choose inside an edge.
    """

    __slots__ = ("parent", "children", "count", "num_continued", "seq", "start", "length", "depth",
                 "best_child")

    def __init__(self, parent: _Node | None, seq: list[int], start: int, length: int, depth: int,
                 count: int) -> None:
        self.parent = parent
        # first token of the child's edge -> child
        self.children: dict[int, _Node] = {}
        # inserted suffixes that reach the end of this node
        self.count = count
        # of those, the ones that go on into a child (the sum of the children's counts); the rest
        # end here: at the end of their sequence, or of the open one (its next token is not known)
        self.num_continued = 0
        self.seq, self.start, self.length = seq, start, length
        # tokens from the root to the end of this node
        self.depth = depth
        # the child with the highest count (the first to reach it on ties); None for a leaf
        self.best_child: _Node | None = None

    def offer_best(self, child: _Node) -> None:
        """Counts only grow, so the best child changes only when an offered child overtakes it."""
        if self.best_child is None or child.count > self.best_child.count:
            self.best_child = child


class SuffixTree:
    """Suffixes of one open sequence, extended token by token, plus any closed sequences before it.

    `append` costs O(max_depth): it advances the (at most max_depth) suffixes of the open sequence
    that are still shorter than max_depth, the "active" ones, by one token each.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(None, [], 0, 0, 0, 0)
        # tokens of every sequence inserted, the open one included
        self.num_tokens = 0
        # the open sequence; nodes refer into it, so it only ever grows
        self.tokens: list[int] = []
        # where the open sequence's suffixes shorter than max_depth end, longest first
        self._active: list[_Node] = []

    # ------------------------------------------------------------------ insertion
    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            self.append(token)

    def add_sequence(self, token_ids: Sequence[int]) -> None:
        """Insert a whole sequence of its own: no suffix spans it and what was open before it."""
        self.tokens, self._active = [], []
        self.extend(token_ids)
        self._active = []

    def append(self, token: int) -> None:
        """Extend the open sequence by one token: every active suffix grows by it, and the one-token
        suffix it forms starts at the root."""
        position = len(self.tokens)
        self.tokens.append(token)
        self.num_tokens += 1
        self.root.count += 1
        self._active.append(self.root)
        still_active = []
        for node in self._active:
            node = self._advance(node, token, position)
            if node.depth < self.max_depth:
                still_active.append(node)
        self._active = still_active

    def _advance(self, node: _Node, token: int, position: int) -> _Node:
        """Move the suffix that ends at `node` over `token` (at `position` of the open sequence);
        return the node it ends at now. `*` marks where the suffix ends, (n) a count, t the token:

            no child t, A is this suffix's own leaf:  A(1)*           ->  At(1)*
            no child t, other suffixes reach A:       A(n)*           ->  A(n) -- t(1)*
            all others at A go on into child tB:      A(c)* -- tB(c-1) ->  At(c)* -- B(c-1)
                                                      (B empty: tB swallows A)
            else into child tB (B empty: no split):   A* -- tB(n)     ->  A -- t(n+1)* -- B(n)
        """
        seq = self.tokens
        child = node.children.get(token)
        if child is None:
            if node.count == 1 and node is not self.root:
                # only this suffix reaches `node`: it is the leaf this suffix made; grow it in place
                node.length += 1
                node.depth += 1
                return node
            leaf = _Node(node, seq, position, 1, node.depth + 1, 1)
            node.children[token] = leaf
            node.num_continued += 1
            node.offer_best(leaf)
            return leaf
        if node.count == child.count + 1 and node is not self.root:
            # every other suffix through `node` goes on into `child`: move the end of `node` one
            # token down instead of creating a node for this suffix alone
            if child.length == 1:
                # `child` swallows `node`: its edge now starts where the edge of `node` did
                parent = node.parent
                child.seq, child.start = seq, position - node.length
                child.length = node.length + 1
                child.count += 1
                child.parent = parent
                parent.children[seq[child.start]] = child
                if parent.best_child is node:
                    parent.best_child = child
                return child
            node.seq, node.start = seq, position - node.length
            node.length += 1
            node.depth += 1
            del node.children[token]
            child.start += 1
            child.length -= 1
            node.children[child.seq[child.start]] = child
            return node
        node.num_continued += 1
        if child.length == 1:
            child.count += 1
            node.offer_best(child)
            return child
        # split `child`: its first token becomes a node of its own, where this suffix ends
        head = _Node(node, child.seq, child.start, 1, node.depth + 1, child.count + 1)
        child.start += 1
        child.length -= 1
        child.parent = head
        head.children[child.seq[child.start]] = child
        head.num_continued = child.count
        head.best_child = child
        node.children[token] = head
        if node.best_child is child:
            node.best_child = head
        else:
            node.offer_best(head)
        return head

    # ------------------------------------------------------------------ lookup
    def repeats(self, max_length: int) -> Iterator[_Node]:
        """Nodes of the suffixes of the open sequence, at most max_length tokens, that occurred
        before with a next token, longest first. O(max_depth)."""
        for node in self._active:
            if node.depth <= max_length and node.num_continued:
                yield node

    def locate(self, token_ids: list[int], start: int, end: int) -> tuple[_Node, int] | None:
        """Where the pattern token_ids[start:end] ends in the tree, as (node, tokens of its edge
        consumed), or None if it never occurred. O(end - start)."""
        node, offset = self.root, 0
        while start < end:
            child = node.children.get(token_ids[start])
            if child is None:
                return None
            step = min(child.length, end - start)
            if step > 1 and (child.seq[child.start + 1:child.start + step]
                             != token_ids[start + 1:start + step]):
                return None
            node, offset, start = child, step, start + step
        return node, offset

    def longest_match(self, token_ids: list[int], max_length: int) -> tuple[_Node, int, int]:
        """The longest suffix of token_ids, at most max_length tokens, that occurred here followed
        by at least one more token, as (node, offset, match length). A binary search: if a suffix
        occurred with a continuation, so did each shorter one. O(max_length * log(max_length))."""
        num_tokens = len(token_ids)
        best, low, high = (self.root, 0, 0), 1, min(max_length, num_tokens)
        while low <= high:
            length = (low + high) // 2
            found = self.locate(token_ids, num_tokens - length, num_tokens)
            if found is not None and (found[1] < found[0].length or found[0].num_continued):
                best, low = (*found, length), length + 1
            else:
                high = length - 1
        return best

    @staticmethod
    def continuation(node: _Node, offset: int, max_tokens: int,
                     min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent path after (node, offset) for up to max_tokens tokens while the
        estimated probability of the path stays >= min_prob; returns (tokens, score), where score
        is the sum of the path's probabilities: the expected number of tokens accepted."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < max_tokens:
            if offset < node.length:
                # inside an edge every occurrence continues the same way: the probability holds
                take = min(node.length - offset, max_tokens - len(draft))
                draft += node.seq[node.start + offset:node.start + offset + take]
                score += prob * take
                offset += take
                continue
            child = node.best_child
            if child is None:
                break
            prob *= child.count / node.num_continued
            if prob < min_prob:
                break
            node, offset = child, 1
            draft.append(child.seq[child.start])
            score += prob
        return draft, score

    @staticmethod
    def speculation_tree(node: _Node, offset: int, max_tokens: int, max_depth: int,
                         min_prob: float) -> tuple[list[int], list[int], float]:
        """The up-to-max_tokens likeliest continuations after (node, offset) as a tree, grown
        best-first by estimated path probability (the product of count(child) / num_continued
        along it, as `continuation` estimates it), no deeper than max_depth and no path below
        min_prob; returns (tokens, parents, score) in the order chosen, which lists each parent
        before its children and siblings likeliest first. score: the sum of the chosen paths'
        probabilities, the expected number of tokens accepted. O(max_tokens * log) plus the
        children looked at."""
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        # (-probability, order pushed, node, index in its edge, parent draft, depth): the token
        # node.seq[node.start + index]; the order pushed breaks ties, siblings best child first
        heap: list[tuple[float, int, _Node, int, int, int]] = []
        num_pushed = 0

        def push_next(node: _Node, offset: int, prob: float, parent: int, depth: int) -> None:
            """Offer what may follow (node, offset), a path of probability prob at depth."""
            nonlocal num_pushed
            if depth >= max_depth:
                return
            if offset < node.length:
                # inside an edge every occurrence continues the same way: the probability holds
                heapq.heappush(heap, (-prob, num_pushed, node, offset, parent, depth + 1))
                num_pushed += 1
                return
            best = node.best_child
            if best is None:
                return
            # NOTE: the best child first, as `continuation` walks it: the main chain is its draft
            others = heapq.nlargest(max_tokens - 1, (child for child in node.children.values()
                                                     if child is not best),
                                    key=lambda child: child.count)
            for child in [best, *others]:
                child_prob = prob * (child.count / node.num_continued)
                if child_prob < min_prob:
                    break
                heapq.heappush(heap, (-child_prob, num_pushed, child, 0, parent, depth + 1))
                num_pushed += 1

        push_next(node, offset, 1.0, -1, 0)
        while heap and len(tokens) < max_tokens:
            neg_prob, _, node, index, parent, depth = heapq.heappop(heap)
            tokens.append(node.seq[node.start + index])
            parents.append(parent)
            score -= neg_prob
            push_next(node, index + 1, -neg_prob, len(tokens) - 1, depth)
        return tokens, parents, score
