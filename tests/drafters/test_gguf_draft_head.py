"""A GGUF draft with a frequency-ranked reduced head (drafters/vocab_ranks.py, `load_draft(..., head_ids=)`): its
head is the file's own rows for the kept ids (no re-quantization), its logits there are the full head's bit for
bit, it drafts only kept tokens (q a distribution over them), and speculation with it gives the target alone's
output, greedy, coupled and sampled, alone and batched. Negative controls: ids off by one break the exact logits
check; a shuffled id map changes the drafts and lowers acceptance (the output stays the target's)."""

import numpy as np
import pytest
import torch

from conftest import CORPUS, VOCAB, tiny_qwen2, train_on_corpus
from gguf_writer import write_gguf
from test_draft_vocab import check_proposals, recorded
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters import spec as spec_module, vocab_ranks
from verispec.drafters.build import build_drafter
from verispec.drafters.model import ModelDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.runtime.model.architectures import QWEN2
from verispec.runtime.model.loading import load_draft
from verispec.runtime.model.reduced_head import ReducedHead, expand_logits
from verispec.runtime.runners.select import make_runner

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernel("quant")]

MAX_LEN = 192
SIZE = 24  # rows kept of the tiny vocabulary's
TEXT = "the cat sat on the mat. the dog sat on the log. the cat ran to the dog and the dog ran to the cat."


@pytest.fixture(scope="module")
def draft_file(tokenizer, tmp_path_factory):
    """A tiny trained Qwen2 draft (untied head: its own output.weight, Q8_0) written as llama.cpp writes one."""
    model = train_on_corpus(tiny_qwen2(12, hidden=32, layers=1), tokenizer, steps=60)
    return write_gguf(model, tmp_path_factory.mktemp("gguf-draft") / "draft.gguf", QWEN2)


def ranked(tokenizer) -> np.ndarray:
    """The corpus' token ids, most frequent first (what recipes/vocab_ranks.py makes for a real tokenizer)."""
    counts = np.bincount(tokenizer(CORPUS)["input_ids"], minlength=VOCAB)
    order = np.lexsort((np.arange(VOCAB), -counts))
    return order[counts[order] > 0]


@pytest.fixture(scope="module")
def ids(tokenizer):
    out = vocab_ranks.head_ids(ranked(tokenizer), SIZE, VOCAB, vocab_ranks.stop_ids(tokenizer))
    assert SIZE <= out.numel() < VOCAB
    return out


def prompts(tokenizer):
    return [tokenizer(TEXT)["input_ids"], tokenizer(TEXT[30:])["input_ids"]]


def last_logits(model, tokens) -> torch.Tensor:
    runner = make_runner(model, MAX_LEN, 1)
    return runner.forward(torch.tensor([tokens]), last_only=True).logits[0, -1]  # [vocab or n]


def test_the_head_is_the_files_own_rows_and_its_logits_the_full_heads(draft_file, ids, tokenizer):
    full = load_draft(draft_file)
    reduced = load_draft(draft_file, head_ids=ids)
    head = make_runner(reduced, MAX_LEN, 1).model.lm_head.weight
    full_head = make_runner(full, MAX_LEN, 1).model.lm_head.weight
    assert isinstance(head, ReducedHead) and head.compact and torch.equal(head.ids, ids)
    assert head.weight.qtype == full_head.qtype == "Q8_0" and tuple(head.weight.shape) == (ids.numel(), 32)
    assert torch.equal(head.weight.data, full_head.data[ids])  # the file's bytes, row by row
    assert reduced.config.draft_vocab == ids.tolist() and reduced.config.vocab_size == VOCAB
    tokens = tokenizer(TEXT)["input_ids"]
    subset, every = last_logits(reduced, tokens), last_logits(full, tokens)  # [n], [vocab]
    assert subset.shape == (ids.numel(),)
    assert torch.equal(subset, every[ids])  # bit for bit
    expanded = expand_logits(subset, ids, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(expanded[outside]).all() and torch.equal(expanded[ids], every[ids])
    # negative control: the same rows under ids off by one are not the full head's logits there
    assert not torch.equal(expand_logits(subset, ids + 1, VOCAB + 1)[ids + 1], every.roll(-1)[ids])
    assert not torch.equal(expand_logits(subset, (ids + 1) % VOCAB, VOCAB)[ids], every[ids])


def engine_on(target, draft, tokenizer, k=3):
    drafter = ModelDrafter(draft, MAX_LEN + CACHE_SLACK)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=k), max_len=MAX_LEN,
                               max_batch_size=2)
    return engine, drafter


PARAMS = {
    "greedy": SamplingParams(max_new_tokens=24, ignore_eos=True),
    "coupled": SamplingParams(max_new_tokens=24, temperature=0.8, seed=5, coupled=True, ignore_eos=True),
    "sampled": SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, coupled=False, ignore_eos=True),
}


