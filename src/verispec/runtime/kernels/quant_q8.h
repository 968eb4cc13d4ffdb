// Integer activations for the GGUF block types (the file's own arithmetic, as llama.cpp computes a Q4/Q8 linear):
// the activations are quantized per row in blocks of 32 to int8 with one fp32 scale a block, each (row, output,
// block) takes an exact integer dot product, and the blocks are combined in fp32 in one fixed order.
//
// Activations (per row r, block b of 32 inputs): amax = max |x|, dx = amax / 127, q = round-to-nearest-even(x / dx)
// computed as x * (1 / dx) (q in [-127, 127]; dx = 0 gives q = 0), sq = sum q (an integer) and sx = dx * sq (fp32).
// The scale stays fp32 (ggml rounds it to fp16: a little more error, no speed).
//
// Per output o and row r, block by block b = 0, 1, ... (nothing else in the sum, whatever the tile, rows or thread):
//   Q4_0 (w = dw (k - 8)):  isum = sum k x_q - 8 sq,          acc = fma(dw * dx, isum, acc)
//   Q4_1 (w = dw k + mw):   isum = sum k x_q,                 acc = fma(dw * dx, isum, acc); acc = fma(mw, sx, acc)
//   Q8_0 (w = dw k):        isum = sum (k + 128) x_q - 128 sq, acc = fma(dw * dx, isum, acc)
// isum is exact (|isum| < 2^20, so exact in fp32 too), dw * dx rounds once, each fma rounds once: every path
// (AVX-512 VNNI vpdpbusd, AVX2 maddubs + madd, scalar) computes the same integers and the same fp32 operations in
// the same order, so the same bits, and a row's outputs do not depend on the rows beside it (batch- and
// width-invariant by construction).
//
// Weights in the "V" layouts (repacked at load by quant.py `pack_v`, the file's bytes reordered): channels in
// groups of 16, each group one contiguous run of
//   Q4: [blocks][4 chunks i][16 channels c][4 bytes k] = the file's quant byte 4i + k of channel c's block (low
//       nibble: element 4i + k, high: 16 + 4i + k), then [blocks][16] fp16 d, then (Q4_1) [blocks][16] fp16 m
//   Q5: as Q4, each block's chunks followed by its [16 channels] u32 fifth bits; then d (and Q5_1's m) as Q4's
//   Q8: [blocks][8 chunks i][16 channels c][4 bytes k] = q[4i + k] of channel c, then [blocks][16] fp16 d
// so one 64-byte load is a chunk of 16 channels, each 32-bit lane one channel's 4 consecutive elements: what
// vpdpbusd multiplies by 4 activations broadcast to every lane. quant_unpack.h unpacks them, on every path.
#pragma once
#include "quant_unpack.h"

#include <cmath>

// The 256-bit tile's integer products: vpdpbusd on 8 lanes where the build has it (AVX-VNNI, the VEX form of
// Alder Lake and later, or AVX-512 VNNI + VL, its EVEX form), else maddubs + madd. The same exact sums either way.
#if defined(__AVXVNNI__)
#define VERISPEC_DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VERISPEC_DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif

