// The K-quants (Q4_K, Q5_K, Q6_K) on integer activations, from their "VK" records: quant_q8.h's activations (int8
// per block of 32, one fp32 scale dx a block, sq = sum q, sh = the sum of its first 16, sx = dx * sq) against the
// weights' own sub-blocks, which are 32 inputs (Q4_K, Q5_K: a 6-bit scale and min each) or 16 (Q6_K: an int8 scale
// each), so every sub-block meets exactly one activation block and its sum is an exact integer.
//
// Per output o and row r, unit by unit u = 0, 1, ... (a super-block's 8 units of 32 in order, nothing else in the sum,
// whatever the tile, rows or thread; k the unsigned quants, xq the activations' int8):
//   Q4_K, Q5_K (w = (d sc) k - dmin mn):  isum = sum k xq,
//       acc = fma((d sc) * dx, isum, acc); acc = fma(-(dmin mn), sx, acc)
//   Q6_K (w = (d sc_h) (k - 32), h the half of 16):  isum_0 = sum_{e<16} k xq - 32 sh, isum_1 = sum_{e>=16} k xq - 32 (sq - sh),
//       acc = fma((d sc_0) * dx, isum_0, acc); acc = fma((d sc_1) * dx, isum_1, acc)
// d sc and dmin mn are exact in fp32 (an fp16 times an integer of <= 8 bits), |isum| < 2^17 (exact in fp32), each
// product with dx and each fma rounds once: the same integers and fp32 operations in the same order on every path
// (AVX-512 VNNI, AVX2 maddubs + madd or vpdpbusd, scalar), so the same bits, row- and width-invariant by construction.
// (llama.cpp's Q8_K activations take one scale per 256 inputs; one per 32, as here, is a finer rounding of the same
// values, and one activation format serves every block type of a file, stacks included: docs/runner.md.)
//
// Weights in the "VK" layouts (repacked at load by quant.py `pack_vk`: the file's values, its scales unpacked to a
// byte each): channels in groups of 16, each group one contiguous run of super-block records, each record
//   Q4_K, Q5_K: [16] fp16 d, [16] fp16 dmin, [8 units][16 channels] u8 sc, [8][16] u8 mn, then per unit
//               [4 chunks i][16 channels c][4 bytes k] nibbles (low: element 4i + k, high: 16 + 4i + k) and (Q5_K)
//               [16] u32 fifth bits in quant_unpack.h v_q5_bit's order
//   Q6_K:       [16] fp16 d, [8 units][2 halves][16 channels] i8 sc, then per unit the nibbles as above (the quants'
//               low 4 bits), [16] u32 high 2 bits of elements 0..15, [16] u32 of elements 16..31 (element 4i + k's
//               at bits 8k + 2i, 8k + 2i + 1: chunk i's are shifted to bits 8k + 4, 8k + 5)
// so a unit is quant_q8.h's Q4 (Q5) V block, its quants unpacked by the same helpers (quant_unpack.h): one 64-byte
// load is a chunk of 16 channels for vpdpbusd.
// Bytes per channel and super-block: Q4_K 148 (the file: 144), Q5_K 180 (176), Q6_K 210 (210).
#pragma once
#include "quant_q8.h"

