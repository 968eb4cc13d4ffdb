"""Draft-step cost of draft-model shapes (width, depth, reduced-head size N) on the native CPU runner as the drafter
runs them (Q8_0 blocks, fp32 activations), beside the shipped default draft and the target's one-token step: one
token at a 256-token context, batch 1, 20 forwards each, the fastest of 15 interleaved repeats (on a shared machine
the minimum is the figure least moved by other jobs; the median is printed beside it), 2 threads. The weights are
random (a step's cost does not depend on their values). What `verispec distill --draft-vocab/--hidden-size/--layers`
was chosen by (docs/distill.md, "Choosing the shape").
Usage: flock /tmp/verispec-bench.lock python recipes/draft_shape_costs.py"""
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verispec.drafters.build import build_drafter
from verispec.drafters.model import ModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.loading import SMOLLM2_DRAFT, SMOLLM2_TARGET, load_tokenizer
from verispec.runtime.model.target import load_target

torch.set_num_threads(2)
SHAPES = [(128, 4, 0), (128, 4, 16384), (128, 4, 8192), (128, 4, 4096), (128, 2, 8192), (128, 6, 8192),
          (192, 4, 8192), (256, 4, 8192), (256, 2, 8192)]  # (hidden, layers, N; 0 = the full 49,152-token head)
target = load_target(SMOLLM2_TARGET, "gguf", "none", dtype=torch.float32, activations="q8")
tok = load_tokenizer(SMOLLM2_TARGET)
engine = SpeculativeEngine(target, tok, None, max_len=1024, max_batch_size=1)
runners = {"target (w=1)": engine.target}
default = build_drafter(SMOLLM2_DRAFT, target, tok, 1024).drafter
default.reserve(1)
runners["shipped default (128x4, full head)"] = default.runner
for hidden, layers, n in SHAPES:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
                         max_position_embeddings=2048, tie_word_embeddings=True)
    if n:
        config.draft_vocab = list(range(n))
    drafter = ModelDrafter(LlamaForCausalLM(config).eval(), 1024)
    drafter.reserve(1)
    runners[f"{hidden}x{layers}, N={n or 49152}"] = drafter.runner
prompt = torch.randint(0, 49152, (1, 256))
for r in runners.values():
    r.reset(0)
    r.forward(prompt, start_slot=0, last_only=True)
times = {name: [] for name in runners}
for _ in range(15):
    for name, r in runners.items():
        keep = r.lengths[0]
        start = time.perf_counter()
        for _ in range(20):
            r.forward(torch.zeros(1, 1, dtype=torch.long), start_slot=0)
            r.truncate(keep, 0)
        times[name].append((time.perf_counter() - start) / 20)
for name, ts in times.items():
    print(f"{name:36s} {1000 * min(ts):6.3f} ms/step (median {1000 * statistics.median(ts):6.3f}; 15 x 20)")
