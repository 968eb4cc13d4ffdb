"""The kernels' work pool (runtime/kernels/pool.cpp, parallel.h): every item of a region runs exactly once whatever
the threads do, a chunk's exception reaches the caller, the kernels really run their regions on it, and which
thread computes an output never changes its bits (every kernel path, 1-4 threads and OpenMP's split)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from test_fused import cache, paths_built
from test_quant_q8 import TYPES, paths_here, weight
from verispec.runtime.caches.kv_cache import attention_mask
from verispec.runtime.kernels import dense, ext, fused, pool, quant

pytestmark = pytest.mark.kernel("pool")


@contextmanager
def threads(n: int):
    before = pool.threads()
    pool.set_threads(n)
    try:
        yield
    finally:
        pool.set_threads(before)


@contextmanager
def on_openmp(*modules):
    """The modules' regions on at::parallel_for (OpenMP's static split), as before the pool."""
    for m in modules:
        m.use_pool(0)
    try:
        yield
    finally:
        for m in modules:
            ext.attach_pool(m)


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4])
def test_every_item_runs_exactly_once(n_threads):
    """Regions of every size and grain, some chunks slow (a worker holding one while the others go on)."""
    with threads(n_threads):
        for n in (1, 2, 7, 64, 1000):
            for grain in (1, 5, 64):
                for sleeps in ([], [0, 300], [2000, 0, 0]):
                    out = torch.zeros(n, dtype=torch.long)
                    pool.kernel().test_region(out, grain, sleeps)
                    assert torch.equal(out, torch.ones(n, dtype=torch.long)), (n, grain, sleeps)
        # negative control: the check sees an item run twice
        out = torch.zeros(100, dtype=torch.long)
        pool.kernel().test_region(out, 1, [])
        pool.kernel().test_region(out[:10], 1, [])
        assert not torch.equal(out, torch.ones(100, dtype=torch.long))


def test_a_chunk_that_raises_reaches_the_caller_and_the_pool_goes_on():
    with threads(2):
        out = torch.zeros(200, dtype=torch.long)
        with pytest.raises(RuntimeError, match="throws, as asked"):
            pool.kernel().test_region(out, 4, [0, -1])
        out.zero_()
        pool.kernel().test_region(out, 4, [])
        assert torch.equal(out, torch.ones(200, dtype=torch.long))


def test_the_kernels_run_their_regions_on_the_pool():
    """A linear big enough to share: the pool counts a region; with the kernel handed back to OpenMP (the negative
    control) it counts none."""
    w = weight("Q4_1", 512, 576)
    x = torch.randn(8, 576)
    with threads(2):
        before = pool.counters()["regions"]
        y = w.linear(x, None)
        assert pool.counters()["regions"] > before
        with on_openmp(quant.kernel()):
            before = pool.counters()["regions"]
            assert torch.equal(w.linear(x, None), y)
            assert pool.counters()["regions"] == before


def splits():
    """Each way of running a region: the pool on 1-4 threads, and OpenMP's static halves."""
    for n in (1, 2, 3, 4):
        with threads(n):
            yield f"pool {n}"
    with threads(2), on_openmp(*(ext.build(name, source) for name, source in ext.KERNELS.items() if name != "pool")):
        yield "openmp 2"


def assert_same_bits_on_every_split(compute) -> None:
    """compute() -> a list of tensors: bitwise the same under every split of `splits()`."""
    want = None
    for split in splits():
        got = compute()
        if want is None:
            want = got
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), split


@pytest.mark.kernel("quant")
def test_quant_linears_give_the_same_bits_on_any_split():
    """Every 32-weight type on integer activations, every path, 1, 5 and 40 rows."""
    cases = [(weight(qtype, 100, 576), path) for qtype in TYPES for path in paths_here()]
    x = torch.randn(40, 576)
    assert_same_bits_on_every_split(lambda: [w.linear(x[:rows], None, path) for w, path in cases
                                             for rows in (1, 5, 40)])


@pytest.mark.kernel("dense")
def test_dense_linears_give_the_same_bits_on_any_split():
    g = torch.Generator().manual_seed(3)
    weight_, x = torch.randn(160, 576, generator=g) / 24, torch.randn(40, 576, generator=g)
    packed = dense.pack(weight_)
    paths = list(dense.kernel().paths()["float32"])
    assert_same_bits_on_every_split(lambda: [dense.linear(x[:rows], packed, None, path) for path in paths
                                             for rows in (1, 7, 40)])


@pytest.mark.kernel("layer")
def test_attention_gives_the_same_bits_on_any_split():
    """Decode steps, verify widths and prefill chunks of several rows, every attention path."""
    gen = torch.Generator().manual_seed(5)
    b, H, Hk, d = 3, 9, 3, 64
    keys, values = cache(b, Hk, 256, d, torch.float32, gen)
    q = torch.randn(b, H, 64, d, generator=gen)
    lengths = torch.tensor([0, 37, 120])
    masks = {n: attention_mask(lengths, n, int(lengths.max()) + n, torch.float32) for n in (1, 5, 64)}
    assert_same_bits_on_every_split(lambda: [fused.kernel().attention(q[:, :, :n], keys, values, mask, path)
                                             for n, mask in masks.items() for path in paths_built()])
