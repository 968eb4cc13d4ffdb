"""Integer activations' and a 16-bit KV cache's quality: the embedded target's teacher-forced negative log-likelihood
with `--activations q8` (and `--kv-cache-dtype float16`) against `fp32` (the fp32 conversion's values), on held-apart text: the docstrings of Python standard-library
modules (English technical prose, nothing of the Spec-Bench prompts), cut into chunks of --tokens tokens. Also the
share of positions where the two models' greedy choice agrees. `--model` another GGUF file of the same tokenizer
(e.g. recipes/kquant_smollm2.sh's Q4_K_M); activations `q8-kfp32`: q8 with the K-quant tensors on fp32 activations
(recipes/_common.py, as activations_step_bench.py runs it). Usage:
  PYTHONPATH=src python recipes/activations_quality.py --chunks 24 --tokens 256 [--model PATH.gguf]
"""

import argparse
import importlib
import json
import math
from contextlib import nullcontext

import torch

from _common import k_quants_on_fp32
from verispec.runtime.model.loading import SMOLLM2_TARGET, load_tokenizer
from verispec.runtime.model.target import load_target
from verispec.config import RunnerOptions
from verispec.runtime.runners.select import make_runner

MODULES = ["argparse", "collections", "json", "textwrap", "pathlib", "logging", "unittest", "datetime", "csv",
           "functools", "itertools", "subprocess", "threading", "heapq", "decimal", "fractions", "statistics",
           "email", "http.client", "zipfile", "tarfile", "sqlite3", "random", "string"]


def held_apart_text() -> str:
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts += [module.__doc__ or ""] + [getattr(module, attr).__doc__ or "" for attr in sorted(dir(module))
                                           if not attr.startswith("_") and callable(getattr(module, attr))]
    return "\n\n".join(p.strip() for p in parts if p and len(p.strip()) > 80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=SMOLLM2_TARGET, help="the target (a GGUF file)")
    parser.add_argument("--configs", default="fp32:float32,q8:float32,q8:float16",
                        help="activations:kv-cache-dtype pairs, the first the reference")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(SMOLLM2_TARGET)
    ids = tokenizer(held_apart_text())["input_ids"]
    chunks = [ids[i : i + args.tokens] for i in range(0, args.chunks * args.tokens, args.tokens)]
    assert len(chunks[-1]) == args.tokens, "not enough text for that many chunks"
    results, choices = {}, {}
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    for activations, kv_cache in configs:
        with k_quants_on_fp32() if activations == "q8-kfp32" else nullcontext():
            model = load_target(args.model, "gguf", activations=activations.removesuffix("-kfp32"))
        options = RunnerOptions(backend="native", compile=False, kv_cache_dtype=kv_cache)
        runner = make_runner(model, args.tokens + 8, 1, options)
        total, count, picks = 0.0, 0, []
        for chunk in chunks:
            runner.reset(0)
            tokens = torch.tensor([chunk])
            with torch.inference_mode():
                logits = runner.forward(tokens).logits[0].double()  # [n, vocab]
            logp = torch.log_softmax(logits[:-1], dim=-1)
            total -= logp.gather(1, tokens[0, 1:].unsqueeze(1)).sum().item()
            count += len(chunk) - 1
            picks.append(logits[:-1].argmax(-1))
        name = f"{activations}/{kv_cache}"
        results[name] = total / count
        choices[name] = torch.cat(picks)
    first = next(iter(results))
    out = {"tokens_scored": count, "reference": first}
    for name, nll in results.items():
        out[name] = {"nll": round(nll, 5), "ppl": round(math.exp(nll), 3), "nll_over_reference": round(nll / results[first], 5),
                     "greedy_choice_agreement": round((choices[name] == choices[first]).float().mean().item(), 4)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