namespace {

enum QTypeV : int64_t { Q4_0V = 202, Q4_1V = 203, Q5_0V = 206, Q5_1V = 207, Q8_0V = 208 };
constexpr bool v_layout(int64_t t) { return t == Q4_0V || t == Q4_1V || t == Q5_0V || t == Q5_1V || t == Q8_0V; }
constexpr int64_t v_file_type(int64_t t) {
  return t == Q4_0V ? Q4_0 : t == Q4_1V ? Q4_1 : t == Q5_0V ? Q5_0 : t == Q5_1V ? Q5_1 : Q8_0;
}
constexpr bool v_q5(int64_t t) { return t == Q5_0V || t == Q5_1V; }
constexpr bool v_has_m(int64_t t) { return t == Q4_1V || t == Q5_1V; }  // d * q + m types
// A block's quant bytes per channel: Q5's 16 nibble bytes and then its 4 bytes of fifth bits (v_q5_bit's order).
constexpr int64_t v_quant_bytes(int64_t t) { return t == Q8_0V ? 32 : v_q5(t) ? 20 : 16; }

// (Q5 V layouts keep a block's 32 fifth bits, the file's qh, spread in their u32 as quant_unpack.h's v_q5_bit says.)
constexpr int64_t v_block_bytes(int64_t t) { return block_bytes(v_file_type(t)); }  // per channel, as the file

// Group g's block b: the quants of 16 channels, and channel c's fp16 d (m) at vd_at + 2c (vm_at + 2c).
inline const uint8_t* vq_at(const Args& a, int64_t t, int64_t g, int64_t b) {
  return a.w + g * a.row_bytes + b * VCH * v_quant_bytes(t);
}
inline const uint8_t* vd_at(const Args& a, int64_t t, int64_t g, int64_t b) {
  return a.w + g * a.row_bytes + a.blocks * VCH * v_quant_bytes(t) + b * 2 * VCH;
}
inline const uint8_t* vm_at(const Args& a, int64_t t, int64_t g, int64_t b) { return vd_at(a, t, g, b) + a.blocks * 2 * VCH; }

// Block b of channel o as the file has it, rebuilt into buf (the embedding's rows and `dequantize`).
inline const uint8_t* v_file_block(const Args& a, int64_t t, int64_t o, int64_t b, uint8_t* buf) {
  const int64_t g = o / VCH, c = o % VCH, head = v_has_m(t) ? 4 : 2;
  std::memcpy(buf, vd_at(a, t, g, b) + 2 * c, 2);
  if (v_has_m(t)) std::memcpy(buf + 2, vm_at(a, t, g, b) + 2 * c, 2);
  const uint8_t* q = vq_at(a, t, g, b);
  int64_t at = head;
  if (v_q5(t)) {  // the file's qh before its nibbles
    uint32_t spread, qh = 0;
    std::memcpy(&spread, q + HIGH_AT + 4 * c, 4);
    for (int j = 0; j < 32; ++j) qh |= ((spread >> v_q5_bit(j)) & 1u) << j;
    std::memcpy(buf + at, &qh, 4);
    at += 4;
  }
  for (int64_t i = 0; i < (t == Q8_0V ? 8 : 4); ++i)  // chunk i: the file's quant bytes 4i .. 4i + 3
    for (int k = 0; k < 4; ++k) buf[at + 4 * i + k] = q[i * CHUNK + 4 * c + k];
  return buf;
}

// ---- the activations --------------------------------------------------------------------------------------------

struct QuantX {
  std::vector<int8_t> q;   // [rows, in]
  std::vector<float> dx;   // [rows, blocks]
  std::vector<float> sx;   // [rows, blocks]: dx * sq
  std::vector<int32_t> sq; // [rows, blocks]
  std::vector<int32_t> sh; // [rows, blocks]: the sum of the block's first 16 q (Q6_K's scales are per 16 inputs)
};

// One block of 32 activations (the same operations on every path: max, one division, one reciprocal, a product
// and a rounding to nearest even per element).
inline void quantize_block(const float* x, int8_t* q, float& dx, int32_t& sq, int32_t& sh) {
  float amax = 0.0f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  dx = amax / 127.0f;
  const float id = dx != 0.0f ? 1.0f / dx : 0.0f;
  int32_t s = 0;
  for (int j = 0; j < QK; ++j) {
    const int v = static_cast<int>(std::nearbyint(x[j] * id));  // the default rounding: to nearest even
    q[j] = static_cast<int8_t>(v);
    s += v;
    if (j == 15) sh = s;
  }
  sq = s;
}

#if defined(VERISPEC_AVX512)
// quantize_block's operations 16 lanes at a time: the same max, division, reciprocal, products and roundings
// (vcvtps2dq rounds to nearest even, as nearbyint under the default rounding mode), so the same q, dx and sq.
inline void quantize_block512(const float* x, int8_t* q, float& dx, int32_t& sq, int32_t& sh) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  dx = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(dx != 0.0f ? 1.0f / dx : 0.0f);
  const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id)), b = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(b));
  sh = _mm512_reduce_add_epi32(a);
  sq = sh + _mm512_reduce_add_epi32(b);
}
#endif

