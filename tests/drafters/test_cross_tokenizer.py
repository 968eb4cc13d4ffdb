"""Drafting across tokenizers: a draft model with another tokenizer, its text re-tokenized at the boundary.

Two tiny trained pairs, one per direction: the character-level tokenizer of conftest.py and a BPE trained on the
same corpus (it merges frequent pairs, so the same text is fewer, different tokens). Greedy output must equal the
target alone at batch 1 and in a ragged batch of 16, with drafts actually proposed and accepted; the mismatch is
detected when the drafter is built; the boundary rules are checked by hand. Sampled exactness (a point mass) is in
test_sampling_exactness.py with the other drafters.
"""

import copy
import logging

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import CHARS, CORPUS, SPECIALS, tiny_llama, train_on_corpus
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.build import build_drafter, model_drafter
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter, common_prefix, same_tokenizer
from verispec.drafters.model import ModelDrafter
from verispec.engine import SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add contention

PROMPTS = ["the cat sat on the", "Paris is the capital of", "one two three", "a bird sang in", "the dog sat",
           "Rome is", "four five six seven", "the mat. the log. a", "t", "one two three four five six seven eight",
           "the capital of France", "sat on the mat. the dog", "Italy.\none", "bird", "the cat sat on the mat. the",
           "ten.\nParis"]


def bpe_tokenizer(merges: int = 60) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the corpus: conftest's characters plus `merges` merged pieces, the same specials
    (ids 0..4), another vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    initial = sorted({alphabet[b] for c in CHARS for b in c.encode()})
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIALS) + len(initial) + merges, special_tokens=SPECIALS,
                                  initial_alphabet=initial, show_progress=False)
    core.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="</s>", additional_special_tokens=["<|im_start|>"])


@pytest.fixture(scope="module")
def bpe():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def bpe_pair(bpe):
    """(target, draft) on the BPE tokenizer, trained briefly on the corpus."""
    vocab = len(bpe)
    target = train_on_corpus(tiny_llama(40, hidden=64, layers=2, vocab=vocab), bpe, steps=150)
    draft = train_on_corpus(tiny_llama(41, hidden=32, layers=1, vocab=vocab), bpe, steps=80)
    return target, draft


def cross(draft, target_tok, draft_tok, max_len=256):
    drafter = model_drafter(None, draft, max_len, target_tok, draft_tok)
    assert isinstance(drafter, CrossTokenizerDrafter)
    return drafter


def assert_greedy_identical(target, target_tok, drafter, batch_size):
    engine = SpeculativeEngine(target, target_tok, drafter, SpeculativeConfig(num_draft_tokens=4), max_len=256,
                               max_batch_size=batch_size)
    prompts = [target_tok(p)["input_ids"] for p in PROMPTS[:batch_size]]
    params = [SamplingParams(max_new_tokens=20 + 3 * (i % 5), ignore_eos=True) for i in range(len(prompts))]
    if batch_size == 1:
        spec = [engine.generate(p, q) for p, q in zip(prompts, params)]
    else:
        spec = engine.generate_batch(prompts, params)
    alone = [engine.generate(p, q, use_drafter=False) for p, q in zip(prompts, params)]
    for s, a, text in zip(spec, alone, PROMPTS):
        assert s.token_ids == a.token_ids, text
    total = engine.total
    print(f"acceptance {total.accepted_tokens / max(total.draft_tokens, 1):.2f}, "
          f"draft tokens per round {total.draft_tokens / total.rounds:.2f}")
    assert total.draft_tokens > 0 and total.accepted_tokens > 0  # it drafted, and drafted well
    return total


# -- detection ----------------------------------------------------------------------------------------------------


def test_the_two_tokenizers_differ(tokenizer, bpe):
    text = "the cat sat on the mat."
    assert len(bpe(text)["input_ids"]) < len(tokenizer(text)["input_ids"])  # merged pieces
    assert bpe.decode(bpe(text)["input_ids"]) == text
    assert not same_tokenizer(tokenizer, bpe) and same_tokenizer(tokenizer, tokenizer)


def test_a_draft_folder_with_another_tokenizer_is_detected_and_wrapped(tmp_path, trained_pair, tokenizer, bpe_pair,
                                                                      bpe, caplog):
    target, _ = trained_pair
    bpe_pair[1].save_pretrained(tmp_path / "bpe-draft")
    bpe.save_pretrained(tmp_path / "bpe-draft")
    with caplog.at_level(logging.INFO, logger="verispec"):
        loaded = build_drafter(str(tmp_path / "bpe-draft"), target, tokenizer, 128)
    assert isinstance(loaded.drafter, CrossTokenizerDrafter) and isinstance(loaded.drafter.inner, ModelDrafter)
    assert loaded.warning is None
    assert "another tokenizer" in caplog.text and "drafting across tokenizers" in caplog.text
    # in a cascade too
    loaded = build_drafter(f"ngram+{tmp_path / 'bpe-draft'}", target, tokenizer, 128)
    assert isinstance(loaded.drafter.stages[1], CrossTokenizerDrafter)


