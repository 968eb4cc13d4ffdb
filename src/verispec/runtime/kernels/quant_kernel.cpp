// Weight-only quantized GEMV/GEMM for verispec (runtime/kernels/quant.py builds it with torch.utils.cpp_extension).
//
// y[r, o] = sum_i w[o, i] * x[r, i], with w[o, i] dequantized exactly as gguf-py does it (in float32, one rounding
// per operation; this file is built with -ffp-contract=off, and the only fused multiply-adds in a dequantization are
// Q4_1's d * q + m, where d * q is exact: an fp16 times a 4-bit integer has at most 15 significant bits):
//   Q4_0: d * (q - 8)    Q4_1: d * q + m    Q8_0: d * q    INT8 (per output channel): scale[o] * q
// so the model is the same as the fp32 conversion's; only the summation order differs.
//
// Three paths, one chosen per call (`path`, quant_common.h's Path = paths.py `KernelPath`: AUTO the best this build and
// CPU run, SCALAR, AVX2 (+FMA, F16C), AVX512):
// each has its own fixed summation order, so outputs are bit-stable within a path, not across paths.
// The work is tiled: a tile is NC output channels x NR rows (NR <= ROWS); each block of 32 weights of a channel is
// dequantized once into registers and multiplied into all NR rows. Row invariance: every (row, channel) output has
// its own accumulator(s), fed block by block in the same order with the same lanes whatever the tile, the number of
// rows in the call or the thread; threads split output channels only.
// Many rows (verify passes, batched decode steps, prefill) dequantize a panel of channels once into a float32 buffer
// and run only multiply-adds over it: the same values, the same sums in the same order as the tiles. AVX-512 from
// GEMM_MIN_ROWS rows on (quant_gemm512.h: 4-channel x 6-row register tiles, 16 sums reduced at once in
// _mm512_reduce_add_ps's order), AVX2 from PANEL_MIN_ROWS (panel256).
//
// Q4_0 and Q4_1 run from a load-time repack (quant.py `pack_q4`; qtypes Q4_0R, Q4_1R), the file's bytes reordered,
// none added but the pad of the last group: channels in groups of 4, each group one contiguous run of
//   [blocks][64] nibbles: byte 4 * j + c = the file's byte j of channel c's block (low nibble element j, high j + 16)
//   [blocks][4] fp16 d, then (Q4_1) [blocks][4] fp16 m
// so one 64-byte load holds a block of 4 channels, and the 32-bit lane j of it shifted right by 8c (by 8c + 4) has
// element j (j + 16) of channel c in its low 4 bits, all a lane permute reads of an index: no unpacking. The AVX-512
// tiles convert the scales of a run of blocks 16 at a time (vcvtph2ps, exact) into a float buffer and broadcast
// them from there, so a block costs one multiply-add for its table, two shifts, two permutes and the row FMAs.
#include "quant_common.h"
#include "quant_gemm512.h"
#include "quant_vk.h"
#include "quant_pack.h"

#include <map>
#include <string>

