"""What speculation costs when it does not draft: nothing of the draft model's.

A draft model's prompt prefill waits for the row's first draft (drafters/model.py), a row's first round decodes with
the target alone (engine/proposer.py), and a round where no row drafts calls no drafter. Counted on a recording
runner's forwards, never timed."""

import pytest
import torch

from conftest import count_stage_rounds
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.engine.policy import FixedK

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 256
TEXT = "the cat sat on the mat. the dog sat on the log. the cat ran to the dog and the dog ran to the cat."


class Recorded:
    """Wraps a ModelDrafter's runner.forward and propose: each forward's (slot, fed tokens), each propose's rows."""

    def __init__(self, drafter: ModelDrafter, monkeypatch) -> None:
        self.forwards: list[tuple[int, int]] = []  # (start slot, tokens fed per row) per forward
        self.calls: list[int] = []  # per forward: the propose call it belongs to (0, 1, ...)
        self.proposals: list[tuple[list[torch.Tensor], list]] = []  # (rows' contexts, proposals) per propose call
        runner, propose = drafter.runner, drafter.propose

        def forward(tokens, *args, start_slot=0, **kwargs):
            self.forwards.append((start_slot, tokens.shape[1]))
            self.calls.append(len(self.proposals))
            return type(runner).forward(runner, tokens, *args, start_slot=start_slot, **kwargs)

        def recording(batch):
            made = propose(batch)
            self.proposals.append(([row.token_ids.clone() for row in batch.rows], made))
            return made

        monkeypatch.setattr(runner, "forward", forward)
        monkeypatch.setattr(drafter, "propose", recording)


def greedy(n=24):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def prompt(tokenizer, text=TEXT):
    return tokenizer(text)["input_ids"]


def test_a_row_that_never_drafts_never_runs_the_draft_model(trained_pair, tokenizer, monkeypatch):
    """Adaptive K at 0 in every round (a drafter that does not pay): no draft forward, no propose call, not even at
    join; outputs equal the target alone's."""
    target, draft = trained_pair
    drafter = ModelDrafter(draft, MAX_LEN + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=3), max_len=MAX_LEN,
                               max_batch_size=3)
    monkeypatch.setattr(engine.policies, "get", lambda spec, drafter: FixedK(0))
    recorded = Recorded(drafter, monkeypatch)
    prompts = [prompt(tokenizer), prompt(tokenizer, TEXT[:40]), prompt(tokenizer, TEXT[20:])]
    results = engine.generate_batch(prompts, greedy())
    assert recorded.forwards == [] and recorded.proposals == []
    assert all(r.stats.draft_s == 0.0 for r in results)
    assert [r.token_ids for r in results] == [r.token_ids for r in engine.generate_batch(prompts, greedy(),
                                                                                         use_drafter=False)]


def test_the_join_step_runs_the_target_alone(trained_pair, tokenizer, monkeypatch):
    """Adaptive K, a row that will draft: the step it joins runs no draft forward (its first token comes as with
    speculation off); the next step prefills its draft cache in its first draft forward (a row drafting alone
    folds its catch-up in: `ModelDrafter._folded`), then drafts."""
    target, draft = trained_pair
    drafter = ModelDrafter(draft, MAX_LEN + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=3, adaptive=True),
                               max_len=MAX_LEN, enable_prefix_caching=False)
    monkeypatch.setattr(engine.policies, "get", lambda spec, drafter: FixedK(3))  # K = 3 whenever it may draft
    recorded = Recorded(drafter, monkeypatch)
    ids = prompt(tokenizer)
    seq = engine.add_request(ids, greedy())
    engine.step()
    assert seq.length == len(ids) + 1 and recorded.forwards == []
    engine.step()
    # One forward over the prompt and the first token, then the draft steps (one token each).
    assert recorded.forwards == [(0, len(ids) + 1)] + [(0, 1)] * 2
    assert seq.stats.draft_s > 0


