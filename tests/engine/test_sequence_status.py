"""The scheduler alone moves a sequence through its statuses (waiting -> prefilling -> running -> finished) and
owns its slot: a long prompt is prefilled in chunks in a slot past the running rows, joins at the next running
slot, and leaves with slot -1; an aborted prompt frees the slot it held."""

from conftest import tiny_llama
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import SpeculativeEngine
from verispec.engine.scheduler import SchedulerConfig
from verispec.engine.sequence import SequenceStatus as Status


def make_engine(tokenizer):
    return SpeculativeEngine(tiny_llama(5), tokenizer, NgramDrafter(), SpeculativeConfig(num_draft_tokens=3),
                             max_len=256, max_batch_size=3,
                             scheduler=SchedulerConfig(max_batched_tokens=16, prefill_chunk_tokens=8))


def test_statuses_and_slots_through_a_request(tokenizer):
    engine = make_engine(tokenizer)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    short = engine.add_request(tokenizer("ab")["input_ids"], params)
    long = engine.add_request(tokenizer("the cat sat on the mat. the dog")["input_ids"], params)
    assert short.status == long.status == Status.WAITING and short.slot == long.slot == -1
    engine.step()
    assert short.status == Status.RUNNING and short.slot == 0 and engine.running == [short]
    assert long.status == Status.PREFILLING and long.slot > 0 and 0 < long.prefilled < long.prompt_len - 1
    assert engine.scheduler.prefilling == [long] and not engine.waiting
    while long.status == Status.PREFILLING:
        engine.step()
    assert long.status == Status.RUNNING and long.slot == engine.running.index(long)
    while engine.has_unfinished:
        engine.step()
    assert short.status == long.status == Status.FINISHED and short.slot == long.slot == -1
    assert short.finish_reason == long.finish_reason == "length"


def test_an_aborted_prompt_frees_its_slot(tokenizer):
    engine = make_engine(tokenizer)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    first = engine.add_request(tokenizer("ab")["input_ids"], params)
    long = engine.add_request(tokenizer("the cat sat on the mat. the dog sat on the log.")["input_ids"], params)
    waiting = engine.add_request(tokenizer("cd")["input_ids"], params)
    engine.step()
    assert long.status == Status.PREFILLING and long.slot >= 0
    engine.abort(long)
    engine.abort(waiting)
    assert long.status == waiting.status == Status.FINISHED and long.slot == waiting.slot == -1
    assert not engine.scheduler.prefilling and not engine.waiting and len(engine.scheduler) == 0
    assert engine.total.requests == 2  # cancelled requests still count
    engine.abort(first)
    assert first.status == Status.FINISHED and not engine.running and not engine.has_unfinished
