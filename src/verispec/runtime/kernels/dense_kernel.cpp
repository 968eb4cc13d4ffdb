// verispec's dense linear: y[M, N] = x[M, K] @ W^T (+ bias), fp32 or bf16, on weights packed once (runtime/kernels/dense.py).
//
// Packed layout (dense.py's `pack`): the output columns in blocks of 16, each block's weights contiguous, so one
// block streams from memory as one sequential run; the last block holds N % 16 columns when N is not a multiple.
//   fp32: block j (columns 16j..) at element 16 j K:  [K][width]
//   bf16: K rounded up to even Ke (a zero column), block j at 16 j Ke:  [Ke / 2][width][2]  (vdpbf16ps's pairs)
// The packed tensor is [N, K] or [N, Ke] elements, so N and Ke are its shape.
//
// Row invariance by construction: every output element (r, n) has one accumulator, started at 0 and updated once
// per k (fp32: a fused multiply-add of w[n, k] x[r, k]; bf16: per pair of k, the odd product first, then the even
// one, as vdpbf16ps does: the AVX-512 path runs them as two FMAs, see there), in increasing k, whatever the number of rows M, the row's
// place in a register tile, the tile shape, K passes (sums wait in fp32 between them: exact), and the thread count
// (threads split output blocks only). The bias
// is added in fp32 after the sum; bf16 output is rounded once (to nearest even). A row's result is therefore
// the same bits in a 1-row call as in any M-row call. Paths: fp32 gives the same bits on every path (the same
// FMA chain); bf16 paths agree except where denormals occur (AVX-512 flushes them as vdpbf16ps does).
//
// Paths (argument `path`; dense.py picks the best built one or VERISPEC_DENSE_PATH forces another):
//   3 AVX-512 bf16 on vdpbf16ps itself (bf16 only; fp32 takes path 2): the same bits as path 2 (which computes
//     vdpbf16ps's arithmetic), twice its multiply-adds per instruction where the CPU issues vdpbf16ps at the FMA
//     rate (AMD Zen 4 class); `paths` puts it first only where `vdpbf16ps_speedup` measured it faster
//   2 AVX-512: FMA for both dtypes (bf16 with vdpbf16ps's rules), bf16 where built with AVX512_BF16 (else the
//     AVX2 bf16 code: it keeps denormals)
//   1 AVX2 + FMA: both dtypes (bf16 -> fp32 by a 16-bit shift, exact)
//   0 scalar: std::fma, the reference order in plain C++
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"
#include <c10/util/BFloat16.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BW = 16;  // columns per packed block
constexpr int64_t X_CHUNK_BYTES = 1 << 20;  // rows of x kept in L2 while a thread's blocks pass over them
using bf16 = uint16_t;

