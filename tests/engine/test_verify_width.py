"""The widest verify pass fits the cache by construction.

A verify pass feeds every row as wide as the widest row (shorter rows are padded), and row b's fed tokens are
written at cache indices `lengths[b] + t`. So a row 2 tokens short of `max_len` is written up to `max_len - 2 + w`
where w is the widest row's width: grammar-forced tokens (up to MAX_FORCED_DRAFT) + K drafted after them + 1. The
cache's slack past `max_len` is derived from those validated limits (config.MAX_VERIFY_WIDTH); these tests build
that worst case and check the limits that bound it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from verispec.config import (MAX_DRAFT_TOKENS, MAX_FORCED_DRAFT, MAX_VERIFY_WIDTH, SamplingParams,
                             SpeculativeConfig, StructuredOutput)
from verispec.drafters.base import DraftProposal, Drafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine

FORCED, FREE = "a" * (MAX_FORCED_DRAFT + 8), "b"  # the regex forces the a's; after them any number of b's


class ScriptDrafter(Drafter):
    """Drafts the grammar's own continuation: `k` more characters of `a...ab...b` after the prompt."""

    def __init__(self, tokenizer, prompt_len: int) -> None:
        self.script = tokenizer(FORCED + FREE * 200)["input_ids"]
        self.prompt_len = prompt_len

    def propose(self, batch):
        out = []
        for row in batch.rows:
            done = row.token_ids.numel() - self.prompt_len
            ids = self.script[done : done + row.k] if row.k and done >= 0 else []
            out.append(DraftProposal(torch.tensor(ids, dtype=torch.long), None))
        return out


def test_the_slack_is_the_widest_verify_pass():
    assert MAX_VERIFY_WIDTH == MAX_FORCED_DRAFT + MAX_DRAFT_TOKENS + 1
    assert CACHE_SLACK >= MAX_VERIFY_WIDTH


@pytest.mark.parametrize("field", ["num_draft_tokens", "max_speculation_depth", "tree_nodes"])
def test_every_draft_length_is_bounded(field):
    SpeculativeConfig(**{field: MAX_DRAFT_TOKENS})
    with pytest.raises(ValueError, match=f"<= {MAX_DRAFT_TOKENS}|\\[0, {MAX_DRAFT_TOKENS}\\]"):
        SpeculativeConfig(**{field: MAX_DRAFT_TOKENS + 1})


@pytest.mark.parametrize("adaptive", [False, True])
def test_forced_tokens_plus_k_beside_a_row_near_max_len(tokenizer, adaptive):
    """One row drafts MAX_FORCED_DRAFT forced tokens + K = 64 more in the same step as a row 2 tokens short of
    max_len: the pass is the widest the limits allow and the near-full row is padded to it. Both rows complete
    and equal the target alone."""
    max_len = 160
    target = tiny_llama(5)
    prompt = tokenizer("the cat sat")["input_ids"]
    full = (tokenizer("the dog sat on the log. ")["input_ids"] * 20)[: max_len - 3]
    spec = SpeculativeConfig(num_draft_tokens=MAX_DRAFT_TOKENS, adaptive=adaptive,
                             max_speculation_depth=MAX_DRAFT_TOKENS)
    engine = SpeculativeEngine(target, tokenizer, ScriptDrafter(tokenizer, len(prompt)), spec, max_len=max_len,
                               max_batch_size=2)
    forced = SamplingParams(max_new_tokens=120, structured=StructuredOutput("regex", f"{FORCED}{FREE}*"))
    near = SamplingParams(max_new_tokens=3, ignore_eos=True)
    widths = []
    forward = engine.target.forward

    def recording(tokens, *args, **kwargs):
        if not kwargs.get("last_only"):  # a verify pass (prefill chunks feed only the prompt)
            widths.append(tuple(tokens.shape))
        return forward(tokens, *args, **kwargs)

    engine.target.forward = recording
    grammar_row = engine.add_request(torch.tensor(prompt), forced)
    near_row = engine.add_request(torch.tensor(full), near, use_drafter=False)
    while engine.has_unfinished:
        engine.step()
    engine.target.forward = forward
    assert (2, MAX_FORCED_DRAFT + MAX_DRAFT_TOKENS + 1) in widths or adaptive  # the widest pass did happen
    assert max(w for _, w in widths) <= MAX_VERIFY_WIDTH
    alone = SpeculativeEngine(target, tokenizer, None, max_len=max_len)
    assert list(grammar_row.stopper.token_ids) == alone.generate(prompt, forced).token_ids
    assert list(near_row.stopper.token_ids) == alone.generate(full, near).token_ids
