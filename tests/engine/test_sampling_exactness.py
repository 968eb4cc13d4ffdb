"""Level (b): speculative sampling follows the processed target distribution exactly.

On a tiny-vocabulary pair whose draft disagrees strongly with the target, the empirical joint distribution of
the first three generated tokens (many seeded runs of the real engine, rows of several cases with different
parameters and drafters side by side in each batch) is compared with the exact target distribution computed by
enumeration. The total-variation bound comes from the sample size: the expected TVD of
an N-sample empirical distribution over M outcomes is at most 0.5 * sqrt(M / N), and McDiarmid's inequality
(each sample moves the TVD by at most 1/N) adds sqrt(ln(1/delta) / (2N)) for failure probability delta = 1e-6.
The same test run on a deliberately biased sampler (recovered tokens drawn from p instead of the residual) must
fail, so the check cannot pass vacuously.
"""

import itertools
import math
from dataclasses import replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import target_probs

from verispec.engine import acceptance as verify
from verispec.config import SamplingParams, SpeculativeConfig, StructuredOutput
from verispec.drafters.base import DraftProposal, Drafter
from verispec.drafters.model import ModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.sampling import Grammar
from verispec.stats import GenerationStats

VOCAB, NEW_TOKENS, PROMPT = 4, 3, [0, 1, 2]
SAMPLES = 6000


class CharTokenizer:
    eos_token_id = None

    def decode(self, ids, **kwargs):
        return "".join("abcd"[i] for i in ids)


def peaky_llama(seed: int, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.5,
                      max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


class PointMassDrafter(Drafter):
    """A drafter with no probabilities, biased towards token 0: exercises the point-mass q path."""

    def __init__(self, vocab: int = VOCAB):
        self.gen = torch.Generator().manual_seed(7)
        self.weights = torch.tensor([0.7] + [0.1] * (vocab - 1))

    def propose(self, batch):
        weights = self.weights
        return [DraftProposal(torch.multinomial(weights, row.k, True, generator=self.gen) if row.k else
                              torch.empty(0, dtype=torch.long), None) for row in batch.rows]


def exact_joint(target, params, vocab: int = VOCAB, tokenizer=None, eos_token_ids=()) -> dict[tuple, float]:
    """P(t1, t2, t3) under the processed target distribution (its grammar too), by enumeration."""
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=NEW_TOKENS):
            prob = 1.0
            for i in range(NEW_TOKENS):
                logits = target(torch.tensor([PROMPT + list(seq[:i])])).logits[0, -1:]
                prob *= target_probs(params, logits, PROMPT, eos_token_ids, generated=seq[:i],
                                     tokenizer=tokenizer)[0, seq[i]].item()
                if prob == 0:
                    break
            joint[seq] = prob
    return joint


def tvd_bound(outcomes: int, samples: int) -> float:
    """The TVD bound of the module docstring for `outcomes` possible outputs."""
    return 0.5 * math.sqrt(outcomes / samples) + math.sqrt(math.log(1e6) / (2 * samples))


TVD_BOUND = tvd_bound(VOCAB**NEW_TOKENS, SAMPLES)

# Rows of all cases run side by side in the same batches (each with its own parameters, drafter and seed), so the
# test checks sampling for rows inside a batch.
CASES = {
    "model-drafter-all-transforms": SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=3, top_p=0.95, min_p=0.05, repetition_penalty=1.3
    ),
    "model-drafter-penalties-logit-bias": SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=2, presence_penalty=0.8, frequency_penalty=0.5,
        logit_bias={1: 1.5, 3: -2.0},
    ),
    "point-mass-drafter-penalties-logit-bias": SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=1.2, presence_penalty=-0.6, frequency_penalty=0.9,
        logit_bias={0: -1.0, 2: 2.0},
    ),
    # a draft model with another tokenizer (drafters/cross_tokenizer.py): its text re-tokenized, a point mass
    "cross-tokenizer-drafter-all-transforms": SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=3, top_p=0.95, logit_bias={1: 0.8}, repetition_penalty=1.2,
    ),
}
# A draft head (random weights) proposing token trees of distinct point masses, verified by recursive rejection over
# siblings, under every position-independent transform, with min_tokens and a stop token (the EOS mask follows each
# node's depth).
TREE_CASES = {
    "tree-head-all-transforms": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.1, top_k=3, top_p=0.95,
                                               logit_bias={2: 0.7}, min_new_tokens=2, stop_token_ids=[3]),
}
ROWS_PER_CASE = 32  # per batch: 128 rows in every step