inline float bf16_to_f32(bf16 h) {  // exact
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 f32_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<bf16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// What one call computes: rows [M, K] (row stride ldx), the packed weight, bias (fp32, or null), out [M, N].
template <typename T>
struct Problem {
  const T* x;
  int64_t ldx;
  const T* w;
  const float* bias;
  T* y;
  int64_t M, N, K, Ke;  // Ke: K, or K rounded up to even for bf16
  int64_t block_stride() const { return BW * Ke; }
};

// ---------------------------------------------------------------------------------------------------- scalar
// Any block (full or the tail), any rows: the reference order.
void scalar_block(const Problem<float>& p, int64_t r0, int64_t rows, int64_t j) {
  const int64_t c0 = j * BW, width = std::min(BW, p.N - c0);
  const float* w = p.w + j * p.block_stride();
  for (int64_t r = r0; r < r0 + rows; ++r) {
    const float* x = p.x + r * p.ldx;
    for (int64_t c = 0; c < width; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc = std::fma(w[k * width + c], x[k], acc);
      p.y[r * p.N + c0 + c] = p.bias ? acc + p.bias[c0 + c] : acc;
    }
  }
}

void scalar_block(const Problem<c10::BFloat16>& p, int64_t r0, int64_t rows, int64_t j) {
  const int64_t c0 = j * BW, width = std::min(BW, p.N - c0);
  const bf16* w = reinterpret_cast<const bf16*>(p.w) + j * p.block_stride();
  for (int64_t r = r0; r < r0 + rows; ++r) {
    const bf16* x = reinterpret_cast<const bf16*>(p.x + r * p.ldx);
    for (int64_t c = 0; c < width; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; k += 2) {
        const bf16* wk = w + k * width + 2 * c;  // this pair's two weights of column c
        const float x_odd = k + 1 < p.K ? bf16_to_f32(x[k + 1]) : 0.f;
        acc = std::fma(bf16_to_f32(wk[1]), x_odd, acc);
        acc = std::fma(bf16_to_f32(wk[0]), bf16_to_f32(x[k]), acc);
      }
      const float v = p.bias ? acc + p.bias[c0 + c] : acc;
      reinterpret_cast<bf16*>(p.y)[r * p.N + c0 + c] = f32_to_bf16(v);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// ------------------------------------------------------------------------------------------------------ AVX2
// A tile of R rows x 1 full block (16 columns = two ymm accumulators a row).
template <int R>
void avx2_tile(const Problem<float>& p, int64_t r0, int64_t j) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* w = p.w + j * p.block_stride();
  const float* x = p.x + r0 * p.ldx;
  for (int64_t k = 0; k < p.K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * BW), w1 = _mm256_loadu_ps(w + k * BW + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * p.ldx + k);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (r0 + r) * p.N + j * BW;
    for (int h = 0; h < 2; ++h) {
      __m256 v = acc[r][h];
      if (p.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(p.bias + j * BW + 8 * h));
      _mm256_storeu_ps(y + 8 * h, v);
    }
  }
}

inline __m256 even_half(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_half(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void store_bf16x8(bf16* y, __m256 v) {  // round to nearest even, NaN to the quiet NaN (as f32_to_bf16)
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
}

template <int R>
void avx2_tile(const Problem<c10::BFloat16>& p, int64_t r0, int64_t j) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const bf16* w = reinterpret_cast<const bf16*>(p.w) + j * p.block_stride();
  const bf16* x = reinterpret_cast<const bf16*>(p.x) + r0 * p.ldx;
  const int64_t pairs = p.K / 2;
  auto step = [&](int64_t kp, const uint32_t* xpair) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kp * 2 * BW));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kp * 2 * BW + BW));
    const __m256 o0 = odd_half(v0), e0 = even_half(v0), o1 = odd_half(v1), e1 = even_half(v1);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(static_cast<int>(xpair[r]));
      const __m256 xo = odd_half(xv), xe = even_half(xv);
      acc[r][0] = _mm256_fmadd_ps(e0, xe, _mm256_fmadd_ps(o0, xo, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(e1, xe, _mm256_fmadd_ps(o1, xo, acc[r][1]));
    }
  };
  uint32_t xpair[R];
  for (int64_t kp = 0; kp < pairs; ++kp) {
    for (int r = 0; r < R; ++r) std::memcpy(&xpair[r], x + r * p.ldx + 2 * kp, 4);
    step(kp, xpair);
  }
  if (p.K % 2) {  // the last k alone: its pair partner is 0 (and the packed weight's padding is 0)
    for (int r = 0; r < R; ++r) xpair[r] = x[r * p.ldx + p.K - 1];
    step(pairs, xpair);
  }
  for (int r = 0; r < R; ++r) {
    bf16* y = reinterpret_cast<bf16*>(p.y) + (r0 + r) * p.N + j * BW;
    for (int h = 0; h < 2; ++h) {
      __m256 v = acc[r][h];
      if (p.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(p.bias + j * BW + 8 * h));
      store_bf16x8(y + 8 * h, v);
    }
  }
}