@pytest.mark.parametrize("mode", list(PARAMS))
def test_speculation_with_the_reduced_draft_gives_the_target_alone(trained_pair, tokenizer, draft_file, ids, mode):
    target, _ = trained_pair
    engine, drafter = engine_on(target, load_draft(draft_file, head_ids=ids), tokenizer)
    assert torch.equal(drafter.vocab_ids, ids)
    seen = recorded(drafter)
    params = PARAMS[mode]
    batched = engine.generate_batch(prompts(tokenizer), params)
    alone = [engine.generate(p, params) for p in prompts(tokenizer)]
    drafter_off = engine.generate_batch(prompts(tokenizer), params, use_drafter=False)
    if mode != "sampled":  # greedy and coupled: the target alone's tokens, whatever drafts
        assert [r.token_ids for r in batched] == [r.token_ids for r in drafter_off]
        assert [r.token_ids for r in alone] == [r.token_ids for r in drafter_off]
    else:  # a seeded request: the same tokens alone or in a batch (rejection sampling's own guarantee)
        assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert sum(r.stats.draft_tokens for r in batched) > 0
    if mode != "sampled":
        assert sum(r.stats.accepted_tokens for r in batched) > 0
    with_q = check_proposals(seen, ids, VOCAB)  # every draft token kept; q 0 outside the subset, 1 over it
    assert (with_q > 0) == (mode == "sampled")


def test_plain_greedy_drafts_on_the_compact_logits_as_on_the_whole_vocabulary(trained_pair, tokenizer, draft_file,
                                                                               ids):
    """The compact head's argmax mapped to ids (`_greedy_choices`) drafts the tokens process_logits + row_choices
    pick on the vocabulary-wide logits (a non-compact head of the same rows)."""
    target, _ = trained_pair
    engines = []
    for compact in (True, False):
        engine, drafter = engine_on(target, load_draft(draft_file, head_ids=ids), tokenizer)
        drafter.reserve(2)
        drafter.runner.model.lm_head.weight.compact = compact
        engines.append((engine, recorded(drafter)))
    outs = [engine.generate_batch(prompts(tokenizer), PARAMS["greedy"]) for engine, _ in engines]
    drafts = [[p.token_ids.tolist() for p in seen] for _, seen in engines]
    assert drafts[0] == drafts[1] and sum(map(len, drafts[0])) > 0
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]


def test_a_shuffled_id_map_changes_the_drafts_not_the_output(trained_pair, tokenizer, draft_file, ids):
    """Negative control: the head's logits mapped to the wrong ids draft other tokens, acceptance falls, and
    verification still gives the target alone's output."""
    target, _ = trained_pair
    results, drafts = [], []
    for shuffle in (False, True):
        engine, drafter = engine_on(target, load_draft(draft_file, head_ids=ids), tokenizer)
        if shuffle:
            drafter.vocab_ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
        seen = recorded(drafter)
        results.append(engine.generate_batch(prompts(tokenizer), PARAMS["greedy"]))
        drafts.append([p.token_ids.tolist() for p in seen])
    right, shuffled = results
    assert [r.token_ids for r in right] == [r.token_ids for r in shuffled]
    assert drafts[0] != drafts[1]
    accepted = [sum(r.stats.accepted_tokens for r in rs) / sum(r.stats.draft_tokens for r in rs) for rs in results]
    assert accepted[1] < accepted[0]


def test_the_drafter_spec_sizes_the_head(trained_pair, tokenizer, draft_file, ids, monkeypatch):
    """'PATH:vN' keeps the N most frequent (the table that knows the tokenizer) and the special tokens; ':vfull' and
    the default without a table keep the whole head; the default with a table keeps DEFAULT_DRAFT_VOCAB."""
    target, _ = trained_pair
    monkeypatch.setattr(spec_module, "MIN_DRAFT_VOCAB", 8)
    monkeypatch.setattr(vocab_ranks, "_tables", lambda: {vocab_ranks.fingerprint(tokenizer): ranked(tokenizer)})

    def head(value):
        drafter = build_drafter(value, target, tokenizer, MAX_LEN).drafter
        drafter.reserve(1)
        return drafter, drafter.runner.model.lm_head.weight

    drafter, reduced = head(f"{draft_file}:v{SIZE}")
    assert isinstance(reduced, ReducedHead) and torch.equal(reduced.ids, ids) and torch.equal(drafter.vocab_ids, ids)
    assert not isinstance(head(f"{draft_file}:vfull")[1], ReducedHead)
    monkeypatch.setattr(vocab_ranks, "DEFAULT_DRAFT_VOCAB", 40)
    assert head(str(draft_file))[1].ids.numel() >= 40
    monkeypatch.setattr(vocab_ranks, "_tables", lambda: {})
    assert not isinstance(head(str(draft_file))[1], ReducedHead)
    load = build_drafter(f"ngram+{draft_file}:v{SIZE}", target, tokenizer, MAX_LEN)
    assert load.name == f"ngram+{draft_file}:v{SIZE}"
