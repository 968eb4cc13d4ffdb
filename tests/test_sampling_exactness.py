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

from verispec import verify
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
}
ROWS_PER_CASE = 32  # per batch: 96 rows in every step


def run_cases(cases=tuple(CASES)):
    """-> {case: (TVD, acceptance rate)} from SAMPLES seeded runs per case, the cases mixed in each batch."""
    target = peaky_llama(0)
    drafters = {case: ModelDrafter(peaky_llama(1), 128) if case.startswith("model") else PointMassDrafter()
                for case in cases}
    engine = SpeculativeEngine(target, CharTokenizer(), None, SpeculativeConfig(num_draft_tokens=2), 64,
                               max_batch_size=len(cases) * ROWS_PER_CASE)
    counts, stats = _sample(engine, {case: CASES[case] for case in cases}, drafters)
    out = {}
    for case in cases:
        joint = exact_joint(target, CASES[case])
        tvd = 0.5 * sum(abs(counts[case].get(s, 0) / SAMPLES - p) for s, p in joint.items())
        out[case] = (tvd, stats[case].acceptance_rate)
    return out


def _sample(engine, cases: dict, drafters: dict, samples: int = SAMPLES) -> tuple[dict, dict]:
    """`samples` seeded runs of every case, the cases' rows side by side in each batch.

    -> ({case: {output tokens: count}}, {case: GenerationStats})"""
    counts = {case: {} for case in cases}
    stats = {case: GenerationStats() for case in cases}
    for first in range(0, samples, ROWS_PER_CASE):
        seqs = [(case, engine.add_request(PROMPT, replace(params, seed=seed), drafter=drafters[case]))
                for seed in range(first, min(first + ROWS_PER_CASE, samples)) for case, params in cases.items()]
        while engine.has_unfinished:
            engine.step()
        for case, seq in seqs:
            key = tuple(seq.stopper.token_ids)
            counts[case][key] = counts[case].get(key, 0) + 1
            stats[case].merge(seq.stats)
    return counts, stats


def test_speculative_sampling_matches_target_distribution_in_a_batch():
    for case, (tvd, acceptance) in run_cases().items():
        print(f"{case}: TVD {tvd:.4f}, bound {TVD_BOUND:.4f}, acceptance {acceptance:.3f}")
        assert 0.05 < acceptance < 0.9, f"{case}: both the draft path and the residual path must run"
        assert tvd < TVD_BOUND, f"{case}: TVD {tvd:.4f} exceeds the sampling bound {TVD_BOUND:.4f}"


def test_the_check_catches_a_biased_sampler(monkeypatch):
    """Recovered tokens drawn from p instead of norm(max(0, p - q)): the classic bug must be detected."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    tvd = run_cases(("model-drafter-all-transforms",))["model-drafter-all-transforms"][0]
    print(f"biased TVD {tvd:.4f}, bound {TVD_BOUND:.4f}")
    assert tvd > TVD_BOUND, f"a biased sampler passed: TVD {tvd:.4f} <= bound {TVD_BOUND:.4f}"


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


# -- token trees ---------------------------------------------------------------------------------------------------

# A draft head (random weights) proposing token trees of distinct point masses, verified by recursive rejection over
# siblings; a sampled chain row (q carried) and a min_tokens row (the EOS mask follows each node's depth) beside it.
TREE_CASES = {
    "tree-head-all-transforms": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=3, top_p=0.95,
                                               logit_bias={2: 0.7}),
    "tree-head-min-tokens": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.3, min_new_tokens=2,
                                           stop_token_ids=[3]),
}


def run_tree_cases(samples: int = SAMPLES):
    """-> {case: (TVD, acceptance rate, mean nodes per round)} of tree speculation, the cases side by side."""
    from verispec.distill.head import HeadNet
    from verispec.drafters.head import HeadConfig, HeadDrafter

    target = peaky_llama(0)
    config = HeadConfig.for_target(target.config, "peaky", VOCAB)
    head = HeadDrafter(config, HeadNet(config, target, torch.arange(VOCAB), seed=3).export(), target, 64)
    engine = SpeculativeEngine(target, CharTokenizer(), head, SpeculativeConfig(num_draft_tokens=2, tree_nodes=5),
                               64, max_batch_size=len(TREE_CASES) * ROWS_PER_CASE)
    counts, stats = _sample(engine, TREE_CASES, {case: head for case in TREE_CASES}, samples)
    out = {}
    for case, params in TREE_CASES.items():
        joint = exact_joint(target, params, eos_token_ids=())
        if params.stop_token_ids:  # a stop token ends the output: fold the enumeration onto what is emitted
            folded = {}
            for seq, p in joint.items():
                key = seq[: seq.index(3) + 1] if 3 in seq else seq
                folded[key] = folded.get(key, 0.0) + p
            joint = folded
        tvd = 0.5 * sum(abs(counts[case].get(s, 0) / samples - p) for s, p in joint.items())
        tvd += 0.5 * sum(n / samples for s, n in counts[case].items() if s not in joint)
        out[case] = (tvd, stats[case].acceptance_rate, stats[case].draft_tokens / max(stats[case].rounds, 1))
    return out


def test_tree_sampling_matches_target_distribution():
    for case, (tvd, acceptance, nodes) in run_tree_cases().items():
        print(f"{case}: TVD {tvd:.4f}, bound {TVD_BOUND:.4f}, acceptance {acceptance:.3f}, nodes/round {nodes:.2f}")
        assert nodes > 2.5, f"{case}: trees were not drafted ({nodes:.2f} draft tokens per round)"
        assert tvd < TVD_BOUND, f"{case}: TVD {tvd:.4f} exceeds the sampling bound {TVD_BOUND:.4f}"


def test_the_tree_check_catches_a_biased_sibling_rule(monkeypatch):
    """Siblings tried against p itself instead of the residual left by the siblings rejected before them."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    tvd = run_tree_cases(samples=3000)["tree-head-all-transforms"][0]
    assert tvd > tvd_bound(VOCAB**NEW_TOKENS, 3000), f"a biased tree sampler passed: TVD {tvd:.4f}"
