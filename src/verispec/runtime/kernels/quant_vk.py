"""The K-quants' integer-activation layouts ("VK", quant_vk.h): `pack_vk` reorders a Q4_K / Q5_K / Q6_K weight's
super-blocks into records of 16 channels (each unit of 32 weights as quant_q8.h's Q4 V chunks, the 6-bit scales and
mins a byte each), `unpack_vk` gives the file's bytes back. Moved by quant_pack.h where the quant kernel is built (at
memory speed); the numpy versions here (`pack_vk_reference`, `unpack_vk_reference`) are the fallback elsewhere and the
reference tests/kernels/test_quant_pack.py holds the C++ to, byte for byte."""

from __future__ import annotations

import numpy as np
import torch

from .ext import KERNELS, build

VK_GROUP = 16  # output channels of a record
SUPER = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes of a super-block in the file
RECORD = {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210}  # bytes a channel's super-block takes in a record
GGML_TYPE = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # what quant_pack.h calls them (quant.py K_BLOCKS' kernel ids)


def _fields(qtype: str, blk: np.ndarray) -> dict[str, np.ndarray]:
    """[..., bytes] super-blocks -> their fields: d, dmin [..., 2] fp16 bytes; sc, mn [..., 8] (Q6_K: sc [..., 16]
    int8 as uint8); k [..., 8 units, 32] the unsigned quants."""
    if qtype == "Q6_K":
        ql, qh = blk[..., :128].astype(np.int32), blk[..., 128:192].astype(np.int32)
        units = []
        for s in range(8):  # unit s = 4h + k: ql[64h + 32 (k % 2) + e] nibble k // 2, qh[32h + e] bits 2k, 2k + 1
            h, k = divmod(s, 4)
            low = (ql[..., 64 * h + 32 * (k % 2) : 64 * h + 32 * (k % 2) + 32] >> (4 * (k // 2))) & 0x0F
            units.append(low | (((qh[..., 32 * h : 32 * h + 32] >> (2 * k)) & 3) << 4))
        return {"d": blk[..., 208:210], "sc": blk[..., 192:208], "k": np.stack(units, axis=-2)}
    p = blk[..., 4:16].astype(np.int32)
    sc = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 0x0F) | ((p[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blk[..., 16:144] if qtype == "Q4_K" else blk[..., 48:176]
    units = []
    for s in range(8):  # unit s: nibble s % 2 of qs[32 (s // 2) + e]; Q5_K: bit s of qh[e] the fifth
        k = (qs[..., 32 * (s // 2) : 32 * (s // 2) + 32].astype(np.int32) >> (4 * (s % 2))) & 0x0F
        if qtype == "Q5_K":
            k = k | (((blk[..., 16:48].astype(np.int32) >> s) & 1) << 4)
        units.append(k)
    return {"d": blk[..., 0:2], "dmin": blk[..., 2:4], "sc": sc, "mn": mn, "k": np.stack(units, axis=-2)}


def _bits(k: np.ndarray, shift: int, width: int, places: list[int]) -> np.ndarray:
    """[..., n] quants -> [...] uint32: bits shift .. shift + width - 1 of element j at places[j] (quant_vk.h's)."""
    out = np.zeros(k.shape[:-1], dtype=np.uint32)
    for j, at in enumerate(places):
        out |= ((k[..., j].astype(np.uint32) >> np.uint32(shift)) & np.uint32((1 << width) - 1)) << np.uint32(at)
    return out


def _unbits(word: np.ndarray, width: int, places: list[int]) -> np.ndarray:
    """`_bits`' inverse: [...] uint32 -> [..., n] the fields (not shifted back)."""
    return np.stack([(word >> np.uint32(at)) & np.uint32((1 << width) - 1) for at in places], axis=-1).astype(np.int32)


_Q5_PLACES = [8 * (j % 4) + j // 4 if j < 16 else 8 * ((j - 16) % 4) + 4 + (j - 16) // 4 for j in range(32)]
_Q6_PLACES = [8 * (j % 4) + 2 * (j // 4) for j in range(16)]  # element j of a half of 16: bits 8k + 2i


def pack_vk(data: torch.Tensor, qtype: str, into: torch.Tensor | None = None) -> torch.Tensor:
    """[out, row_bytes] Q4_K / Q5_K / Q6_K super-blocks -> [ceil(out / 16), 16 * RECORD * super-blocks], quant_vk.h's
    records (a last group short of 16 channels padded with zeros: computed, never returned); into: where to write
    them (contiguous uint8, their shape), -> into."""
    ext = build("quant", KERNELS["quant"])
    if ext is not None:
        return ext.pack_v(data, GGML_TYPE[qtype], into)
    packed = pack_vk_reference(data, qtype)
    return packed if into is None else into.copy_(packed)


def unpack_vk(packed: torch.Tensor, qtype: str, out: int) -> torch.Tensor:
    """`pack_vk`'s inverse: [ceil(out / 16), 16 * RECORD * super-blocks] -> [out, row_bytes], the file's bytes."""
    ext = build("quant", KERNELS["quant"])
    return unpack_vk_reference(packed, qtype, out) if ext is None else ext.unpack_v(packed, GGML_TYPE[qtype], out)


def pack_vk_reference(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """`pack_vk` in numpy."""
    out = data.shape[0]
    groups = -(-out // VK_GROUP)
    raw = data.contiguous().numpy()
    if groups * VK_GROUP != out:
        raw = np.concatenate([raw, np.zeros((groups * VK_GROUP - out, raw.shape[1]), dtype=np.uint8)])
    n = raw.shape[1] // SUPER[qtype]
    f = _fields(qtype, raw.reshape(groups, VK_GROUP, n, SUPER[qtype]).transpose(0, 2, 1, 3))  # [g, n, 16, ...]
    k = f["k"]  # [g, n, 16, 8, 32]
    low = k & 0x0F
    nib = (low[..., :16] | (low[..., 16:] << 4)).astype(np.uint8)  # [g, n, 16, 8, 16]: byte 4i + j
    nib = nib.reshape(groups, n, VK_GROUP, 8, 4, 4).transpose(0, 1, 3, 4, 2, 5)  # [g, n, 8 units, 4 i, 16 c, 4 j]
    unit = [nib.reshape(groups, n, 8, 256)]
    if qtype == "Q5_K":
        unit.append(_bits(k, 4, 1, _Q5_PLACES).transpose(0, 1, 3, 2).copy().view(np.uint8))  # [g, n, 8, 64]
    if qtype == "Q6_K":
        for half in (k[..., :16], k[..., 16:]):
            unit.append(_bits(half, 4, 2, _Q6_PLACES).transpose(0, 1, 3, 2).copy().view(np.uint8))
    head = [f["d"].reshape(groups, n, -1)]
    if qtype == "Q6_K":
        head.append(f["sc"].reshape(groups, n, VK_GROUP, 8, 2).transpose(0, 1, 3, 4, 2).reshape(groups, n, -1))
    else:
        head += [f["dmin"].reshape(groups, n, -1)]
        head += [f[name].transpose(0, 1, 3, 2).astype(np.uint8).reshape(groups, n, -1) for name in ("sc", "mn")]
    units = np.concatenate(unit, axis=-1).reshape(groups, n, -1)
    record = np.concatenate([h.astype(np.uint8) for h in head] + [units], axis=-1)  # [g, n, 16 * RECORD]
    return torch.from_numpy(np.ascontiguousarray(record).reshape(groups, -1))


def unpack_vk_reference(packed: torch.Tensor, qtype: str, out: int) -> torch.Tensor:
    """`unpack_vk` in numpy."""
    groups = packed.shape[0]
    n = packed.shape[1] // (VK_GROUP * RECORD[qtype])
    rec = packed.contiguous().numpy().reshape(groups, n, VK_GROUP * RECORD[qtype])
    at = 288 if qtype == "Q6_K" else 320  # the head: d and sc (and dmin, mn)
    per_unit = {"Q4_K": 256, "Q5_K": 320, "Q6_K": 384}[qtype]
    units = rec[..., at:].reshape(groups, n, 8, per_unit)
    nib = units[..., :256].reshape(groups, n, 8, 4, VK_GROUP, 4).transpose(0, 1, 4, 2, 3, 5)  # [g, n, c, 8, i, j]
    nib = nib.reshape(groups, n, VK_GROUP, 8, 16).astype(np.int32)
    k = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)  # [g, n, 16, 8, 32]
    words = units[..., 256:].copy().view(np.uint32).reshape(groups, n, 8, -1, VK_GROUP).transpose(0, 1, 4, 2, 3)
    if qtype == "Q5_K":
        k |= _unbits(words[..., 0], 1, _Q5_PLACES) << 4
    if qtype == "Q6_K":
        k |= np.concatenate([_unbits(words[..., 0], 2, _Q6_PLACES), _unbits(words[..., 1], 2, _Q6_PLACES)], -1) << 4
    d = rec[..., :32].reshape(groups, n, VK_GROUP, 2)
    blk = np.zeros((groups, n, VK_GROUP, SUPER[qtype]), dtype=np.uint8)
    if qtype == "Q6_K":
        ql = np.zeros((groups, n, VK_GROUP, 128), dtype=np.int32)
        qh = np.zeros((groups, n, VK_GROUP, 64), dtype=np.int32)
        for s in range(8):
            h, kk = divmod(s, 4)
            at_l = 64 * h + 32 * (kk % 2)
            ql[..., at_l : at_l + 32] |= (k[..., s, :] & 0x0F) << (4 * (kk // 2))
            qh[..., 32 * h : 32 * h + 32] |= (k[..., s, :] >> 4) << (2 * kk)
        blk[..., :128], blk[..., 128:192] = ql, qh
        blk[..., 192:208] = rec[..., 32:288].reshape(groups, n, 8, 2, VK_GROUP).transpose(0, 1, 4, 2, 3).reshape(
            groups, n, VK_GROUP, 16)
        blk[..., 208:210] = d
    else:
        sc = rec[..., 64:192].reshape(groups, n, 8, VK_GROUP).transpose(0, 1, 3, 2).astype(np.int32)
        mn = rec[..., 192:320].reshape(groups, n, 8, VK_GROUP).transpose(0, 1, 3, 2).astype(np.int32)
        blk[..., 0:2], blk[..., 2:4] = d, rec[..., 32:64].reshape(groups, n, VK_GROUP, 2)
        blk[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
        blk[..., 8:12] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
        blk[..., 12:16] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
        first = 16 if qtype == "Q4_K" else 48
        qs = np.zeros((groups, n, VK_GROUP, 128), dtype=np.int32)
        for s in range(8):
            qs[..., 32 * (s // 2) : 32 * (s // 2) + 32] |= (k[..., s, :] & 0x0F) << (4 * (s % 2))
        blk[..., first : first + 128] = qs
        if qtype == "Q5_K":
            blk[..., 16:48] = sum(((k[..., s, :] >> 4) & 1) << s for s in range(8))
    rows = blk.transpose(0, 2, 1, 3).reshape(groups * VK_GROUP, n * SUPER[qtype])
    return torch.from_numpy(np.ascontiguousarray(rows[:out]))
