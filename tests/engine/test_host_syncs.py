"""Host syncs and allocations of one step, counted rather than claimed (DEVELOPERS.md, "The step" -> Host syncs).

Every way a tensor's value reaches the host (`tolist`, `item`, `cpu`, `numpy`, `bool`/`int`/`float`/`index`,
`nonzero`) is wrapped for the length of one steady step and counted by the verispec module that asked for it. On
the CPU these are cheap, but each is a device-to-host sync on an accelerator: the engine's own is ONE per step,
whatever mix of rows (greedy, rejection-sampled and coupled, chains and trees, model drafter and n-gram); the rest
is one NaN check per forward and what each drafter documents.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch

from conftest import tiny_llama
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.distill.head import HeadNet
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.head import HeadConfig, HeadDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.engine.proposer import Proposer

READS = ["tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"]
K = 4
ROWS = 4


def _site() -> str:
    """The verispec module (path under src/verispec/) whose code asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/src/verispec/" in frame.filename:
            return frame.filename.split("/src/verispec/")[1]
    return "elsewhere"


class SyncCounter:
    """Counts host reads of tensor values while `on`, by the verispec module that made them."""

    def __init__(self, monkeypatch) -> None:
        self.on = False
        self.sites: Counter = Counter()
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                if self.on:
                    self.sites[_site()] += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def step(self, engine) -> Counter:
        self.sites.clear()
        self.on = True
        try:
            engine.step()
        finally:
            self.on = False
        return Counter(self.sites)


def engine_syncs(sites: Counter) -> int:
    """The engine's own: the step's modules and the verification math (drafters and the NaN check apart)."""
    return sum(n for site, n in sites.items() if site.startswith("engine/") or site == "acceptance.py")


# Each row's sampling: greedy, rejection sampling (its own generator) or coupled (Gumbel-max noise keyed by seed).
GREEDY, REJECTION, COUPLED = "greedy", "rejection", "coupled"
MIXES = {"greedy": (GREEDY,) * ROWS, "rejection": (GREEDY, REJECTION, GREEDY, REJECTION),
         "coupled": (GREEDY, COUPLED, GREEDY, COUPLED), "all": (GREEDY, REJECTION, COUPLED, COUPLED)}


def row_params(kind: str, seed: int) -> SamplingParams:
    assert kind in (GREEDY, REJECTION, COUPLED), kind
    if kind == GREEDY:
        return SamplingParams(max_new_tokens=100, ignore_eos=True)
    return SamplingParams(max_new_tokens=100, ignore_eos=True, temperature=1.0, seed=seed, coupled=kind == COUPLED)


def run_rows(engine, tokenizer, rows=MIXES["rejection"], warm_steps=2):
    prompt = tokenizer("the cat sat on the mat. the cat sat on the")["input_ids"]
    for i, kind in enumerate(rows):
        engine.add_request(prompt, row_params(kind, i))
    for _ in range(warm_steps):  # admission and prefill done: the next steps are plain decoding rounds
        engine.step()
    assert len(engine.running) == len(rows)
    assert sum(seq.sampling.noise_seed is not None for seq in engine.running) == rows.count(COUPLED)


@pytest.fixture
def counter(monkeypatch):
    return SyncCounter(monkeypatch)


@pytest.fixture
def drafts_seen(monkeypatch):
    """Every StepDrafts the proposer hands the verifier."""
    seen = []
    propose = Proposer.propose

    def spy(self, rows):
        seen.append(propose(self, rows))
        return seen[-1]

    monkeypatch.setattr(Proposer, "propose", spy)
    return seen


@pytest.mark.parametrize("mix", ["rejection", "coupled", "all"])
def test_model_drafter_step(tokenizer, trained_pair, counter, mix):
    """Greedy and sampled rows (rejection-sampled, coupled, both) with a model drafter: the engine's one sync, one
    NaN check per forward (the verify pass and each of the K draft forwards), the model drafter's one read of which
    rows sample. Coupled rows' choices (the noise keyed by seed and position) cost no sync of their own."""
    target, draft = trained_pair
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(draft, 256 + CACHE_SLACK),
                               SpeculativeConfig(num_draft_tokens=K), max_len=256, max_batch_size=ROWS)
    run_rows(engine, tokenizer, MIXES[mix])
    for _ in range(3):
        sites = counter.step(engine)
        assert engine_syncs(sites) == 1, sites
        assert sites["sampling/processors.py"] == 1 + K, sites  # check_finite: one per forward
        assert sites["drafters/model.py"] == 1, sites
        assert sum(sites.values()) == 1 + (1 + K) + 1, sites


