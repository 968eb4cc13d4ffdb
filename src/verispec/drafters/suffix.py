"""Suffix decoding: draft from the request's own text and from earlier requests' texts, no model.

`--draft-model suffix` (SuffixDecoding, Oliaro et al., NeurIPS'25). Each round the longest suffix of the sequence
that occurred earlier with a continuation is matched in two suffix tries (suffix_tree.py): the request's own
(prompt and committed output, grown by each round's committed tokens, never rebuilt) and its scope's cache of
finished requests (`SuffixCache`, shared by every suffix drafter of the process unless given another). From the
match it follows the most frequent continuations while their empirical path probability stays >= `min_prob` and
at most `spec_factor` x the match's length deep: K is chosen by the match's confidence (at most the row's K), and a row that may verify a token tree gets the best-first
tree of its most probable continuations. The proposal with the higher expected accepted length wins.

In a cascade (`suffix+ngram+MODEL`) the stage gives way when its match is short: `can_propose` is true only for a
match of at least `cascade_min_match` tokens (2), so the next stage (a draft model) drafts after a one-token match.
Replaying the target's greedy outputs of the packaged repetitive workload, one-token matches accepted 0.06-0.63
tokens per round whatever their counts said, two-token ones 1.1-2.3 and longer ones 2.8-4.3 (docs/speculation.md).

Drafts are point masses (no q), so the verifier keeps greedy output equal to the target alone and sampling exact.

Scopes: a request's text joins the cache of its scope when it finishes (`release`), and drafts read only that
scope. The server passes each request's scope (its API key's hash) through `set_scope` before `begin`; without
one, a request is in the default scope "" (one tenant: the Python API, the CLI, the bench).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from .base import DraftBatch, DraftProposal, Drafter, DraftRow
from .suffix_tree import EMPTY, SuffixCache, SuffixDraft, SuffixTrie

DEFAULT_SCOPE = ""
DEFAULT_CACHE_TOKENS = 65536
# Drafts at most SPEC_FACTOR x the matched suffix's length deep. Replaying the target's greedy outputs of the
# packaged repetitive workload (17 prompts, 128 tokens, K=8, a verify token costing 6.6% of a step as bf16 measures
# here): 1.81x predicted against 1.59x uncapped (1.71x at K=4); 2.0 beat 1.0 and 3.0 (1.80x, 1.78x).
SPEC_FACTOR = 2.0

_shared: SuffixCache | None = None
_shared_lock = threading.Lock()


def shared_cache(max_tokens: int | None = None) -> SuffixCache:
    """The process's suffix cache (created on first use; `max_tokens` resizes it, e.g. `--suffix-cache-tokens`).
    Every suffix drafter built by name uses it, so `suffix` and `suffix+ngram` of one server learn together."""
    global _shared
    with _shared_lock:
        if _shared is None or (max_tokens is not None and max_tokens != _shared.max_tokens):
            _shared = SuffixCache(DEFAULT_CACHE_TOKENS if max_tokens is None else max_tokens)
        return _shared


@dataclass
class _Request:
    """A running sequence as the drafter keeps it."""

    tokens: list[int]  # committed tokens (prompt + output)
    trie: SuffixTrie  # over `tokens`, extended as they grow
    scope: str


class SuffixDrafter(Drafter):
    """Suffix decoding over the request's own text and its scope's earlier requests (module docstring)."""

    name = "suffix"
    provides_probs = False
    wants_tokens = True

    def __init__(self, cache: SuffixCache | None = None, *, depth: int = 16, max_match: int = 8,
                 min_prob: float = 0.1, spec_factor: float | None = SPEC_FACTOR, cascade_min_match: int = 2) -> None:
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        if spec_factor is not None and spec_factor <= 0:
            raise ValueError(f"spec_factor must be > 0 (or None: no cap), got {spec_factor}")
        if not 1 <= max_match < depth:
            raise ValueError(f"max_match must be in [1, depth), got {max_match} with depth {depth}")
        if not 1 <= cascade_min_match <= max_match:
            raise ValueError(f"cascade_min_match must be in [1, max_match], got {cascade_min_match}")
        self.cache = cache if cache is not None else shared_cache()
        self.depth = depth
        self.max_match = max_match
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.cascade_min_match = cascade_min_match
        self._requests: dict[int, _Request] = {}  # slot -> running sequence
        self._scopes: dict[int, str] = {}  # slot -> scope named by set_scope, taken by the next begin
        self.drafted_from = {"own": 0, "cache": 0}  # rounds drafted from each trie (stats, tests)

    # -- the slot's life -----------------------------------------------------------------------------------------

    def set_scope(self, slot: int, scope: str) -> None:
        self._scopes[slot] = scope

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        self._requests[slot] = self._new_request(prompt_ids.tolist(), self._scopes.pop(slot, DEFAULT_SCOPE))

    def observe_tokens(self, slot: int, token_ids: list[int]) -> None:
        request = self._requests.get(slot)
        if request is not None:
            request.tokens += token_ids
            request.trie.extend(token_ids)

    def move_slot(self, src: int, dst: int) -> None:
        if src in self._requests:
            self._requests[dst] = self._requests.pop(src)

    def release(self, slot: int) -> None:
        """The finished sequence's text joins its scope's cache (a cancelled one's too: its text is as good)."""
        request = self._requests.pop(slot, None)
        if request is not None:
            self.cache.add(request.scope, request.tokens)

    def _new_request(self, tokens: list[int], scope: str) -> _Request:
        trie = SuffixTrie(self.depth)
        trie.extend(tokens)
        return _Request(tokens, trie, scope)

    # -- drafting ------------------------------------------------------------------------------------------------

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        """Whether this stage's draft after `token_ids` [n] should be taken over a cascade's next stage: a suffix
        of at least cascade_min_match tokens occurred earlier, in the request's own text or its scope's cache (a
        one-token match is a weak sign: module docstring). Only cascades ask; alone, every match drafts."""
        request = self._request_of(token_ids)
        if request is None:  # not a sequence this drafter holds (a drafter used on its own): the row decides
            return True
        context, need = request.tokens, self.cascade_min_match
        return (request.trie.match(context, self.max_match)[1] >= need
                or self.cache.match_length(request.scope, context, self.max_match) >= need)

    def _request_of(self, token_ids: torch.Tensor) -> _Request | None:
        """The running sequence whose committed tokens are `token_ids` [n] (a row's tokens; one pass over the
        batch's slots, comparing lengths and the last tokens)."""
        n = token_ids.numel()
        tail = token_ids[-self.max_match:].tolist()
        for request in self._requests.values():
            if len(request.tokens) == n and request.tokens[-len(tail):] == tail:
                return request
        return None

    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        start = time.perf_counter()
        drafts = [self._draft(row) if row.member and row.k > 0 else EMPTY for row in batch.rows]
        seconds = time.perf_counter() - start
        return [DraftProposal(torch.tensor(d.tokens, dtype=torch.long), None, seconds,
                              None if d.parents is None else torch.tensor(d.parents, dtype=torch.long))
                for d in drafts]

    def _draft(self, row: DraftRow) -> SuffixDraft:
        request = self._requests.get(row.slot)
        if request is None:  # called without `begin` (a drafter used on its own): start from the row's tokens
            request = self._requests[row.slot] = self._new_request(row.token_ids.tolist(), DEFAULT_SCOPE)
        context = request.tokens
        n = row.token_ids.numel()
        if n > len(context):  # tokens in front of the draft that are not committed (a grammar's forced tokens)
            context = context + row.token_ids[len(context):].tolist()
        elif n < len(context):  # not the sequence this slot holds: follow the row
            context = row.token_ids.tolist()
        # Its own confidence (path probability >= min_prob) sets the draft's length; the model drafters' cut-off
        # (`row.threshold`, a per-step top probability) does not apply, as for n-gram drafts.
        tree = row.tree_nodes if row.tree_nodes > row.k else 0
        own = request.trie.draft(context, row.k, self.min_prob, self.max_match, tree, self.spec_factor)
        shared = self.cache.draft(request.scope, context, row.k, self.min_prob, self.max_match, tree,
                                  self.spec_factor)
        best = own if own.score >= shared.score else shared
        if best.tokens:
            self.drafted_from["own" if best is own else "cache"] += 1
        return best
