"""Time vLLM on given token-id prompts, one at a time (batch 1, greedy): the peer figure beside `verispec bench`.

Runs inside a vLLM virtualenv, never inside verispec's (it imports only vLLM and the standard library):
    VLLM_PYTHON vllm_driver.py IN.json OUT.json
IN.json: {"model": folder, "dtype": "float32", "spec": "none" | "ngram" | "draft", "draft_model": folder (spec
"draft"), "k": 4, "max_new_tokens": 128, "prompts": [[token ids], ...]}. OUT.json: {"rows": [{"tokens", "seconds",
"token_ids"}], "load_s", "spec_counters", "version"}. Exit code 3: vllm cannot be imported (no virtualenv).
"""

import json
import os
import sys
import time

# vLLM-CPU reserves its KV cache up front (GiB); a 135M model needs little on a 24 GiB machine. Offline: no telemetry.
for key, value in {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                   "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(key, value)


MISSING = 3  # exit code: vllm is not importable


def main() -> None:
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        print(f"vllm is not importable with {sys.executable}: {exc}", file=sys.stderr)
        sys.exit(MISSING)

    job = json.load(open(sys.argv[1]))
    spec = None
    if job["spec"] == "ngram":  # prompt lookup, n-grams of 1..3 tokens, as verispec's n-gram drafter
        spec = {"method": "ngram", "num_speculative_tokens": job["k"], "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif job["spec"] == "draft":  # the same draft model verispec drafts with
        spec = {"method": "draft_model", "model": job["draft_model"], "num_speculative_tokens": job["k"]}
    start = time.perf_counter()
    llm = LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], max_model_len=4096, seed=0,
              enable_prefix_caching=False, speculative_config=spec, disable_log_stats=False, max_num_seqs=4)
    load_s = time.perf_counter() - start
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], SamplingParams(temperature=0.0, max_tokens=32),
                 use_tqdm=False)  # warm-up, not timed
    rows = []
    for ids in job["prompts"]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0].outputs[0]
        rows.append({"tokens": len(out.token_ids), "seconds": time.perf_counter() - t,
                     "token_ids": list(out.token_ids)})
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
    json.dump({"rows": rows, "load_s": load_s, "spec_counters": counters, "version": vllm.__version__},
              open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from re-running main()
    main()
