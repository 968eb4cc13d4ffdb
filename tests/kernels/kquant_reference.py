"""A reference K-quant quantizer for the tests (numpy, written here: gguf-py dequantizes K-quants but does not make
them): float rows -> Q4_K, Q5_K or Q6_K blocks as the GGUF format lays them out, with the values each block stands for
computed here too, so a test can hold both the packing and the formulas against gguf-py's dequantization.

The scales are chosen simply (a sub-block's range over the super-block's largest), not by llama.cpp's search: any
valid block is a test of the kernel, and these are close enough to the floats for a model to keep its predictions.

    Q4_K / Q5_K (256 weights): d, dmin fp16; 8 sub-blocks of 32 with a 6-bit scale sc and min mn (12 packed bytes);
                 w = (d * sc) * q - dmin * mn, q of 4 (Q4_K) or 5 (Q5_K: the fifth bits in qh[32]) bits
    Q6_K (256):  ql[128], qh[64], 16 int8 scales (one per 16 weights), d fp16; w = (d * sc) * (q - 32), q of 6 bits
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes: bytes 0-3 scales 0-3 (their top 2 bits: scales 4-7's high bits),
    4-7 mins 0-3 (likewise for mins 4-7), 8-11 scales 4-7's low 4 bits | mins 4-7's low 4 bits << 4."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _quantize_affine(x: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """[n, 256] -> (d, dmin [n] fp16 values, sc, mn [n, 8] uint8, q [n, 8, 32] uint8, values [n, 256] float32)."""
    top = 2 ** bits - 1
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)  # [n, 8]: the (non-positive) offset a min takes away
    scale = (sub.max(axis=-1) - low) / top  # [n, 8]
    d = _f16(scale.max(axis=-1) / 63)  # [n]
    dmin = _f16(-low.min(axis=-1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin[:, None] > 0, np.rint(-low / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
    a = (d[:, None] * sc.astype(np.float32))[..., None]  # [n, 8, 1] exact
    c = (dmin[:, None] * mn.astype(np.float32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(a > 0, np.rint((sub + c) / a), 0).clip(0, top).astype(np.uint8)  # [n, 8, 32]
    values = (a * q.astype(np.float32) - c).astype(np.float32).reshape(-1, QK_K)
    return d, dmin, sc, mn, q, values


def quantize(x: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float32 (in a multiple of 256) -> ([out, in / 256 * bytes] uint8 blocks, [out, in] float32 the
    values they stand for, computed here as gguf-py's formulas do)."""
    out, width = x.shape
    rows = x.astype(np.float32).reshape(-1, QK_K)  # [n, 256]
    n = rows.shape[0]
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin, sc, mn, q, values = _quantize_affine(rows, 4 if qtype == "Q4_K" else 5)
        head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                               dmin.astype(np.float16).view(np.uint8).reshape(n, 2), _pack_scales(sc, mn)], axis=1)
        low = q & 15  # [n, 8, 32]
        qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)  # sub-blocks 2j (low nibble), 2j + 1 (high)
        parts = [head]
        if qtype == "Q5_K":
            parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
        blocks = np.concatenate(parts + [qs], axis=1)
    elif qtype == "Q6_K":
        sub = rows.reshape(n, 16, 16)
        scale = np.abs(sub).max(axis=-1) / 31  # [n, 16]
        d = _f16(scale.max(axis=-1) / 127)  # [n]
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-128, 127).astype(np.int8)
            a = (d[:, None] * sc.astype(np.float32))[..., None]  # [n, 16, 1] exact
            q = (np.where(a != 0, np.rint(sub / a), 0).clip(-32, 31) + 32).astype(np.uint8).reshape(n, 256)
        values = (a * (q.reshape(n, 16, 16).astype(np.float32) - 32)).astype(np.float32).reshape(n, QK_K)
        # element 128h + 32k + e: low nibble k // 2 of ql[64h + 32 (k % 2) + e], high bits 2k of qh[32h + e]
        quarters = q.reshape(n, 2, 4, 32)  # [n, h, k, e]
        ql = (quarters[:, :, 0:2] & 15) | ((quarters[:, :, 2:4] & 15) << 4)  # [n, h, k % 2, e]
        qh = np.bitwise_or.reduce((quarters >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
        blocks = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                                 d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=1)
    else:
        raise ValueError(f"no reference quantizer for {qtype}")
    return blocks.reshape(out, -1), values.reshape(out, width)


def random_blocks(qtype: str, out: int, width: int, seed: int = 0) -> np.ndarray:
    """[out, row_bytes] uint8 of a 5-bit or K-quant type: random quants and packed scales, random finite fp16 d (and
    dmin / m) of a model's size; every bit pattern of the rest is a valid block."""
    from verispec.runtime.kernels.quant import K_BLOCKS, row_bytes

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out, row_bytes(qtype, width)), dtype=np.uint8)
    blocks = raw.reshape(out, width // (QK_K if qtype in K_BLOCKS else 32), -1)
    halves = {"Q5_0": 1, "Q6_K": 1}.get(qtype, 2)
    scales = (rng.standard_normal(blocks.shape[:2] + (halves,)) * 0.01).astype(np.float16).view(np.uint8)
    at = 208 if qtype == "Q6_K" else 0
    blocks[..., at : at + 2 * halves] = scales.reshape(*blocks.shape[:2], 2 * halves)
    return raw