namespace {

enum QTypeVK : int64_t { Q4_KV = 212, Q5_KV = 213, Q6_KV = 214 };
constexpr bool vk_layout(int64_t t) { return t == Q4_KV || t == Q5_KV || t == Q6_KV; }
constexpr int64_t vk_file_type(int64_t t) { return t == Q4_KV ? Q4_K : t == Q5_KV ? Q5_K : Q6_K; }
constexpr int64_t vk_head_bytes(int64_t t) { return t == Q6_KV ? 32 + 256 : 64 + 256; }  // a record's before unit 0
constexpr int64_t vk_unit_bytes(int64_t t) { return t == Q4_KV ? 256 : t == Q5_KV ? 256 + 64 : 256 + 128; }
// A channel's bytes of a super-block's record.
constexpr int64_t vk_channel_bytes(int64_t t) { return (vk_head_bytes(t) + 8 * vk_unit_bytes(t)) / VCH; }
constexpr int vk_high_bits(int64_t t) { return t == Q4_KV ? 0 : t == Q5_KV ? 1 : 2; }  // quant_unpack.h unpack_quants'

// Group g's super-block sb: its record; unit s of it: its chunks (quant_unpack.h's layout).
inline const uint8_t* vk_record(const Args& a, int64_t t, int64_t g, int64_t sb) {
  return a.w + g * a.row_bytes + sb * VCH * vk_channel_bytes(t);
}
inline const uint8_t* vk_unit_at(const uint8_t* rec, int64_t t, int64_t s) {
  return rec + vk_head_bytes(t) + s * vk_unit_bytes(t);
}

// The K-quants' sub-block scales, unit s of a record, for the lanes' channels c0 .. (exact products, as the file's
// layout gives them): Q4_K, Q5_K: s0 = d sc, s1 = dmin mn (w = s0 k - s1); Q6_K: s0, s1 = d sc of elements 0..15,
// 16..31. d and dmin: vk_d / vk_dmin of the same channels (a tile reads them once per record).
template <class L>
VERISPEC_KQ_INLINE typename L::F vk_d(const uint8_t* rec, int64_t c0) { return L::halves(rec + 2 * c0); }
template <class L>
VERISPEC_KQ_INLINE typename L::F vk_dmin(const uint8_t* rec, int64_t c0) { return L::halves(rec + 32 + 2 * c0); }
template <class L, int64_t T>
VERISPEC_KQ_INLINE void vk_unit_scales(const uint8_t* rec, int64_t s, int64_t c0, typename L::F d, typename L::F dmin,
                                       typename L::F& s0, typename L::F& s1) {
  if constexpr (T == Q6_KV) {
    s0 = L::mul(d, L::bytes(rec + 32 + 2 * VCH * s + c0, true));
    s1 = L::mul(d, L::bytes(rec + 32 + 2 * VCH * s + VCH + c0, true));
  } else {
    s0 = L::mul(d, L::bytes(rec + 64 + VCH * s + c0, false));
    s1 = L::mul(dmin, L::bytes(rec + 192 + VCH * s + c0, false));
  }
}

// Unit s of channel c in a record: its 32 unsigned quants (the reference path and `dequantize`).
template <int64_t T>
inline void vk_quants(const uint8_t* rec, int64_t s, int64_t c, int* k) {
  uint32_t w[8];
  unpack_quants<Lane32, vk_high_bits(T)>(vk_unit_at(rec, T, s) + 4 * c, w);
  for (int e = 0; e < 32; ++e) k[e] = lane_byte(w[e / 4], e % 4);
}

// Unit s of channel c's affine form, quant_k.h's KUnit (the same exact products as the file's layout gives).
template <int64_t T>
inline KUnit vk_unit_form(const uint8_t* rec, int64_t s, int64_t c) {
  float s0, s1;
  vk_unit_scales<Lane32, T>(rec, s, c, vk_d<Lane32>(rec, c), vk_dmin<Lane32>(rec, c), s0, s1);
  return T == Q6_KV ? KUnit{{s0, s1}, 0.0f, 32} : KUnit{{s0, s0}, -s1, 0};
}

// Block b (unit b % 8 of super-block b / 8) of channel o: its 32 weights, kq_dequant_scalar's values.
template <int64_t T>
inline void vk_dequant_block(const Args& a, int64_t o, int64_t b, float* w) {
  const uint8_t* rec = vk_record(a, T, o / VCH, b / 8);
  const int64_t c = o % VCH, s = b % 8;
  const KUnit u = vk_unit_form<T>(rec, s, c);
  int k[32];
  vk_quants<T>(rec, s, c, k);
  for (int e = 0; e < 32; ++e) {
    const float v = u.a[e / 16] * static_cast<float>(k[e] - u.offset);  // exact
    w[e] = T == Q6_KV ? v : v + u.c;                                     // the one rounding
  }
}

// ---- scalar: the reference --------------------------------------------------------------------------------------

template <int64_t T>
void vk_tile_scalar(const Args& a, const QuantX& xq, int64_t g, int64_t r0, int64_t nr) {
  walk_scalar(a, g, r0, nr, [&](int64_t c, int64_t r, int64_t b, float& acc) {
    const uint8_t* rec = vk_record(a, T, g, b / 8);
    const KUnit u = vk_unit_form<T>(rec, b % 8, c);
    int k[32];
    vk_quants<T>(rec, b % 8, c, k);
    const int8_t* x = xq.q.data() + r * a.in + b * QK;
    const int64_t at = r * a.blocks + b;
    int32_t sum[2] = {0, 0};
    for (int e = 0; e < 32; ++e) sum[e / 16] += k[e] * x[e];
    if (T == Q6_KV) {
      acc = std::fma(u.a[0] * xq.dx[at], static_cast<float>(sum[0] - 32 * xq.sh[at]), acc);
      acc = std::fma(u.a[1] * xq.dx[at], static_cast<float>(sum[1] - 32 * (xq.sq[at] - xq.sh[at])), acc);
    } else {
      acc = std::fma(u.a[0] * xq.dx[at], static_cast<float>(sum[0] + sum[1]), acc);
      acc = std::fma(u.c, xq.sx[at], acc);  // u.c = -(dmin mn)
    }
  });
}

// ---- AVX-512 VNNI: 16 channels a register, vpdpbusd -------------------------------------------------------------
#if defined(VERISPEC_VNNI512)
template <int64_t T, int NR>
void vk_tile512_rows(const Args& a, const QuantX& xq, int64_t g, int64_t r0) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < a.blocks / 8; ++sb) {
    const uint8_t* rec = vk_record(a, T, g, sb);
    ask_ahead<NR>(rec, vk_head_bytes(T), a.rows);
    const __m512 d = vk_d<Lanes512>(rec, 0), dmin = vk_dmin<Lanes512>(rec, 0);  // (Q6_K: no dmin, an unused load)
    // The units in a loop, not unrolled: unrolled, the compiler hoisted the 8 units' scales and spilled the rows'
    // sums to the stack (Q6_K 1.05-1.07x, Q4_K the same; recipes/int8_peak.py --beside says what the pipes allow).
#pragma GCC unroll 1
    for (int s = 0; s < 8; ++s) {
      __m512i w[8];  // w[j] multiplies activations 4j .. 4j + 3
      ask_ahead<NR>(vk_unit_at(rec, T, s), vk_unit_bytes(T), a.rows);
      unpack_quants<Lanes512, vk_high_bits(T)>(vk_unit_at(rec, T, s), w);
      __m512 s0, s1;
      vk_unit_scales<Lanes512, T>(rec, s, 0, d, dmin, s0, s1);
      row_passes512<NR, 0, rows_a_pass512(NR)>(a, xq, r0, sb * 8 + s, w,
          [&](int r, int64_t at, __m512i h0, __m512i h1) __attribute__((always_inline)) {
            const __m512 dx = _mm512_set1_ps(xq.dx[at]);
            if constexpr (T == Q6_KV) {
              const __m512i i0 = _mm512_sub_epi32(h0, _mm512_set1_epi32(32 * xq.sh[at]));
              const __m512i i1 = _mm512_sub_epi32(h1, _mm512_set1_epi32(32 * (xq.sq[at] - xq.sh[at])));
              acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s0, dx), _mm512_cvtepi32_ps(i0), acc[r]);
              acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s1, dx), _mm512_cvtepi32_ps(i1), acc[r]);
            } else {
              const __m512i isum = _mm512_add_epi32(h0, h1);
              acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s0, dx), _mm512_cvtepi32_ps(isum), acc[r]);
              acc[r] = _mm512_fnmadd_ps(s1, _mm512_set1_ps(xq.sx[at]), acc[r]);  // -(dmin mn) sx + acc, one rounding
            }
          });
    }
  }
  store_group512(a, acc, g, r0);
}

