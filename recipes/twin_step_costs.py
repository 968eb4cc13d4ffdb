"""Cost per draft token of the twin configurations beside the target's one-token and five-token (a K = 4 verify) steps:
10 forwards each, median of 3 interleaved repeats, bf16 target, 2 threads (docs/speculation.md, "Reduced LM head").
Usage: python recipes/twin_step_costs.py"""
import statistics
import time

import torch
from verispec.runtime.model.loading import load_model, load_tokenizer, SMOLLM2_TARGET
from verispec.drafters.build import build_drafter
from verispec.engine import SpeculativeEngine
torch.set_num_threads(2)
target = load_model(SMOLLM2_TARGET, dtype=torch.bfloat16)
tok = load_tokenizer(SMOLLM2_TARGET)
names = ["self:int8", "self:int8:v8192", "self:int8:v16384", "self:int4", "verispec-draft-smollm2-135m"]
drafters = {n: build_drafter(n, target, tok, 1024).drafter for n in names}
engine = SpeculativeEngine(target, tok, None, max_len=1024, max_batch_size=1)
runners = {"target": engine.target}
for n, d in drafters.items():
    d.reserve(1); runners[n] = d.runner
prompt = torch.tensor([tok("Write a short story about a robot learning to paint. " * 4)["input_ids"]])
times = {n: [] for n in runners}
for n, r in runners.items():
    r.reset(0); r.forward(prompt, start_slot=0, last_only=True)
for rep in range(3):
    for n, r in runners.items():
        for width in ([1, 5] if n == "target" else [1]):
            L = r.lengths[0]
            t = time.perf_counter()
            for _ in range(10):
                r.forward(torch.zeros(1, width, dtype=torch.long), start_slot=0)
                r.truncate(L, 0)
            times[n + (f" w{width}" if n == "target" else "")] = times.get(n + (f" w{width}" if n == "target" else ""), []) + [(time.perf_counter() - t) / 10]
for n, ts in times.items():
    if ts: print(n, "ms/step median of 3x10:", round(1000 * statistics.median(ts), 2))