def run_cases(cases=tuple(CASES) + tuple(TREE_CASES), samples: int = SAMPLES):
    """-> {case: (TVD, acceptance rate, draft tokens per round)} from `samples` seeded runs per case, the cases
    (chains and trees) mixed in each batch."""
    from verispec.distill.head import HeadNet
    from verispec.drafters.head import HeadConfig, HeadDrafter

    target = peaky_llama(0)
    config = HeadConfig.for_target(target.config, "peaky", VOCAB)
    head = HeadDrafter(config, HeadNet(config, target, torch.arange(VOCAB), seed=3).export(), target, 64)
    drafters = {case: head if case in TREE_CASES else ModelDrafter(peaky_llama(1), 128) if case.startswith("model")
                else cross_tokenizer_drafter() if case.startswith("cross") else PointMassDrafter() for case in cases}
    engine = SpeculativeEngine(target, CharTokenizer(), None, SpeculativeConfig(num_draft_tokens=2), 64,
                               max_batch_size=len(cases) * ROWS_PER_CASE)
    every = {**CASES, **TREE_CASES}
    specs = {case: SpeculativeConfig(num_draft_tokens=2, tree_nodes=5) for case in TREE_CASES}
    counts, stats = _sample(engine, {case: every[case] for case in cases}, drafters, samples, specs)
    out = {}
    for case in cases:
        joint = _emitted(exact_joint(target, every[case]), every[case])
        n = case_samples(case, samples)
        tvd = 0.5 * sum(abs(counts[case].get(s, 0) / n - p) for s, p in joint.items())
        tvd += 0.5 * sum(c / n for s, c in counts[case].items() if s not in joint)
        out[case] = (tvd, stats[case].acceptance_rate, stats[case].draft_tokens / max(stats[case].rounds, 1))
    return out


def _emitted(joint: dict, params: SamplingParams) -> dict:
    """The enumeration folded onto what is emitted: a stop token ends the output."""
    if not params.stop_token_ids:
        return joint
    folded = {}
    for seq, p in joint.items():
        cut = min((seq.index(t) for t in params.stop_token_ids if t in seq), default=len(seq) - 1)
        folded[seq[: cut + 1]] = folded.get(seq[: cut + 1], 0.0) + p
    return folded


def case_samples(case: str, samples: int) -> int:
    """Tree cases run half as many seeds (their rows cost most; the tree verifier's own statistics, with a negative
    control, are in test_tree_verify.py)."""
    return samples // 2 if case in TREE_CASES else samples


def _sample(engine, cases: dict, drafters: dict, samples: int = SAMPLES, specs: dict | None = None) -> tuple[dict, dict]:
    """`samples` seeded runs of every case, the cases' rows side by side in each batch (specs: per-case
    speculation settings, default the engine's).

    -> ({case: {output tokens: count}}, {case: GenerationStats})"""
    counts = {case: {} for case in cases}
    stats = {case: GenerationStats() for case in cases}
    specs = specs or {}
    for first in range(0, samples, ROWS_PER_CASE):
        # `replace` keeps each case's coupling as built: unseeded cases resolved to rejection sampling.
        seqs = [(case, engine.add_request(PROMPT, replace(params, seed=seed), specs.get(case),
                                          drafter=drafters[case]))
                for case, params in cases.items() if first < case_samples(case, samples)
                for seed in range(first, min(first + ROWS_PER_CASE, case_samples(case, samples)))]
        while engine.has_unfinished:
            engine.step()
        for case, seq in seqs:
            key = tuple(seq.stopper.token_ids)
            counts[case][key] = counts[case].get(key, 0) + 1
            stats[case].merge(seq.stats)
    return counts, stats


def test_speculative_sampling_matches_target_distribution_in_a_batch():
    """Chains (a draft model, a point-mass drafter) and token trees (a draft head's point-mass siblings, verified by
    recursive rejection) side by side in every batch."""
    for case, (tvd, acceptance, per_round) in run_cases().items():
        bound = tvd_bound(VOCAB**NEW_TOKENS, case_samples(case, SAMPLES))
        print(f"{case}: TVD {tvd:.4f}, bound {bound:.4f}, acceptance {acceptance:.3f}, drafts/round {per_round:.2f}")
        assert 0.05 < acceptance < 0.9, f"{case}: both the draft path and the residual path must run"
        assert tvd < bound, f"{case}: TVD {tvd:.4f} exceeds the sampling bound {bound:.4f}"
        if case in TREE_CASES:
            assert per_round > 2.5, f"{case}: trees were not drafted ({per_round:.2f} draft tokens per round)"