namespace {

// ---- scalar: the reference path (any CPU), and the dequantization of embedding rows ------------------------------

// The 32 weights of block b of output channel o into w[32] (exactly gguf-py's values).
template <int64_t T>
inline void dequant_block(const Args& a, int64_t o, int64_t b, float* w) {
  constexpr int64_t F = file_type(T);
  if constexpr (kq_family(T)) {
    kq_dequant_scalar<T>(a.w + o * a.row_bytes + kq_block_offset(T, b), b & 7, w);
    return;
  } else if constexpr (q5_repacked(T)) {
    uint8_t buf[24];
    kq_dequant_scalar<q5_file_type(T)>(q5r_file_block<T>(a, o, b, buf), 0, w);
    return;
  }
  uint8_t buf[20];
  const uint8_t* blk = file_block<T>(a, o, b, buf);
  const float scale = a.scale ? a.scale[o] : 0.0f;
  if (F == Q4_0) {
    const float d = half_at(blk);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(static_cast<int>(blk[2 + j] & 0x0F) - 8);
      w[j + 16] = d * static_cast<float>(static_cast<int>(blk[2 + j] >> 4) - 8);
    }
  } else if (F == Q4_1) {
    const float d = half_at(blk), m = half_at(blk + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(blk[4 + j] & 0x0F) + m;
      w[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
    }
  } else if (F == Q8_0) {
    const float d = half_at(blk);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
  } else {
    for (int j = 0; j < 32; ++j) w[j] = scale * static_cast<float>(static_cast<int8_t>(blk[j]));
  }
}

// One channel x NR rows; a row's 16 partial sums take elements j and j + 16 of each block, then add up in order.
template <int64_t T, int NC, int NR>
void tile_scalar(const Args& a, int64_t o0, int64_t r0) {
  for (int c = 0; c < NC; ++c) {
    const int64_t o = o0 + c;
    if (o >= a.out) return;  // a repacked group's padding
    float acc[NR][16] = {};
    float w[QK];
    for (int64_t b = 0; b < a.blocks; ++b) {
      dequant_block<T>(a, o, b, w);
      for (int r = 0; r < NR; ++r) {
        const float* xr = a.x + (r0 + r) * a.in + b * QK;
        for (int j = 0; j < 16; ++j) acc[r][j] += w[j] * xr[j] + w[j + 16] * xr[j + 16];
      }
    }
    for (int r = 0; r < NR; ++r) {
      float s = 0.0f;
      for (int j = 0; j < 16; ++j) s += acc[r][j];
      a.y[(r0 + r) * a.out + o] = s;
    }
  }
}

// Block b of channel o of a V layout (quant_q8.h): its file bytes rebuilt, then dequantized as the file's type.
template <int64_t T>
inline void v_dequant_block(const Args& a, int64_t o, int64_t b, float* w) {
  uint8_t buf[40];
  const uint8_t* blk = v_file_block(a, T, o, b, buf);
  const Args one{nullptr, blk, nullptr, nullptr, 0, QK, 1, v_block_bytes(T), 1};
  dequant_block<v_file_type(T)>(one, 0, 0, w);
}

// ---- AVX-512: a block is two 16-lane registers -----------------------------------------------------------------
#if defined(VERISPEC_AVX512)
template <int64_t T, int NC, int NR>
void tile512(const Args& a, int64_t o0, int64_t r0) {
  __m512 acc[NC][NR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm512_setzero_ps();
  const float* x0 = a.x + r0 * a.in;
  for (int64_t b = 0; b < a.blocks; ++b) {
    for (int c = 0; c < NC; ++c) {
      // the channel 32 (or NC) ahead: closer (8 channels, 4.9 KB of Q8_0 at 576 inputs) left the LM head at one row
      // waiting on DRAM (a step's linears at one row 2.58 -> 2.36 ms on 2 threads, 3.72 -> 3.24 on one)
      _mm_prefetch(reinterpret_cast<const char*>(a.w + (o0 + c + std::max(NC, 32)) * a.row_bytes + b * block_bytes(T)),
                   _MM_HINT_T0);
      __m512 lo, hi;
      dequant512<T>(a, o0 + c, b, lo, hi);
      for (int r = 0; r < NR; ++r) {
        const float* xr = x0 + r * a.in + b * QK;
        acc[c][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[c][r]);
        acc[c][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) a.y[(r0 + r) * a.out + o0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

// Repacked Q4: NC channels (whole groups of 4) x NR rows. The same values and the same sums in the same order as tile512
// (lanes: elements j and j + 16 of a block; lo, then hi, block by block), so a row's outputs do not change with it.
template <int64_t T, int NC, int NR>
void tile512_q4r(const Args& a, int64_t o0, int64_t r0) {
  static_assert(NC % CHANNELS_PER_GROUP == 0, "whole groups");
  constexpr int NG = NC / CHANNELS_PER_GROUP;
  constexpr int64_t RUN = 32;  // blocks whose scales are converted at once
  __m512 acc[NC][NR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm512_setzero_ps();
  const __m512 k = q4r_levels<T>();
  const int64_t g0 = o0 / CHANNELS_PER_GROUP;
  const float* x0 = a.x + r0 * a.in;
  alignas(64) float d[NG][RUN * CHANNELS_PER_GROUP], m[NG][T == Q4_1R ? RUN * CHANNELS_PER_GROUP : 1];
  for (int g = 0; g < NG; ++g) prefetch_scales<T>(a, g0 + g + PREFETCH_TILES * NG);
  for (int64_t b0 = 0; b0 < a.blocks; b0 += RUN) {
    const int64_t run = std::min(RUN, a.blocks - b0);
    for (int g = 0; g < NG; ++g) {
      halves_to_floats(d_at(a, g0 + g, b0), run * CHANNELS_PER_GROUP, d[g]);
      if (T == Q4_1R) halves_to_floats(m_at(a, g0 + g, b0), run * CHANNELS_PER_GROUP, m[g]);
    }
    for (int64_t b = 0; b < run; ++b) {
      const float* x = x0 + (b0 + b) * QK;
      for (int g = 0; g < NG; ++g) {
        const uint8_t* nib = nibbles_at(a, g0 + g, b0 + b);
        _mm_prefetch(reinterpret_cast<const char*>(nib + PREFETCH_TILES * NG * a.row_bytes), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(nib);
        for (int c = 0; c < CHANNELS_PER_GROUP; ++c) {
          const int64_t i = b * CHANNELS_PER_GROUP + c;
          // Q4_1: d * k + m (d * k exact: one rounding, as gguf-py's d * q + m); Q4_0: d * (q - 8), exact
          const __m512 table = T == Q4_1R ? _mm512_fmadd_ps(_mm512_set1_ps(d[g][i]), k, _mm512_set1_ps(m[g][i]))
                                          : _mm512_mul_ps(_mm512_set1_ps(d[g][i]), k);
          const __m512 lo = _mm512_permutexvar_ps(c == 0 ? v : _mm512_srli_epi32(v, 8 * c), table);
          const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * c + 4), table);
          __m512* out = acc[g * CHANNELS_PER_GROUP + c];
          for (int r = 0; r < NR; ++r) {
            out[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * a.in), out[r]);
            out[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * a.in + 16), out[r]);
          }
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    if (o0 + c < a.out)  // the last group's padding is never stored
      for (int r = 0; r < NR; ++r) a.y[(r0 + r) * a.out + o0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

// Repacked Q5_0 / Q5_1: NC channels (whole groups of 4) x NR rows, kq_dequant512's values (a block's 32 possible
// values made once per channel, picked by vpermt2ps from the nibble, with the fifth bit or-ed in under a mask of the
// channel's qh) and tile512's sums in tile512's order (lo, then hi, block by block; _mm512_reduce_add_ps). The
// scales of a run of blocks are converted 16 at a time, as tile512_q4r does.
template <int64_t T, int NC, int NR>
void tile512_q5r(const Args& a, int64_t o0, int64_t r0) {
  static_assert(NC % CHANNELS_PER_GROUP == 0, "whole groups");
  constexpr int NG = NC / CHANNELS_PER_GROUP;
  constexpr int64_t RUN = 32;
  __m512 acc[NC][NR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm512_setzero_ps();
  const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 k16 = _mm512_add_ps(k, _mm512_set1_ps(16.0f));
  const __m512 kneg = _mm512_sub_ps(k, _mm512_set1_ps(16.0f));
  const __m512i low4 = _mm512_set1_epi32(0x0F), bit4 = _mm512_set1_epi32(16);
  const int64_t g0 = o0 / CHANNELS_PER_GROUP;
  const float* x0 = a.x + r0 * a.in;
  alignas(64) float d[NG][RUN * CHANNELS_PER_GROUP], m[NG][T == Q5_1R ? RUN * CHANNELS_PER_GROUP : 1];
  for (int64_t b0 = 0; b0 < a.blocks; b0 += RUN) {
    const int64_t run = std::min(RUN, a.blocks - b0);
    for (int g = 0; g < NG; ++g) {
      halves_to_floats(q5r_d_at(a, g0 + g, b0), run * CHANNELS_PER_GROUP, d[g]);
      if (T == Q5_1R) halves_to_floats(q5r_m_at(a, g0 + g, b0), run * CHANNELS_PER_GROUP, m[g]);
    }
    for (int64_t b = 0; b < run; ++b) {
      const float* x = x0 + (b0 + b) * QK;
      for (int g = 0; g < NG; ++g) {
        const uint8_t* nib = nibbles_at(a, g0 + g, b0 + b);
        _mm_prefetch(reinterpret_cast<const char*>(nib + PREFETCH_TILES * NG * a.row_bytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q5r_qh_at(a, g0 + g, b0 + b) + PREFETCH_TILES * NG * a.row_bytes),
                     _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(nib);
        uint32_t qh[CHANNELS_PER_GROUP];
        std::memcpy(qh, q5r_qh_at(a, g0 + g, b0 + b), sizeof(qh));
        for (int c = 0; c < CHANNELS_PER_GROUP; ++c) {
          const int64_t i = b * CHANNELS_PER_GROUP + c;
          const __m512 dv = _mm512_set1_ps(d[g][i]);
          // Q5_1: d * k + m (d * k exact: one rounding, as gguf-py); Q5_0: d * (q - 16), exact
          const __m512 t0 = T == Q5_1R ? _mm512_fmadd_ps(dv, k, _mm512_set1_ps(m[g][i])) : _mm512_mul_ps(dv, kneg);
          const __m512 t1 = T == Q5_1R ? _mm512_fmadd_ps(dv, k16, _mm512_set1_ps(m[g][i])) : _mm512_mul_ps(dv, k);
          const __m512i i0 = _mm512_and_si512(c == 0 ? v : _mm512_srli_epi32(v, 8 * c), low4);
          const __m512i i1 = _mm512_and_si512(_mm512_srli_epi32(v, 8 * c + 4), low4);
          const __m512 lo = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(i0, static_cast<__mmask16>(qh[c]), i0, bit4), t1);
          const __m512 hi = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(i1, static_cast<__mmask16>(qh[c] >> 16), i1, bit4), t1);
          __m512* out = acc[g * CHANNELS_PER_GROUP + c];
          for (int r = 0; r < NR; ++r) {
            out[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * a.in), out[r]);
            out[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * a.in + 16), out[r]);
          }
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    if (o0 + c < a.out)  // the last group's padding is never stored
      for (int r = 0; r < NR; ++r) a.y[(r0 + r) * a.out + o0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

// K-quants: NC channels x NR rows, a super-block of a channel at a time: its 8 units' scales decoded once
// (kq_units), then each unit's values (kq_dequant512's) multiplied in. Per accumulator the order is tile512's (unit by
// unit, lo then hi; _mm512_reduce_add_ps), so the same bits as tile512 and the GEMM's panels.
template <int64_t T, int NC, int NR>
void tile512_k(const Args& a, int64_t o0, int64_t r0) {
  __m512 acc[NC][NR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm512_setzero_ps();
  const float* x0 = a.x + r0 * a.in;
  KUnit u[8];
  for (int64_t sb = 0; sb < a.blocks / 8; ++sb) {
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = a.w + (o0 + c) * a.row_bytes + sb * kq_bytes(T);
      const uint8_t* ahead = a.w + (o0 + c + std::max(NC, 16)) * a.row_bytes + sb * kq_bytes(T);
      for (int64_t i = 0; i < kq_bytes(T); i += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T0);
      kq_units<T>(blk, u);
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {  // unrolled: each unit's shifts and offsets are constants
        __m512 lo, hi;
        kq_dequant512<T>(blk, s, u[s], lo, hi);
        for (int r = 0; r < NR; ++r) {
          const float* xr = x0 + r * a.in + (sb * 8 + s) * QK;
          acc[c][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[c][r]);
          acc[c][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) a.y[(r0 + r) * a.out + o0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

// Repacked Q4, one group (4 channels) x NR <= 5 rows: tile512_q4r's values and sums (per accumulator: lo, then hi,
// block by block), with a block's 8 vectors of values made first, so each row's input is loaded once per half and
// kept in a register for 4 multiply-adds (4 x 5 accumulators + 8 values + 1 input + the nibbles: 30 registers).
template <int64_t T, int NR>
void tile512_q4r_rows(const Args& a, int64_t o0, int64_t r0) {
  static_assert(NR <= 5, "registers");
  constexpr int64_t RUN = 32;  // blocks whose scales are converted at once
  __m512 acc[NR][CHANNELS_PER_GROUP];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CHANNELS_PER_GROUP; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512 k = q4r_levels<T>();
  const int64_t g = o0 / CHANNELS_PER_GROUP;
  const float* x0 = a.x + r0 * a.in;
  alignas(64) float d[RUN * CHANNELS_PER_GROUP], m[T == Q4_1R ? RUN * CHANNELS_PER_GROUP : 1];
  prefetch_scales<T>(a, g + PREFETCH_TILES);
  for (int64_t b0 = 0; b0 < a.blocks; b0 += RUN) {
    const int64_t run = std::min(RUN, a.blocks - b0);
    halves_to_floats(d_at(a, g, b0), run * CHANNELS_PER_GROUP, d);
    if (T == Q4_1R) halves_to_floats(m_at(a, g, b0), run * CHANNELS_PER_GROUP, m);
    for (int64_t b = 0; b < run; ++b) {
      const uint8_t* nib = nibbles_at(a, g, b0 + b);
      _mm_prefetch(reinterpret_cast<const char*>(nib + PREFETCH_TILES * a.row_bytes), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(nib);
      __m512 w[2][CHANNELS_PER_GROUP];  // [lo, hi][channel]
      for (int c = 0; c < CHANNELS_PER_GROUP; ++c) {
        const int64_t i = b * CHANNELS_PER_GROUP + c;
        const __m512 table = T == Q4_1R ? _mm512_fmadd_ps(_mm512_set1_ps(d[i]), k, _mm512_set1_ps(m[i]))
                                        : _mm512_mul_ps(_mm512_set1_ps(d[i]), k);
        w[0][c] = _mm512_permutexvar_ps(c == 0 ? v : _mm512_srli_epi32(v, 8 * c), table);
        w[1][c] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * c + 4), table);
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < NR; ++r) {
          __m512 xv = _mm512_loadu_ps(x0 + r * a.in + (b0 + b) * QK + 16 * h);
          __asm__("" : "+v"(xv));  // one load per row and half, kept in a register (not refetched per channel)
          for (int c = 0; c < CHANNELS_PER_GROUP; ++c) acc[r][c] = _mm512_fmadd_ps(w[h][c], xv, acc[r][c]);
        }
    }
  }
  store_tile512<NR>(a, acc, o0, r0, std::min<int64_t>(CHANNELS_PER_GROUP, a.out - o0));
}

#endif

// ---- AVX2 + FMA + F16C: a block is four 8-lane registers --------------------------------------------------------
#if defined(VERISPEC_AVX2)
inline __m256 cvt8(__m128i bytes8, bool is_signed) {  // the low 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

// Channel c's 16 nibble bytes of a repacked block (bytes c, c + 4, ... of the 64): the file's bytes of its block.
inline __m128i q4r_bytes(const uint8_t* nib, int64_t c) {
  const __m128i pick = _mm_add_epi8(_mm_setr_epi8(0, 4, 8, 12, -128, -128, -128, -128, -128, -128, -128, -128, -128,
                                                  -128, -128, -128), _mm_set1_epi8(static_cast<char>(c)));
  __m128i part[4];
  for (int i = 0; i < 4; ++i)
    part[i] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + 16 * i)), pick);
  return _mm_unpacklo_epi64(_mm_unpacklo_epi32(part[0], part[1]), _mm_unpacklo_epi32(part[2], part[3]));
}

// Block b's values, elements 8i..8i+7 in v[i].
template <int64_t T>
inline void dequant256(const Args& a, int64_t o, int64_t b, __m256* v) {
  constexpr int64_t F = file_type(T);
  if constexpr (kq_family(T)) {
    kq_dequant256<T>(a.w + o * a.row_bytes + kq_block_offset(T, b), b & 7, v);
    return;
  } else if constexpr (q5_repacked(T)) {
    uint8_t buf[24];
    kq_dequant256<q5_file_type(T)>(q5r_file_block<T>(a, o, b, buf), 0, v);
    return;
  }
  const uint8_t* blk = a.w + o * a.row_bytes + b * block_bytes(T);
  if (F == Q4_0 || F == Q4_1) {
    const int64_t g = o / CHANNELS_PER_GROUP, c = o % CHANNELS_PER_GROUP;
    const __m128i bytes = repacked(T) ? q4r_bytes(nibbles_at(a, g, b), c)
                                      : _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == Q4_1 ? 4 : 2)));
    const uint8_t* d_bits = repacked(T) ? d_at(a, g, b) + 2 * c : blk;
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(bits_at(d_bits))));
    __m256 q[4] = {cvt8(lo, false), cvt8(_mm_unpackhi_epi64(lo, lo), false), cvt8(hi, false),
                   cvt8(_mm_unpackhi_epi64(hi, hi), false)};
    if (F == Q4_1) {
      const uint8_t* m_bits = repacked(T) ? m_at(a, g, b) + 2 * c : blk + 2;
      const __m256 m = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(bits_at(m_bits))));
      for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(d, q[i], m);  // d * q exact: one rounding, as gguf-py
    } else {
      const __m256 eight = _mm256_set1_ps(8.0f);
      for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(d, _mm256_sub_ps(q[i], eight));
    }
  } else {
    const uint8_t* q = T == Q8_0 ? blk + 2 : blk;
    const __m256 d = T == Q8_0 ? _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(bits_at(blk)))) : _mm256_set1_ps(a.scale[o]);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_mul_ps(cvt8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)), true), d);
    }
  }
}

template <int64_t T, int NC, int NR>
void tile256(const Args& a, int64_t o0, int64_t r0) {
  __m256 acc[NC][NR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm256_setzero_ps();
  const float* x0 = a.x + r0 * a.in;
  for (int64_t b = 0; b < a.blocks; ++b) {
    for (int c = 0; c < NC; ++c) {
      const int64_t next = o0 + c + NC;
      _mm_prefetch(reinterpret_cast<const char*>(repacked(T) ? nibbles_at(a, next / CHANNELS_PER_GROUP, b)
                                                             : a.w + next * a.row_bytes + b * block_bytes(T)),
                   _MM_HINT_T0);
      __m256 v[4];
      dequant256<T>(a, o0 + c, b, v);
      for (int r = 0; r < NR; ++r) {
        const float* xr = x0 + r * a.in + b * QK;
        for (int i = 0; i < 4; ++i) acc[c][r] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xr + 8 * i), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR && o0 + c < a.out; ++r) {  // 8 lanes -> 1, in a fixed order (padding never stored)
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[c][r]), _mm256_extractf128_ps(acc[c][r], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      a.y[(r0 + r) * a.out + o0 + c] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}

// Many rows: tile256's sums in tile256's order, from a panel dequantized once into wbuf [NC, in] (panel512's twin).
template <int NC, int NR>
void panel256(const Args& a, const float* wbuf, int64_t o0, int64_t r0) {
  __m256 acc[NC][NR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm256_setzero_ps();
  const float* x0 = a.x + r0 * a.in;
  for (int64_t b = 0; b < a.blocks; ++b)
    for (int i = 0; i < 4; ++i) {
      __m256 xr[NR];
      for (int r = 0; r < NR; ++r) xr[r] = _mm256_loadu_ps(x0 + r * a.in + b * QK + 8 * i);
      for (int c = 0; c < NC; ++c) {
        const __m256 v = _mm256_loadu_ps(wbuf + c * a.in + b * QK + 8 * i);
        for (int r = 0; r < NR; ++r) acc[c][r] = _mm256_fmadd_ps(v, xr[r], acc[c][r]);
      }
    }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[c][r]), _mm256_extractf128_ps(acc[c][r], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      a.y[(r0 + r) * a.out + o0 + c] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}

template <int64_t T>
void panel_group256(const Args& a, float* wbuf, int64_t o_begin, int64_t o_end) {
  constexpr int NC = 4, ROWS = 2;
  for (int64_t o = o_begin; o < o_end; ++o)
    for (int64_t b = 0; b < a.blocks; ++b) {
      __m256 v[4];
      dequant256<T>(a, o, b, v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(wbuf + (o - o_begin) * a.in + b * QK + 8 * i, v[i]);
    }
  for (int64_t r0 = 0; r0 < a.rows; r0 += ROWS) {
    const bool two = r0 + 1 < a.rows;
    int64_t o = o_begin;
    for (; o + NC <= o_end; o += NC) (two ? panel256<NC, 2> : panel256<NC, 1>)(a, wbuf + (o - o_begin) * a.in, o, r0);
    for (; o < o_end; ++o) (two ? panel256<1, 2> : panel256<1, 1>)(a, wbuf + (o - o_begin) * a.in, o, r0);
  }
}
#endif

// ---- panels (many rows): which group function per (path, type) ---------------------------------------------------
using GroupFn = void (*)(const Args&, float*, int64_t, int64_t);

template <int64_t T>
GroupFn panel_for_type(int64_t path) {
#if defined(VERISPEC_AVX2)
  if (path == AVX2) return panel_group256<T>;
#endif
  return nullptr;
}

GroupFn panel_group_for(int64_t qtype, int64_t path) {  // null: this path has no panel (scalar)
  switch (qtype) {
    case Q4_0: return panel_for_type<Q4_0>(path);
    case Q4_1: return panel_for_type<Q4_1>(path);
    case Q4_0R: return panel_for_type<Q4_0R>(path);
    case Q4_1R: return panel_for_type<Q4_1R>(path);
    case Q8_0: return panel_for_type<Q8_0>(path);
    case Q5_0: return panel_for_type<Q5_0>(path);
    case Q5_1: return panel_for_type<Q5_1>(path);
    case Q4_K: return panel_for_type<Q4_K>(path);
    case Q5_K: return panel_for_type<Q5_K>(path);
    case Q6_K: return panel_for_type<Q6_K>(path);
    case Q5_0R: return panel_for_type<Q5_0R>(path);
    case Q5_1R: return panel_for_type<Q5_1R>(path);
    default: return panel_for_type<INT8>(path);
  }
}

// ---- tiles: which NC for NR rows, per path; a table of instantiations per (path, type) ------------------------------
using TileFn = void (*)(const Args&, int64_t, int64_t);
constexpr int MAX_ROWS = 8;

// Enough independent accumulators to hide the FMA latency, few enough to stay in registers.
constexpr int nc512(int nr) { return nr <= 2 ? 8 : nr <= 4 ? 4 : 2; }  // 32 zmm registers
constexpr int nc256(int nr) { return nr <= 2 ? 4 : 2; }                // 16 ymm registers
constexpr int nc512_q4r(int nr) { return nr <= 2 ? 8 : 4; }            // whole groups of 4 channels

struct Tiles {
  int max_rows;
  int nc[MAX_ROWS + 1];
  TileFn main[MAX_ROWS + 1];  // NC channels x NR rows
  TileFn one[MAX_ROWS + 1];   // `unit` channels x NR rows (the channels past the last whole tile)
  int unit = 1;               // 4: tiles take whole repacked groups (the last one's padding is computed, not stored)
  bool even = false;          // rows split into tiles as evenly as max_rows allows (8 rows, 5 a tile: 4 + 4), not
                              // max_rows first (5 + 3): measured better where tiles hold few rows (tile512_q4r_rows)
};

#define VERISPEC_TILES(FN, NCF, T)                                                                                    \
  Tiles {                                                                                                             \
    8, {0, NCF(1), NCF(2), NCF(3), NCF(4), NCF(5), NCF(6), NCF(7), NCF(8)},                                          \
        {nullptr, FN<T, NCF(1), 1>, FN<T, NCF(2), 2>, FN<T, NCF(3), 3>, FN<T, NCF(4), 4>, FN<T, NCF(5), 5>,           \
         FN<T, NCF(6), 6>, FN<T, NCF(7), 7>, FN<T, NCF(8), 8>},                                                       \
        {nullptr, FN<T, 1, 1>, FN<T, 1, 2>, FN<T, 1, 3>, FN<T, 1, 4>, FN<T, 1, 5>, FN<T, 1, 6>, FN<T, 1, 7>,          \
         FN<T, 1, 8>},                                                                                                \
  }
constexpr int nc1(int) { return 1; }
#define VERISPEC_TILES4(FN, NCF, T)                                                                                   \
  Tiles {                                                                                                             \
    4, {0, NCF(1), NCF(2), NCF(3), NCF(4)}, {nullptr, FN<T, NCF(1), 1>, FN<T, NCF(2), 2>, FN<T, NCF(3), 3>,           \
                                             FN<T, NCF(4), 4>},                                                       \
        {nullptr, FN<T, 1, 1>, FN<T, 1, 2>, FN<T, 1, 3>, FN<T, 1, 4>},                                                \
  }

// Repacked Q4 on AVX-512: up to 5 rows a tile (from 3 rows: one group x NR rows, tile512_q4r_rows).
#define VERISPEC_TILES5_Q4R(T)                                                                                        \
  Tiles {                                                                                                             \
    5, {0, nc512_q4r(1), nc512_q4r(2), 4, 4, 4},                                                                      \
        {nullptr, tile512_q4r<T, nc512_q4r(1), 1>, tile512_q4r<T, nc512_q4r(2), 2>, tile512_q4r_rows<T, 3>,            \
         tile512_q4r_rows<T, 4>, tile512_q4r_rows<T, 5>},                                                             \
        {nullptr, tile512_q4r<T, 4, 1>, tile512_q4r<T, 4, 2>, tile512_q4r_rows<T, 3>, tile512_q4r_rows<T, 4>,         \
         tile512_q4r_rows<T, 5>},                                                                                     \
        CHANNELS_PER_GROUP, true,                                                                                     \
  }

// Repacked Q5 on AVX-512: up to 4 rows a tile, whole groups of 4 channels (8 at 1-2 rows).
constexpr int nc512_q5r(int nr) { return nr <= 2 ? 8 : 4; }
#define VERISPEC_TILES4_Q5R(T)                                                                                        \
  Tiles {                                                                                                             \
    4, {0, nc512_q5r(1), nc512_q5r(2), nc512_q5r(3), nc512_q5r(4)},                                                   \
        {nullptr, tile512_q5r<T, nc512_q5r(1), 1>, tile512_q5r<T, nc512_q5r(2), 2>, tile512_q5r<T, nc512_q5r(3), 3>,  \
         tile512_q5r<T, nc512_q5r(4), 4>},                                                                            \
        {nullptr, tile512_q5r<T, 4, 1>, tile512_q5r<T, 4, 2>, tile512_q5r<T, 4, 3>, tile512_q5r<T, 4, 4>},            \
        CHANNELS_PER_GROUP, true,                                                                                     \
  }

template <int64_t T>
const Tiles& tiles_for(int64_t path) {
  static const Tiles scalar = VERISPEC_TILES(tile_scalar, nc1, T);
#if defined(VERISPEC_AVX512)
  if constexpr (q5_repacked(T)) {
    static const Tiles avx512 = VERISPEC_TILES4_Q5R(T);
    if (path == AVX512) return avx512;
  } else if constexpr (k_quant(T)) {
    static const Tiles avx512 = VERISPEC_TILES(tile512_k, nc512, T);
    if (path == AVX512) return avx512;
  } else if constexpr (repacked(T)) {
    static const Tiles avx512 = VERISPEC_TILES5_Q4R(T);
    if (path == AVX512) return avx512;
  } else {
    static const Tiles avx512 = VERISPEC_TILES(tile512, nc512, T);
    if (path == AVX512) return avx512;
  }
#endif
#if defined(VERISPEC_AVX2)
  static const Tiles avx2 = VERISPEC_TILES4(tile256, nc256, T);
  if (path == AVX2) return avx2;
#endif
  return scalar;
}

const Tiles& tiles(int64_t qtype, int64_t path) {
  switch (qtype) {
    case Q4_0: return tiles_for<Q4_0>(path);
    case Q4_1: return tiles_for<Q4_1>(path);
    case Q4_0R: return tiles_for<Q4_0R>(path);
    case Q4_1R: return tiles_for<Q4_1R>(path);
    case Q8_0: return tiles_for<Q8_0>(path);
    case Q5_0: return tiles_for<Q5_0>(path);
    case Q5_1: return tiles_for<Q5_1>(path);
    case Q4_K: return tiles_for<Q4_K>(path);
    case Q5_K: return tiles_for<Q5_K>(path);
    case Q6_K: return tiles_for<Q6_K>(path);
    case Q5_0R: return tiles_for<Q5_0R>(path);
    case Q5_1R: return tiles_for<Q5_1R>(path);
    default: return tiles_for<INT8>(path);
  }
}

bool cpu_has(int64_t path) {
#if defined(__GNUC__)
  if (path == AVX512) return __builtin_cpu_supports("avx512f");
  if (path == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return path == SCALAR;
}

bool compiled(int64_t path) {
#if defined(VERISPEC_AVX512)
  if (path == AVX512) return true;
#endif
#if defined(VERISPEC_AVX2)
  if (path == AVX2) return true;
#endif
  return path == SCALAR;
}

}  // namespace

// The path `path` asks for (AUTO: the best one compiled in and supported by this CPU). Refuses one it cannot run.
int64_t resolve_path(int64_t path) {
  if (path == AUTO) {
    for (int64_t p : {AVX512, AVX2})
      if (compiled(p) && cpu_has(p)) return p;
    return SCALAR;
  }
  TORCH_CHECK(path >= SCALAR && path <= AVX512, "path must be ", AUTO, " (auto), ", SCALAR, " (scalar), ", AVX2,
              " (avx2) or ", AVX512, " (avx512), not ", path);
  TORCH_CHECK(compiled(path) && cpu_has(path), "this kernel path is not available on this build or CPU: ", path);
  return path;
}

// The rows data has for `out` channels of `in` inputs, and the bytes of each (repacked: 4 channels a row).
void check_data(const torch::Tensor& data, const torch::Tensor& scales, int64_t qtype, int64_t in, int64_t out) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous() && data.dim() == 2, "data must be contiguous uint8 2-d");
  TORCH_CHECK(in % QK == 0, "in must be a multiple of 32");
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == INT8 || repacked(qtype) || v_layout(qtype) ||
              kq_family(qtype) || q5_repacked(qtype) || vk_layout(qtype), "unknown qtype");
  TORCH_CHECK(!(k_quant(qtype) || vk_layout(qtype)) || in % QK_K == 0,
              "a K-quant weight's input size must be a multiple of 256");
  const int64_t per_row = repacked(qtype) || q5_repacked(qtype) ? CHANNELS_PER_GROUP
                        : v_layout(qtype) || vk_layout(qtype)   ? VCH : 1;
  const int64_t bytes = v_layout(qtype) ? v_block_bytes(qtype) : q5_repacked(qtype) ? kq_bytes(q5_file_type(qtype))
                                                                                     : block_bytes(qtype);
  TORCH_CHECK(data.size(0) == (out + per_row - 1) / per_row, "data has ", data.size(0), " rows for ", out, " channels");
  TORCH_CHECK(data.size(1) == (kq_family(qtype)    ? file_row_bytes(qtype, in)
                               : vk_layout(qtype) ? VCH * (in / QK_K) * vk_channel_bytes(qtype)
                                                  : per_row * (in / QK) * bytes),
              "data's row size does not match the type and in");
  TORCH_CHECK(qtype != INT8 || (scales.numel() == out && scales.dtype() == torch::kFloat32 && scales.is_contiguous()),
              "INT8 needs scales [out]");
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, torch::Tensor scales, int64_t qtype, int64_t in,
                           int64_t out, int64_t path);

// A stack of weights of different block types along the output dimension (a fused q/k/v or gate/up whose parts
// the file stores in different types: quant.py `stack`), one uint8 [1, bytes] tensor: int64 [parts], then per part
// (kernel id, out, data rows, data row bytes, byte offset of its data), each part's data at its 64-byte-aligned
// offset. Each part runs as a weight of its own (its own bits: a part's outputs are those of the part alone).
constexpr int64_t STACK = 300;
torch::Tensor stack_linear(const torch::Tensor& x, const torch::Tensor& data, int64_t in, int64_t out, int64_t path) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous() && data.dim() == 2 && data.size(0) == 1 &&
              data.size(1) >= 8, "a stack is one contiguous uint8 row");
  const auto* head = reinterpret_cast<const int64_t*>(data.data_ptr<uint8_t>());
  const int64_t parts = head[0];
  TORCH_CHECK(parts >= 1 && data.size(1) >= 8 * (1 + 5 * parts), "a stack's header is cut short");
  auto y = torch::empty({x.size(0), out}, x.options());
  int64_t o0 = 0;
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t* p = head + 1 + 5 * i;  // kernel id, out, rows, row bytes, offset
    TORCH_CHECK(p[4] >= 0 && p[4] + p[2] * p[3] <= data.size(1) && o0 + p[1] <= out, "a stack's part lies outside it");
    const torch::Tensor part = data.narrow(1, p[4], p[2] * p[3]).view({p[2], p[3]});
    y.narrow(1, o0, p[1]).copy_(quant_linear(x, part, torch::empty({0}), p[0], in, p[1], path));
    o0 += p[1];
  }
  TORCH_CHECK(o0 == out, "a stack's parts have ", o0, " channels, not ", out);
  return y;
}

// x [rows, in] float32, data [out, row_bytes] uint8 (repacked: [ceil(out / 4), 4 * row_bytes]; STACK: stack_linear's),
// scales [out] float32 (INT8 only, else empty) -> [rows, out]
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, torch::Tensor scales, int64_t qtype, int64_t in,
                           int64_t out, int64_t path) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == in, "x must be float32 [rows, in]");
  if (qtype == STACK) return stack_linear(x.contiguous(), data, in, out, path);
  check_data(data, scales, qtype, in, out);
  x = x.contiguous();
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, out}, x.options());
  const Args a{x.data_ptr<float>(), data.data_ptr<uint8_t>(), qtype == INT8 ? scales.data_ptr<float>() : nullptr,
               y.data_ptr<float>(), rows, in, out, data.size(1), in / QK};
  const int64_t chosen = resolve_path(path);
  if (v_layout(qtype) || vk_layout(qtype)) {  // integer activations (quant_q8.h, quant_vk.h): one bits on every path
    int64_t per_tile = 16;
    const VTileFn tile = v_layout(qtype) ? v_tile(qtype, chosen, per_tile) : vk_tile(qtype, chosen, per_tile);
    v_linear(a, tile, per_tile, chosen);
    return y;
  }
  const Tiles& t = tiles(qtype, chosen);
  const int64_t groups = (out + GROUP - 1) / GROUP;
