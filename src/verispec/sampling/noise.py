"""Counter-based Gumbel noise for coupled sampling: g(seed, position, token), the same on any device and batch.

Coupled (Gumbel-max) sampling picks the token at absolute position t as argmax_v(log p_t(v) + g(seed, t, v)), with
g standard Gumbel noise. That is an exact sample from p_t, and since the noise is a pure function of (seed, t, v)
rather than draws from a stream, a drafter can use the very same noise (argmax(log q_t + g)) and the target's
choice at t does not depend on how many tokens were drafted, verified or batched before it.

The hash is 32-bit integer mixing (Wellons' "lowbias32" with its improved constants 0x21f0aaad, 0x735a2d97, both
below 2**31) computed in int64 tensor ops: every product of a 32-bit value and a constant stays below 2**63, so no
op overflows and the bits are the same on every device and backend. Per row and position a 32-bit key mixes the
seed (both halves) and the position; per token, `key ^ lowbias32(token)` goes through one more round. lowbias32 is
a bijection, so the uniforms within one position are all distinct (no ties). The top 24 bits make u in (0, 1),
exact in float32, and g = -log(-log u).
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_TOKEN_SALT = 0x9E3779B9  # the golden ratio's bits: token 0 does not hash to 0
_POSITION_SALT = 0x85EBCA6B
_BLOCK_SALT = 0x27D4EB2F  # block ids' domain, apart from token ids'
BLOCK = 256  # token ids per block of the two-level Gumbel-max


def lowbias32(x: Tensor) -> Tensor:
    """A 32-bit integer bijection (avalanche mixing) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32  # < 2**32 * 2**30: no int64 overflow
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def seed_halves(seed: int) -> tuple[int, int]:
    """A Python int seed (any sign or size) -> its low and high 32-bit halves modulo 2**64."""
    seed %= 1 << 64
    return seed & _MASK32, seed >> 32


def position_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """seeds: [rows, 2] int64 (`seed_halves`); positions: [rows, n] int64, absolute positions -> [rows, n] keys."""
    low, high = seeds[:, 0:1], seeds[:, 1:2]  # [rows, 1]
    key = lowbias32(lowbias32(low ^ _POSITION_SALT) ^ high)  # [rows, 1]
    return lowbias32(key ^ (positions & _MASK32))  # [rows, n]


def gumbel_noise(keys: Tensor, ids: Tensor, salt: int = _TOKEN_SALT) -> Tensor:
    """Standard Gumbel noise for each key and id: keys [rows, n] (`position_keys`), ids [..., m] int64 in
    [0, 2**32), broadcastable to [rows, n, m] -> [rows, n, m] float32."""
    bits = lowbias32(keys.unsqueeze(-1) ^ lowbias32((ids + salt) & _MASK32))  # [rows, n, m]
    uniform = ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))  # (0, 1), exact in float32 (1 - 2**-24 at most)
    return -torch.log(-torch.log(uniform))


def gumbel_argmax(logits: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """The coupled choice at each row and position: an exact sample of softmax(logits), keyed by (seed, position).

    logits: [rows, n, vocab] processed (-inf where removed); seeds: [rows, 2] int64 (`seed_halves`); positions:
    [rows, n] int64 absolute positions -> [rows, n] long.

    Two-level Gumbel-max: the vocabulary is cut into blocks of BLOCK consecutive ids; the block is
    argmax_B(logsumexp(logits[B]) + g(B)), which picks B with probability Z_B / Z, and the token within it
    argmax_v(logits[v] + g(v)), with probability exp(logits[v]) / Z_B given B: together softmax(logits), with noise
    for (vocab / BLOCK + BLOCK) ids per position instead of the whole vocabulary (the hash is the costly part).
    """
    rows, n, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    padded = torch.nn.functional.pad(logits, (0, blocks * BLOCK - vocab), value=float("-inf"))
    padded = padded.view(rows, n, blocks, BLOCK)  # [rows, n, blocks, BLOCK]
    keys = position_keys(seeds, positions)  # [rows, n]
    block_ids = torch.arange(blocks, device=logits.device)  # [blocks]
    block = (padded.logsumexp(dim=-1) + gumbel_noise(keys, block_ids, _BLOCK_SALT)).argmax(dim=-1)  # [rows, n]
    inside = padded.gather(2, block.view(rows, n, 1, 1).expand(rows, n, 1, BLOCK)).squeeze(2)  # [rows, n, BLOCK]
    ids = block.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=logits.device)  # [rows, n, BLOCK]
    return block * BLOCK + (inside + gumbel_noise(keys, ids)).argmax(dim=-1)