// The rows' activations quantized (into `out`, reused across calls: no allocation once it is large enough).
inline void quantize_rows(const float* x, int64_t rows, int64_t in, QuantX& out, int64_t path) {
  const int64_t blocks = in / QK;
  if (static_cast<int64_t>(out.q.size()) < rows * in) out.q.resize(rows * in);
  if (static_cast<int64_t>(out.dx.size()) < rows * blocks) {
    out.dx.resize(rows * blocks);
    out.sx.resize(rows * blocks);
    out.sq.resize(rows * blocks);
    out.sh.resize(rows * blocks);
  }
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#if defined(VERISPEC_AVX512)
      if (path == AVX512)
        quantize_block512(x + i * QK, out.q.data() + i * QK, out.dx[i], out.sq[i], out.sh[i]);
      else
#endif
        quantize_block(x + i * QK, out.q.data() + i * QK, out.dx[i], out.sq[i], out.sh[i]);
      out.sx[i] = out.dx[i] * static_cast<float>(out.sq[i]);
    }
  };
  if (rows * blocks < 512) {
    run(0, rows * blocks);  // a few rows: on the calling thread
  } else {
    verispec_pool::parallel_for(0, rows * blocks, 256, run);
  }
}

// What each block's integer sum needs taken away: 8 sq (Q4_0's k - 8), 128 sq (Q8_0's k + 128 on the unsigned
// side of vpdpbusd; the scalar and AVX2 paths reach the same integer their own way), none (Q4_1).
constexpr int32_t v_offset(int64_t t) { return t == Q4_0V ? 8 : t == Q5_0V ? 16 : t == Q8_0V ? 128 : 0; }

// Block b's 8 registers of quants (quant_unpack.h), on lanes L: w[j] multiplies activations 4j .. 4j + 3; Q8_0 signed,
// or as k + 128 where plus128 (AVX-512's vpdpbusd, with v_offset taken away).
template <class L, int64_t T>
VERISPEC_KQ_INLINE void v_unpack(const uint8_t* q, typename L::I* w, bool plus128) {
  if constexpr (T == Q8_0V)
    unpack_q8<L>(q, w, plus128);
  else
    unpack_quants<L, v_q5(T) ? 1 : 0>(q, w);
}

// ---- scalar: the reference --------------------------------------------------------------------------------------

// The scalar tiles' walk (the V layouts' here, the VK records' in quant_vk.h): each channel c of group g (the last
// group's padding skipped) and row r, its sum built block by block by add(c, r, b, acc), then stored.
template <class Add>
inline void walk_scalar(const Args& a, int64_t g, int64_t r0, int64_t nr, Add&& add) {
  for (int64_t c = 0; c < VCH; ++c) {
    const int64_t o = g * VCH + c;
    if (o >= a.out) return;
    for (int64_t r = r0; r < r0 + nr; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < a.blocks; ++b) add(c, r, b, acc);
      a.y[r * a.out + o] = acc;
    }
  }
}

template <int64_t T>
void v_tile_scalar(const Args& a, const QuantX& xq, int64_t g, int64_t r0, int64_t nr) {
  walk_scalar(a, g, r0, nr, [&](int64_t c, int64_t r, int64_t b, float& acc) {
    uint32_t w[8];  // lane_byte(w[j], k): element 4j + k's quant
    v_unpack<Lane32, T>(vq_at(a, T, g, b) + 4 * c, w, false);
    const int8_t* x = xq.q.data() + r * a.in + b * QK;
    int32_t isum = 0;
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < 4; ++k) {
        const int32_t q = lane_byte(w[j], k);
        isum += (T == Q8_0V ? static_cast<int8_t>(q) : q) * x[4 * j + k];
      }
    if (T == Q4_0V || T == Q5_0V) isum -= v_offset(T) * xq.sq[r * a.blocks + b];  // Q8_0: signed, no offset
    const float dw = half_at(vd_at(a, T, g, b) + 2 * c);
    acc = std::fma(dw * xq.dx[r * a.blocks + b], static_cast<float>(isum), acc);
    if (v_has_m(T)) acc = std::fma(half_at(vm_at(a, T, g, b) + 2 * c), xq.sx[r * a.blocks + b], acc);
  });
}