@pytest.mark.parametrize("mix", ["rejection", "coupled"])
def test_ngram_step(tokenizer, counter, mix):
    """Prompt lookup: the engine's one sync, the verify pass's NaN check, and the matcher's one per row."""
    engine = SpeculativeEngine(tiny_llama(3), tokenizer, NgramDrafter(), SpeculativeConfig(num_draft_tokens=K),
                               max_len=256, max_batch_size=ROWS)
    run_rows(engine, tokenizer, MIXES[mix])
    for _ in range(3):
        sites = counter.step(engine)
        assert engine_syncs(sites) == 1, sites
        assert sites["sampling/processors.py"] == 1, sites
        assert sites["drafters/ngram.py"] == ROWS, sites
        assert sum(sites.values()) == 1 + 1 + ROWS, sites


@pytest.mark.parametrize("mix", ["greedy", "rejection", "coupled"])
def test_token_tree_step(tokenizer, trained_pair, counter, drafts_seen, mix):
    """Token trees from a draft head (greedy, rejection-sampled and coupled rows): still the engine's one sync per
    step (no trim of the accepted paths, no per-row read of the trees, their depths come back with the verdict)."""
    target, _ = trained_pair
    config = HeadConfig.for_target(target.config, "tiny", target.config.vocab_size)
    head = HeadDrafter(config, HeadNet(config, target, torch.arange(target.config.vocab_size), seed=0).export(),
                       target, 256)
    engine = SpeculativeEngine(target, tokenizer, head, SpeculativeConfig(num_draft_tokens=K, tree_nodes=10),
                               max_len=256, max_batch_size=ROWS)
    run_rows(engine, tokenizer, MIXES[mix])
    for _ in range(3):
        sites = counter.step(engine)
        assert drafts_seen[-1].tree is not None  # the step verified trees
        assert engine_syncs(sites) == 1, sites


@pytest.mark.parametrize("mix", ["greedy", "rejection", "coupled"])
def test_model_tree_step(tokenizer, trained_pair, counter, drafts_seen, mix):
    """Token trees from a draft model: the engine's one sync, one NaN check per forward (the verify pass, the draft's
    root forward and one per depth below the deepest), and the tree drafter's own: one read of which rows sample,
    two per depth (the top tokens and their probabilities), one more per depth where a sampled row draws."""
    target, draft = trained_pair
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(draft, 256 + CACHE_SLACK),
                               SpeculativeConfig(num_draft_tokens=K, tree_nodes=10), max_len=256, max_batch_size=ROWS)
    run_rows(engine, tokenizer, MIXES[mix])
    for _ in range(3):
        sites = counter.step(engine)
        assert drafts_seen[-1].tree is not None  # the step verified trees
        assert engine_syncs(sites) == 1, sites
        assert sites["sampling/processors.py"] == 1 + K, sites
        assert sites["drafters/model_tree.py"] == 1 + 2 * K + (K if mix == "rejection" else 0), sites
        assert sum(sites.values()) == 1 + (1 + K) + sites["drafters/model_tree.py"], sites


def test_no_draft_probability_tensor_without_q(tokenizer, trained_pair, monkeypatch, drafts_seen):
    """No row carries q (greedy rows of a model drafter, sampled rows of prompt lookup): no [batch, width, vocab]
    tensor is allocated for it; a sampled model-drafter row carries q, and then it is."""
    target, draft = trained_pair
    vocab = target.config.vocab_size
    wide = []
    zeros = torch.zeros

    def counted_zeros(*size, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        if len(shape) == 3 and shape[-1] == vocab:
            wide.append(shape)
        return zeros(*size, **kwargs)

    cascade = CascadeDrafter([NgramDrafter(min_ngram=2), ModelDrafter(draft, 256 + CACHE_SLACK)])
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=K), max_len=256,
                               max_batch_size=ROWS)
    prompt = tokenizer("the cat sat on the mat. the cat sat on the")["input_ids"]
    engine.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))  # greedy: q never needed
    engine.add_request(tokenizer("xyz")["input_ids"], SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.step()
    monkeypatch.setattr(torch, "zeros", counted_zeros)
    while engine.has_unfinished:
        engine.step()
    assert drafts_seen and all(d.draft_probs is None for d in drafts_seen)
    assert any(d.num_draft_tokens.sum() > 0 for d in drafts_seen)  # drafts were verified all along
    assert not wide, wide
    # A sampled row drafted by the model carries q: then (and only then) the tensor exists.
    engine.add_request(tokenizer("xyz")["input_ids"], SamplingParams(max_new_tokens=8, temperature=1.0, seed=0,
                                                                     ignore_eos=True, coupled=False))
    while engine.has_unfinished:
        engine.step()
    assert any(d.draft_probs is not None for d in drafts_seen) and wide
