"""A request resumed after output it already handed out (`add_request(resume=Continuation(...))`, what a failover
sends to another replica, server/scale/ingress.py) goes on as one uninterrupted request.

Level (c): cut after every chunk of a full run, the resumed run hands out exactly the rest: the same tokens, text
(stop strings held back and cut as in one run) and logprobs, the same finish reason, under greedy decoding and
seeded coupled sampling (the noise's output positions continue), with penalties that count the replayed tokens as
output, min_tokens, logit_bias and a grammar whose state is re-derived from them; with a drafter in both runs.
Level (b): unseeded sampling (rejection sampling and coupled, presence and frequency penalties, logit_bias) resumed
after a fixed first token follows the exact conditional distribution of what comes next, by enumeration; feeding
the same token as prompt instead (penalties no longer count it) fails the same bound, so the check has power.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_sampling_exactness import PROMPT, ROWS_PER_CASE, VOCAB, CharTokenizer, peaky_llama, tvd_bound
from conftest import target_probs
from verispec.config import SamplingParams, SpeculativeConfig, StructuredOutput
from verispec.drafters.model import ModelDrafter
from verispec.engine import Continuation, SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 200
NEW = 32
COUPLED = dict(temperature=1.3, top_k=20, seed=7, coupled=True)
CASES = {
    "greedy": dict(),
    "greedy-logprobs": dict(logprobs=3),
    "coupled": dict(COUPLED, logprobs=2),
    "coupled-penalties": dict(COUPLED, presence_penalty=0.7, frequency_penalty=0.6, repetition_penalty=1.3),
    "greedy-penalties-bias": dict(frequency_penalty=1.1, logit_bias={5: 2.5, 9: -3.0}, logprobs=1),
    "min-tokens-stop-string": dict(COUPLED, min_new_tokens=12, ignore_eos=False),  # stop: from the output
    "regex": dict(ignore_eos=False,
                  structured=StructuredOutput("regex", spec="(the|a) (cat|dog) sat on the (mat|log)[a-z .]*")),
}


@pytest.fixture(scope="module")
def engine(trained_pair, tokenizer):
    target, draft = trained_pair
    return SpeculativeEngine(target, tokenizer, ModelDrafter(draft, MAX_LEN), SpeculativeConfig(num_draft_tokens=4),
                             max_len=MAX_LEN, max_batch_size=4)


def _run(engine, prompt, params, resume=None) -> tuple[list[tuple[list[int], str, list]], str]:
    """-> ([(token ids, text, logprobs) per chunk], finish reason)."""
    chunks, finish = [], None
    for chunk in engine.generate_iter(prompt, params, resume=resume):
        chunks.append((chunk.token_ids, chunk.text, chunk.logprobs or []))
        finish = chunk.finish_reason or finish
    return chunks, finish


def _logprobs(items) -> list[tuple]:
    return [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in items]


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_hands_out_exactly_the_rest(engine, tokenizer, case):
    prompt = tokenizer("the cat sat on")["input_ids"]
    params = SamplingParams(**{"max_new_tokens": NEW, "ignore_eos": True, **CASES[case]})
    if case.endswith("stop-string"):  # a stop string the output meets past its first chunks, and one it never does
        text = "".join(c[1] for c in _run(engine, prompt, params)[0])
        params = replace(params, stop=(text[20:23], "zzq"))
    chunks, finish = _run(engine, prompt, params)
    ids = [t for c in chunks for t in c[0]]
    text = "".join(c[1] for c in chunks)
    logprobs = _logprobs([lp for c in chunks for lp in c[2]])
    assert len(chunks) > 2 and len(ids) > 4, chunks
    cuts = 0
    for i in range(1, len(chunks)):
        done_ids = [t for c in chunks[:i] for t in c[0]]
        shown = "".join(c[1] for c in chunks[:i])
        rest, rest_finish = _run(engine, prompt, params, Continuation(tuple(done_ids), len(shown)))
        assert done_ids + [t for c in rest for t in c[0]] == ids, (case, i)
        assert shown + "".join(c[1] for c in rest) == text, (case, i)
        assert rest_finish == finish
        if params.logprobs is not None:
            assert _logprobs([lp for c in chunks[:i] for lp in c[2]] + [lp for c in rest for lp in c[2]]) == logprobs
        cuts += 1
    assert cuts >= 2


def test_a_continuation_past_the_end_is_refused_and_one_to_the_end_finishes(engine, tokenizer):
    prompt = tokenizer("the cat")["input_ids"]
    eos = min(engine.eos_token_ids)
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=3), resume=Continuation((5, 6, 7, 8)))
    with pytest.raises(ValueError, match="past the request's end"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=8), resume=Continuation((5, eos, 6)))
    with pytest.raises(ValueError, match="structured output"):
        regex = StructuredOutput("regex", spec="ab+")
        engine.add_request(prompt, SamplingParams(max_new_tokens=8, structured=regex),
                           resume=Continuation(tuple(tokenizer("ba")["input_ids"])))
    assert not engine.has_unfinished
    # The last tokens streamed ended it (its replica died before saying so): finished at once, queued nowhere.
    for tokens, params, reason in [((5, 6, 7), SamplingParams(max_new_tokens=3), "length"),
                                   ((5, eos), SamplingParams(max_new_tokens=8), "stop")]:
        seq = engine.add_request(prompt, params, resume=Continuation(tokens))
        assert seq.finish_reason == reason and not engine.has_unfinished


# -- level (b): unseeded sampling continues from the conditional distribution ----------------------------------------

FIRST = 2  # the token generated before the failover
SAMPLED = dict(max_new_tokens=3, temperature=0.8, top_k=3, presence_penalty=1.5, frequency_penalty=1.0,
               logit_bias={1: 0.5})
SAMPLES = 2000


def _conditional(target, params) -> dict[tuple, float]:
    """P(t2, t3 | t1 = FIRST) under the processed target distribution, FIRST counted as output."""
    joint = {}
    with torch.no_grad():
        for t2 in range(VOCAB):
            for t3 in range(VOCAB):
                prob = 1.0
                for generated, token in (((FIRST,), t2), ((FIRST, t2), t3)):
                    logits = target(torch.tensor([PROMPT + list(generated)])).logits[0, -1:]
                    prob *= target_probs(params, logits, PROMPT, generated=generated)[0, token].item()
                joint[(t2, t3)] = prob
    return joint


def _tvd(counts: dict, exact: dict, samples: int) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / samples - p) for k, p in exact.items())


def _sample_rest(engine, drafter, params, as_prompt: bool) -> dict:
    counts = {}
    for first in range(0, SAMPLES, 4 * ROWS_PER_CASE):
        seqs = []
        for seed in range(first, min(first + 4 * ROWS_PER_CASE, SAMPLES)):
            if as_prompt:  # the wrong way: the generated token fed as prompt, its penalties lost
                seqs.append(engine.add_request(PROMPT + [FIRST], replace(params, seed=seed, max_new_tokens=2),
                                               drafter=drafter))
            else:
                seqs.append(engine.add_request(PROMPT, replace(params, seed=seed), drafter=drafter,
                                               resume=Continuation((FIRST,))))
        while engine.has_unfinished:
            engine.step()
        for seq in seqs:
            key = tuple(seq.stopper.token_ids[-2:])
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("coupled", [False, True], ids=["rejection", "coupled"])
def test_resumed_sampling_follows_the_conditional_distribution(coupled):
    target = peaky_llama(0)
    engine = SpeculativeEngine(target, CharTokenizer(), None, SpeculativeConfig(num_draft_tokens=2), 64,
                               max_batch_size=4 * ROWS_PER_CASE)
    drafter = ModelDrafter(peaky_llama(1), 128)
    params = SamplingParams(**SAMPLED, coupled=coupled)
    exact = _conditional(target, params)
    bound = tvd_bound(len(exact), SAMPLES)
    tvd = _tvd(_sample_rest(engine, drafter, params, as_prompt=False), exact, SAMPLES)
    assert tvd < bound, (tvd, bound)
    wrong = _tvd(_sample_rest(engine, drafter, params, as_prompt=True), exact, SAMPLES)
    assert wrong > bound, (wrong, bound)  # the test can fail: penalties that missed the token are caught
