"""Structured-output rows in the step: everything the engine does for a row with a grammar, in one place.

- admission: `row_grammar` compiles the request's constraint (sampling/grammar.py);
- proposing: `force` puts the tokens the grammar forces next in front of the row's draft (they are the only tokens
  its mask allows), and `cut` drops draft tokens from the first one the grammar forbids;
- verifying: the grammar's masks are applied by `process_logits` with the rest of the row's processing.

A forbidden draft token has p = 0 and would be rejected anyway, so cutting it changes no output; forced tokens are
point masses (q = one-hot), verified like any draft token.
"""

from __future__ import annotations

import torch

from ..config import MAX_FORCED_DRAFT, SamplingParams
from ..drafters.base import DraftProposal
from ..sampling import Grammar
from .sequence import Sequence


def row_grammar(params: SamplingParams, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> Grammar | None:
    """The compiled constraint of a request (None without one). Raises ValueError naming a bad constraint."""
    if params.structured is None:
        return None
    return Grammar(params.structured, tokenizer, vocab_size, eos_token_ids)


def forced_draft(seq: Sequence) -> torch.Tensor | None:
    """[f] the tokens a structured-output row's grammar forces next (e.g. `","year":` between two JSON values);
    None when nothing is forced."""
    grammar = seq.sampling.grammar
    if grammar is None:
        return None
    tokens = grammar.forced_tokens()[: min(seq.remaining - 1, MAX_FORCED_DRAFT)]
    return torch.tensor(tokens, dtype=torch.long, device=seq.tokens.device) if tokens else None


def with_forced(forced: torch.Tensor | None, proposal: DraftProposal) -> DraftProposal:
    """The forced tokens (point masses: q = one-hot) followed by what the drafter proposed after them."""
    if forced is None:
        return proposal
    tokens = torch.cat([forced, proposal.token_ids.to(forced.device)])
    probs = None
    if proposal.probs is not None and proposal.token_ids.numel():
        one_hot = torch.nn.functional.one_hot(forced, proposal.probs.shape[-1]).to(proposal.probs)
        probs = torch.cat([one_hot.to(proposal.probs.device), proposal.probs])
    return DraftProposal(tokens, probs, proposal.seconds, catch_up_s=proposal.catch_up_s)


def cut(seq: Sequence, proposal: DraftProposal) -> DraftProposal:
    """A structured-output row's draft, cut before the first token its grammar forbids (the recovered token is
    then drawn from p there). One host read of the draft per structured-output row that drafted: the grammar runs
    on the host."""
    grammar = seq.sampling.grammar
    n = proposal.token_ids.numel()
    if grammar is None or n == 0:
        return proposal
    valid = grammar.valid_prefix(proposal.token_ids.tolist())
    if valid == n:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:valid]
    return DraftProposal(proposal.token_ids[:valid], probs, proposal.seconds, catch_up_s=proposal.catch_up_s)