def test_a_draft_with_the_targets_tokenizer_is_a_plain_model_drafter(trained_pair, tokenizer, model_dirs):
    target, _ = trained_pair
    assert type(build_drafter(str(model_dirs["draft"]), target, tokenizer, 128).drafter) is ModelDrafter
    with pytest.raises(ValueError, match="vocabulary size"):  # same tokenizer, other output size: still an error
        build_drafter(str(model_dirs["odd_vocab"]), target, tokenizer, 128)


# -- greedy identity, both directions --------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 16])
def test_char_target_bpe_draft_greedy_identical(trained_pair, tokenizer, bpe_pair, bpe, batch_size):
    target, _ = trained_pair
    assert_greedy_identical(target, tokenizer, cross(bpe_pair[1], tokenizer, bpe), batch_size)


@pytest.mark.parametrize("batch_size", [1, 16])
def test_bpe_target_char_draft_greedy_identical(trained_pair, tokenizer, bpe_pair, bpe, batch_size):
    assert_greedy_identical(bpe_pair[0], bpe, cross(trained_pair[1], bpe, tokenizer), batch_size)


@pytest.mark.parametrize("which", ["char", "bpe"])
def test_the_boundary_loses_nothing_when_the_draft_is_the_target(trained_pair, tokenizer, bpe_pair, bpe, which):
    """The target drafting for itself behind the wrapper (text out, text in): every draft token is accepted and a
    round commits K + 1 tokens, so re-tokenizing drops no determined token and adds no wrong one."""
    target, tok = (trained_pair[0], tokenizer) if which == "char" else (bpe_pair[0], bpe)
    # the draft a copy: the same weights with a twin of its own (the draft's Q8_0 blocks would else be the target's)
    engine = SpeculativeEngine(target, tok, CrossTokenizerDrafter(ModelDrafter(copy.deepcopy(target), 512), tok, tok),
                               SpeculativeConfig(num_draft_tokens=4), max_len=256)
    for text in PROMPTS[:4]:
        result = engine.generate(tok(text)["input_ids"], SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert result.stats.accepted_tokens == result.stats.draft_tokens > 0
        assert result.stats.generated_tokens == 5 * result.stats.rounds  # K + 1 per round (30 = 6 rounds)


def test_sampled_rows_are_verified_as_point_masses(trained_pair, tokenizer, bpe_pair, bpe, monkeypatch):
    import verispec.engine.verifier as verifier
    from verispec.engine.acceptance import rejection_verify

    seen = []

    def spy(meta, q, has_q, p, *args, **kwargs):
        seen.append((meta.draft_token_ids.shape[1], q is None or not has_q.any()))
        return rejection_verify(meta, q, has_q, p, *args, **kwargs)

    monkeypatch.setattr(verifier, "rejection_verify", spy)
    engine = SpeculativeEngine(trained_pair[0], tokenizer, cross(bpe_pair[1], tokenizer, bpe),
                               SpeculativeConfig(num_draft_tokens=3), max_len=256)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    engine.generate_batch(prompts, SamplingParams(max_new_tokens=16, temperature=0.8, seed=1, ignore_eos=True, coupled=False))
    assert any(k > 0 for k, _ in seen) and all(point_mass for _, point_mass in seen)


# -- the boundary, by hand --------------------------------------------------------------------------------------------


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    long = list(range(500))
    assert common_prefix(long, long[:300] + [-1]) == 300 and common_prefix(long, [9] + long[1:]) == 0


def test_only_determined_target_tokens_are_proposed(tokenizer, bpe, trained_pair):
    """The draft's text becomes the target's tokens; the last one is dropped (it may merge with more text), and a
    text that would merge into the committed tokens proposes nothing."""
    drafter = cross(trained_pair[1], bpe, tokenizer)  # target: BPE, draft: characters
    committed = torch.tensor(bpe("the cat")["input_ids"])
    context = tokenizer("the cat")["input_ids"]
    out = drafter._target_tokens([_row(committed)], {0: context}, {0: tokenizer(" sat on the")["input_ids"]})
    full = bpe("the cat sat on the")["input_ids"]
    assert full[: len(committed)] == committed.tolist()
    assert out[0] == full[len(committed): -1]  # " sat", " on" ...; the last piece " the" dropped
    # the committed text ends inside a piece the draft's text completes ("the c" "a" + "t" is "the c" "at"):
    # nothing is determined
    inside = torch.tensor(bpe("the ca")["input_ids"])
    assert bpe("the cat")["input_ids"][: len(inside)] != inside.tolist()
    assert drafter._target_tokens([_row(inside)], {0: tokenizer("the ca")["input_ids"]},
                                  {0: tokenizer("t sat on")["input_ids"]}) == {}
    # a special token the target knows ends the text and is kept
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = drafter._target_tokens([_row(committed)], {0: context}, {0: tokenizer(" sat")["input_ids"] + [eos]})
    assert out[0][-1] == bpe.convert_tokens_to_ids("<|im_end|>")


def _row(tokens):
    from verispec.drafters.base import DraftRow

    return DraftRow(tokens, 4, 0, torch.Generator())