template <int64_t T>
void vk_tile512(const Args& a, const QuantX& xq, int64_t g, int64_t r0, int64_t nr) {
  using Fn = void (*)(const Args&, const QuantX&, int64_t, int64_t);
  static constexpr Fn by_rows[V512_ROWS + 1] = VERISPEC_BY_ROWS16(vk_tile512_rows, T);
  by_rows[nr](a, xq, g, r0);
}
#endif

// ---- AVX2: 8 channels a register (each chunk's halves), maddubs + madd or 256-bit vpdpbusd ----------------------
#if defined(VERISPEC_AVX2)
template <int64_t T>
void vk_tile256(const Args& a, const QuantX& xq, int64_t g, int64_t r0, int64_t nr) {
  walk256(a, g, r0, nr, [&](int64_t b, int h, int64_t rt, int rows, __m256* acc) __attribute__((always_inline)) {
    const uint8_t* rec = vk_record(a, T, g, b / 8);
    const int64_t s = b % 8;
    __m256i w[8];  // channels 8h .. 8h + 7: bytes 32h .. of each chunk and of the high bits' words
    unpack_quants<Lanes256, vk_high_bits(T)>(vk_unit_at(rec, T, s) + 32 * h, w);
    __m256 s0, s1;
    vk_unit_scales<Lanes256, T>(rec, s, 8 * h, vk_d<Lanes256>(rec, 8 * h), vk_dmin<Lanes256>(rec, 8 * h), s0, s1);
    for (int r = 0; r < rows; ++r) {
      const int64_t row = rt + r, at = row * a.blocks + b;
      const int32_t* x4 = reinterpret_cast<const int32_t*>(xq.q.data() + row * a.in + b * QK);
      __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      // k <= 63 unsigned: a pair's |sum| <= 2 * 63 * 127 (maddubs does not saturate)
      for (int j = 0; j < 8; ++j) isum[j / 4] = dpbusd256(isum[j / 4], w[j], _mm256_set1_epi32(x4[j]));
      const __m256 dx = _mm256_set1_ps(xq.dx[at]);
      if (T == Q6_KV) {
        const __m256i i0 = _mm256_sub_epi32(isum[0], _mm256_set1_epi32(32 * xq.sh[at]));
        const __m256i i1 = _mm256_sub_epi32(isum[1], _mm256_set1_epi32(32 * (xq.sq[at] - xq.sh[at])));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(s0, dx), _mm256_cvtepi32_ps(i0), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(s1, dx), _mm256_cvtepi32_ps(i1), acc[r]);
      } else {
        const __m256i i = _mm256_add_epi32(isum[0], isum[1]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(s0, dx), _mm256_cvtepi32_ps(i), acc[r]);
        acc[r] = _mm256_fnmadd_ps(s1, _mm256_set1_ps(xq.sx[at]), acc[r]);
      }
    }
  });
}
#endif

template <int64_t T>
VTileFn vk_tile_for(int64_t path, int64_t& rows_per_tile) {
  rows_per_tile = 16;
#if defined(VERISPEC_VNNI512)
  if (path == AVX512) {
    rows_per_tile = T == Q6_KV ? 12 : V512_ROWS;  // Q6_K's epilogue holds 2 scales a unit: 12 rows fit the registers
    return vk_tile512<T>;
  }
#endif
#if defined(VERISPEC_AVX2)
  if (path == AVX2 || path == AVX512) return vk_tile256<T>;  // an AVX-512 build without VNNI: the same bits
#endif
  return vk_tile_scalar<T>;
}

// The tile of VK-layout type `qtype` on `path`, and the rows it takes at most (v_linear runs it).
inline VTileFn vk_tile(int64_t qtype, int64_t path, int64_t& per_tile) {
  return qtype == Q4_KV ? vk_tile_for<Q4_KV>(path, per_tile)
       : qtype == Q5_KV ? vk_tile_for<Q5_KV>(path, per_tile)
                        : vk_tile_for<Q6_KV>(path, per_tile);
}

}  // namespace
