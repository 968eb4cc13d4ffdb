// The load-time repacks of GGUF blocks into the integer-activation layouts, in C++ (quant.py `pack_v` / `unpack_v`,
// quant_vk.py `pack_vk` / `unpack_vk` call these where the kernel is built; their numpy versions are the fallback and
// the reference, and tests/kernels/test_quant_pack.py holds the two equal byte for byte).
//
// The layouts (quant_q8.h for V, quant_vk.h for VK) reorder a weight's bytes, channels in groups of 16, each group one
// contiguous run; a last group short of 16 channels is padded with zero blocks. A group is packed from its 16 rows
// (or unpacked into them) on its own, so groups run in parallel on the work pool and the result never depends on the
// thread. Only bytes move (and bits, within a block): the functions are byte shuffles, exact for any input bytes.
//
//   V  (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), per group: for every block its quants as [chunks][16 channels][4 bytes] and
//      (Q5) [16] u32 fifth bits (bit j of the file's qh at Q5_BIT[j]), then every block's [16] fp16 d, then (Q4_1,
//      Q5_1) every block's [16] fp16 m.
//   VK (Q4_K, Q5_K, Q6_K), per group: one record per super-block,
//      Q4_K, Q5_K: [16] fp16 d, [16] fp16 dmin, [8 units][16] u8 sc, [8][16] u8 mn, then per unit
//                  [4 chunks i][16 channels][4 bytes j] nibbles (low: element 4i + j, high: 16 + 4i + j), (Q5_K) [16] u32
//                  fifth bits (element j's at Q5_BIT[j])
//      Q6_K:       [16] fp16 d, [16 scales][16] i8 sc, then per unit the nibbles as above and [2 halves][16] u32 of the
//                  quants' high 2 bits (element j of a half at bits 8 (j % 4) + 2 (j / 4))
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "parallel.h"

