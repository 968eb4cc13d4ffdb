"""What several recipes share. A recipe run as `python recipes/NAME.py` finds this module beside it (Python puts a
script's own folder first on sys.path); nothing here is verispec's API, and nothing imports the tests.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

CONTEXT = 64  # tokens each row holds before a timed decode / verify step (`fill_slots`, `step`)
QUANT_KERNEL = "src/verispec/runtime/kernels/quant_kernel.cpp"


def prefill(runner, n: int) -> tuple[float, torch.Tensor]:
    """One n-token prompt from an empty cache, last logits only -> (seconds, the last logits [1, 1, vocab])."""
    runner.reset()
    prompt = torch.arange(n).remainder(1000).add(100).view(1, n)  # [1, n]
    start = time.perf_counter()
    logits = runner.forward(prompt, last_only=True).logits
    return time.perf_counter() - start, logits


def fill_slots(runner, slots: int) -> None:
    """Every one of `slots` rows holds CONTEXT entries (what `step` rolls back to)."""
    runner.reset()
    for slot in range(slots):
        runner.forward(torch.arange(CONTEXT).add(300 + slot).view(1, CONTEXT), start_slot=slot, last_only=True)


def step(runner, rows: int, width: int, calls: int = 3) -> tuple[float, torch.Tensor]:
    """Mean seconds of one forward of [rows, width] tokens on CONTEXT kept entries per row (rolled back after), and
    the last call's logits [rows, width, vocab]."""
    fed = torch.arange(rows * width).remainder(900).add(200).view(rows, width)  # [rows, width]
    start = time.perf_counter()
    for _ in range(calls):
        logits = runner.forward(fed).logits
        for slot in range(rows):
            runner.truncate(CONTEXT, slot)
    return (time.perf_counter() - start) / calls, logits


def quant_shapes(w: dict, layers: int) -> dict[str, list]:
    """A GGUF checkpoint's quantized weights (`read_gguf_weights`) -> linear name (qkv, o, gate_up, down, lm_head)
    -> that linear's weight in every layer (the LM head: one), fused as the native model fuses them."""
    from verispec.runtime.kernels.quant import cat

    def of(i: int, names: list[str]):
        parts = [w[f"model.layers.{i}.{n}.weight"] for n in names]
        return cat(parts) if len(parts) > 1 else parts[0]

    named = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
             "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    out = {name: [of(i, names) for i in range(layers)] for name, names in named.items()}
    out["lm_head"] = [w["model.embed_tokens.weight"]]
    return out


def baseline_quant_kernel(rev: str):
    """The quant kernel's source (and its local includes) as git revision `rev` has them, built as its own
    extension (ext.py's builder, on a folder outside runtime/)."""
    from verispec.runtime.kernels import ext

    folder = Path(tempfile.mkdtemp(prefix="quant-baseline-"))
    pending = [Path(QUANT_KERNEL).name]
    while pending:
        name = pending.pop()
        text = subprocess.check_output(["git", "show", f"{rev}:{Path(QUANT_KERNEL).parent / name}"], text=True)
        (folder / name).write_text(text)
        pending += [n for n in re.findall(r'^#include "([^"]+)"', text, re.M) if not (folder / n).exists()]
    return ext._load("quant_baseline", folder / Path(QUANT_KERNEL).name, [])


@contextmanager
def k_quants_on_fp32():
    """Models loaded inside keep their K-quant tensors on fp32 activations (the others as asked): what ran before
    the K-quants had an integer path."""
    from verispec.runtime.kernels.quant import K_BLOCKS
    from verispec.runtime.model import gguf_weights

    chosen = gguf_weights.tensor_activations
    gguf_weights.tensor_activations = lambda kind, activations: ("fp32" if kind in K_BLOCKS
                                                                 else chosen(kind, activations))
    try:
        yield
    finally:
        gguf_weights.tensor_activations = chosen


def random_kquant_blocks(qtype: str, out: int, width: int, seed: int = 0) -> torch.Tensor:
    """[out, row_bytes] uint8 of a K-quant type (gguf-py makes none): random quants and packed scales, random finite
    fp16 d (and dmin) of a model's size; every bit pattern of the rest is a valid block. For timing only."""
    from verispec.runtime.kernels.quant import K_BLOCKS, SUPER_BLOCK, row_bytes

    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (out, row_bytes(qtype, width)), dtype=torch.uint8, generator=g)
    blocks = raw.view(out, width // SUPER_BLOCK, K_BLOCKS[qtype][0])  # [out, super-blocks, bytes]
    halves, at = (1, 208) if qtype == "Q6_K" else (2, 0)  # d (Q6_K: its last 2 bytes), dmin
    scales = (torch.randn(out, blocks.shape[1], halves, generator=g) * 0.01).half()
    blocks[..., at : at + 2 * halves] = scales.view(torch.uint8).view(out, blocks.shape[1], 2 * halves)
    return raw


SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"


def prompts_of(tokenizer, per_category: int, spec_bench: int) -> list[tuple[str, list[int]]]:
    """(category, chat-templated prompt ids): the code workload's first `per_category` prompts of each category and
    Spec-Bench's first `spec_bench` prompts (the draft recipes' prompts)."""
    import json

    from verispec.bench.code_workload import build_prompts

    records = [(r["category"], r["turns"][0]) for r in build_prompts(per_category=per_category)]
    if spec_bench:
        rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()][:spec_bench]
        records += [("spec-bench", row["turns"][0]) for row in rows]
    out = []
    for category, text in records:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append((category, list(ids if isinstance(ids, list) else ids["input_ids"])))
    return out
