"""Microbenchmark: the integer-activation repacks at load (quant.py `pack_v` / `unpack_v`, the K-quants' `pack_vk` /
`unpack_vk`) in numpy (`*_reference`) against the C++ (quant_pack.h), on the shapes and block types of a GGUF file's
linears (default: Qwen2.5-Coder-1.5B Q4_K_M's, the coder target: q / o [1536, 1536], k / v [256, 1536], gate / up
[8960, 1536], down [1536, 8960], the embedding and the head [151936, 1536]), with random blocks (the repacks move
bytes whatever they hold). Per (type, shape): ms per call of each, the C++'s GB/s (bytes in), and the whole file's
linears as the sum over its tensors; the outputs are checked equal. Each figure is the min over --repeats calls
(numpy once where a call takes over a second). Taken on the 2-core machine shared with other work (load average ~4),
--repeats 2: the coder target's 198 tensors (1111 MB) pack in 41.7 s in numpy and 0.93 s in C++, unpack in 32.9 s
and 0.92 s; the C++'s time there is mostly the first touch of its fresh output (its own CPU time moves 3-5 GB/s a
thread).
    PYTHONPATH=src python recipes/quant_pack_bench.py [--gguf FILE] [--threads 2] [--repeats 3] [--no-numpy]"""

import argparse
import time
from collections import Counter
from functools import partial

import numpy as np
import torch

from verispec.runtime.kernels import pool, quant, quant_vk
from verispec.runtime.kernels.quant import K_BLOCKS, V_LAYOUTS, kernel, kernel_id, row_bytes

# Qwen2.5-Coder-1.5B Q4_K_M's 2-d tensors: (type, out, in) -> how many (28 layers; the embedding Q4_K, the head Q6_K)
CODER = {("Q4_K", 256, 1536): 42, ("Q4_K", 1536, 1536): 56, ("Q4_K", 1536, 8960): 14, ("Q4_K", 8960, 1536): 56,
         ("Q4_K", 151936, 1536): 1, ("Q6_K", 256, 1536): 14, ("Q6_K", 1536, 8960): 14, ("Q6_K", 151936, 1536): 1}


def file_linears(path: str) -> Counter:
    """(type, out, in) -> how many of the file's 2-d tensors are of it (the types integer activations run)."""
    from verispec.runtime.weights.gguf_file import open_gguf

    counts = Counter()
    for info in open_gguf(path).tensors:
        if info.type_name in V_LAYOUTS and len(info.shape) == 2:
            counts[(info.type_name, info.shape[0], info.shape[-1])] += 1
    return counts


def best_of(repeats: int, fn, *args) -> tuple[float, torch.Tensor]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - t)
        if best > 1.0:
            break
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", help="time this file's linears' shapes and types (default: the coder target's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-numpy", action="store_true", help="the C++ alone (numpy takes ~1 min for a 1 GB file)")
    args = ap.parse_args()
    pool.set_threads(args.threads)
    ext = kernel()
    shapes = file_linears(args.gguf) if args.gguf else Counter(CODER)
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}; ms per call, min of {args.repeats}")
    print("| type | [out, in] | tensors | MB | numpy pack | C++ pack | C++ GB/s | numpy unpack | C++ unpack |")
    print("|---|---|---|---|---|---|---|---|---|")
    total = Counter()
    for (qtype, out, width), count in sorted(shapes.items()):
        data = torch.from_numpy(rng.integers(0, 256, (out, row_bytes(qtype, width)), np.uint8))
        kid = kernel_id(qtype)
        ref_pack = quant_vk.pack_vk_reference if qtype in K_BLOCKS else quant.pack_v_reference
        ref_unpack = quant_vk.unpack_vk_reference if qtype in K_BLOCKS else quant.unpack_v_reference
        t = {}
        best = partial(best_of, args.repeats)
        t["cpp_pack"], packed = best(ext.pack_v, data, kid)
        t["cpp_unpack"], back = best(ext.unpack_v, packed, kid, out)
        assert torch.equal(back, data)
        if not args.no_numpy:
            t["np_pack"], reference = best(ref_pack, data, qtype)
            t["np_unpack"], _ = best(ref_unpack, packed, qtype, out)
            assert torch.equal(reference, packed)
        for k, v in t.items():
            total[k] += v * count
        total["bytes"] += data.numel() * count
        ms = {k: f"{t[k] * 1e3:.1f}" if k in t else "-" for k in ("np_pack", "cpp_pack", "np_unpack", "cpp_unpack")}
        print(f"| {qtype} | {[out, width]} | {count} | {data.numel() / 1e6:.1f} | {ms['np_pack']} | {ms['cpp_pack']} | "
              f"{data.numel() / t['cpp_pack'] / 1e9:.2f} | {ms['np_unpack']} | {ms['cpp_unpack']} |", flush=True)
    ms = {k: f"{total[k]:.2f} s" if k in total else "-" for k in ("np_pack", "cpp_pack", "np_unpack", "cpp_unpack")}
    print(f"| every linear | | {sum(shapes.values())} | {total['bytes'] / 1e6:.0f} | {ms['np_pack']} | "
          f"{ms['cpp_pack']} | {total['bytes'] / total['cpp_pack'] / 1e9:.2f} | {ms['np_unpack']} | "
          f"{ms['cpp_unpack']} |")


if __name__ == "__main__":
    main()