namespace verispec_pack {

constexpr int64_t CH = 16;  // channels of a group
// GGML type ids (quant.py GGML_BLOCKS, K_BLOCKS).
enum FileType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr bool k_type(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
// Bytes of a block (K: a super-block) in the file, and a channel's bytes of a VK record.
constexpr int64_t file_bytes(int64_t t) {
  return t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q5_1 ? 24 : t == Q8_0 ? 34 : t == Q4_K ? 144
       : t == Q5_K ? 176 : t == Q6_K ? 210 : 0;
}
constexpr int64_t record_bytes(int64_t t) { return t == Q4_K ? 148 : t == Q5_K ? 180 : 210; }

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// ---- V: the 32-weight blocks ---------------------------------------------------------------------------------------

struct VFields {
  int64_t first, count;  // the quant bytes of a block in the file
  bool q5;               // a u32 qh just before them
  int scales;            // fp16 fields at bytes 0 (d) and 2 (m) of the file's block: 1 or 2
};
constexpr VFields v_fields(int64_t t) {
  return t == Q8_0 ? VFields{2, 32, false, 1} : VFields{file_bytes(t) - 16, 16, t == Q5_0 || t == Q5_1,
                                                       t == Q4_1 || t == Q5_1 ? 2 : 1};
}

// The V layouts' fifth bits: bit j of the file's qh at bit 8 (j % 4) + j / 4 (j < 16), 8 (j % 4) + 4 + (j - 16) / 4
// (j >= 16), i.e. element 4q + m at bit 8m + q (quant_unpack.h v_q5_bit): nibble q of qh becomes bit q of the 4 bytes.
// A nibble x times 0x204081 (shifts 0, 7, 14, 21) has its bit m at 8m and at 21 + m, no two partial products
// overlapping (no carries): & 0x01010101 spreads it into bytes, >> 21 gathers bytes' low bits back.
constexpr uint64_t SPREAD = 0x204081;
inline uint32_t spread_q5(uint32_t qh) {
  uint32_t out = 0;
  for (int q = 0; q < 8; ++q) out |= ((((qh >> (4 * q)) & 0xFu) * static_cast<uint32_t>(SPREAD)) & 0x01010101u) << q;
  return out;
}
inline uint32_t gather_q5(uint32_t spread) {
  uint32_t qh = 0;
  for (int q = 0; q < 8; ++q) qh |= static_cast<uint32_t>((((spread >> q) & 0x01010101u) * SPREAD >> 21) & 0xFu) << (4 * q);
  return qh;
}

// Group g's 16 channels' blocks (rows[c]: channel c's row, a zero row past `out`) into its run `dst`.
inline void pack_v_group(int64_t t, const uint8_t* const* rows, int64_t n, uint8_t* dst) {
  const VFields f = v_fields(t);
  const int64_t size = file_bytes(t), per_block = CH * (f.count + 4 * f.q5);
  for (int64_t b = 0; b < n; ++b) {
    uint8_t* q = dst + b * per_block;
    for (int64_t c = 0; c < CH; ++c) {
      const uint8_t* blk = rows[c] + b * size;
      for (int64_t i = 0; i < f.count / 4; ++i) std::memcpy(q + i * 4 * CH + 4 * c, blk + f.first + 4 * i, 4);
      if (f.q5) store32(q + CH * f.count + 4 * c, spread_q5(load32(blk + f.first - 4)));
      for (int s = 0; s < f.scales; ++s) std::memcpy(dst + n * per_block + (s * n + b) * 2 * CH + 2 * c, blk + 2 * s, 2);
    }
  }
}

// `pack_v_group`'s inverse into rows[c] for the group's first `live` channels (the padding is dropped).
inline void unpack_v_group(int64_t t, const uint8_t* src, int64_t n, int64_t live, uint8_t* const* rows) {
  const VFields f = v_fields(t);
  const int64_t size = file_bytes(t), per_block = CH * (f.count + 4 * f.q5);
  for (int64_t c = 0; c < live; ++c) {
    for (int64_t b = 0; b < n; ++b) {
      uint8_t* blk = rows[c] + b * size;
      const uint8_t* q = src + b * per_block;
      for (int64_t i = 0; i < f.count / 4; ++i) std::memcpy(blk + f.first + 4 * i, q + i * 4 * CH + 4 * c, 4);
      if (f.q5) store32(blk + f.first - 4, gather_q5(load32(q + CH * f.count + 4 * c)));
      for (int s = 0; s < f.scales; ++s) std::memcpy(blk + 2 * s, src + n * per_block + (s * n + b) * 2 * CH + 2 * c, 2);
    }
  }
}

// ---- VK: the K-quants' super-blocks --------------------------------------------------------------------------------

constexpr int64_t vk_head(int64_t t) { return t == Q6_K ? 32 + 256 : 64 + 256; }
constexpr int64_t vk_unit(int64_t t) { return t == Q4_K ? 256 : t == Q5_K ? 256 + 64 : 256 + 128; }

// A unit's 32 nibbles (lo[e], hi[e] = elements e, 16 + e, each in the low 4 bits of its byte after `shift`) into
// channel c's place of the unit's [4 chunks][16 channels][4 bytes].
inline void put_nibbles(const uint8_t* lo, const uint8_t* hi, int shift, uint8_t* unit, int64_t c) {
  uint8_t v[16];
  for (int e = 0; e < 16; ++e) v[e] = static_cast<uint8_t>(((lo[e] >> shift) & 0x0F) | (((hi[e] >> shift) & 0x0F) << 4));
  for (int i = 0; i < 4; ++i) std::memcpy(unit + i * 4 * CH + 4 * c, v + 4 * i, 4);
}
inline void get_nibbles(const uint8_t* unit, int64_t c, uint8_t* v) {
  for (int i = 0; i < 4; ++i) std::memcpy(v + 4 * i, unit + i * 4 * CH + 4 * c, 4);
}

// Super-block `blk` of channel c into its record `rec`.
inline void pack_vk_block(int64_t t, const uint8_t* blk, int64_t c, uint8_t* rec) {
  const int64_t head = vk_head(t), unit = vk_unit(t);
  if (t == Q6_K) {
    std::memcpy(rec + 2 * c, blk + 208, 2);
    for (int m = 0; m < 16; ++m) rec[32 + m * CH + c] = blk[192 + m];
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int s = 0; s < 8; ++s) {  // unit s = 4h + k: ql[64h + 32 (k % 2) + e] nibble k / 2, qh[32h + e] bits 2k, 2k + 1
      const int h = s / 4, k = s % 4;
      uint8_t* u = rec + head + s * unit;
      const uint8_t* low = ql + 64 * h + 32 * (k % 2);
      put_nibbles(low, low + 16, 4 * (k / 2), u, c);
      for (int half = 0; half < 2; ++half) {  // element 4i + j of the half: byte j of load i, bits 2i of the word
        uint32_t word = 0;
        for (int i = 0; i < 4; ++i) word |= ((load32(qh + 32 * h + 16 * half + 4 * i) >> (2 * k)) & 0x03030303u) << (2 * i);
        store32(u + 256 + half * 4 * CH + 4 * c, word);
      }
    }
    return;
  }
  std::memcpy(rec + 2 * c, blk, 2);
  std::memcpy(rec + 32 + 2 * c, blk + 2, 2);
  const uint8_t* p = blk + 4;  // the 12 bytes of 6-bit scales and mins
  for (int i = 0; i < 4; ++i) {
    rec[64 + i * CH + c] = p[i] & 63;
    rec[64 + (4 + i) * CH + c] = static_cast<uint8_t>((p[8 + i] & 0x0F) | ((p[i] >> 6) << 4));
    rec[192 + i * CH + c] = p[4 + i] & 63;
    rec[192 + (4 + i) * CH + c] = static_cast<uint8_t>((p[8 + i] >> 4) | ((p[4 + i] >> 6) << 4));
  }
  const uint8_t* qs = blk + (t == Q4_K ? 16 : 48);
  for (int s = 0; s < 8; ++s) {  // unit s: nibble s % 2 of qs[32 (s / 2) + e]; Q5_K: bit s of qh[e] the fifth
    uint8_t* u = rec + head + s * unit;
    put_nibbles(qs + 32 * (s / 2), qs + 32 * (s / 2) + 16, 4 * (s % 2), u, c);
    if (t == Q5_K) {  // element 4q + m at bit 8m + q: byte m of load q, bit s
      uint32_t word = 0;
      for (int q = 0; q < 8; ++q) word |= ((load32(blk + 16 + 4 * q) >> s) & 0x01010101u) << q;
      store32(u + 256 + 4 * c, word);
    }
  }
}

// `pack_vk_block`'s inverse: channel c's super-block out of record `rec` into `blk` (as quant_vk.py's `unpack_vk`
// computes it, also for bytes no packing made).
inline void unpack_vk_block(int64_t t, const uint8_t* rec, int64_t c, uint8_t* blk) {
  const int64_t head = vk_head(t), unit = vk_unit(t);
  uint8_t v[16];
  if (t == Q6_K) {
    std::memset(blk, 0, 192);
    uint8_t *ql = blk, *qh = blk + 128;
    for (int s = 0; s < 8; ++s) {
      const int h = s / 4, k = s % 4, shift = 4 * (k / 2);
      const uint8_t* u = rec + head + s * unit;
      get_nibbles(u, c, v);
      uint8_t* low = ql + 64 * h + 32 * (k % 2);
      for (int e = 0; e < 16; ++e) {
        low[e] |= static_cast<uint8_t>((v[e] & 0x0F) << shift);
        low[16 + e] |= static_cast<uint8_t>((v[e] >> 4) << shift);
      }
      for (int half = 0; half < 2; ++half) {
        const uint32_t word = load32(u + 256 + half * 4 * CH + 4 * c);
        for (int i = 0; i < 4; ++i) {
          uint8_t* at = qh + 32 * h + 16 * half + 4 * i;
          store32(at, load32(at) | (((word >> (2 * i)) & 0x03030303u) << (2 * k)));
        }
      }
    }
    for (int m = 0; m < 16; ++m) blk[192 + m] = rec[32 + m * CH + c];
    std::memcpy(blk + 208, rec + 2 * c, 2);
    return;
  }
  std::memcpy(blk, rec + 2 * c, 2);
  std::memcpy(blk + 2, rec + 32 + 2 * c, 2);
  for (int i = 0; i < 4; ++i) {  // (uint8 truncation, as numpy's assignment)
    const int sc = rec[64 + i * CH + c], sc4 = rec[64 + (4 + i) * CH + c];
    const int mn = rec[192 + i * CH + c], mn4 = rec[192 + (4 + i) * CH + c];
    blk[4 + i] = static_cast<uint8_t>(sc | ((sc4 >> 4) << 6));
    blk[8 + i] = static_cast<uint8_t>(mn | ((mn4 >> 4) << 6));
    blk[12 + i] = static_cast<uint8_t>((sc4 & 0x0F) | ((mn4 & 0x0F) << 4));
  }
  uint8_t* qs = blk + (t == Q4_K ? 16 : 48);
  if (t == Q5_K) std::memset(blk + 16, 0, 32);
  for (int s = 0; s < 8; ++s) {
    const int shift = 4 * (s % 2);
    const uint8_t* u = rec + head + s * unit;
    get_nibbles(u, c, v);
    uint8_t* lo = qs + 32 * (s / 2);
    for (int e = 0; e < 16; ++e) {
      const uint8_t a = static_cast<uint8_t>((v[e] & 0x0F) << shift), b = static_cast<uint8_t>((v[e] >> 4) << shift);
      lo[e] = shift ? (lo[e] | a) : a;
      lo[16 + e] = shift ? (lo[16 + e] | b) : b;
    }
    if (t == Q5_K) {
      const uint32_t word = load32(u + 256 + 4 * c);
      for (int q = 0; q < 8; ++q) {
        uint8_t* at = blk + 16 + 4 * q;
        store32(at, load32(at) | (((word >> q) & 0x01010101u) << s));
      }
    }
  }
}

// ---- the bindings --------------------------------------------------------------------------------------------------

inline int64_t checked_blocks(const torch::Tensor& t2d, int64_t type, int64_t bytes, const char* what) {
  TORCH_CHECK(file_bytes(type) > 0, "no V layout for GGML type ", type);
  TORCH_CHECK(t2d.dim() == 2 && t2d.scalar_type() == torch::kUInt8, what, ": a 2-d uint8 tensor");
  TORCH_CHECK(t2d.size(1) % bytes == 0, what, ": ", t2d.size(1), " bytes a row is not whole blocks of ", bytes);
  return t2d.size(1) / bytes;
}

// [out, row_bytes] blocks of GGML type `type` -> [ceil(out / 16), 16 * row_bytes] (quant.py `pack_v`, `pack_vk`).
inline torch::Tensor pack_v(torch::Tensor data, int64_t type, c10::optional<torch::Tensor> into) {
  const int64_t size = file_bytes(type);
  const int64_t n = checked_blocks(data, type, size, "pack_v data");
  data = data.contiguous();
  const int64_t out = data.size(0), groups = (out + CH - 1) / CH, row = data.size(1);
  const int64_t run = k_type(type) ? CH * record_bytes(type) * n : CH * row;
  // `into`: the packed bytes' place (a view of the weights' arena), written directly instead of a new tensor
  auto packed = into.has_value() ? *into : torch::empty({groups, run}, torch::kUInt8);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == groups && packed.size(1) == run,
              "pack_v into: a contiguous uint8 [", groups, ", ", run, "] tensor is needed");
  const std::vector<uint8_t> zeros(static_cast<size_t>(row), 0);
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  verispec_pool::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* rows[CH];
      for (int64_t c = 0; c < CH; ++c) rows[c] = g * CH + c < out ? src + (g * CH + c) * row : zeros.data();
      if (!k_type(type)) {
        pack_v_group(type, rows, n, dst + g * run);
        continue;
      }
      for (int64_t c = 0; c < CH; ++c)  // (each row read in order: a group's rows are one run of the input)
        for (int64_t b = 0; b < n; ++b)
          pack_vk_block(type, rows[c] + b * size, c, dst + g * run + b * CH * record_bytes(type));
    }
  });
  return packed;
}

