"""Parallel regions side by side in one process (issue 40; docs/runner.md, "Threads"): the target alone (or
`--draft`), greedy, `--tokens` new tokens per run, the settings alternated run by run so that drift on a shared
machine hits each alike. A setting is `omp` / `ompN` (the kernels on OpenMP's static split, as before the work pool,
N threads, default 2) or `pool:SPIN_US:CHUNKS:THREADS` (the work pool with that spin, chunks per thread and
threads). `--busy N` runs it all beside N spinning processes. Prints each setting's median tokens/s and every run.

    PYTHONPATH=src python recipes/threads_ab.py --settings omp,pool:50:2:2,pool:50:2:1 [--busy 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from verispec.bench.busy import busy_cores
from verispec.generator import SpeculativeGenerator
from verispec.runtime.kernels import ext, pool

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="omp,pool:50:2:2,pool:50:2:1")
    p.add_argument("--busy", type=int, default=0, help="spinning processes beside every run")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--draft", default="none", help="the drafter (default: none, the target alone)")
    args = p.parse_args()

    torch.set_num_threads(2)
    gen = SpeculativeGenerator.from_pretrained("smollm2-135m-instruct", args.draft)
    gen.generate(PROMPT, max_new_tokens=16)  # every kernel built and loaded
    kernels = [m for m in ext._BUILT.values() if hasattr(m, "use_pool")]
    work_pool = pool.kernel()

    def use(setting: str) -> None:
        if setting.startswith("omp"):
            os.environ[pool.POOL_ENV] = "off"  # the engine step leaves torch's threads alone too
            for m in kernels:
                m.use_pool(0)
            torch.set_num_threads(int(setting[3:] or 2))
            return
        os.environ.pop(pool.POOL_ENV, None)
        _, spin, chunks, threads = setting.split(":")
        for m in kernels:
            pool.attach_pool(m)
        pool.set_threads(int(threads))
        work_pool.set_spin_us(int(spin))
        work_pool.set_chunks_per_thread(int(chunks))

    settings = args.settings.split(",")
    speeds: dict[str, list[float]] = {s: [] for s in settings}
    with busy_cores(args.busy):
        for _ in range(args.reps):
            for setting in settings:
                use(setting)
                start = time.perf_counter()
                gen.generate(PROMPT, max_new_tokens=args.tokens, ignore_eos=True)
                speeds[setting].append(args.tokens / (time.perf_counter() - start))
    for setting, runs in speeds.items():
        print(f"{setting:16s} median {statistics.median(runs):6.1f} tok/s   runs "
              + " ".join(f"{v:.0f}" for v in runs), flush=True)


if __name__ == "__main__":
    main()