// ---- AVX-512 VNNI: 16 channels a register, vpdpbusd -------------------------------------------------------------
#if defined(VERISPEC_VNNI512)
constexpr int V512_ROWS = 16;  // rows a tile: 16 accumulators + 8 weight registers + temporaries in 32 registers
// FN<T, NR> for NR = 1 .. 16 by the row count (0: none): a tile's rows are a template argument, so its accumulators
// stay in registers and its loops unroll.
#define VERISPEC_BY_ROWS16(FN, T)                                                                                     \
  {                                                                                                                   \
    nullptr, FN<T, 1>, FN<T, 2>, FN<T, 3>, FN<T, 4>, FN<T, 5>, FN<T, 6>, FN<T, 7>, FN<T, 8>, FN<T, 9>, FN<T, 10>,     \
        FN<T, 11>, FN<T, 12>, FN<T, 13>, FN<T, 14>, FN<T, 15>, FN<T, 16>                                              \
  }

// A tile's sums (NR rows of 16 channels) into y: rows r0 .., the channels of group g (the last group's masked to out).
template <int NR> inline void store_group512(const Args& a, const __m512 (&acc)[NR], int64_t g, int64_t r0) {
  const int64_t o0 = g * VCH;
  const __mmask16 keep = a.out - o0 >= VCH ? __mmask16(0xFFFF) : __mmask16((1u << (a.out - o0)) - 1);
  for (int r = 0; r < NR; ++r) _mm512_mask_storeu_ps(a.y + (r0 + r) * a.out + o0, keep, acc[r]);
}

// The integer sums of block (unit) b for RB rows from row0 against its unpacked weights w: h0[r] over w[0..3], h1[r]
// over w[4..7]. vpdpbusd's latency (~5 cycles) is what a chain of 8 pays, row by row; the sums are cut into
// independent chains (by half, and for a lone row by j's parity too) interleaved across the rows, which integer
// addition leaves exactly as they were (the V and VK tiles share this).
template <int RB>
VERISPEC_KQ_INLINE void unit_sums512(const Args& a, const QuantX& xq, int64_t row0, int64_t b, const __m512i (&w)[8],
                                     __m512i (&h0)[RB], __m512i (&h1)[RB]) {
  constexpr int C = RB == 1 ? 2 : 1;  // chains a half of a row's sum
  const int32_t* x4[RB];
  __m512i i0[RB][C], i1[RB][C];
  for (int r = 0; r < RB; ++r) {
    x4[r] = reinterpret_cast<const int32_t*>(xq.q.data() + (row0 + r) * a.in + b * QK);  // 8 quads
    for (int c = 0; c < C; ++c) i0[r][c] = i1[r][c] = _mm512_setzero_si512();
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < RB; ++r) {
      i0[r][j % C] = _mm512_dpbusd_epi32(i0[r][j % C], w[j], _mm512_set1_epi32(x4[r][j]));
      i1[r][j % C] = _mm512_dpbusd_epi32(i1[r][j % C], w[4 + j], _mm512_set1_epi32(x4[r][4 + j]));
    }
  for (int r = 0; r < RB; ++r) {
    h0[r] = i0[r][0], h1[r] = i1[r][0];
    if constexpr (C == 2) h0[r] = _mm512_add_epi32(h0[r], i0[r][1]), h1[r] = _mm512_add_epi32(h1[r], i1[r][1]);
  }
}

// Rows in passes of this many: their chains in flight, registers to spare beside NR accumulators and 8 weights.
constexpr int rows_a_pass512(int nr) { return nr < 4 ? nr : nr <= 8 ? 4 : 2; }

// Every row of an NR-row tile's block (unit) b, RB rows a pass from row R0: their sums (unit_sums512), then
// `epilogue(r, at, h0, h1)` for tile row r (at: its index into the activations' per-block fields), which adds them
// into the row's accumulator as its block type does (the V and VK tiles).
template <int NR, int R0, int RB, class Epilogue>
VERISPEC_KQ_INLINE void row_passes512(const Args& a, const QuantX& xq, int64_t r0, int64_t b, const __m512i (&w)[8],
                                      Epilogue&& epilogue) {
  __m512i h0[RB], h1[RB];
  unit_sums512<RB>(a, xq, r0 + R0, b, w, h0, h1);
  for (int r = 0; r < RB; ++r) epilogue(R0 + r, (r0 + R0 + r) * a.blocks + b, h0[r], h1[r]);
  if constexpr (R0 + RB < NR) {
    constexpr int NEXT = NR - R0 - RB < RB ? NR - R0 - RB : RB;
    row_passes512<NR, R0 + RB, NEXT>(a, xq, r0, b, w, epilogue);
  }
}