template <typename T>
void avx2_rows(const Problem<T>& p, int64_t r0, int64_t rows, int64_t j) {
  constexpr int R = 4;
  int64_t r = r0;
  for (; r + R <= r0 + rows; r += R) avx2_tile<R>(p, r, j);
  switch (r0 + rows - r) {
    case 3: avx2_tile<3>(p, r, j); break;
    case 2: avx2_tile<2>(p, r, j); break;
    case 1: avx2_tile<1>(p, r, j); break;
    default: break;
  }
}
#endif

#if defined(__AVX512F__)
// --------------------------------------------------------------------------------------------------- AVX-512
// Both dtypes run fp32 FMAs on fp32 rows: bf16 rows are widened once per chunk (exact), bf16 weights per load (the
// pair's odd value masked, the even one shifted up: exact), and each pair is two FMAs, the odd product first, then
// the even one: vdpbf16ps's own order and rounding (a product of two bf16 values is exact in fp32), at twice its
// speed on CPUs where vdpbf16ps issues at a quarter of the FMA rate. vdpbf16ps treats denormal inputs as zero and
// flushes denormal results; the bf16 FMAs run with MXCSR's DAZ and FTZ set for the same bits.
//
// A tile is R rows x C blocks (R x C zmm accumulators). fp32, and bf16 with few rows (< BIG_ROWS): C = 4 and the
// whole K in one pass (few rows are memory-bound: four independent chains a row). bf16 with many rows: C = 2 and K in passes whose weight panel (2 blocks x
// the pass's inputs) stays in L1 while all the chunk's row tiles (12 rows each) use it; between passes a tile's
// accumulators wait in an fp32 scratch (exact), so each output is still one accumulator over k in order. A pass's
// rows go in tiles of equal height.
constexpr int64_t BIG_ROWS = 8;
constexpr int64_t PANEL_BYTES = 24 << 10;  // weights of one pass of a 2-block group: L1 holds it and the tile's rows
constexpr int64_t PART_WIDTH = 4 * BW;  // scratch columns a row (the widest group)

// One pass of a chunk of rows: rows x[r * ldx + k] (fp32), inputs [k0, k1), output rows row0 + r.
struct Pass {
  const float* x;
  int64_t ldx, row0, k0, k1;
  const uint32_t* xp;  // path 3: the rows as bf16 pairs (x[k], x[k + 1]) in one 32-bit word, ldp words a row
  int64_t ldp;
  float* part;  // [rows][PART_WIDTH] sums between passes
  bool first, last;
};

inline __m512 odd_f32(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 even_f32(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }

template <int R, int C>
inline void start(__m512 (&acc)[R][C], const Pass& s, int64_t r0) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = s.first ? _mm512_setzero_ps() : _mm512_loadu_ps(s.part + (r0 + r) * PART_WIDTH + c * BW);
}

template <typename T, int R, int C>
inline void finish(const Problem<T>& p, const __m512 (&acc)[R][C], const Pass& s, int64_t r0, int64_t j,
                   __mmask16 mask) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (!s.last) {
        _mm512_storeu_ps(s.part + (r0 + r) * PART_WIDTH + c * BW, acc[r][c]);
        continue;
      }
      __m512 v = acc[r][c];
      if (p.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p.bias + (j + c) * BW));
      const int64_t at = (s.row0 + r0 + r) * p.N + (j + c) * BW;
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(p.y + at, mask, v);
      } else {
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16(reinterpret_cast<bf16*>(p.y) + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
#endif
      }
    }
}

// TAIL: one block narrower than 16 (masked loads and stores, weight stride = its width).
template <int R, int C, bool TAIL>
void avx512_tile(const Problem<float>& p, const Pass& s, int64_t r0, int64_t j) {
  const int64_t width = TAIL ? p.N - j * BW : BW;
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
  __m512 acc[R][C];
  start(acc, s, r0);
  const float* w = p.w + j * p.block_stride();
  const float* x = s.x + r0 * s.ldx;
  for (int64_t k = s.k0; k < s.k1; ++k) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c)
      wv[c] = TAIL ? _mm512_maskz_loadu_ps(mask, w + k * width) : _mm512_loadu_ps(w + c * p.block_stride() + k * BW);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * s.ldx + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xb, acc[r][c]);
    }
  }
  finish(p, acc, s, r0, j, mask);
}

