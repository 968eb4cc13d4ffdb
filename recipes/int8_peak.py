"""What is this CPU's int8 multiply-add peak (the arithmetic ceiling of the integer-activation kernels: prefill, wide
verify passes)? A loop of 16 independent `vpdpbusd` on zmm registers (AVX-512 VNNI; ymm with AVX-VNNI / AVX2 machines
are reported as not measured), timed on one core and on every core at once (one process per core, pinned).
    python recipes/int8_peak.py [--iters 2000000] [--repeats 30] [--beside]
Prints G int8 multiply-adds per second per core and for the machine, and G instructions per second per core.
--beside: which instructions compete with `vpdpbusd` for its pipes (what a tile's epilogue costs): the same loop
with 4, 8 or 16 independent instructions of one kind among each 16 `vpdpbusd`, one core; a kind that slows the loop
takes a `vpdpbusd` slot each.
Measured 2026-11-28 (AMD EPYC, avx512_vnni): vmulps, vfmadd231ps, vpmulld and vpdpwssd each take a slot (16 + 4 of
them: 2.93 G vpdpbusd/s against 3.67 alone, 16 + 16: 1.83); vcvtdq2ps, vpaddd, vaddps (up to 8), vpandd, vpsrld and
broadcasts from memory run beside it for free.
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


# --beside: one kind of instruction among the vpdpbusd (AT&T operands; %%zmm{r}: one of 8 registers of its own)
BESIDE = {"vfmadd231ps": "vfmadd231ps %%zmm30, %%zmm31, %%zmm{r}", "vmulps": "vmulps %%zmm30, %%zmm{r}, %%zmm{r}",
          "vcvtdq2ps": "vcvtdq2ps %%zmm29, %%zmm{r}", "vpaddd": "vpaddd %%zmm29, %%zmm{r}, %%zmm{r}",
          "vpmulld": "vpmulld %%zmm29, %%zmm{r}, %%zmm{r}", "vaddps": "vaddps %%zmm30, %%zmm{r}, %%zmm{r}",
          "vpbroadcastd (mem)": "vpbroadcastd (%%rsp), %%zmm{r}", "vpdpwssd": "vpdpwssd %%zmm30, %%zmm31, %%zmm{r}",
          "vpandd": "vpandd %%zmm29, %%zmm{r}, %%zmm{r}", "vpsrld": "vpsrld $4, %%zmm29, %%zmm{r}"}


def beside_source() -> str:
    """A program timing 16 vpdpbusd with 0, 4, 8 or 16 instructions of each BESIDE kind: G vpdpbusd/s, best of 5."""
    clobbers = ", ".join(f'"xmm{i}"' for i in list(range(24)) + [29, 30, 31])
    funcs, calls = [], []
    for n, (name, op) in enumerate([("none", "")] + list(BESIDE.items())):
        for extra in ((0,) if not op else (4, 8, 16)):
            lines = []
            for i in range(16):
                lines.append(f'"vpdpbusd %%zmm30, %%zmm31, %%zmm{i}\\n"')
                if i < extra:
                    lines.append('"' + op.format(r=16 + i % 8) + '\\n"')
            funcs.append(f"double run_{n}_{extra}(long iters) {{ auto t0 = std::chrono::steady_clock::now();\n"
                         f'  asm volatile("mov %0, %%rcx\\n1:\\n" {" ".join(lines)} "dec %%rcx\\n jnz 1b\\n" '
                         f':: "r"(iters) : "rcx", "memory", {clobbers});\n'
                         "  return iters * 16.0 / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)"
                         ".count() / 1e9; }")
            calls.append(f'  {{ double b = 0; for (int k = 0; k < 5; ++k) b = std::max(b, run_{n}_{extra}(iters));'
                         f' std::printf("| %s | %d | %.2f |\\n", "{name}", {extra}, b); }}')
    return ("#include <algorithm>\n#include <chrono>\n#include <cstdio>\n#include <cstdlib>\n" + "\n".join(funcs)
            + "\nint main(int argc, char** argv) { const long iters = std::atol(argv[1]);\n" + "\n".join(calls)
            + "\n}\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--beside", action="store_true", help="which instructions take vpdpbusd's pipes (one core)")
    args = ap.parse_args()
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    if "avx512_vnni" not in flags:
        print("not measured: this CPU has no AVX-512 VNNI (the recipe times zmm vpdpbusd)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        if args.beside:
            src.write_text(beside_source())
            subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
            print("| beside 16 vpdpbusd | how many | G vpdpbusd/s |\n|---|---|---|")
            print(subprocess.run([str(exe), str(args.iters // 2)], capture_output=True, text=True, check=True).stdout,
                  end="")
            return
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
