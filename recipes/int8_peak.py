"""What is this CPU's int8 multiply-add peak (the arithmetic ceiling of the integer-activation kernels: prefill, wide
verify passes)? A loop of 16 independent `vpdpbusd` on zmm registers (AVX-512 VNNI; ymm with AVX-VNNI / AVX2 machines
are reported as not measured), timed on one core and on every core at once (one process per core, pinned).
    python recipes/int8_peak.py [--iters 2000000] [--repeats 30]
Prints G int8 multiply-adds per second per core and for the machine, and G instructions per second per core.
Measured 2026-11-28 (AMD EPYC, 2 cores, avx512_vnni): 235 G/s per core alone, 230 each with both busy: 460 G/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  const long iters = std::atol(argv[1]);
  const int repeats = std::atoi(argv[2]);
  double best = 0;
  for (int rep = 0; rep < repeats; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    asm volatile(
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n"
        "vpternlogd $0xff, %%zmm31, %%zmm31, %%zmm31\n"
        "mov %0, %%rcx\n"
        "1:\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n vpdpbusd %%zmm30, %%zmm31, %%zmm1\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm2\n vpdpbusd %%zmm30, %%zmm31, %%zmm3\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm4\n vpdpbusd %%zmm30, %%zmm31, %%zmm5\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm6\n vpdpbusd %%zmm30, %%zmm31, %%zmm7\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm8\n vpdpbusd %%zmm30, %%zmm31, %%zmm9\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm10\n vpdpbusd %%zmm30, %%zmm31, %%zmm11\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm12\n vpdpbusd %%zmm30, %%zmm31, %%zmm13\n"
        "vpdpbusd %%zmm30, %%zmm31, %%zmm14\n vpdpbusd %%zmm30, %%zmm31, %%zmm15\n"
        "dec %%rcx\n jnz 1b\n"
        :: "r"(iters) : "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm30", "xmm31");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double macs = iters * 16.0 * 64 / s;
    if (macs > best) best = macs;
  }
  std::printf("%.3f\n", best / 1e9);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    if "avx512_vnni" not in flags:
        print("not measured: this CPU has no AVX-512 VNNI (the recipe times zmm vpdpbusd)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        run = [str(exe), str(args.iters), str(args.repeats)]
        alone = float(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
        cores = sorted(os.sched_getaffinity(0))
        procs = [subprocess.Popen(["taskset", "-c", str(c), *run], stdout=subprocess.PIPE, text=True) for c in cores]
        together = [float(p.communicate()[0]) for p in procs]
    print(f"one core alone: {alone:.1f} G int8 multiply-adds/s ({alone / 64:.2f} G vpdpbusd/s)")
    print(f"{len(cores)} cores at once: " + ", ".join(f"{v:.1f}" for v in together)
          + f" G/s each; the machine: {sum(together):.1f} G/s")


if __name__ == "__main__":
    main()