// bf16: per pair, the odd product, then the even one. DP false (path 2): two FMAs on the widened pair, MXCSR's DAZ
// and FTZ set for vdpbf16ps's denormal rules. DP true (path 3): vdpbf16ps itself on the bf16 rows' pairs (one 32-bit
// broadcast a row), which flushes denormals whatever MXCSR says: the same bits.
template <int R, int C, bool TAIL, bool DP = false>
void avx512_tile(const Problem<c10::BFloat16>& p, const Pass& s, int64_t r0, int64_t j) {
  const int64_t width = TAIL ? p.N - j * BW : BW;
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
  __m512 acc[R][C];
  start(acc, s, r0);
  const bf16* w = reinterpret_cast<const bf16*>(p.w) + j * p.block_stride();
  const unsigned csr = _mm_getcsr();
  if constexpr (!DP) _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ: vdpbf16ps's denormal rules
  for (int64_t k = s.k0; k < s.k1; k += 2) {  // one pair: the block's 16 columns x (k, k + 1), interleaved
    __m512i v[C];
    for (int c = 0; c < C; ++c)
      v[c] = TAIL ? _mm512_maskz_loadu_epi32(mask, w + k * width) : _mm512_loadu_si512(w + c * p.block_stride() + k * BW);
    if constexpr (DP) {
#if defined(__AVX512BF16__)
      const uint32_t* x = s.xp + r0 * s.ldp;
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * s.ldp + k / 2]));
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)v[c], xb);
      }
#endif
    } else {
      const float* x = s.x + r0 * s.ldx;
      __m512 odd[C], even[C];
      for (int c = 0; c < C; ++c) {
        odd[c] = odd_f32(v[c]);
        even[c] = even_f32(v[c]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xo = _mm512_set1_ps(x[r * s.ldx + k + 1]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(odd[c], xo, acc[r][c]);
        const __m512 xe = _mm512_set1_ps(x[r * s.ldx + k]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(even[c], xe, acc[r][c]);
      }
    }
  }
  if constexpr (!DP) _mm_setcsr(csr);
  finish(p, acc, s, r0, j, mask);
}

// Rows [r0, r0 + left) of a pass, left <= R, as one tile of exactly `left` rows.
template <typename T, int R, int C, bool TAIL, bool DP>
void avx512_rest(const Problem<T>& p, const Pass& s, int64_t r0, int64_t left, int64_t j) {
  if constexpr (R > 0) {
    if (left == R) {
      if constexpr (DP) avx512_tile<R, C, TAIL, true>(p, s, r0, j);  // bf16 only
      else avx512_tile<R, C, TAIL>(p, s, r0, j);
    } else {
      avx512_rest<T, R - 1, C, TAIL, DP>(p, s, r0, left, j);
    }
  }
}

// A pass's rows in tiles of at most R rows, of equal height within one (16 rows: 8 + 8, not 12 + 4: a short tile
// has too few independent chains to keep the FMA units busy).
template <typename T, int R, int C, bool TAIL, bool DP>
void avx512_rows(const Problem<T>& p, const Pass& s, int64_t rows, int64_t j) {
  const int64_t tiles = (rows + R - 1) / R, base = rows / tiles, taller = rows % tiles;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t height = base + (t < taller ? 1 : 0);
    avx512_rest<T, R, C, TAIL, DP>(p, s, r, height, j);
    r += height;
  }
}

