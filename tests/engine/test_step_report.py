"""The step's report names the sequences it started (the server's worker counts a request running from there,
without looking at every sequence): each sequence exactly once, in the step whose first prompt chunk gave it a slot,
whether its prompt ran in one chunk or several, and whether it waited for a free slot first."""

import pytest

from conftest import tiny_llama
from verispec.config import SamplingParams
from verispec.engine import SpeculativeEngine
from verispec.engine.scheduler import SchedulerConfig


@pytest.mark.parametrize("chunk", [None, 3])
def test_each_sequence_is_reported_started_once_when_it_takes_a_slot(tokenizer, chunk):
    engine = SpeculativeEngine(tiny_llama(3), tokenizer, None, max_len=64, max_batch_size=2,
                               scheduler=SchedulerConfig(prefill_chunk_tokens=chunk))
    params = SamplingParams(max_new_tokens=4)
    prompts = [tokenizer(text)["input_ids"] for text in ("the cat sat on", "one two three four", "a b c d e")]
    seqs = [engine.add_request(prompt, params, use_drafter=False) for prompt in prompts]
    started_at = {}
    for step in range(64):
        slots_before = {seq.seq_id: seq.slot for seq in seqs}
        engine.step()
        for seq in engine.last_step.started:
            assert seq.seq_id not in started_at, "a sequence was reported started twice"
            assert slots_before[seq.seq_id] < 0, "reported started, but it held a slot before this step"
            started_at[seq.seq_id] = step
        for seq in seqs:  # a sequence with a slot (or done) was reported started in this step or before
            if seq.slot >= 0 or seq.finished:
                assert seq.seq_id in started_at
        if all(seq.finished for seq in seqs):
            break
    assert sorted(started_at) == sorted(seq.seq_id for seq in seqs)
    assert started_at[seqs[2].seq_id] > started_at[seqs[0].seq_id]  # the third waited for a free slot
