"""Time llama.cpp on given token-id prompts, one at a time (batch 1, greedy): the peer figure beside `verispec bench`.

Runs inside the llama.cpp virtualenv (`scripts/setup_peers.sh llama.cpp`), never inside verispec's: it imports only
llama-cpp-python, numpy and the standard library.
    LLAMACPP_PYTHON llamacpp_driver.py IN.json OUT.json
IN.json: {"gguf": file, "spec": "none" | "lookup" | "draft", "draft_gguf": file (spec "draft"), "k": 4,
"threads": 2, "max_new_tokens": 128, "prompts": [[token ids], ...], "n_ctx": 4096 (optional)}.
OUT.json: {"rows": [{"tokens", "seconds", "first_s" (to the first token: the prompt's processing), "token_ids"}], "load_s", "weights_bytes", "model", "threads",
"load_avg" (the 1-minute load average before and after the timed prompts: a run on a busy machine shows it),
"version", "system_info"}. Exit code 3: llama_cpp cannot be imported (the virtualenv is missing or broken).

As `verispec bench` counts: every prompt starts from an empty cache (no prefix reuse between prompts), prompt
processing is inside the timed seconds, every prompt generates exactly max_new_tokens, and one untimed warm-up
generation comes first. Generation goes on past EOS, as vLLM's `ignore_eos` does (masking EOS through a Python
logits processor would cost llama.cpp ~25% of its speed here: a copy of the logits per token).
"""

import json
import os
import sys
import time

N_CTX = 4096
N_BATCH = 512
MISSING = 3  # exit code: llama_cpp is not importable


def _draft_model(llama_cpp, path: str, k: int, threads: int, n_ctx: int = N_CTX):
    """A small GGUF model as llama-cpp-python's draft: k greedy tokens from its own KV cache, whose prefix
    `Llama.generate` keeps from call to call (it re-evaluates only the tokens after the common prefix)."""
    import numpy as np
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GGUFDraft(LlamaDraftModel):
        def __init__(self):
            self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                       n_batch=N_BATCH, verbose=False, seed=0)

        def __call__(self, input_ids, /, **kwargs):  # input_ids: [n] the target's tokens so far
            drafts = []
            for token in self.llm.generate(input_ids.tolist(), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                drafts.append(token)
                if len(drafts) == k:
                    break
            return np.array(drafts, dtype=np.intc)

        def reset(self):
            self.llm.reset()

    return GGUFDraft()


def _model_bytes(llm) -> int:
    """Bytes of all the model's tensors as stored (quantized): what a decode step reads."""
    import llama_cpp

    return int(llama_cpp.llama_model_size(llm.model))


def main() -> None:
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        print(f"llama_cpp is not importable with {sys.executable}: {exc}", file=sys.stderr)
        sys.exit(MISSING)

    job = json.load(open(sys.argv[1]))
    threads, k = job["threads"], job["k"]
    draft = None
    if job["spec"] == "lookup":  # prompt lookup: the continuation of the last 1..3-gram's earlier occurrence
        draft = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=k)
    elif job["spec"] == "draft":
        draft = _draft_model(llama_cpp, job["draft_gguf"], k, threads, job.get("n_ctx", N_CTX))
    start = time.perf_counter()
    # logits_all: a speculative verify pass samples at every fed position.
    n_ctx = job.get("n_ctx", N_CTX)
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=N_BATCH, logits_all=draft is not None, draft_model=draft, verbose=False, seed=0)
    load_s = time.perf_counter() - start

    def generate(ids: list, n: int) -> tuple[list, float, float]:
        llm.reset()  # an empty cache: no prefix shared with the previous prompt
        if hasattr(draft, "reset"):
            draft.reset()
        out, t, first = [], time.perf_counter(), 0.0
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:
                first = time.perf_counter() - t
            out.append(token)
            if len(out) == n:
                break
        return out, time.perf_counter() - t, first

    # Warm-up, not timed: a whole generation, since the first one after loading ran at 30-40% of the speed of
    # the next ones here (29 against 74-79 tok/s) and a 32-token warm-up did not cover it.
    generate(job["prompts"][0], job["max_new_tokens"])
    load_before = os.getloadavg()[0]
    rows = []
    for ids in job["prompts"]:
        out, seconds, first = generate(ids, job["max_new_tokens"])
        rows.append({"tokens": len(out), "seconds": seconds, "first_s": first, "token_ids": out})
    json.dump({"rows": rows, "load_s": load_s, "weights_bytes": _model_bytes(llm), "model": llm._model.desc(),
               "threads": threads, "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
               "version": llama_cpp.__version__,
               "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()},
              open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
