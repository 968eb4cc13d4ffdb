"""The default draft model's chains against its token trees (drafters/model_tree.py), in one process: the embedded
SmolLM2 target, greedy, batch 1, every method interleaved prompt by prompt (docs/speculation.md, "Token trees").
Usage: python recipes/model_trees.py THREADS PROMPTS NEW_TOKENS [TEMPERATURE] (e.g. 2 6 64): the first prompt of the
first PROMPTS categories of the bench's prompts file (Spec-Bench), as chat; TEMPERATURE > 0 samples (rejection
sampling, seed 0, not coupled: sampled rows' siblings are drawn without replacement) instead of greedy. Prints one
JSON line per method: tokens/s, speedup over the target alone (same run), mean accepted length, draft and verify
milliseconds per round, outputs equal to the target's; then a draft forward's cost by the tokens it feeds."""
import json
import sys
import time

import torch

from verispec.bench.prompts import default_prompts_path
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.build import build_drafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.loading import SMOLLM2_DRAFT, SMOLLM2_TARGET, load_model, load_tokenizer
from verispec.stats import GenerationStats

torch.set_num_threads(int(sys.argv[1]))
n_prompts, new = int(sys.argv[2]), int(sys.argv[3])
seen, prompts = set(), []
for line in open(default_prompts_path()):
    row = json.loads(line)
    if row["category"] not in seen:
        seen.add(row["category"])
        prompts.append(row)
target = load_model(SMOLLM2_TARGET, dtype=torch.float32)
tok = load_tokenizer(SMOLLM2_TARGET)
ids = [tok.apply_chat_template([{"role": "user", "content": p["turns"][0]}], add_generation_prompt=True, tokenize=True)
       for p in prompts[:n_prompts]]
ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
drafter = build_drafter(SMOLLM2_DRAFT, target, tok, 1024).drafter
engine = SpeculativeEngine(target, tok, drafter, max_len=1024, max_batch_size=1)
methods = {"target": None, "chain K=4": SpeculativeConfig(num_draft_tokens=4),
           "tree K=4 N=8": SpeculativeConfig(num_draft_tokens=4, tree_nodes=8),
           "tree K=5 N=16": SpeculativeConfig(num_draft_tokens=5, tree_nodes=16),
           "adaptive chain": SpeculativeConfig(adaptive=True),
           "adaptive tree N=8": SpeculativeConfig(adaptive=True, tree_nodes=8),
           "adaptive tree N=16": SpeculativeConfig(adaptive=True, tree_nodes=16)}
for spec in methods.values():  # warm-up
    engine.generate(ids[0], SamplingParams(max_new_tokens=8), spec=spec, use_drafter=spec is not None)
temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
params = SamplingParams(max_new_tokens=new, min_new_tokens=new, temperature=temperature,
                        **({"seed": 0, "coupled": False} if temperature > 0 else {}))
acc = {name: [0.0, 0, GenerationStats(), []] for name in methods}
for i, prompt in enumerate(ids):
    for name, spec in methods.items():  # interleaved per prompt
        start = time.perf_counter()
        r = engine.generate(prompt, params, spec=spec, use_drafter=spec is not None)
        acc[name][0] += time.perf_counter() - start
        acc[name][1] += len(r.token_ids)
        acc[name][2].merge(r.stats)
        acc[name][3].append(r.token_ids)
    print("prompt", i, "done", flush=True)
base = acc["target"][1] / acc["target"][0]
for name, (sec, n, st, outs) in acc.items():
    line = {"method": name, "tok_s": round(n / sec, 2), "speedup": round(n / sec / base, 3),
            "equal": sum(o == t for o, t in zip(outs, acc["target"][3]))}
    if st.rounds:
        line.update(mal=round(st.mean_accepted_length, 3), draft_tokens_per_round=round(st.draft_tokens / st.rounds, 2),
                    draft_ms_per_round=round(1000 * st.draft_s / st.rounds, 2),
                    verify_ms_per_round=round(1000 * st.verify_s / st.rounds, 2), rounds=st.rounds)
    print(json.dumps(line), flush=True)
# What the next round's catch-up costs after a tree (the draft's slot kept only the committed prefix, so its first
# forward feeds the accepted path and the next token) against a chain's usual 2 tokens: one draft forward per width.
runner = drafter.runner
for width in (1, 2, 3, 5):
    times = []
    for _ in range(20):
        runner.reset(0)
        runner.forward(torch.tensor([ids[0][:-width]]), last_only=True)
        start = time.perf_counter()
        runner.forward(torch.tensor([ids[0][-width:]]), last_only=True)
        times.append(time.perf_counter() - start)
    print(json.dumps({"draft_forward_tokens": width, "median_ms": round(1000 * sorted(times)[len(times) // 2], 2)}))