// Blocks [j, j + C) of a chunk's rows, K in passes of at most `step` inputs (step even for bf16).
template <typename T, int R, int C, bool TAIL, bool DP>
void avx512_group(const Problem<T>& p, Pass s, int64_t rows, int64_t j, int64_t step) {
  for (int64_t k0 = 0; k0 < p.Ke; k0 += step) {
    s.k0 = k0;
    s.k1 = std::min(p.Ke, k0 + step);
    s.first = k0 == 0;
    s.last = s.k1 == p.Ke;
    avx512_rows<T, R, C, TAIL, DP>(p, s, rows, j);
  }
}

// Blocks [j0, j1) of a chunk's rows: groups of C full blocks, then single ones, then the tail block if here.
template <typename T, bool DP>
void avx512_chunk(const Problem<T>& p, const Pass& s, int64_t rows, int64_t j0, int64_t j1) {
  const int64_t full_end = std::min(j1, p.N / BW);
  int64_t j = j0;
  if (std::is_same_v<T, float> || rows < BIG_ROWS) {  // fp32: 6 x 4 tiles measured faster at every row count
    constexpr int R = std::is_same_v<T, float> ? 6 : 5;  // 6 x 4 + 4 or 5 x 4 + 8 of the 32 zmm registers
    for (; j + 4 <= full_end; j += 4) avx512_group<T, R, 4, false, DP>(p, s, rows, j, p.Ke);
    for (; j + 2 <= full_end; j += 2) avx512_group<T, R, 2, false, DP>(p, s, rows, j, p.Ke);
    for (; j < full_end; ++j) avx512_group<T, R, 1, false, DP>(p, s, rows, j, p.Ke);
    if (j1 > full_end) avx512_group<T, R, 1, true, DP>(p, s, rows, full_end, p.Ke);
    return;
  }
  constexpr int64_t unit = std::is_same_v<T, float> ? 1 : 2;
  const int64_t most = std::max(unit, PANEL_BYTES / (2 * BW * static_cast<int64_t>(sizeof(T))) / unit * unit);
  const int64_t passes = (p.Ke + most - 1) / most, step = ((p.Ke + passes - 1) / passes + unit - 1) / unit * unit;
  for (; j + 2 <= full_end; j += 2) avx512_group<T, 12, 2, false, DP>(p, s, rows, j, step);  // 24 + 2 or 4 zmm
  for (; j < full_end; ++j) avx512_group<T, 12, 1, false, DP>(p, s, rows, j, step);
  if (j1 > full_end) avx512_group<T, 12, 1, true, DP>(p, s, rows, full_end, step);
}

// One thread's share on AVX-512: rows in equal chunks of at most X_CHUNK_BYTES of fp32 rows (the weights stream
// once per chunk), bf16 rows widened to fp32 first (a zero after the last input where K is odd); on path 3 (DP)
// bf16 rows stay bf16, read as pairs where K is even, copied with a zero after the last input where it is odd.
template <typename T, bool DP>
void avx512_blocks(const Problem<T>& p, int64_t j0, int64_t j1) {
  thread_local std::vector<float> widened, part;
  thread_local std::vector<bf16> padded;
  const int64_t most = std::max<int64_t>(BIG_ROWS, X_CHUNK_BYTES / (p.Ke * 4));
  const int64_t chunks = (p.M + most - 1) / most, chunk = (p.M + chunks - 1) / chunks;
  if (static_cast<int64_t>(part.size()) < chunk * PART_WIDTH) part.resize(chunk * PART_WIDTH);
  for (int64_t r0 = 0; r0 < p.M; r0 += chunk) {
    const int64_t rows = std::min(chunk, p.M - r0);
    Pass s{nullptr, p.ldx, r0, 0, 0, nullptr, 0, part.data(), true, true};
    if constexpr (std::is_same_v<T, float>) {
      s.x = p.x + r0 * p.ldx;
    } else if constexpr (DP) {
      const bf16* x = reinterpret_cast<const bf16*>(p.x);
      if (p.Ke == p.K && p.ldx % 2 == 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0) {
        s.xp = reinterpret_cast<const uint32_t*>(x + r0 * p.ldx);
        s.ldp = p.ldx / 2;
      } else {
        if (static_cast<int64_t>(padded.size()) < rows * p.Ke) padded.resize(rows * p.Ke);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(padded.data() + r * p.Ke, x + (r0 + r) * p.ldx, p.K * sizeof(bf16));
          if (p.Ke > p.K) padded[r * p.Ke + p.K] = 0;
        }
        s.xp = reinterpret_cast<const uint32_t*>(padded.data());
        s.ldp = p.Ke / 2;
      }
    } else {
      if (static_cast<int64_t>(widened.size()) < rows * p.Ke) widened.resize(rows * p.Ke);
      const bf16* x = reinterpret_cast<const bf16*>(p.x);
      for (int64_t r = 0; r < rows; ++r) {
        float* out = widened.data() + r * p.Ke;
        for (int64_t k = 0; k < p.K; ++k) out[k] = bf16_to_f32(x[(r0 + r) * p.ldx + k]);
        if (p.Ke > p.K) out[p.K] = 0.f;
      }
      s.x = widened.data();
      s.ldx = p.Ke;
    }
    avx512_chunk<T, DP>(p, s, rows, j0, j1);
  }
}
#endif

