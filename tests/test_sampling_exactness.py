"""Level (b): speculative sampling follows the processed target distribution exactly.

On a tiny-vocabulary pair whose draft disagrees strongly with the target, the empirical joint distribution of
the first three generated tokens (many seeded runs of the real engine) is compared with the exact target
distribution computed by enumeration. The total-variation bound comes from the sample size: the expected TVD of
an N-sample empirical distribution over M outcomes is at most 0.5 * sqrt(M / N), and McDiarmid's inequality
(each sample moves the TVD by at most 1/N) adds sqrt(ln(1/delta) / (2N)) for failure probability delta = 1e-6.
The same test run on a deliberately biased sampler (recovered tokens drawn from p instead of the residual) must
fail, so the check cannot pass vacuously.
"""

import itertools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verispec import verify
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.base import DraftProposal, Drafter
from verispec.drafters.model import ModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.sampling import TokenSampler

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

    def propose(self, request):
        tokens = torch.multinomial(torch.tensor([0.7, 0.1, 0.1, 0.1]), request.k, True, generator=self.gen)
        return DraftProposal(tokens, None)


def exact_joint(target, params) -> dict[tuple, float]:
    """P(t1, t2, t3) under the processed target distribution, by enumeration."""
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
            prob = 1.0
            for i in range(NEW_TOKENS):
                sampler = TokenSampler(params, VOCAB, [], PROMPT)
                sampler.commit(list(seq[:i]))
                logits = target(torch.tensor([PROMPT + list(seq[:i])])).logits[0, -1:]
                prob *= sampler.probs(sampler.process(logits))[0, seq[i]].item()
            joint[seq] = prob
    return joint


def empirical_tvd(engine, params, joint) -> float:
    counts = dict.fromkeys(joint, 0)
    for seed in range(SAMPLES):
        run = SamplingParams(**{**params.__dict__, "seed": seed})
        counts[tuple(engine.generate(PROMPT, run).token_ids)] += 1
    return 0.5 * sum(abs(counts[s] / SAMPLES - p) for s, p in joint.items())


TVD_BOUND = 0.5 * math.sqrt(VOCAB**NEW_TOKENS / SAMPLES) + math.sqrt(math.log(1e6) / (2 * SAMPLES))

CASES = {
    "model-drafter-all-transforms": SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=3, top_p=0.95, min_p=0.05, repetition_penalty=1.3
    ),
    "point-mass-drafter-temperature": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.2),
}


def build_engine(case):
    target = peaky_llama(0)
    drafter = ModelDrafter(peaky_llama(1), 128) if case.startswith("model") else PointMassDrafter()
    return target, SpeculativeEngine(target, CharTokenizer(), drafter, SpeculativeConfig(num_draft_tokens=2), 64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_speculative_sampling_matches_target_distribution(case):
    target, engine = build_engine(case)
    params = CASES[case]
    joint = exact_joint(target, params)
    tvd = empirical_tvd(engine, params, joint)
    print(f"{case}: TVD {tvd:.4f}, bound {TVD_BOUND:.4f}, acceptance {engine.total.acceptance_rate:.3f}")
    assert engine.total.accepted_tokens > 0.05 * engine.total.draft_tokens  # the draft path really ran
    assert engine.total.accepted_tokens < 0.9 * engine.total.draft_tokens  # ...and so did the residual path
    assert tvd < TVD_BOUND, f"TVD {tvd:.4f} exceeds the sampling bound {TVD_BOUND:.4f}"


def test_the_check_catches_a_biased_sampler(monkeypatch):
    """Recovered tokens drawn from p instead of norm(max(0, p - q)): the classic bug must be detected."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    target, engine = build_engine("model-drafter-all-transforms")
    params = CASES["model-drafter-all-transforms"]
    tvd = empirical_tvd(engine, params, exact_joint(target, params))
    print(f"biased TVD {tvd:.4f}, bound {TVD_BOUND:.4f}")
    assert tvd > TVD_BOUND, f"a biased sampler passed: TVD {tvd:.4f} <= bound {TVD_BOUND:.4f}"