def test_rows_drafting_together_catch_up_in_their_own_forwards(trained_pair, tokenizer, monkeypatch):
    """Two rows drafting in one step: each prefills its draft cache in a forward of its own (never padded into the
    other's), then one batched forward feeds each its last token; outputs equal the target alone's."""
    target, draft = trained_pair
    drafter = ModelDrafter(draft, MAX_LEN + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=3), max_len=MAX_LEN,
                               max_batch_size=2, enable_prefix_caching=False)
    recorded = Recorded(drafter, monkeypatch)
    prompts = [prompt(tokenizer), prompt(tokenizer, TEXT[:40])]
    results = engine.generate_batch(prompts, greedy())
    first_call = [f for f, call in zip(recorded.forwards, recorded.calls) if call == 0]
    (slot_a, fed_a), (slot_b, fed_b), batched = first_call[:3]
    assert (slot_a, slot_b, batched) == (0, 1, (0, 1)), first_call  # own forwards, then one token each, batched
    assert fed_a >= len(prompts[0]) - 1 and fed_b >= len(prompts[1]) - 1, first_call
    assert [r.token_ids for r in results] == [r.token_ids for r in engine.generate_batch(prompts, greedy(),
                                                                                         use_drafter=False)]


def draft_alone(draft, tokens: torch.Tensor, k: int) -> list[int]:
    """The draft model's own greedy continuation of `tokens`, recomputed from scratch (no cache)."""
    ids = tokens.clone()
    for _ in range(k):
        ids = torch.cat([ids, draft(ids.unsqueeze(0)).logits[0, -1].argmax().view(1)])
    return ids[tokens.numel():].tolist()


class EarlyNgram(NgramDrafter):
    """Prompt lookup for a request's first `generated` tokens only: the draft model drafts after."""

    def __init__(self, prompt_len: int, generated: int) -> None:
        super().__init__(min_ngram=2)
        self.limit = prompt_len + generated

    def can_propose(self, token_ids):
        return token_ids.numel() < self.limit and super().can_propose(token_ids)


@torch.inference_mode()
def test_first_draft_after_ngram_rounds_catches_up_exactly(trained_pair, tokenizer, monkeypatch):
    """ngram drafts the first rounds, the model later: its first draft (after its catch-up over the prompt and the
    tokens generated so far, the prompt's blocks from the draft's own prefix cache on the second request) equals
    the draft model's greedy continuation from scratch, and outputs equal the target alone's."""
    target, draft = trained_pair
    ids = prompt(tokenizer)
    model = ModelDrafter(draft, MAX_LEN + CACHE_SLACK)
    cascade = CascadeDrafter([EarlyNgram(len(ids), 12), model])
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=3), max_len=MAX_LEN)
    counts = count_stage_rounds(cascade)
    recorded = Recorded(model, monkeypatch)
    expected = engine.generate(ids, greedy(40), use_drafter=False).token_ids
    for request in range(2):
        recorded.forwards.clear()
        recorded.calls.clear()
        recorded.proposals.clear()
        before = dict(counts)
        assert engine.generate(ids, greedy(40)).token_ids == expected
        assert counts["ngram"] > before["ngram"] and counts["model"] > before["model"]
        contexts, made = recorded.proposals[0]
        first = contexts[0]
        assert first.numel() > len(ids) + 1  # the model's first draft came after ngram's rounds
        assert made[0].token_ids.tolist() == draft_alone(draft, first, made[0].token_ids.numel())
        cached = 16 * ((len(ids) - 1) // 16) if request else 0  # the second request: the prompt's full blocks
        assert model._prefix.hit_tokens == cached
        # Its own catch-up first, then one token a forward. A later call may catch up again on the rounds ngram
        # drafted (its own forward, first of that call); no other forward feeds more than one or two tokens.
        assert recorded.forwards[0] == (0, first.numel() - 1 - cached) and recorded.forwards[1] == (0, 1)
        firsts = {call: i for i, call in reversed(list(enumerate(recorded.calls)))}  # call -> its first forward
        assert all(n <= ModelDrafter.IN_BATCH or firsts[call] == i
                   for i, ((_, n), call) in enumerate(zip(recorded.forwards, recorded.calls))), str(recorded.forwards)