// The AVX-512 code for T where it is built (fp32: AVX-512F; bf16: AVX512_BF16): false where it is not.
inline bool avx512_blocks_if_built(const Problem<float>& p, int64_t /*path*/, int64_t j0, int64_t j1) {
#if defined(__AVX512F__)
  avx512_blocks<float, false>(p, j0, j1);
  return true;
#else
  return false;
#endif
}

inline bool avx512_blocks_if_built(const Problem<c10::BFloat16>& p, int64_t path, int64_t j0, int64_t j1) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (path >= 3) avx512_blocks<c10::BFloat16, true>(p, j0, j1);
  else avx512_blocks<c10::BFloat16, false>(p, j0, j1);
  return true;
#else
  return false;
#endif
}

// One thread's share: output blocks [j0, j1) of every row, on `path` or the best built path below it.
template <typename T>
void run_blocks(const Problem<T>& p, int64_t path, int64_t j0, int64_t j1) {
  if (path >= 2 && avx512_blocks_if_built(p, path, j0, j1)) return;
  // Rows in equal chunks of at most X_CHUNK_BYTES of x (the weights stream once per chunk: a small last chunk
  // would pay a whole pass for a few rows).
  const int64_t most = std::max<int64_t>(6, X_CHUNK_BYTES / (p.K * static_cast<int64_t>(sizeof(T))));
  const int64_t chunks = (p.M + most - 1) / most, chunk = (p.M + chunks - 1) / chunks;
  for (int64_t r0 = 0; r0 < p.M; r0 += chunk) {
    const int64_t rows = std::min(chunk, p.M - r0);
#if defined(__AVX2__) && defined(__FMA__)
    if (path >= 1) {
      for (int64_t j = j0; j < j1; ++j) {
        if ((j + 1) * BW <= p.N) avx2_rows(p, r0, rows, j);
        else scalar_block(p, r0, rows, j);  // the tail block
      }
      continue;
    }
#endif
    for (int64_t j = j0; j < j1; ++j) scalar_block(p, r0, rows, j);
  }
}

template <typename T>
void run(const Problem<T>& p, int64_t path) {
  const int64_t blocks = (p.N + BW - 1) / BW;
  // Small problems stay on one thread (the split never changes a result, only who computes it).
  const int64_t grain = p.M * p.N * p.K < (1 << 18) ? blocks : 1;
  verispec_pool::parallel_for(0, blocks, grain, [&](int64_t j0, int64_t j1) { run_blocks(p, path, j0, j1); });
}

}  // namespace

torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias,
                           int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in] with contiguous rows");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.dtype() == x.dtype(),
              "packed must be a contiguous [out, in] weight of x's dtype (dense.py's pack)");
  const bool half = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(half || x.scalar_type() == torch::kFloat32, "dense_linear takes float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), Ke = packed.size(1);
  TORCH_CHECK(Ke == (half ? K + K % 2 : K), "packed weight's input size ", Ke, " does not fit x's ", K);
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.dtype() == torch::kFloat32 && bias.is_contiguous() && bias.numel() == N),
              "bias must be float32 [out] (or empty)");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  if (half) {
    using T = c10::BFloat16;
    run(Problem<T>{x.data_ptr<T>(), x.stride(0), packed.data_ptr<T>(), b, y.data_ptr<T>(), M, N, K, Ke}, path);
  } else {
    run(Problem<float>{x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), b, y.data_ptr<float>(), M, N,
                       K, Ke}, path);
  }
  return y;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// vdpbf16ps's multiply-adds per second over the FMA's (2 on CPUs that issue both at one rate: vdpbf16ps does two
// per lane; 0.5 where vdpbf16ps issues at a quarter of the FMA rate): the same register-only loop of each, 24
// independent chains, the best of several short runs taking turns (about 2 ms in all).
template <bool DP>
__attribute__((noinline)) double chains_seconds(int64_t n, int seed) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 x = _mm512_set1_ps(1e-9f * seed);
  const __m512bh xb = (__m512bh)_mm512_set1_epi32(seed);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
#pragma GCC unroll 24
    for (int c = 0; c < 24; ++c) {
      if constexpr (DP) acc[c] = _mm512_dpbf16_ps(acc[c], xb, xb);
      else acc[c] = _mm512_fmadd_ps(x, x, acc[c]);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512 sum = acc[0];
  for (int i = 1; i < 24; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return seconds;
}
#endif

double vdpbf16ps_speedup() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  static const double measured = [] {
    constexpr int64_t n = 4000;  // 96k instructions a run
    double fma = 1e9, dp = 1e9;
    for (int run = 0; run < 7; ++run) {
      fma = std::min(fma, chains_seconds<false>(n, run + 1));
      dp = std::min(dp, chains_seconds<true>(n, run + 1));
    }
    return 2.0 * fma / dp;  // vdpbf16ps: 32 multiply-adds an instruction, FMA 16
  }();
  return measured;
#else
  return 0.0;
#endif
}

// The paths built here, best first, per dtype: {"float32": [2, 1, 0], "bfloat16": [3, 2, 1, 0]}; bf16's path 3
// (vdpbf16ps) goes first only where it was measured at least 1.3x the FMAs' multiply-adds, else after path 2.
std::map<std::string, std::vector<int64_t>> paths() {
  std::vector<int64_t> f32, b16;
#if defined(__AVX512F__)
  f32.push_back(2);
#if defined(__AVX512BF16__)
  if (vdpbf16ps_speedup() >= 1.3) {
    b16.push_back(3);
    b16.push_back(2);
  } else {
    b16.push_back(2);
    b16.push_back(3);
  }
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
  f32.push_back(1);
  b16.push_back(1);
#endif
  f32.push_back(0);
  b16.push_back(0);
  return {{"float32", f32}, {"bfloat16", b16}};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_pool", &verispec_pool::use_pool, "run parallel regions on the work pool whose table (pool_api.h) is at this address");
  m.def("dense_linear", &dense_linear, "x @ W^T (+ bias) on a packed weight; path 3 AVX-512 vdpbf16ps (bf16), 2 AVX-512, 1 AVX2, 0 scalar");
  m.def("paths", &paths, "the paths built, best first, per dtype");
  m.def("vdpbf16ps_speedup", &vdpbf16ps_speedup,
        "vdpbf16ps's multiply-adds per second over the FMA's on this CPU (measured once; 0 where not built)");
  // For layer_loop.h, which calls dense_linear from C++ (one process, one libtorch: Tensors pass as they are).
  m.def("dense_linear_address", [] { return reinterpret_cast<int64_t>(&dense_linear); }, "&dense_linear");
}