// `pack_v`'s inverse: [ceil(out / 16), run] -> [out, row_bytes], the file's bytes (quant.py `unpack_v`, `unpack_vk`).
inline torch::Tensor unpack_v(torch::Tensor packed, int64_t type, int64_t out) {
  const int64_t size = file_bytes(type);
  const int64_t per = k_type(type) ? record_bytes(type) : size;  // a channel's bytes of a block in the group's run
  const int64_t n = checked_blocks(packed, type, CH * per, "unpack_v packed");
  packed = packed.contiguous();
  const int64_t groups = packed.size(0), run = packed.size(1), row = n * size;
  TORCH_CHECK(out >= 0 && (out + CH - 1) / CH == groups, "unpack_v: ", out, " channels are not ", groups, " groups");
  auto data = torch::empty({out, row}, torch::kUInt8);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = data.data_ptr<uint8_t>();
  verispec_pool::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t live = std::min<int64_t>(CH, out - g * CH);
      uint8_t* rows[CH];
      for (int64_t c = 0; c < live; ++c) rows[c] = dst + (g * CH + c) * row;
      if (!k_type(type)) {
        unpack_v_group(type, src + g * run, n, live, rows);
        continue;
      }
      for (int64_t c = 0; c < live; ++c)
        for (int64_t b = 0; b < n; ++b)
          unpack_vk_block(type, src + g * run + b * CH * record_bytes(type), c, rows[c] + b * size);
    }
  });
  return data;
}

}  // namespace verispec_pack
