"""The scheduler (continuous batching): FIFO admission, chunked prefill within the step's token budget, and the
engine running it: a long prompt is prefilled over several steps while the batch keeps decoding, the output of a
request does not depend on what else runs, and an aborted sequence frees its slot before the next step."""

from types import SimpleNamespace

import pytest

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.model import ModelDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.engine.scheduler import Scheduler, SchedulerConfig


def waiting(*prompt_lens):
    return [SimpleNamespace(prompt_len=n, prefilled=0, name=i) for i, n in enumerate(prompt_lens)]


def plan(chunks):
    return [(c.seq.name, c.start, c.end, c.joins) for c in chunks]


# -- (a) the scheduler alone, hand-built cases ------------------------------------------------------------------------


def test_unbounded_scheduler_prefills_every_prompt_in_one_forward():
    scheduler = Scheduler()
    scheduler.waiting.extend(waiting(5, 1, 9))
    assert plan(scheduler.schedule(decode_tokens=3, free_slots=8)) == [(0, 0, 4, True), (1, 0, 0, True),
                                                                        (2, 0, 8, True)]
    assert not scheduler.waiting and not scheduler.prefilling


def test_chunks_follow_the_prompt_and_the_budget():
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=10, prefill_chunk_tokens=4))
    scheduler.waiting.extend(waiting(12, 3))  # prompt 0 prefills 11 tokens: chunks [0, 4), [4, 8), [8, 11)
    # 2 decode tokens: 8 left, two chunks of 4; the third would overrun.
    assert plan(scheduler.schedule(decode_tokens=2, free_slots=4)) == [(0, 0, 4, False), (0, 4, 8, False)]
    assert len(scheduler) == 2 and [s.name for s in scheduler.prefilling] == [0]
    # A full budget still runs one chunk, so a prompt is never starved; the joining chunk counts its first token.
    assert plan(scheduler.schedule(decode_tokens=50, free_slots=3)) == [(0, 8, 11, True)]
    assert plan(scheduler.schedule(decode_tokens=5, free_slots=3)) == [(1, 0, 2, True)]
    assert len(scheduler) == 0


def test_a_later_shorter_prompt_uses_what_the_earlier_one_cannot():
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=12, prefill_chunk_tokens=8))
    scheduler.waiting.extend(waiting(20, 3, 30))
    # Prompt 0 takes 8 of the 12 tokens; its next chunk (8) does not fit, prompt 1's whole prefill (2 + 1) does.
    # Prompt 2 comes next in line, but not into the 1 token left: nobody is admitted ahead of the queue's head.
    assert plan(scheduler.schedule(decode_tokens=0, free_slots=4)) == [(0, 0, 8, False), (1, 0, 2, True)]
    assert [s.name for s in scheduler.prefilling] == [0] and [s.name for s in scheduler.waiting] == [2]
    # The earlier prompt always goes first: it completes (8 + 3 + 1 tokens); prompt 2 waits for the next step.
    assert plan(scheduler.schedule(decode_tokens=0, free_slots=3)) == [(0, 8, 16, False), (0, 16, 19, True)]
    assert [s.name for s in scheduler.waiting] == [2]


def test_a_second_prompt_is_prefilled_beside_the_first_only_with_a_spare_slot():
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=12, prefill_chunk_tokens=8))
    scheduler.waiting.extend(waiting(20, 3))
    assert plan(scheduler.schedule(decode_tokens=0, free_slots=2)) == [(0, 0, 8, False)]  # 1 slot left: no
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=12, prefill_chunk_tokens=8))
    scheduler.waiting.extend(waiting(20, 1))
    # A one-token prompt joins at once, into the decoding slot: only when no other prompt is half prefilled.
    assert plan(scheduler.schedule(decode_tokens=0, free_slots=8)) == [(0, 0, 8, False)]


def test_admission_is_fifo_and_stops_at_the_free_slots():
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=100, prefill_chunk_tokens=64))
    scheduler.waiting.extend(waiting(2, 2, 2, 2))
    assert [name for name, *_ in plan(scheduler.schedule(decode_tokens=0, free_slots=2))] == [0, 1]
    assert [s.name for s in scheduler.waiting] == [2, 3]
    assert scheduler.remove(scheduler.waiting[0]) and not scheduler.remove(SimpleNamespace())
    assert [name for name, *_ in plan(scheduler.schedule(decode_tokens=0, free_slots=1))] == [3]


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="max_batched_tokens"):
        SchedulerConfig(max_batched_tokens=0)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        SchedulerConfig(prefill_chunk_tokens=-1)


