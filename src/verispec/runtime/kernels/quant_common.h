// Shared by quant_kernel.cpp and quant_gemm512.h: the quantized types, their bytes (the file's layout and the
// Q4 repack), and the AVX-512 dequantization of a block (exactly gguf-py's values; see quant_kernel.cpp).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <vector>
#include "quant_k.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define VERISPEC_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VERISPEC_AVX2 1
#endif

namespace {

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, INT8 = 100, Q4_0R = 102, Q4_1R = 103 };  // R: repacked
// (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: quant_k.h's KQType)
// The code paths, numbered as runtime/kernels/paths.py `KernelPath` (one numbering for every kernel; VDPBF16PS = 3 is
// the dense kernel's alone).
enum Path : int64_t { AUTO = -1, SCALAR = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t QK = 32;      // elements per block (Q4_0, Q4_1, Q8_0; INT8 is cut the same way)
constexpr int64_t GROUP = 8;    // output channels per unit of parallel work (a multiple of every tile's NC)
constexpr int64_t PANEL_MIN_ROWS = 16;  // from this many rows on, AVX2 dequantizes a panel once (same sums)

constexpr int64_t file_type(int64_t t) { return t == Q4_0R ? Q4_0 : t == Q4_1R ? Q4_1 : t; }
constexpr bool repacked(int64_t t) { return t == Q4_0R || t == Q4_1R; }
// Bytes of a block of 32 inputs (a K-quant's: its super-block's share, rounded down: only prefetch addresses use it).
constexpr int64_t block_bytes(int64_t t) {
  return file_type(t) == Q4_0 ? 18 : file_type(t) == Q4_1 ? 20 : t == Q8_0 ? 34 : k_quant(t) ? kq_bytes(t) / 8
       : kq_family(t) ? kq_bytes(t) : QK;
}
// Bytes of a row of `in` inputs as the file has it.
constexpr int64_t file_row_bytes(int64_t t, int64_t in) { return k_quant(t) ? in / QK_K * kq_bytes(t) : in / QK * block_bytes(t); }
constexpr int64_t CHANNELS_PER_GROUP = 4;  // repacked types

struct Args {
  const float* x;      // [rows, in]
  const uint8_t* w;    // [out, row_bytes], repacked: [ceil(out / 4), row_bytes] (4 channels' bytes a row)
  const float* scale;  // [out] (INT8) or null
  float* y;            // [rows, out]
  int64_t rows, in, out, row_bytes, blocks;
};

inline uint16_t bits_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

inline float half_at(const uint8_t* p) {  // fp16 -> fp32 is exact
  return static_cast<float>(c10::Half(bits_at(p), c10::Half::from_bits()));
}

// Repacked block b of group g: its 64 nibble bytes, and channel c's fp16 d (m) at d_at(...) (+ 2 * ...).
inline const uint8_t* nibbles_at(const Args& a, int64_t g, int64_t b) { return a.w + g * a.row_bytes + b * 64; }
inline const uint8_t* d_at(const Args& a, int64_t g, int64_t b) { return a.w + g * a.row_bytes + a.blocks * 64 + b * 8; }
inline const uint8_t* m_at(const Args& a, int64_t g, int64_t b) { return d_at(a, g, b) + a.blocks * 8; }

// How far ahead (in tiles of whole groups) the repacked Q4 tiles of 1-10 rows ask for their weights. A tile starts by
// converting its groups' fp16 scales, which sit after the nibbles in each group's run of bytes: a cache line the
// hardware prefetchers did not fetch, so without a prefetch every tile began with a DRAM round trip about as long as
// its own work (a step's linears at one row read 27 GB/s from DRAM on 2 threads; with the scales and nibbles asked for
// 4 tiles ahead, 43 GB/s: docs/runner.md). Hints only: the values and sums are unchanged.
constexpr int64_t PREFETCH_TILES = 4;

// Group g's fp16 scales (d, and m for Q4_1) into L1. An address past the weight's end is harmless (a prefetch never
// faults).
template <int64_t T>
inline void prefetch_scales(const Args& a, int64_t g) {
  const char* s = reinterpret_cast<const char*>(d_at(a, g, 0));
  for (int64_t i = 0; i < a.blocks * 8 * (file_type(T) == Q4_1 ? 2 : 1); i += 64) __builtin_prefetch(s + i, 0, 3);
}

// Repacked Q5_0 / Q5_1 (quant.py `pack_q5`): Q4R's groups of 4 channels with the fifth bits beside the nibbles, the
// file's bytes reordered: [blocks][64] nibbles (byte 4j + c: channel c's byte j), [blocks][4 channels] u32 qh,
// [blocks][4] fp16 d, then (Q5_1) [blocks][4] fp16 m.
enum Q5Type : int64_t { Q5_0R = 106, Q5_1R = 107 };
constexpr bool q5_repacked(int64_t t) { return t == Q5_0R || t == Q5_1R; }
constexpr int64_t q5_file_type(int64_t t) { return t == Q5_0R ? Q5_0 : Q5_1; }
inline const uint8_t* q5r_qh_at(const Args& a, int64_t g, int64_t b) { return a.w + g * a.row_bytes + a.blocks * 64 + b * 16; }
inline const uint8_t* q5r_d_at(const Args& a, int64_t g, int64_t b) { return a.w + g * a.row_bytes + a.blocks * 80 + b * 8; }
inline const uint8_t* q5r_m_at(const Args& a, int64_t g, int64_t b) { return q5r_d_at(a, g, b) + a.blocks * 8; }

// Block b of channel o of a repacked Q5 weight, rebuilt as the file has it into buf[24].
template <int64_t T>
inline const uint8_t* q5r_file_block(const Args& a, int64_t o, int64_t b, uint8_t* buf) {
  const int64_t g = o / CHANNELS_PER_GROUP, c = o % CHANNELS_PER_GROUP, head = T == Q5_1R ? 4 : 2;
  std::memcpy(buf, q5r_d_at(a, g, b) + 2 * c, 2);
  if (T == Q5_1R) std::memcpy(buf + 2, q5r_m_at(a, g, b) + 2 * c, 2);
  std::memcpy(buf + head, q5r_qh_at(a, g, b) + 4 * c, 4);
  const uint8_t* nib = nibbles_at(a, g, b);
  for (int j = 0; j < 16; ++j) buf[head + 4 + j] = nib[4 * j + c];
  return buf;
}

// Block b of channel o as the file has it: a pointer into the weights, or (repacked types) rebuilt into buf.
template <int64_t T>
inline const uint8_t* file_block(const Args& a, int64_t o, int64_t b, uint8_t* buf) {
  if (!repacked(T)) return a.w + o * a.row_bytes + b * block_bytes(T);
  const int64_t g = o / CHANNELS_PER_GROUP, c = o % CHANNELS_PER_GROUP, head = T == Q4_1R ? 4 : 2;
  std::memcpy(buf, d_at(a, g, b) + 2 * c, 2);
  if (T == Q4_1R) std::memcpy(buf + 2, m_at(a, g, b) + 2 * c, 2);
  const uint8_t* nib = nibbles_at(a, g, b);
  for (int j = 0; j < 16; ++j) buf[head + j] = nib[4 * j + c];
  return buf;
}

#if defined(VERISPEC_AVX512)
// Block b's values: lo = elements 0..15, hi = 16..31. A 4-bit block's 16 possible values are made once
// (table[k] = d * k + m, or d * (k - 8)) and looked up by nibble (a lane permute reads an index's low 4 bits only).
// The block's fp16 d (and m) as floats in lanes 0 (and 1): one conversion of the block's first 8 bytes.
inline __m128 dm_at(const uint8_t* blk) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
}