#if defined(VERISPEC_AVX512)
  if (chosen == AVX512 && rows >= GEMM_MIN_ROWS) {
    gemm512_linear(a, qtype, GROUP);
    return y;
  }
#endif
  const GroupFn group = rows >= PANEL_MIN_ROWS ? panel_group_for(qtype, chosen) : nullptr;
  if (group != nullptr) {
    // Channels per panel: the panel (and a tile of rows beside it) stays in L1 for the embedded model's widths.
    const int64_t panel = in * 4 * GROUP <= 20 * 1024 ? GROUP : GROUP / 2;
    verispec_pool::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> wbuf;  // each thread's own, kept across chunks and calls
      if (wbuf.size() < static_cast<size_t>(GROUP * in)) wbuf.resize(GROUP * in);
      for (int64_t o = begin * GROUP; o < std::min(out, end * GROUP); o += panel)
        group(a, wbuf.data(), o, std::min({out, o + panel, end * GROUP}));
    });
    return y;
  }
  const int64_t padded = (out + t.unit - 1) / t.unit * t.unit;  // tiles of whole groups run over the padding
  const int64_t row_tiles = (rows + t.max_rows - 1) / t.max_rows;
  verispec_pool::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o_end = std::min(padded, (g + 1) * GROUP);
      // the group's weights stay in L1 across the tiles of rows
      for (int64_t i = 0, r0 = 0; i < row_tiles; ++i) {
        const int64_t left = rows - r0, even = left / (row_tiles - i) + (left % (row_tiles - i) != 0);
        const int nr = static_cast<int>(t.even ? even : std::min<int64_t>(t.max_rows, left));
        int64_t o = g * GROUP;
        for (; o + t.nc[nr] <= o_end; o += t.nc[nr]) t.main[nr](a, o, r0);
        for (; o < o_end; o += t.unit) t.one[nr](a, o, r0);
        r0 += nr;
      }
    }
  });
  return y;
}

