"""Which ops of the native forward break batch / width invariance, and what the invariant path costs.

    PYTHONPATH=src python recipes/invariance_probe.py [--threads 2] [--repeats 20] [--no-timing | --no-probes]

1. oneDNN's packed linear, fp32 and bf16: for each input size K, the row counts M (1..64, 97, 128, 512) at which a
   row's output differs from the same row run alone (K <= 1024 measured invariant; runtime/kernels/invariant.py).
2. Attention over a padded verify pass (random lengths, widths 1..8, batch 1..16) against one-query steps:
   rows that differ, torch's SDPA vs `invariant.block_attention`.
3. Cost: the real target's (the embedded SmolLM2-135M) forward per step shape (rows x fed tokens: a decode step
   and a K = 4 verify pass at batch 1 and 16, 256 cached entries), batch_invariant off and on interleaved in one
   process, so the ratio is side by side.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from verispec.runtime.kernels.invariant import block_attention
from verispec.runtime.caches.kv_cache import attention_mask
from verispec.runtime.model.llama import try_pack


def linear_rows(dtype: torch.dtype) -> None:
    counts = [*range(1, 65), 97, 128, 512]
    for size in (576, 960, 1024, 1152, 1536, 2560):
        weight = torch.randn(1536, size).to(dtype) * 0.05
        packed = try_pack(weight)
        if packed is None:
            print(f"  {dtype} K={size}: no packed kernel on this CPU")
            continue
        x = torch.randn(512, size).to(dtype)
        run = lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")  # noqa: E731
        alone = torch.cat([run(x[r : r + 1]) for r in range(512)])
        bad = [m for m in counts if not torch.equal(run(x[:m]), alone[:m])]
        print(f"  {dtype} K={size}: row counts that differ from one row: {len(bad)}/{len(counts)} {bad[:4]}")


def attention_rows(dtype: torch.dtype) -> None:
    sdpa = lambda q, k, v, m: F.scaled_dot_product_attention(  # noqa: E731
        q, k[:, :, : m.shape[-1]], v[:, :, : m.shape[-1]], attn_mask=m, enable_gqa=True)
    gen = torch.Generator().manual_seed(0)
    for name, attend in (("sdpa", sdpa), ("block_attention", block_attention)):
        bad = total = 0
        for _ in range(8):
            b, n = int(torch.randint(1, 17, (), generator=gen)), int(torch.randint(1, 9, (), generator=gen))
            lengths = torch.randint(1, 900, (b,), generator=gen)
            keys, values = torch.randn(2, b, 3, 1024, 64, generator=gen).to(dtype)
            q = torch.randn(b, 9, n, 64, generator=gen).to(dtype)
            out = attend(q, keys, values, attention_mask(lengths, n, int(lengths.max()) + n, dtype))
            for r in range(b):
                for t in range(n):
                    one = attention_mask(lengths[r : r + 1] + t, 1, int(lengths[r]) + t + 1, dtype)
                    single = attend(q[r : r + 1, :, t : t + 1], keys[r : r + 1], values[r : r + 1], one)
                    bad += not torch.equal(single[0, :, 0], out[r, :, t])
                    total += 1
        print(f"  {dtype} {name}: {bad}/{total} query rows differ from the one-query step")


def costs(dtype: torch.dtype, repeats: int) -> None:
    from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
    from verispec.runtime.runners.native import NativeRunner

    model = load_model(SMOLLM2_TARGET, dtype=dtype)
    runners = {flag: NativeRunner.from_hf(model, 1024, num_slots=16, batch_invariant=flag) for flag in (False, True)}
    for rows, width in ((1, 1), (1, 5), (16, 1), (16, 5)):
        spent = {False: 0.0, True: 0.0}
        for runner in runners.values():
            runner.reset()
            for slot in range(rows):
                runner.forward(torch.randint(0, 1000, (1, 256)), start_slot=slot)
        tokens = torch.randint(0, 1000, (rows, width))
        for _ in range(repeats):
            for flag, runner in runners.items():  # interleaved: the machine's load falls on both alike
                start = time.perf_counter()
                runner.forward(tokens)
                spent[flag] += time.perf_counter() - start
                for slot in range(rows):
                    runner.truncate(256, slot)
        off, on = spent[False] / repeats * 1e3, spent[True] / repeats * 1e3
        print(f"  {dtype} {rows} row(s) x {width} token(s): today {off:.2f} ms, invariant {on:.2f} ms "
              f"({on / off:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-probes", action="store_true", help="timing only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = (torch.float32, torch.bfloat16)
    if not args.no_probes:
        print("1. packed linear, rows M vs one row")
        for dtype in dtypes:
            linear_rows(dtype)
        print("2. attention, padded verify pass vs one-query steps")
        for dtype in dtypes:
            attention_rows(dtype)
    if not args.no_timing:
        print(f"3. the target's forward, today vs batch_invariant ({args.threads} threads)")
        for dtype in dtypes:
            costs(dtype, args.repeats)


if __name__ == "__main__":
    main()
