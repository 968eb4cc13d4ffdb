"""A depth-bounded suffix trie with counts, and the cross-request cache built on it (suffix decoding's data).

SuffixDecoding (Oliaro et al., NeurIPS'25; ArcticInference and vLLM ship it) drafts from a suffix tree over earlier
text: match the longest suffix of the sequence in the tree, then follow the most frequent continuations. Here the
tree is a trie of every substring of at most `depth` tokens; a node's `count` is how many times its path occurs,
so a child's share of its siblings' counts is the empirical probability of that continuation.

- `SuffixTrie.extend` adds tokens one at a time (each new token extends the `depth` latest partial paths: O(depth)
  dict operations), so a request's own trie grows with its committed tokens and is never rebuilt.
- `SuffixTrie.remove` takes a whole text back out (counts down, emptied subtrees dropped): the cache's eviction.
- `SuffixTrie.draft` matches and proposes a chain or a small token tree scored by those probabilities.

`SuffixCache` holds finished requests' prompts and outputs, one trie per scope (the server: an API key's hash),
bounded in tokens (least recently added request evicted first) and locked: the engine thread adds and reads it
while the server's other threads may configure or inspect it.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class _Node:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0  # occurrences of this node's path
        self.kids: dict[int, _Node] | None = None  # token -> child (None: a leaf, saves a dict per leaf)


@dataclass
class SuffixDraft:
    """A proposal from a trie: a chain (parents None) or a tree in parents-first order."""

    tokens: list[int]  # draft tokens, node order
    parents: list[int] | None  # [len(tokens)]: parent node (0: the last committed token; i: tokens[i - 1])
    score: float  # sum of the nodes' path probabilities: the expected number of accepted tokens
    match: int  # tokens of the matched suffix


EMPTY = SuffixDraft([], None, 0.0, 0)


class SuffixTrie:
    """Every substring of at most `depth` tokens of the texts added, with occurrence counts."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"suffix depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.nodes = 0  # nodes besides the root (memory accounting, tests)
        self._open: list[_Node] = []  # extend's partial paths: ends of the last depth - 1 suffixes, longest first

    # -- building ------------------------------------------------------------------------------------------------

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the text being built (one text per trie that uses extend: a request's own)."""
        limit = self.depth - 1
        for token in tokens:
            self.root.count += 1
            grown = []
            for node in [*self._open, self.root]:  # the hot loop: _child inlined
                kids = node.kids
                if kids is None:
                    kids = node.kids = {}
                child = kids.get(token)
                if child is None:
                    child = kids[token] = _Node()
                    self.nodes += 1
                child.count += 1
                grown.append(child)
            # A path of `depth` tokens cannot grow further: keep the depth - 1 shortest.
            self._open = grown[-limit:] if len(grown) > limit else grown

    def add(self, tokens: Sequence[int]) -> None:
        """Insert a whole text (its own substrings only: nothing joins it to other texts)."""
        for start in range(len(tokens)):
            node = self.root
            node.count += 1
            for token in tokens[start : start + self.depth]:
                node = self._child(node, token)
                node.count += 1

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a text given to `add` earlier (counts fall; a subtree whose count reaches 0 is dropped)."""
        for start in range(len(tokens)):
            node = self.root
            node.count -= 1
            for token in tokens[start : start + self.depth]:
                child = node.kids[token]
                child.count -= 1
                if child.count == 0:  # descendants count no more than their ancestor: all of them are gone too
                    self.nodes -= _size(child)
                    del node.kids[token]
                    if not node.kids:
                        node.kids = None
                    break
                node = child

    def _child(self, node: _Node, token: int) -> _Node:
        if node.kids is None:
            node.kids = {}
        child = node.kids.get(token)
        if child is None:
            child = node.kids[token] = _Node()
            self.nodes += 1
        return child

    # -- drafting ------------------------------------------------------------------------------------------------

    def match(self, context: Sequence[int], max_match: int) -> tuple[_Node | None, int]:
        """The longest suffix of `context` (at most max_match tokens) that occurred earlier with a continuation ->
        (its node, its length), or (None, 0). Monotone in the length (an occurrence of a suffix followed by a
        token contains one of each shorter suffix), so a binary search finds it in O(max_match log max_match)."""
        lo, hi, best = 1, min(max_match, len(context), self.depth - 1), None
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self._walk(context[len(context) - mid :])
            if node is not None and node.kids:
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best or (None, 0)

    def _walk(self, tokens: Sequence[int]) -> _Node | None:
        node = self.root
        for token in tokens:
            if node.kids is None:
                return None
            node = node.kids.get(token)
            if node is None:
                return None
        return node

    def draft(self, context: Sequence[int], k: int, min_prob: float, max_match: int, tree_nodes: int = 0,
              spec_factor: float | None = None) -> SuffixDraft:
        """Up to k tokens continuing `context`, each with path probability >= min_prob (the product of the
        continuation shares along the path): the most frequent chain, or with tree_nodes > k a token tree of up to
        tree_nodes nodes, depth <= k, expanded best first. The match leaves room for k tokens below it.
        spec_factor: at most spec_factor x the match's length (at least 1) tokens deep (SuffixDecoding's
        max_spec_factor): a one-token match seen once is a weak sign, however certain its counts look."""
        node, size = self.match(context, min(max_match, self.depth - 1 - min(k, self.depth - 2)))
        if spec_factor is not None:
            k = min(k, max(1, int(spec_factor * size)))
        if node is None or k <= 0:
            return EMPTY
        if tree_nodes > k:
            return _best_first(node, k, min_prob, tree_nodes, size)
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < k and node.kids:
            total = sum(kid.count for kid in node.kids.values())
            token, kid = max(node.kids.items(), key=lambda item: item[1].count)
            prob *= kid.count / total
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            node = kid
        return SuffixDraft(tokens, None, score, size)


def _best_first(node: _Node, k: int, min_prob: float, budget: int, size: int) -> SuffixDraft:
    """A token tree: the `budget` most probable continuations (path probability >= min_prob, depth <= k)."""
    tokens, parents, score = [], [], 0.0
    heap: list[tuple] = []  # candidates: (-path probability, order, parent node index, depth, token, trie node)
    order = 0

    def offer(at: _Node, prob: float, index: int, depth: int) -> None:
        nonlocal order
        if depth > k or not at.kids:
            return
        total = sum(kid.count for kid in at.kids.values())
        for token, kid in at.kids.items():
            if prob * kid.count / total >= min_prob:
                heapq.heappush(heap, (-prob * kid.count / total, order, index, depth, token, kid))
                order += 1

    offer(node, 1.0, 0, 1)
    while heap and len(tokens) < budget:
        neg, _, parent, depth, token, kid = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        score -= neg
        offer(kid, -neg, len(tokens), depth + 1)
    # A candidate is offered only once its parent is a node: parents come first.
    return SuffixDraft(tokens, parents, score, size)


def _size(node: _Node) -> int:
    stack, total = [node], 0
    while stack:
        at = stack.pop()
        total += 1
        if at.kids:
            stack.extend(at.kids.values())
    return total


class SuffixCache:
    """Finished requests' texts (prompt + output), one trie per scope, at most `max_tokens` tokens in all.

    Scopes never see each other's text: what a request can draft from (and so how fast it runs) depends only on
    its own scope's earlier requests. Least recently added requests are evicted first. Every method holds the lock.
    """

    def __init__(self, max_tokens: int = 65536, depth: int = 16) -> None:
        if max_tokens < 0:
            raise ValueError(f"--suffix-cache-tokens must be >= 0 (0 disables the cache), got {max_tokens}")
        self.max_tokens = max_tokens
        self.depth = depth
        self.tokens = 0
        self._tries: dict[str, SuffixTrie] = {}
        self._texts: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # id -> (scope, text), oldest first
        self._next = 0
        self._lock = threading.Lock()

    def add(self, scope: str, tokens: Sequence[int]) -> None:
        """Remember a finished request's text in `scope` (its last max_tokens tokens at most)."""
        text = list(tokens[-self.max_tokens:]) if self.max_tokens else []
        if len(text) < 2:
            return
        with self._lock:
            trie = self._tries.get(scope)
            if trie is None:
                trie = self._tries[scope] = SuffixTrie(self.depth)
            trie.add(text)
            self._texts[self._next] = (scope, text)
            self._next += 1
            self.tokens += len(text)
            while self.tokens > self.max_tokens:
                self._evict()

    def _evict(self) -> None:
        _, (scope, text) = self._texts.popitem(last=False)
        trie = self._tries[scope]
        trie.remove(text)
        self.tokens -= len(text)
        if trie.root.count == 0:
            del self._tries[scope]

    def draft(self, scope: str, context: Sequence[int], k: int, min_prob: float, max_match: int,
              tree_nodes: int = 0, spec_factor: float | None = None) -> SuffixDraft:
        with self._lock:
            trie = self._tries.get(scope)
            return EMPTY if trie is None else trie.draft(context, k, min_prob, max_match, tree_nodes, spec_factor)

    def match_length(self, scope: str, context: Sequence[int], max_match: int) -> int:
        """Tokens of the longest suffix of `context` (at most max_match) that occurred in scope with a continuation."""
        with self._lock:
            trie = self._tries.get(scope)
            return 0 if trie is None else trie.match(context, max_match)[1]

    def clear(self) -> None:
        with self._lock:
            self._tries.clear()
            self._texts.clear()
            self.tokens = 0

    def stats(self) -> dict:
        """Requests, tokens and trie nodes held, per scope count (for metrics; never a scope's text)."""
        with self._lock:
            return {"requests": len(self._texts), "tokens": self.tokens, "scopes": len(self._tries),
                    "nodes": sum(trie.nodes for trie in self._tries.values())}
