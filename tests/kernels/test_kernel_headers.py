"""Every header of the C++ kernels compiles on its own (it includes what it uses: no fragment that depends on names
defined before its #include), with the flags and include paths the kernels are built with. Slow-marked (~15 s a
header: torch's headers), run by .ci/run."""

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from verispec.runtime.kernels import ext

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

KERNELS = Path(ext.__file__).parent
HEADERS = sorted(KERNELS.glob("*.h"))


@pytest.mark.slow
@pytest.mark.parametrize("header", HEADERS, ids=[h.name for h in HEADERS])
def test_each_header_compiles_on_its_own(header):
    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "no C++ compiler: the kernels cannot be built either"
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    flags = [f for f in ext.CFLAGS if f.startswith(("-march", "-fopenmp", "-ffp"))]
    result = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", "-Wno-pragma-once-outside-header", *flags,
                             *includes, "-x", "c++", str(header)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_every_local_include_is_hashed_into_the_build_key():
    """ext.py keys a kernel's build on every file it includes, recursively (a header's edit rebuilds the kernel)."""
    assert [str(p) for p in ext.local_includes(KERNELS / "layer_kernel.cpp")] == [
        "layer_loop.h", "layer_ops.h", "attention.h", "layer_common.h", "parallel.h", "pool_api.h"]
    assert [str(p) for p in ext.local_includes(KERNELS / "quant_kernel.cpp")] == [
        "quant_common.h", "quant_gemm512.h", "quant_vk.h", "quant_pack.h", "parallel.h", "quant_k.h", "quant_q8.h",
        "pool_api.h", "quant_unpack.h"]