def test_the_check_catches_a_biased_sampler(monkeypatch):
    """Recovered tokens drawn from p instead of norm(max(0, p - q)): the classic bug must be detected. (Tree siblings
    tried against p instead of the residual: the same check on the tree verifier, tests/unit/test_tree_verify.py.)"""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    for case, (tvd, _, _) in run_cases(("model-drafter-all-transforms",)).items():
        print(f"biased {case}: TVD {tvd:.4f}, bound {TVD_BOUND:.4f}")
        assert tvd > TVD_BOUND, f"a biased sampler passed: {case} TVD {tvd:.4f} <= bound {TVD_BOUND:.4f}"


# -- structured output ---------------------------------------------------------------------------------------------

# A grammar whose mask at each position depends on the tokens before it: 12 allowed outputs of 3 tokens, EOS
# (token 4) never allowed before the third, so every run generates 3 tokens.
GRAMMAR = StructuredOutput("regex", spec="(a[ab]|b[bc]|c[ac])[bc][abc]*")
GRAMMAR_CASES = {
    "grammar-model-drafter": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.3, structured=GRAMMAR,
                                            logit_bias={1: 0.5}, frequency_penalty=0.3),
    "grammar-point-mass-drafter": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.95,
                                                 structured=GRAMMAR),
}


def abcd_tokenizer():
    """Tokens a, b, c, d and the EOS token </s> (id 4), byte-level like a real BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(["a", "b", "c", "d", "</s>"])}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")


def cross_tokenizer_drafter():
    """A draft model whose tokenizer merges pairs of the target's characters (ab, cd, ca), behind the wrapper that
    re-tokenizes its text into the target's a, b, c, d."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter

    pieces = ["a", "b", "c", "d", "ab", "cd", "ca"]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=[("a", "b"), ("c", "d"), ("c", "a")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    merged = PreTrainedTokenizerFast(tokenizer_object=core)
    return CrossTokenizerDrafter(ModelDrafter(peaky_llama(4, len(pieces)), 128), abcd_tokenizer(), merged)


def run_grammar_cases(samples: int = SAMPLES):
    """-> {case: (TVD, its bound, acceptance rate, outputs outside the grammar)} from `samples` runs per case."""
    tokenizer = abcd_tokenizer()
    vocab = len(tokenizer)
    target = peaky_llama(0, vocab)
    drafters = {case: ModelDrafter(peaky_llama(1, vocab), 128) if "model" in case else PointMassDrafter(vocab)
                for case in GRAMMAR_CASES}
    engine = SpeculativeEngine(target, tokenizer, None, SpeculativeConfig(num_draft_tokens=2), 64,
                               max_batch_size=len(GRAMMAR_CASES) * ROWS_PER_CASE)
    counts, stats = _sample(engine, GRAMMAR_CASES, drafters, samples)
    out = {}
    for case, params in GRAMMAR_CASES.items():
        joint = exact_joint(target, params, vocab, tokenizer, engine.eos_token_ids)
        support = {s: p for s, p in joint.items() if p > 0}
        outside = sum(n for s, n in counts[case].items() if s not in support)
        tvd = 0.5 * sum(abs(counts[case].get(s, 0) / samples - p) for s, p in joint.items())
        out[case] = (tvd, tvd_bound(len(support), samples), stats[case].acceptance_rate, outside)
    return out


def test_speculative_sampling_under_a_grammar_matches_target_distribution():
    """The grammar's masks (prefix-dependent), logit bias and penalties applied to p and q at every draft
    position; forbidden point-mass drafts are cut before verification: still exactly the target's distribution."""
    for case, (tvd, bound, acceptance, outside) in run_grammar_cases().items():
        print(f"{case}: TVD {tvd:.4f}, bound {bound:.4f}, acceptance {acceptance:.3f}, outside {outside}")
        assert outside == 0, f"{case}: {outside} outputs the grammar forbids"
        assert 0.05 < acceptance < 0.95, f"{case}: both the draft path and the residual path must run"
        assert tvd < bound, f"{case}: TVD {tvd:.4f} exceeds the sampling bound {bound:.4f}"


def test_the_grammar_check_catches_masks_that_ignore_the_draft(monkeypatch):
    """Masks computed from the committed state alone (the draft tokens before a position not consumed, a classic
    speculative structured-output bug): outputs leave the grammar and the test sees it."""
    masks = Grammar.masks
    monkeypatch.setattr(Grammar, "masks", lambda self, pending, windows: masks(self, pending, [0] * len(windows)))
    results = run_grammar_cases(samples=320)
    assert any(outside > 0 or tvd > bound for tvd, bound, _, outside in results.values()), results