# -- (c) the engine with a scheduler ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(small_pair):
    return small_pair


def make_engine(pair, tokenizer, max_batch_size=4, drafter=True):
    target, draft = pair
    return SpeculativeEngine(target, tokenizer, ModelDrafter(draft, 256 + CACHE_SLACK) if drafter else None,
                             SpeculativeConfig(num_draft_tokens=3), max_len=256, max_batch_size=max_batch_size,
                             scheduler=SchedulerConfig(max_batched_tokens=16, prefill_chunk_tokens=8))


LONG = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. one two three"


def test_a_long_prompt_prefills_over_several_steps_while_others_decode(pair, tokenizer):
    engine = make_engine(pair, tokenizer)
    short = engine.add_request(tokenizer("one two")["input_ids"], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()
    long_ids = tokenizer(LONG)["input_ids"]
    long = engine.add_request(long_ids, SamplingParams(max_new_tokens=8, ignore_eos=True))
    steps_to_join = 0
    while long not in engine.running:
        before = short.length
        engine.step()
        steps_to_join += 1
        assert short.length > before  # the batch kept decoding while the long prompt was prefilled
    # 8-token chunks, one or two per step next to the short row (the budget is 16 tokens).
    assert steps_to_join >= (len(long_ids) - 1) / 16
    assert long.prefilled == len(long_ids) - 1
    while engine.has_unfinished:
        engine.step()
    alone = make_engine(pair, tokenizer).generate(long_ids, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert list(long.stopper.token_ids) == alone.token_ids


def test_outputs_do_not_depend_on_the_load(pair, tokenizer):
    texts = [LONG, "one two three", "Paris is the capital of", "a", LONG[:40], "the dog sat on the"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    params = [SamplingParams(max_new_tokens=10 + 3 * i, ignore_eos=True) for i in range(len(texts))]
    params[1] = SamplingParams(max_new_tokens=16, temperature=0.9, seed=5, ignore_eos=True, coupled=False)
    engine = make_engine(pair, tokenizer, max_batch_size=3)  # fewer slots than prompts: some wait
    together = engine.generate_batch(prompts, params)
    for prompt, p, result in zip(prompts, params, together):
        assert make_engine(pair, tokenizer).generate(prompt, p).token_ids == result.token_ids
    assert engine.total.accepted_tokens > 0


def test_abort_frees_the_slot_of_a_sequence_being_prefilled(pair, tokenizer):
    engine = make_engine(pair, tokenizer, max_batch_size=2, drafter=False)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    first = engine.add_request(tokenizer("one two")["input_ids"], params)
    long = engine.add_request(tokenizer(LONG)["input_ids"], params)
    third = engine.add_request(tokenizer("the cat")["input_ids"], params)
    engine.step()
    assert engine.scheduler.prefilling == [long] and long.slot == 1 and list(engine.waiting) == [third]
    engine.abort(long)
    assert long.slot == -1 and not engine.scheduler.prefilling
    engine.step()
    assert engine.running == [first, third]  # the freed slot went to the next in line
    engine.abort(first)
    assert engine.running == [third] and third.slot == 0
    while engine.has_unfinished:
        engine.step()
    assert engine.total.requests == 3


def test_a_prompt_completed_beside_a_long_one_joins_first(pair, tokenizer):
    """The short prompt's prefill completes in the budget the long one leaves; it takes the decoding slot (the
    long prompt steps aside into the spare slot), and a row that finishes meanwhile leaves a gap the long prompt
    fills when it joins. Every output equals the request alone."""
    engine = make_engine(pair, tokenizer, max_batch_size=4, drafter=False)
    other = engine.add_request(tokenizer("two")["input_ids"], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.step()
    long_ids, short_ids = tokenizer(LONG)["input_ids"], tokenizer("a b")["input_ids"]
    long = engine.add_request(long_ids, SamplingParams(max_new_tokens=6, ignore_eos=True))
    short = engine.add_request(short_ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.step()
    assert engine.running == [other, short] and long.slot == 2 and long.prefilled == 8
    engine.step()  # other finishes; short moves into its slot; long waits in slot 2 for slot 1
    assert other.finished and engine.running == [short] and long.slot == 2
    while long not in engine.running:
        engine.step()
    assert long.slot == engine.running.index(long)
    while engine.has_unfinished:
        engine.step()
    for seq, ids in ((long, long_ids), (short, short_ids)):
        alone = make_engine(pair, tokenizer, drafter=False).generate(ids, seq.params)
        assert list(seq.stopper.token_ids) == alone.token_ids