// What a repacked Q4 nibble k stands for before its block's scale: k (Q4_1, then d * k + m) or k - 8 (Q4_0).
template <int64_t T>
inline __m512 q4r_levels() {
  return T == Q4_1R ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                    : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}

template <int64_t T>
inline void dequant512(const Args& a, int64_t o, int64_t b, __m512& lo, __m512& hi) {
  constexpr int64_t F = file_type(T);
  if constexpr (kq_family(T)) {
    kq_dequant512<T>(a.w + o * a.row_bytes + kq_block_offset(T, b), b & 7, lo, hi);
    return;
  } else if constexpr (q5_repacked(T)) {  // (the GEMM's panels: tile512_q5r makes the same values)
    uint8_t buf[24];
    kq_dequant512<q5_file_type(T)>(q5r_file_block<T>(a, o, b, buf), 0, lo, hi);
    return;
  }
  const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if (repacked(T)) {  // channel c's nibbles sit at bit 8c of every lane: shift, and let the permutes mask
    const int64_t g = o / CHANNELS_PER_GROUP, c = o % CHANNELS_PER_GROUP;
    const __m512i v = _mm512_loadu_si512(nibbles_at(a, g, b));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(bits_at(d_at(a, g, b) + 2 * c)));  // F16C: exact, one instruction
    const __m512 table = F == Q4_1 ? _mm512_fmadd_ps(d, k, _mm512_set1_ps(_cvtsh_ss(bits_at(m_at(a, g, b) + 2 * c))))
                                   : _mm512_mul_ps(d, _mm512_sub_ps(k, _mm512_set1_ps(8.0f)));
    lo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * c), table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * c + 4), table);
    return;
  }
  const uint8_t* blk = a.w + o * a.row_bytes + b * block_bytes(T);
  if (F == Q4_0 || F == Q4_1) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == Q4_1 ? 4 : 2))));
    const __m128 dm = dm_at(blk);
    const __m512 d = _mm512_broadcastss_ps(dm);
    const __m512 table =
        F == Q4_1 ? _mm512_fmadd_ps(d, k, _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dm)))
                  : _mm512_mul_ps(d, _mm512_sub_ps(k, _mm512_set1_ps(8.0f)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const uint8_t* q = T == Q8_0 ? blk + 2 : blk;
    const __m512 d = T == Q8_0 ? _mm512_broadcastss_ps(dm_at(blk)) : _mm512_set1_ps(a.scale[o]);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), d);
  }
}

// n fp16 values (a multiple of 4) -> float32, 16 at a time (exact).
inline void halves_to_floats(const uint8_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i))));
  for (; i < n; i += 4)
    _mm_storeu_ps(dst + i, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 * i))));
}

#endif

}  // namespace
