"""runtime/weights/hugepages.py: buffers cut 2 MiB-aligned and advised onto transparent huge pages hold exactly what
torch.zeros / a copy would, and the kernel backs them with huge pages where THP is on."""

from pathlib import Path

import pytest
import torch

from conftest import machine_reason
from verispec.runtime.weights import hugepages

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_zeros_and_copies_hold_the_same_values_aligned_to_a_huge_page(monkeypatch):
    monkeypatch.setattr(hugepages, "ENABLED", True)
    z = hugepages.zeros((3, 5, 1000, 64), torch.float32)  # 3.8 MB
    assert z.shape == (3, 5, 1000, 64) and z.dtype == torch.float32 and z.is_contiguous()
    assert z.data_ptr() % hugepages.HUGE == 0 and not z.any()
    z[2, 4, 999, 63] = 7.0  # writable to its last element
    t = torch.randn(1100, 1024, dtype=torch.bfloat16)  # 2.25 MB
    c = hugepages.like(t)
    assert c.data_ptr() % hugepages.HUGE == 0 and torch.equal(c, t) and c.dtype == torch.bfloat16
    small = hugepages.zeros((4, 4), torch.float32)  # under a huge page: an ordinary tensor
    assert torch.equal(small, torch.zeros(4, 4))


def test_turned_off_gives_ordinary_tensors(monkeypatch):
    monkeypatch.setattr(hugepages, "ENABLED", False)
    z = hugepages.zeros((4 * MIB,), torch.uint8)
    assert z.untyped_storage().nbytes() == 4 * MIB  # torch's own allocation, not a padded cut of one
    t = [torch.randn(1000, 1000)]
    assert hugepages.gather(t)[0] is t[0]


def test_gather_copies_into_one_arena_in_order(monkeypatch):
    monkeypatch.setattr(hugepages, "ENABLED", True)
    tensors = [torch.randn(1000, 577),  # 2.3 MB in all: torch.randint(0, 255, (1001, 333), dtype=torch.uint8),
               torch.randn(64, 2048, dtype=torch.bfloat16)]
    views = hugepages.gather(tensors)
    storage = views[0].untyped_storage().data_ptr()
    assert views[0].data_ptr() % hugepages.HUGE == 0
    for t, v in zip(tensors, views):
        assert torch.equal(t, v) and v.dtype == t.dtype and v.is_contiguous()
        assert v.untyped_storage().data_ptr() == storage and v.data_ptr() % 64 == 0
    assert [v.data_ptr() for v in views] == sorted(v.data_ptr() for v in views)  # in the order given
    small = [torch.randn(4, 4)]
    assert hugepages.gather(small)[0] is small[0]  # under a huge page in all: left as is


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason=machine_reason("no transparent huge pages (the kernel's setting)"))
def test_the_kernel_backs_the_buffers_with_huge_pages(monkeypatch):
    """Where THP is on (`always` or `madvise`), the advised buffers sit on huge pages. (Whether torch's own do is
    not asserted: smaps counts huge pages per mapping, and the allocator may hand back a region an earlier test's
    huge buffer left.) The kernel's collapse is best effort: under another process's memory churn MADV_COLLAPSE now
    and then refuses a range (EINVAL, seen in the full suite on a shared machine), so the arena gets three tries,
    each a fresh allocation, and the failure names what the kernel answered."""
    import ctypes

    monkeypatch.setattr(hugepages, "ENABLED", True)
    z = hugepages.zeros((16 * MIB,), torch.uint8)
    assert hugepages.huge_bytes(z) >= 8 * MIB
    advise, refused = hugepages._madvise, []

    def answered(address, length, advice):
        ok = advise(address, length, advice)
        if not ok:
            refused.append((advice, ctypes.get_errno()))
        return ok

    monkeypatch.setattr(hugepages, "_madvise", answered)
    for _ in range(3):
        views = hugepages.gather([torch.randn(MIB // 4) for _ in range(12)])  # 12 x 1 MiB, each alone too small
        if hugepages.huge_bytes(views[5]) > 0:
            break
    assert hugepages.huge_bytes(views[5]) > 0, f"three arenas on ordinary pages; madvise refused (advice, errno): " \
                                               f"{refused}"
