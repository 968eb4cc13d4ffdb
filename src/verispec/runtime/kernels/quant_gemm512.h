// The AVX-512 path for many rows (verify passes, batched decode steps, prefill): a GEMM over dequantized panels.
// Included by quant_kernel.cpp (one translation unit); see its header comment for the numerics contract.
#pragma once
#include "quant_common.h"

#if defined(VERISPEC_AVX512)
namespace {

// lane i = _mm512_reduce_add_ps(acc[i]) bit for bit: the same tree of additions (upper 8 lanes + lower 8, then upper
// 4 + lower 4, then lanes 0 + 2 and 1 + 3, then those two), done for 16 accumulators at once by shuffles.
inline __m512 reduce16(const __m512* acc) {
  // the shuffles below leave accumulator k's sum in lane P[k] (P is its own inverse), so feed them acc[P[k]]
  static constexpr int P[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 u[8], v[4], w[2];
  for (int j = 0; j < 8; ++j)  // accumulators j and j + 8: their upper 8 lanes + lower 8
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[P[j]], acc[P[j + 8]], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(acc[P[j]], acc[P[j + 8]], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)  // upper 4 + lower 4: one accumulator per 128-bit lane
    v[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[j], u[j + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[j], u[j + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int j = 0; j < 2; ++j)  // lanes 0 + 2 and 1 + 3
    w[j] = _mm512_add_ps(_mm512_shuffle_ps(v[j], v[j + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(v[j], v[j + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Stores the sums of a 4-channel x NR-row tile of accumulators acc[r][c]: y[r0 + r, o0 + c] for c < nc (the last
// group's padding is never stored), 4 rows at a time through reduce16.
template <int NR>
inline void store_tile512(const Args& a, const __m512 (&acc)[NR][4], int64_t o0, int64_t r0, int64_t nc) {
  const __mmask8 keep = static_cast<__mmask8>((1u << nc) - 1);
  for (int r4 = 0; r4 < NR; r4 += 4) {
    __m512 s[16];
    for (int i = 0; i < 16; ++i) s[i] = r4 + i / 4 < NR ? acc[r4 + i / 4][i % 4] : _mm512_setzero_ps();
    const __m512 sums = reduce16(s);  // lane 4 * i + c: row r4 + i, channel c
    float* y = a.y + (r0 + r4) * a.out + o0;
    if (r4 + 0 < NR) _mm_mask_storeu_ps(y, keep, _mm512_extractf32x4_ps(sums, 0));
    if (r4 + 1 < NR) _mm_mask_storeu_ps(y + a.out, keep, _mm512_extractf32x4_ps(sums, 1));
    if (r4 + 2 < NR) _mm_mask_storeu_ps(y + 2 * a.out, keep, _mm512_extractf32x4_ps(sums, 2));
    if (r4 + 3 < NR) _mm_mask_storeu_ps(y + 3 * a.out, keep, _mm512_extractf32x4_ps(sums, 3));
  }
}

constexpr int64_t TC = 4;                   // channels per GEMM tile (a repacked group)
constexpr int64_t TILE_FLOATS = TC * QK;    // a tile's values of one block: [4 channels][32]

// Channels [o0, o0 + n) (o0 a multiple of 4) into wp [ceil(n / 4) tiles][blocks][4][32]: the values dequant512 makes
// (and tile512_q4r: the same table), laid out as the GEMM tile reads them; channels past n are zeros (never stored).
template <int64_t T>
void dequant_panel512(const Args& a, float* wp, int64_t o0, int64_t n) {
  const int64_t tiles = (n + TC - 1) / TC;
  if constexpr (repacked(T)) {
    const __m512 k = q4r_levels<T>();
    constexpr int64_t RUN = 32;
    alignas(64) float d[RUN * CHANNELS_PER_GROUP], m[T == Q4_1R ? RUN * CHANNELS_PER_GROUP : 1];
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t g = o0 / CHANNELS_PER_GROUP + t;
      for (int64_t b0 = 0; b0 < a.blocks; b0 += RUN) {
        const int64_t run = std::min(RUN, a.blocks - b0);
        halves_to_floats(d_at(a, g, b0), run * CHANNELS_PER_GROUP, d);
        if (T == Q4_1R) halves_to_floats(m_at(a, g, b0), run * CHANNELS_PER_GROUP, m);
        for (int64_t b = 0; b < run; ++b) {
          _mm_prefetch(reinterpret_cast<const char*>(nibbles_at(a, g + tiles, b0 + b)), _MM_HINT_T0);  // next panel's
          const __m512i v = _mm512_loadu_si512(nibbles_at(a, g, b0 + b));
          float* w = wp + (t * a.blocks + b0 + b) * TILE_FLOATS;
          for (int c = 0; c < CHANNELS_PER_GROUP; ++c) {
            const int64_t i = b * CHANNELS_PER_GROUP + c;
            const __m512 table = T == Q4_1R ? _mm512_fmadd_ps(_mm512_set1_ps(d[i]), k, _mm512_set1_ps(m[i]))
                                            : _mm512_mul_ps(_mm512_set1_ps(d[i]), k);
            _mm512_storeu_ps(w + c * QK, _mm512_permutexvar_ps(c == 0 ? v : _mm512_srli_epi32(v, 8 * c), table));
            _mm512_storeu_ps(w + c * QK + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * c + 4), table));
          }
        }
      }
    }
  } else {
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t c = 0; c < TC; ++c) {
        const int64_t o = o0 + t * TC + c;
        for (int64_t b = 0; b < a.blocks; ++b) {
          float* w = wp + (t * a.blocks + b) * TILE_FLOATS + c * QK;
          __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
          if (o < o0 + n) {
            _mm_prefetch(reinterpret_cast<const char*>(a.w + (o + n) * a.row_bytes + b * block_bytes(T)), _MM_HINT_T0);
            dequant512<T>(a, o, b, lo, hi);
          }
          _mm512_storeu_ps(w, lo);
          _mm512_storeu_ps(w + 16, hi);
        }
      }
  }
}

// 4 channels x NR rows from a dequantized tile wt [blocks][4][32]: each output's accumulator fed as tile512's are (lo
// then hi, block by block) and reduced as _mm512_reduce_add_ps does, so a row's outputs are the 1-row path's bits.
template <int NR>
void gemm_tile512(const Args& a, const float* wt, int64_t o0, int64_t r0, int64_t nc) {
  __m512 acc[NR][TC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < TC; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* x0 = a.x + r0 * a.in;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* w = wt + b * TILE_FLOATS;
    for (int h = 0; h < 2; ++h) {  // elements 0..15 (lo), then 16..31 (hi)
      __m512 wv[TC];
      for (int c = 0; c < TC; ++c) wv[c] = _mm512_loadu_ps(w + c * QK + 16 * h);
      for (int r = 0; r < NR; ++r) {
        __m512 xv = _mm512_loadu_ps(x0 + r * a.in + b * QK + 16 * h);
        __asm__("" : "+v"(xv));  // one load per row, kept in a register (else each multiply-add reloads it)
        for (int c = 0; c < TC; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
      }
    }
  }
  store_tile512<NR>(a, acc, o0, r0, nc);
}

using GemmTileFn = void (*)(const Args&, const float*, int64_t, int64_t, int64_t);
// Rows per tile: 6 x 4 accumulators, 4 weight vectors and one input vector take 29 of the 32 zmm registers.
constexpr int64_t GEMM_ROWS = 6;
constexpr GemmTileFn GEMM_TILE[GEMM_ROWS + 1] = {nullptr,         gemm_tile512<1>, gemm_tile512<2>, gemm_tile512<3>,
                                                 gemm_tile512<4>, gemm_tile512<5>, gemm_tile512<6>};
// From this many rows on the GEMM beats tiles that dequantize in registers (tile512, tile512_q4r*), which redo the
// dequantization once per tile of rows (measured: recipes/quant_linear_bench.py, docs/runner.md).
constexpr int64_t GEMM_MIN_ROWS = 11;
// A panel's bytes: it stays in L1 (48 KiB here) beside the tile of rows it meets.
constexpr int64_t PANEL_BYTES = 24 * 1024;

// Channels [o_begin, o_end) (o_begin a multiple of 4) x every row: panels of `panel` channels dequantized once into
// wp, then for each tile of rows (which stays in L1 while it meets the panel's channels) every 4-channel tile. Tiles
// of rows are as even as 6 rows a tile allows (16 rows: 6 + 5 + 5), which does not change any output.
template <int64_t T>
void gemm512(const Args& a, float* wp, int64_t o_begin, int64_t o_end, int64_t panel) {
  const int64_t row_tiles = (a.rows + GEMM_ROWS - 1) / GEMM_ROWS;
  for (int64_t o0 = o_begin; o0 < o_end; o0 += panel) {
    const int64_t n = std::min(panel, o_end - o0);
    dequant_panel512<T>(a, wp, o0, n);
    for (int64_t i = 0, r0 = 0; i < row_tiles; ++i) {
      const int64_t nr = (a.rows - r0) / (row_tiles - i) + ((a.rows - r0) % (row_tiles - i) != 0);
      for (int64_t t = 0; t * TC < n; ++t)
        GEMM_TILE[nr](a, wp + t * a.blocks * TILE_FLOATS, o0 + t * TC, r0, std::min(TC, n - t * TC));
      r0 += nr;
    }
  }
}

using GemmFn = void (*)(const Args&, float*, int64_t, int64_t, int64_t);
GemmFn gemm512_for(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return gemm512<Q4_0>;
    case Q4_1: return gemm512<Q4_1>;
    case Q4_0R: return gemm512<Q4_0R>;
    case Q4_1R: return gemm512<Q4_1R>;
    case Q8_0: return gemm512<Q8_0>;
    case Q5_0: return gemm512<Q5_0>;
    case Q5_1: return gemm512<Q5_1>;
    case Q4_K: return gemm512<Q4_K>;
    case Q5_K: return gemm512<Q5_K>;
    case Q6_K: return gemm512<Q6_K>;
    case Q5_0R: return gemm512<Q5_0R>;
    case Q5_1R: return gemm512<Q5_1R>;
    default: return gemm512<INT8>;
  }
}

// y = x W^T for every row; threads take channels in units of `group` (a multiple of 4), as the tiles do.
void gemm512_linear(const Args& a, int64_t qtype, int64_t group) {
  const int64_t panel = std::max(TC, PANEL_BYTES / (a.in * 4) / TC * TC);
  const GemmFn gemm = gemm512_for(qtype);
  verispec_pool::parallel_for(0, (a.out + group - 1) / group, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wp;  // each thread's own, kept across chunks and calls
    if (wp.size() < static_cast<size_t>(panel / TC * a.blocks * TILE_FLOATS)) wp.resize(panel / TC * a.blocks * TILE_FLOATS);
    gemm(a, wp.data(), begin * group, std::min(a.out, end * group), panel);
  });
}

}  // namespace
#endif
