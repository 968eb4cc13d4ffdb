"""Batch- and width-invariant kernels of the native forward (issue "bit for bit"): every reduction in one fixed
order, so a row's logits and hidden states in a verify pass of any width, in a batch of any size and padding,
are bitwise those of a one-row, one-token step at the same position.

Measured on this CPU's kernels (`recipes/invariance_probe.py`), not assumed:
- oneDNN's packed linear is row-invariant (M = 1..512 rows, 1 or 2 threads, fp32 and bf16) while the reduced
  dimension is at most `MAX_INVARIANT_IN` (1024); past it the kernel blocks K by the row count. `split_in` cuts
  such a weight into input chunks of at most that size, summed in chunk order in fp32 (`linear_chunks`).
- torch's SDPA (flash kernel on CPU) splits the attended length by shape: not invariant. `block_attention`
  splits it into blocks of `BLOCK` entries from cache index 0; its two products have fixed M and K (64 x 64) and
  a fixed N as well: the queries are cut into chunks of `COLUMNS` columns (the last one zero-padded), one product
  each. MKL picks its GEMM kernel by N: on an AMD EPYC a column's bits changed between N = 3 and N = 18, while on
  the Intel Xeon measured before any N >= 2 agreed; at a fixed N, a column's bits measured independent of its
  place in the chunk, of the other columns and of the batch entries on both. Fully masked blocks contribute
  exactly 0, and the blocks are summed in block order (a cumulative sum, sequential by construction: torch's
  `sum` reorders by shape). Softmax uses the global maximum (exact).
- RMSNorm, rotary, embedding and the elementwise ops work per row: invariant as they are.

Where the C++ layer kernel is built (`fused.py`), its attention is invariant by construction and replaces
`block_attention`, which stays the fallback for invariant runners without it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MAX_INVARIANT_IN = 1024  # largest linear input size measured row-invariant in oneDNN's packed kernel
BLOCK = 64  # attended entries per attention block (also the products' fixed M and K)
COLUMNS = 16  # the products' fixed N: query columns per product


def split_in(weight: torch.Tensor) -> list[torch.Tensor]:
    """A [out, in] weight -> its column chunks [out, <= MAX_INVARIANT_IN] (equal sizes, multiples of 64)."""
    size = weight.shape[1]
    parts = -(-size // MAX_INVARIANT_IN)
    step = -(-size // parts // 64) * 64
    return [weight[:, i : i + step].contiguous() for i in range(0, size, step)]


def block_attention(
    q: torch.Tensor,  # [b, H, n, d]
    keys: torch.Tensor,  # [b, Hk, max_len, d]: the rows' cache buffers
    values: torch.Tensor,  # [b, Hk, max_len, d]
    mask: torch.Tensor,  # [b, 1, n, L] additive (0 / dtype min)
) -> torch.Tensor:  # [b, H, n, d]
    """softmax(q k^T / sqrt(d) + mask) v over [0, L) in fp32, the attended length in blocks of BLOCK entries."""
    b, H, n, d = q.shape
    Hk = keys.shape[1]
    g = H // Hk  # query heads per KV head (head h reads KV head h // g)
    L = mask.shape[-1]
    nb = -(-L // BLOCK)
    Lp = nb * BLOCK
    k, v = keys[:, :, :Lp].float(), values[:, :, :Lp].float()  # [b, Hk, <= Lp, d]
    if k.shape[2] < Lp:  # near the end of the cache: zero entries, masked below
        k, v = F.pad(k, (0, 0, 0, Lp - k.shape[2])), F.pad(v, (0, 0, 0, Lp - v.shape[2]))
    if Lp > L:
        mask = F.pad(mask, (0, Lp - L), value=torch.finfo(mask.dtype).min)
    cols = g * n  # the products' columns: (query head in the group, query)
    q_t = (q.float() * (1.0 / math.sqrt(d))).reshape(b, Hk, cols, d).transpose(-1, -2)  # [b, Hk, d, cols]
    scores = fixed_n_matmul(k.contiguous().view(b, Hk, nb, BLOCK, d), q_t.unsqueeze(2))  # [b, Hk, nb, B, cols]
    masks = mask.float().view(b, 1, n, nb, BLOCK).permute(0, 1, 3, 4, 2).unsqueeze(4)  # [b, 1, nb, B, 1, n]
    scores = scores.view(b, Hk, nb, BLOCK, g, n) + masks
    p = torch.exp(scores - scores.amax((2, 3), keepdim=True)).view(b, Hk, nb, BLOCK, cols)  # masked: exactly 0
    ones = v.new_ones(()).expand(b, Hk, Lp, 1)  # the softmax denominator comes out of the same product
    v_t = torch.cat([v, ones], -1).view(b, Hk, nb, BLOCK, d + 1).transpose(-1, -2)  # [b, Hk, nb, d + 1, B]
    acc = fixed_n_matmul(v_t, p).cumsum(2)[:, :, -1]  # [b, Hk, d + 1, cols]: blocks summed in order
    out = acc[:, :, :d] / acc[:, :, d:]  # [b, Hk, d, cols]
    return out.transpose(-1, -2).reshape(b, H, n, d).to(q.dtype)


def fixed_n_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] as products of exactly COLUMNS columns each (b's last chunk zero-padded), so the
    GEMM kernel, and with it each column's bits, does not depend on N (module docstring)."""
    n = b.shape[-1]
    padded = F.pad(b, (0, -n % COLUMNS))
    return torch.cat([torch.matmul(a, chunk) for chunk in padded.split(COLUMNS, -1)], -1)[..., :n]