// NR rows (a template argument: the accumulators stay in registers and the loops unroll).
template <int64_t T, int NR>
void v_tile512_rows(const Args& a, const QuantX& xq, int64_t g, int64_t r0) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* q = vq_at(a, T, g, b);
    ask_ahead<NR>(q, VCH * v_quant_bytes(T), a.rows);
    __m512i w[8];  // w[j]: the unsigned bytes multiplying activations 4j..4j+3 (Q4: 4 chunks x low, high nibbles)
    v_unpack<Lanes512, T>(q, w, true);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vd_at(a, T, g, b))));
    __m512 mw = _mm512_setzero_ps();
    if (v_has_m(T)) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vm_at(a, T, g, b))));
    row_passes512<NR, 0, rows_a_pass512(NR)>(a, xq, r0, b, w,
        [&](int r, int64_t at, __m512i h0, __m512i h1) __attribute__((always_inline)) {
          __m512i isum = _mm512_add_epi32(h0, h1);
          if (v_offset(T)) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(v_offset(T) * xq.sq[at]));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xq.dx[at])), _mm512_cvtepi32_ps(isum), acc[r]);
          if (v_has_m(T)) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xq.sx[at]), acc[r]);
        });
  }
  store_group512(a, acc, g, r0);
}
template <int64_t T>
void v_tile512(const Args& a, const QuantX& xq, int64_t g, int64_t r0, int64_t nr) {
  using Fn = void (*)(const Args&, const QuantX&, int64_t, int64_t);
  static constexpr Fn by_rows[V512_ROWS + 1] = VERISPEC_BY_ROWS16(v_tile512_rows, T);
  by_rows[nr](a, xq, g, r0);
}
#endif

// ---- AVX2: 8 channels a register (each V chunk's halves), maddubs + madd or 256-bit vpdpbusd --------------------
#if defined(VERISPEC_AVX2)
constexpr int V256_ROWS = 4;

// acc[r] -> y's row rt + r, channels o0 .. o0 + 7 (fewer at the weight's end).
inline void v_store256(const Args& a, const __m256* acc, int rows, int64_t rt, int64_t o0) {
  const int64_t n = std::min<int64_t>(8, a.out - o0);
  for (int r = 0; r < rows; ++r) {
    if (n == 8) {
      _mm256_storeu_ps(a.y + (rt + r) * a.out + o0, acc[r]);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[r]);
      std::memcpy(a.y + (rt + r) * a.out + o0, tmp, n * sizeof(float));
    }
  }
}

// 4 unsigned bytes u times 4 signed bytes s in each 32-bit lane, summed exactly into acc: vpdpbusd where the build
// has it, else maddubs + madd (exact while a pair's |sum| < 2^15: the callers' operands keep it so).
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
#if defined(VERISPEC_DPBUSD256)
  return VERISPEC_DPBUSD256(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// The AVX2 tiles' walk (the V layouts' here, the VK records' in quant_vk.h): each half h of group g's 16 channels
// (8 lanes: bytes 32h .. 32h + 31 of every 64-byte chunk), its rows V256_ROWS at a time, block by block:
// add(b, h, rt, rows, acc) adds block b's terms to the sums of rows rt .. rt + rows - 1, which are then stored.
template <class Add>
VERISPEC_KQ_INLINE void walk256(const Args& a, int64_t g, int64_t r0, int64_t nr, Add&& add) {
  for (int h = 0; h < 2; ++h) {
    const int64_t o0 = g * VCH + 8 * h;
    if (o0 >= a.out) return;
    for (int64_t rt = r0; rt < r0 + nr; rt += V256_ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(V256_ROWS, r0 + nr - rt));
      __m256 acc[V256_ROWS];
      for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < a.blocks; ++b) add(b, h, rt, rows, acc);
      v_store256(a, acc, rows, rt, o0);
    }
  }
}

