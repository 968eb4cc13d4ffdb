"""The server's engine, batch 1, greedy, 64 tokens: its decode step where the model loaded and where it decodes.

The server loads its models before the engine thread starts; libgomp gives every thread that opens a parallel
region a pool of its own and, once the workers of all pools outnumber the CPUs, lets them spin only briefly
before sleeping between regions. `--load main` loads on this (main) thread, as the server did before 2026-11-26;
`--load thread` loads on a thread that ends with the load, as `ServedModel.load` does now. Decoding runs on a
fresh thread either way (as the server's worker). Prints each run's decode step p50 and the process's voluntary
context switches (an OpenMP worker that sleeps between regions is woken once per region).

    PYTHONPATH=src python recipes/served_step.py --load main|thread [--weights gguf|fp32] [--threads 2] [--runs 4]
"""

from __future__ import annotations

import argparse
import resource
import threading
import time

import torch

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.runtime.model.loading import SMOLLM2_TARGET
from verispec.server import ServerConfig
from verispec.server.served import ServedModel

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def decode(served: ServedModel, runs: int) -> None:
    engine = served.engine
    ids = served.encode(PROMPT, "messages")
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    p50s = []
    for _ in range(runs):
        seq = engine.add_request(ids, params, use_drafter=False)
        steps = []
        while engine.has_unfinished:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
            seq.take()
        steps = sorted(steps[1:])  # the first step prefills
        p50s.append(steps[len(steps) // 2] * 1000)
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    print(f"decode step p50 {' '.join(f'{x:.2f}' for x in p50s)} ms; {switches / (runs * 64):.0f} voluntary "
          "context switches a step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", choices=("main", "thread"), required=True)
    parser.add_argument("--weights", choices=("gguf", "fp32"), default="gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ServerConfig(model=SMOLLM2_TARGET, spec=SpeculativeConfig(), weights=args.weights,
                          dtype=torch.float32, max_num_seqs=16)
    if args.load == "main":
        served = ServedModel._load(config)  # what `load` did before: the main thread keeps its OpenMP pool
    else:
        served = ServedModel.load(config)
    where = "the main thread" if args.load == "main" else "a thread that ended"
    print(f"{args.weights} weights, loaded on {where}, {args.threads} torch threads:", flush=True)
    for _ in range(2):
        worker = threading.Thread(target=decode, args=(served, args.runs))
        worker.start()
        worker.join()


if __name__ == "__main__":
    main()
