"""The target's quantized twins beside the target alone and the default cascade, in one process: greedy, fp32,
batch 1, K = 4 fixed and adaptive, every method interleaved prompt by prompt (docs/speculation.md, "The target's own
quantized twin"). Usage: python recipes/twin_side_by_side.py THREADS PROMPTS NEW_TOKENS [PROMPTS_FILE] (e.g. 1 4 48):
the first prompt of the first PROMPTS categories of the bench's prompts file, as chat. Environment: TWIN_NAMES (the
drafters, comma-separated; default self:int8,self:int4,self:q4_0 and the default cascade), TWIN_DTYPE (float32 or
bfloat16; default float32)."""
import json, os, sys, time
import torch
from verispec.runtime.model.loading import load_model, load_tokenizer, SMOLLM2_TARGET, SMOLLM2_DRAFTER
from verispec.bench.prompts import default_prompts_path
from verispec.drafters.build import build_drafter
from verispec.engine import SpeculativeEngine
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.stats import GenerationStats
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
n_prompts, new = int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(l) for l in open(sys.argv[4] if len(sys.argv) > 4 else default_prompts_path())]
seen, prompts = set(), []
for r in rows:
    if r["category"] not in seen:
        seen.add(r["category"]); prompts.append(r)
prompts = prompts[:n_prompts]
target = load_model(SMOLLM2_TARGET, dtype=getattr(torch, os.environ.get("TWIN_DTYPE", "float32")))
tok = load_tokenizer(SMOLLM2_TARGET)
ids = [tok.apply_chat_template([{"role": "user", "content": p["turns"][0]}], add_generation_prompt=True, tokenize=True) for p in prompts]
ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
names = os.environ.get("TWIN_NAMES", f"self:int8,self:int4,self:q4_0,{SMOLLM2_DRAFTER}").split(",")
drafters = {}
for n in names:
    t = time.perf_counter(); drafters[n] = build_drafter(n, target, tok, 1024).drafter; print(n, "built in", round(time.perf_counter() - t, 1), "s", flush=True)
engine = SpeculativeEngine(target, tok, None, max_len=1024, max_batch_size=1)
params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
engine.generate(ids[0], SamplingParams(max_new_tokens=4), use_drafter=False)  # warm-up
for d in drafters.values():
    engine.generate(ids[0], SamplingParams(max_new_tokens=8), spec=SpeculativeConfig(num_draft_tokens=4), drafter=d)
res = {}
methods = [("target", None, None)] + [(f"{n} K=4", n, SpeculativeConfig(num_draft_tokens=4)) for n in names] + \
          [(f"{n} adaptive", n, SpeculativeConfig(adaptive=True)) for n in names]
acc = {m[0]: [0.0, 0, GenerationStats(), []] for m in methods}
for i, p in enumerate(ids):
    for name, dn, spec in methods:  # interleaved per prompt
        t = time.perf_counter()
        r = engine.generate(p, params, spec=spec, drafter=drafters[dn] if dn else None, use_drafter=dn is not None)
        acc[name][0] += time.perf_counter() - t; acc[name][1] += len(r.token_ids); acc[name][2].merge(r.stats); acc[name][3].append(r.token_ids)
    print("prompt", i, "done", flush=True)
base = acc["target"][1] / acc["target"][0]
for name, (sec, n, st, outs) in acc.items():
    line = {"method": name, "tok_s": round(n / sec, 2), "speedup": round(n / sec / base, 3),
            "equal": sum(o == t for o, t in zip(outs, acc["target"][3]))}
    if st.rounds:
        line.update(mal=round(st.mean_accepted_length, 3), acc_rate=round(st.acceptance_rate, 3),
                    by_pos=[round(x, 3) for x in st.acceptance_by_position],
                    draft_ms_per_draft_token=round(1000 * st.draft_s / max(st.draft_tokens, 1), 2),
                    verify_ms_per_round=round(1000 * st.verify_s / st.rounds, 2), draft_tokens=st.draft_tokens, rounds=st.rounds)
    print(json.dumps(line), flush=True)
for n in names:
    if hasattr(drafters[n], "weight_bytes"):
        print(n, "twin bytes", drafters[n].weight_bytes())
