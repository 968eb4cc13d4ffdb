"""Stopping by token ids and by stop strings across token boundaries; stats count only what was returned."""

import pytest
import torch

from conftest import EOS_ID
from verispec.config import SamplingParams
from verispec.engine.detokenize import IncrementalDetokenizer, StopChecker
from verispec.generator import SpeculativeGenerator


def checker(tokenizer, **kwargs):
    params = SamplingParams(**{"max_new_tokens": 50, **kwargs})
    return StopChecker(params, {EOS_ID}, tokenizer, params.max_new_tokens)


def push_text(stop, tokenizer, text):
    for token in tokenizer(text)["input_ids"]:
        if stop.push(token):
            break


def test_stop_string_across_token_boundaries_cuts_before_it(tokenizer):
    stop = checker(tokenizer, stop=["sat on"])
    push_text(stop, tokenizer, "the cat sat on the mat")
    assert stop.finish_reason == "stop"
    assert stop.text == "the cat "
    assert tokenizer.decode(stop.token_ids) == "the cat sat on"  # tokens up to the one completing the match


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    stop = checker(tokenizer, stop=["STOP"])
    shown = ""
    for token in tokenizer("abc ST")["input_ids"]:
        stop.push(token)
        shown += stop.take_text()
    assert shown == "abc "  # "ST" could still become "STOP"
    for token in tokenizer("ART")["input_ids"]:
        stop.push(token)
        shown += stop.take_text()
    assert shown == "abc START"


@pytest.mark.parametrize("token", [EOS_ID, 1])
def test_eos_ids_and_user_stop_ids_end_generation(tokenizer, token):
    stop = StopChecker(SamplingParams(stop_token_ids=(1,)), {EOS_ID}, tokenizer, 10)
    assert stop.push(tokenizer("a")["input_ids"][0]) is None
    assert stop.push(token) == "stop"
    assert stop.text == "a" and len(stop.token_ids) == 2


def test_several_eos_ids(tokenizer):
    stop = StopChecker(SamplingParams(), {EOS_ID, 2}, tokenizer, 10)
    assert stop.push(2) == "stop"


def test_ignore_eos(tokenizer):
    stop = StopChecker(SamplingParams(ignore_eos=True), {EOS_ID}, tokenizer, 10)
    assert stop.push(EOS_ID) is None


def test_max_new_tokens_is_length(tokenizer):
    stop = checker(tokenizer, max_new_tokens=3)
    reasons = [stop.push(t) for t in tokenizer("abcd")["input_ids"][:3]]
    assert reasons == [None, None, "length"]


def test_incremental_detokenizer_equals_full_decode(tokenizer):
    ids = tokenizer("Hello, world! one two\nthree")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(t) for t in ids) == tokenizer.decode(ids)


class ScriptedTokenizer:
    """Decodes each id to a fixed string; ids 0 and 1 are the two halves of one UTF-8 character."""

    eos_token_id = None
    pieces = {0: b"\xc3", 1: b"\xa9", 2: b"x"}

    def decode(self, ids, **kwargs):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_split_multibyte_character_waits_for_its_second_half():
    detok = IncrementalDetokenizer(ScriptedTokenizer())
    assert detok.push(2) == "x"
    assert detok.push(0) == ""
    assert detok.push(1) == "é"


def test_engine_drops_tokens_accepted_past_a_stop(trained_pair, tokenizer):
    target, _ = trained_pair
    gen = SpeculativeGenerator(target, target, tokenizer, K=6, max_len=256)  # identical drafter: long acceptances
    prompt = "the cat sat on the"
    full = gen.generate(prompt, max_new_tokens=40, ignore_eos=True, return_dict=True)
    stop_at = full.text[5:9]
    assert stop_at and stop_at not in full.text[:8]
    cut = gen.generate(prompt, max_new_tokens=40, ignore_eos=True, stop=[stop_at], return_dict=True)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop_at)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert cut.stats.generated_tokens == len(cut.token_ids) < len(full.token_ids)
    assert cut.stats.accepted_tokens <= cut.stats.generated_tokens


def test_engine_min_new_tokens_blocks_stop_ids_like_hf(trained_pair, tokenizer):
    target, draft = trained_pair
    gen = SpeculativeGenerator(target, draft, tokenizer, K=4, max_len=256)
    space = tokenizer(" ")["input_ids"][0]  # a stop id that the target emits early
    free = gen.generate("the cat", max_new_tokens=40, stop_token_ids=[space], return_dict=True)
    assert free.finish_reason == "stop" and free.token_ids[-1] == space
    n = len(free.token_ids) + 3
    forced = gen.generate("the cat", max_new_tokens=40, stop_token_ids=[space], min_new_tokens=n, return_dict=True)
    assert space not in forced.token_ids[:n]
    prompt = torch.tensor([tokenizer("the cat")["input_ids"]])
    hf = target.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=[EOS_ID, space], min_new_tokens=n)
    assert forced.token_ids == hf[0, prompt.shape[1] :].tolist()


def test_stream_yields_the_same_text_as_generate(trained_pair, tokenizer):
    target, draft = trained_pair
    gen = SpeculativeGenerator(target, draft, tokenizer, K=4, max_len=256)
    pieces = list(gen.stream("the dog sat", max_new_tokens=40, stop=["tree"]))
    whole = gen.generate("the dog sat", max_new_tokens=40, stop=["tree"])
    assert "".join(pieces) == whole
    assert len(pieces) > 1
    assert gen.get_stats()["last"]["generated_tokens"] > 0


def test_chat_prompt_uses_the_template(trained_pair, tokenizer):
    target, draft = trained_pair
    gen = SpeculativeGenerator(target, draft, tokenizer, K=4, max_len=256)
    ids = gen.encode("hi", chat=True)
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                tokenize=True)["input_ids"]
    assert isinstance(gen.generate("hi", chat=True, max_new_tokens=5), str)
    assert torch.tensor(ids).dim() == 1