// The dequantized weights of channels `ids` (empty: all `out`) -> [n, in] float32 (the embedding's rows, tests).
torch::Tensor dequantize(torch::Tensor data, torch::Tensor scales, int64_t qtype, int64_t in, int64_t out,
                         torch::Tensor ids) {
  check_data(data, scales, qtype, in, out);
  ids = ids.numel() ? ids.to(torch::kInt64).contiguous() : torch::arange(out, torch::kInt64);
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < out, "id ", id[i], " out of range");
  auto w = torch::empty({n, in}, torch::kFloat32);
  const Args a{nullptr, data.data_ptr<uint8_t>(), qtype == INT8 ? scales.data_ptr<float>() : nullptr, nullptr, 0, in,
               out, data.size(1), in / QK};
  float* wp = w.data_ptr<float>();
  auto run = [&](auto block) {
    verispec_pool::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t b = 0; b < a.blocks; ++b) block(a, id[i], b, wp + i * in + b * QK);
    });
  };
  switch (qtype) {
    case Q4_0: run(dequant_block<Q4_0>); break;
    case Q4_1: run(dequant_block<Q4_1>); break;
    case Q4_0R: run(dequant_block<Q4_0R>); break;
    case Q4_1R: run(dequant_block<Q4_1R>); break;
    case Q8_0: run(dequant_block<Q8_0>); break;
    case Q5_0: run(dequant_block<Q5_0>); break;
    case Q5_1: run(dequant_block<Q5_1>); break;
    case Q4_K: run(dequant_block<Q4_K>); break;
    case Q5_K: run(dequant_block<Q5_K>); break;
    case Q6_K: run(dequant_block<Q6_K>); break;
    case Q5_0R: run(dequant_block<Q5_0R>); break;
    case Q5_1R: run(dequant_block<Q5_1R>); break;
    case Q4_0V: run(v_dequant_block<Q4_0V>); break;
    case Q4_1V: run(v_dequant_block<Q4_1V>); break;
    case Q8_0V: run(v_dequant_block<Q8_0V>); break;
    case Q5_0V: run(v_dequant_block<Q5_0V>); break;
    case Q5_1V: run(v_dequant_block<Q5_1V>); break;
    case Q4_KV: run(vk_dequant_block<Q4_KV>); break;
    case Q5_KV: run(vk_dequant_block<Q5_KV>); break;
    case Q6_KV: run(vk_dequant_block<Q6_KV>); break;
    default: run(dequant_block<INT8>); break;
  }
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_pool", &verispec_pool::use_pool, "run parallel regions on the work pool whose table (pool_api.h) is at this address");
  m.def("quant_linear", &quant_linear, "x @ dequant(W)^T, weight-only quantized", py::arg("x"), py::arg("data"),
        py::arg("scales"), py::arg("qtype"), py::arg("in_features"), py::arg("out_features"), py::arg("path") = 0);
  m.def("dequantize", &dequantize, "dequantized rows", py::arg("data"), py::arg("scales"), py::arg("qtype"),
        py::arg("in_features"), py::arg("out_features"), py::arg("ids"));
  m.def("pack_v", &verispec_pack::pack_v, "[out, row_bytes] GGUF blocks -> their V / VK layout (quant_pack.h)",
        py::arg("data"), py::arg("ggml_type"), py::arg("into") = py::none());
  m.def("unpack_v", &verispec_pack::unpack_v, "a V / VK layout -> the file's [out, row_bytes] blocks (quant_pack.h)",
        py::arg("packed"), py::arg("ggml_type"), py::arg("out_features"));
  m.def("set_prefetch", [](int64_t from_rows, int64_t upto_rows, int64_t distance, bool to_l2) {
    TORCH_CHECK(from_rows >= 1 && upto_rows >= 1 && distance >= 0, "from_rows >= 1, upto_rows >= 1, distance >= 0");
    tile_prefetch = TilePrefetch{from_rows, upto_rows, distance, to_l2};
  }, "how the V / VK tiles ask for their weights ahead (quant_unpack.h TilePrefetch)", py::arg("from_rows"),
        py::arg("upto_rows"), py::arg("distance"), py::arg("to_l2"));
  m.def("get_prefetch", [] {
    return py::make_tuple(tile_prefetch.from_rows, tile_prefetch.upto_rows, tile_prefetch.distance, tile_prefetch.to_l2);
  }, "the V / VK tiles' prefetch setting (from_rows, upto_rows, distance, to_l2)");
  m.def("set_row_block", [](int64_t rows) {
    TORCH_CHECK(rows >= 0, "rows >= 0 (0: every row in one pass)");
    const int64_t old = v_row_block;
    v_row_block = rows;
    return old;
  }, "rows a pass of the V / VK linears over the groups takes at most (quant_q8.h v_row_block) -> the old value",
        py::arg("rows"));
  m.def("resolve_path", &resolve_path, "the kernel path a call with this path runs (AUTO: the best here)");
  m.def("path_numbers", [] {  // (a test holds them equal to paths.py's)
    return std::map<std::string, int64_t>{{"auto", AUTO}, {"scalar", SCALAR}, {"avx2", AVX2}, {"avx512", AVX512}};
  }, "the numbers of the paths, by name");
  // For layer_loop.h, which calls quant_linear from C++ (one process, one libtorch: Tensors pass as they are).
  m.def("quant_linear_address", [] { return reinterpret_cast<int64_t>(&quant_linear); }, "&quant_linear");
}