template <int64_t T>
void v_tile256(const Args& a, const QuantX& xq, int64_t g, int64_t r0, int64_t nr) {
  walk256(a, g, r0, nr, [&](int64_t b, int h, int64_t rt, int rows, __m256* acc) __attribute__((always_inline)) {
    __m256i w[8];  // (Q8_0: signed, multiplied by sign below)
    v_unpack<Lanes256, T>(vq_at(a, T, g, b) + 32 * h, w, false);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vd_at(a, T, g, b) + 16 * h)));
    __m256 mw = _mm256_setzero_ps();
    if (v_has_m(T)) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vm_at(a, T, g, b) + 16 * h)));
    for (int r = 0; r < rows; ++r) {
      const int64_t row = rt + r, at = row * a.blocks + b;
      const int32_t* x4 = reinterpret_cast<const int32_t*>(xq.q.data() + row * a.in + b * QK);
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i x = _mm256_set1_epi32(x4[j]);
        // Q8: |k| times x with k's sign (pairs |sum| <= 2 * 128 * 127: no saturation); Q4: k <= 15 unsigned
        const __m256i u = T == Q8_0V ? _mm256_sign_epi8(w[j], w[j]) : w[j];
        const __m256i v = T == Q8_0V ? _mm256_sign_epi8(x, w[j]) : x;
        isum = dpbusd256(isum, u, v);
      }
      if (T == Q4_0V || T == Q5_0V) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(v_offset(T) * xq.sq[at]));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xq.dx[at])), _mm256_cvtepi32_ps(isum), acc[r]);
      if (v_has_m(T)) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xq.sx[at]), acc[r]);
    }
  });
}
#endif

using VTileFn = void (*)(const Args&, const QuantX&, int64_t, int64_t, int64_t);

template <int64_t T>
VTileFn v_tile_for(int64_t path, int64_t& rows_per_tile) {
#if defined(VERISPEC_VNNI512)
  if (path == AVX512) {
    rows_per_tile = V512_ROWS;
    return v_tile512<T>;
  }
#endif
#if defined(VERISPEC_AVX2)
  if (path == AVX2 || path == AVX512) {  // an AVX-512 build without VNNI runs the AVX2 code: the same bits
    rows_per_tile = 16;
    return v_tile256<T>;
  }
#endif
  rows_per_tile = 16;
  return v_tile_scalar<T>;
}

// The tile of V-layout type `qtype` on `path`, and the rows it takes at most.
inline VTileFn v_tile(int64_t qtype, int64_t path, int64_t& per_tile) {
  return qtype == Q4_0V ? v_tile_for<Q4_0V>(path, per_tile)
       : qtype == Q4_1V ? v_tile_for<Q4_1V>(path, per_tile)
       : qtype == Q5_0V ? v_tile_for<Q5_0V>(path, per_tile)
       : qtype == Q5_1V ? v_tile_for<Q5_1V>(path, per_tile)
                        : v_tile_for<Q8_0V>(path, per_tile);
}

// Rows a pass over the groups takes at most (0: all): a prefill chunk's activations of that many rows stay in L2 while
// every group's weights stream past (all 512 rows of a chunk filled L2 and the weights evicted them: a 512-token
// prefill of the coder target ran ~1.3x slower); the weights are read once a block, a small cost beside a block's
// products. Rows are independent, so the same bits at any block. quant.set_row_block for measurements.
inline int64_t v_row_block = 64;

// y [rows, out] = the integer-activation linear of x [rows, in], `tile` run on each group of 16 channels (the V
// layouts' here, the K-quants' in quant_vk.h) and every tile of at most per_tile rows, v_row_block rows a pass.
inline void v_linear(const Args& a, VTileFn tile, int64_t per_tile, int64_t path) {
  // The calling thread's buffers, reused. The tiles on other threads read them through this reference (a
  // thread_local named inside the lambda would be each worker's own, empty, instance).
  static thread_local QuantX buffers;
  QuantX& xq = buffers;
  quantize_rows(a.x, a.rows, a.in, xq, path);
  const int64_t groups = (a.out + VCH - 1) / VCH;
  const int64_t block = v_row_block > 0 ? v_row_block : a.rows;
  for (int64_t rb = 0; rb < a.rows; rb += block) {
    const int64_t re = std::min(a.rows, rb + block);
    verispec_pool::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        for (int64_t r0 = rb; r0 < re; r0 += per_tile) tile(a, xq, g, r0, std::min(per_tile, re - r0));
    });
  }
}

}  // namespace
