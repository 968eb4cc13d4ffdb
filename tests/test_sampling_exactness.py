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
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.base import DraftProposal, Drafter
from verispec.drafters.model import ModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.stats import GenerationStats

VOCAB, NEW_TOKENS, PROMPT = 4, 3, [0, 1, 2]
SAMPLES = 6000


class CharTokenizer:
    eos_token_id = None

    def decode(self, ids, **kwargs):
        return "".join("abcd"[i] for i in ids)


def peaky_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.5,
                      max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


class PointMassDrafter(Drafter):
    """A drafter with no probabilities, biased towards token 0: exercises the point-mass q path."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(7)

    def propose(self, batch):
        weights = torch.tensor([0.7, 0.1, 0.1, 0.1])
        return [DraftProposal(torch.multinomial(weights, row.k, True, generator=self.gen) if row.k else
                              torch.empty(0, dtype=torch.long), None) for row in batch.rows]


def exact_joint(target, params) -> dict[tuple, float]:
    """P(t1, t2, t3) under the processed target distribution, by enumeration."""
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
            prob = 1.0
            for i in range(NEW_TOKENS):
                logits = target(torch.tensor([PROMPT + list(seq[:i])])).logits[0, -1:]
                prob *= target_probs(params, logits, PROMPT, generated=seq[:i])[0, seq[i]].item()
            joint[seq] = prob
    return joint


TVD_BOUND = 0.5 * math.sqrt(VOCAB**NEW_TOKENS / SAMPLES) + math.sqrt(math.log(1e6) / (2 * SAMPLES))

# Rows of all cases run side by side in the same batches (each with its own parameters, drafter and seed), so the
# test checks sampling for rows inside a batch.
CASES = {
    "model-drafter-all-transforms": SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=3, top_p=0.95, min_p=0.05, repetition_penalty=1.3
    ),
    "model-drafter-penalties": SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=2, presence_penalty=0.8, frequency_penalty=0.5
    ),
    "point-mass-drafter-temperature": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.2),
}
ROWS_PER_CASE = 32  # per batch: 96 rows in every step


def run_cases(cases=tuple(CASES)):
    """-> {case: (TVD, acceptance rate)} from SAMPLES seeded runs per case, the cases mixed in each batch."""
    target = peaky_llama(0)
    drafters = {case: ModelDrafter(peaky_llama(1), 128) if case.startswith("model") else PointMassDrafter()
                for case in cases}
    engine = SpeculativeEngine(target, CharTokenizer(), None, SpeculativeConfig(num_draft_tokens=2), 64,
                               max_batch_size=len(cases) * ROWS_PER_CASE)
    counts = {case: {} for case in cases}
    stats = {case: GenerationStats() for case in cases}
    for first in range(0, SAMPLES, ROWS_PER_CASE):
        seqs = [(case, engine.add_request(PROMPT, replace(params, seed=seed), drafter=drafters[case]))
                for seed in range(first, min(first + ROWS_PER_CASE, SAMPLES)) for case in cases
                for params in [CASES[case]]]
        while engine.has_unfinished:
            engine.step()
        for case, seq in seqs:
            key = tuple(seq.stopper.token_ids)
            counts[case][key] = counts[case].get(key, 0) + 1
            stats[case].merge(seq.stats)
    out = {}
    for case in cases:
        joint = exact_joint(target, CASES[case])
        tvd = 0.5 * sum(abs(counts[case].get(s, 0) / SAMPLES - p) for s, p in joint.items())
        out[case] = (tvd, stats[case].acceptance_rate)
    return out


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
