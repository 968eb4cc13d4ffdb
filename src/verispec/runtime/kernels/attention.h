// Attention of the native layer (layer_kernel.cpp's header comment states the arithmetic contract): one query
// at a time, and tiles of queries sharing a KV head's keys and values.
#pragma once
#include "layer_common.h"

namespace {

// ---- attention -------------------------------------------------------------------------------------------------

// One (row, head, query) at a time (vec: the AVX-512 code where built; else the scalar code, the same operations).
// T: q, mask and output; C: the cache's entries (T, or a 16-bit cache's: converted to fp32 exactly where read).
template <typename T, typename C>
void attention_impl(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                    const at::Tensor& out, bool vec) {
  const int64_t b = q.size(0), H = q.size(1), n = q.size(2), d = q.size(3);
  const int64_t Hk = keys.size(1), g = H / Hk, L = mask.size(3);
  const auto qs = q.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides(), os = out.strides();
  const T *qp = ptr<T>(q), *mp = ptr<T>(mask);
  const C *kp = ptr<C>(keys), *vp = ptr<C>(values);
  T* op = mut<T>(out);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  verispec_pool::parallel_for(0, b * H * n, attention_grain(b * H * n, 2 * b * H * n * L * d), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(d), s(L), acc(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / (H * n), h = item / n % H, t = item % n, kh = h / g;
      const T* qrow = qp + row * qs[0] + h * qs[1] + t * qs[2];
      for (int64_t i = 0; i < d; ++i) qf[i] = to_f(qrow[i]) * scale;
      const T* mrow = mp + row * ms[0] + t * ms[2];
      const C* krow = kp + row * ks[0] + kh * ks[1];
      const C* vrow = vp + row * vs[0] + kh * vs[1];
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < L; ++j) {
        const float m = to_f(mrow[j * ms[3]]);
        s[j] = m <= MASKED ? -std::numeric_limits<float>::infinity()
                           : (vec ? dot(qf.data(), krow + j * ks[2], d) : dot_scalar(qf.data(), krow + j * ks[2], d)) + m;
        top = std::max(top, s[j]);
      }
      T* orow = op + row * os[0] + h * os[1] + t * os[2];
      if (top == -std::numeric_limits<float>::infinity()) {  // every entry masked: zeros (no NaN to spread)
        for (int64_t i = 0; i < d; ++i) orow[i] = from_f<T>(0.0f);
        continue;
      }
      exp_shifted(s.data(), L, top, vec);  // masked: exactly 0
      float total = 0.0f;
      for (int64_t j = 0; j < L; ++j) total += s[j];  // in cache order (adding 0 changes nothing)
      accumulate(s.data(), vrow, vs[2], L, d, acc.data(), vec);
      for (int64_t i = 0; i < d; ++i) orow[i] = from_f<T>(acc[i] / total);
    }
  });
}

// ---- attention over a tile of queries (long chunks) --------------------------------------------------------------
//
// The same per-(row, head, query) arithmetic as `attention_impl`'s one-query loop, for many queries at once: the
// queries of one KV head (its g query heads x a run of positions) share each key and value vector, loaded once
// for the tile. Per (query, key): the dot over d in dot()'s order (16 lanes over d, then halved pairwise: sixteen
// keys' sums reduced together by `reduce16`, each lane's operations those of dot()), + mask, exact maximum,
// fexp16, sum_j p_j in j order and sum_j p_j v_j in j order with p_j = 0 skipped (a masked add), acc / total.
#if defined(__AVX512F__)
// 16 dot accumulators -> one vector, lane i: acc[i]'s horizontal sum in dot()'s order (l + 8, + 4, + 2, + 1).
inline __m512 reduce16(const __m512* acc) {
  static constexpr int order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};  // a 4 x 4 transpose
  __m512 v8[8], v4[4], v2[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: a[l] + a[l + 8], 8-15: b[l] + b[l + 8]
    const __m512 a = acc[order[2 * i]], b = acc[order[2 * i + 1]];
    v8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)  // 128-bit chunk c: input 4 i + c's h8[l] + h8[l + 4]
    v4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v8[2 * i], v8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(v8[2 * i], v8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // per chunk: [a0 + a2, a1 + a3, b0 + b2, b1 + b3]
    v2[i] = _mm512_add_ps(_mm512_shuffle_ps(v4[2 * i], v4[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(v4[2 * i], v4[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(v2[0], v2[1], _MM_SHUFFLE(2, 0, 2, 0)),  // h2[0] + h2[1]; the
                       _mm512_shuffle_ps(v2[0], v2[1], _MM_SHUFFLE(3, 1, 3, 1)));  // transpose undone: lane i
}

// Software prefetch of the cache entries PREFETCH_ENTRIES ahead of the one in use. A (row, KV head)'s keys and values
// are short runs (a 4 KB page holds 16 entries of d = 64 in fp32) that the hardware's stream prefetchers, which stop
// at page boundaries, barely cover: a decode step's attention read its caches at ~12 GB/s on one thread without
// this (docs/runner.md). Hints only: the arithmetic and the bits are unchanged.
constexpr int64_t PREFETCH_ENTRIES = 16;
inline void prefetch_entry(const void* at, int64_t bytes) {
  const char* c = static_cast<const char*>(at);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

struct TileScratch {
  std::vector<float> q, k, v, m, s;  // the tile's queries, keys, values, masks, scores (then p)
  std::vector<int64_t> len;  // per query: 1 + its last unmasked entry (0: none)
  int64_t from = 0;  // the tile's first block that any query sees (a multiple of 16): the entries before it are
                     // masked for every query (a sliding window's far past), so p = 0 there and they are skipped
};

// Queries q0 .. q0 + R - 1 of a tile (scores already exponentiated in w.s): sum_j p_j v_j and sum_j p_j in j order,
// p_j = 0 skipped (a masked add: what the one-query loop's `continue` does), then acc / total into the output.
// The values come from `v` (stride `vstride` between entries): the tile's fp32 copy, or the cache itself (V).
// The head dim's channels go in passes of CP vectors (at most 24 sums, R x CP, stay in registers; up to 8 queries
// share each value vector loaded);
// each channel's sum is the same j-ordered chain whichever pass holds it. Entries before w.from have p = 0 for
// every query (sum_j p_j starting there adds the same numbers).
template <int NC, int R, typename T, typename V>
void weigh_values(TileScratch& w, const V* v, int64_t vstride, const std::vector<float>& top, int64_t q0, int64_t Lp,
                  const at::Tensor& out, int64_t row, int64_t kh, int64_t g, int64_t nt, int64_t t0,
                  bool prefetch = false) {  // prefetch: v is the cache (else the tile's copy, in cache already)
  constexpr int64_t d = 16 * NC;
  constexpr int CP = NC <= 4 ? NC                                            // vectors a pass sums (divides NC)
                   : NC == 8 ? (R <= 2 ? 8 : R <= 6 ? 4 : 2)
                             : (R == 1 ? 16 : R == 2 ? 8 : R <= 4 ? 4 : 2);
  int64_t Lr = 0;
  for (int r = 0; r < R; ++r) Lr = std::max(Lr, w.len[q0 + r]);
  float sums[R * d], totals[R];  // out of the registers with constant indices (else the sums live in memory)
  for (int c0 = 0; c0 < NC; c0 += CP) {
    __m512 acc[R][CP];
    float total[R];
    const float* p[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      total[r] = 0.0f;
      p[r] = w.s.data() + (q0 + r) * Lp;
      for (int c = 0; c < CP; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    for (int64_t j = w.from; j < Lr; ++j) {
      const V* vj = v + j * vstride + 16 * c0;
      if (prefetch && j + PREFETCH_ENTRIES < Lr) prefetch_entry(vj + PREFETCH_ENTRIES * vstride, 16 * CP * sizeof(V));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const float pj = p[r][j];
        total[r] += pj;
        const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_set1_ps(pj), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        const __m512 pv = _mm512_set1_ps(pj);
#pragma GCC unroll 16
        for (int c = 0; c < CP; ++c)
          acc[r][c] = _mm512_mask3_fmadd_ps(pv, load16(vj + 16 * c, 0xffff), acc[r][c], keep);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      totals[r] = total[r];
#pragma GCC unroll 16
      for (int c = 0; c < CP; ++c) _mm512_storeu_ps(sums + r * d + 16 * (c0 + c), acc[r][c]);
    }
  }
  const auto os = out.strides();
  for (int r = 0; r < R; ++r) {
    const int64_t qi = q0 + r;
    T* orow = mut<T>(out) + row * os[0] + (kh * g + qi / nt) * os[1] + (t0 + qi % nt) * os[2];
    if (top[qi] == -std::numeric_limits<float>::infinity()) {  // every entry masked: zeros
      for (int64_t i = 0; i < d; ++i) orow[i] = from_f<T>(0.0f);
      continue;
    }
    for (int64_t i = 0; i < d; ++i) orow[i] = from_f<T>(sums[r * d + i] / totals[r]);
  }
}

// weigh_values for a run-time count of R <= QR queries (R <= 10).
template <int NC, int QR, typename T, typename V>
void weigh_some(int64_t R, TileScratch& w, const V* v, int64_t vstride, const std::vector<float>& top, int64_t q0,
                int64_t Lp, const at::Tensor& out, int64_t row, int64_t kh, int64_t g, int64_t nt, int64_t t0,
                bool prefetch = false) {
  switch (R) {
#define VERISPEC_WEIGH(N) \
  case N: \
    if constexpr (N <= QR) return weigh_values<NC, N, T>(w, v, vstride, top, q0, Lp, out, row, kh, g, nt, t0, prefetch);
    VERISPEC_WEIGH(1) VERISPEC_WEIGH(2) VERISPEC_WEIGH(3) VERISPEC_WEIGH(4) VERISPEC_WEIGH(5)
    VERISPEC_WEIGH(6) VERISPEC_WEIGH(7) VERISPEC_WEIGH(8) VERISPEC_WEIGH(9) VERISPEC_WEIGH(10)
#undef VERISPEC_WEIGH
    default: TORCH_CHECK(false, "weigh_some: more queries than a pass holds");
  }
}

template <int NC, typename T, typename C>
void attend_tile(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                 const at::Tensor& out, int64_t row, int64_t kh, int64_t t0, int64_t t1, TileScratch& w) {
  constexpr int64_t d = 16 * NC;
  // queries whose sums stay in registers together (R x CP of weigh_values): d = 128 takes 6, a GQA group of 6 query
  // heads (Qwen2's) decoding in one pass over the cache's values, which it then reads where they are (no fp32 copy)
  constexpr int QR = NC > 8 ? 8 : NC == 8 ? 6 : 20 / NC;
  const int64_t H = q.size(1), g = H / keys.size(1), L = mask.size(3), nt = t1 - t0, Q = g * nt;
  const auto qs = q.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides(), os = out.strides();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const float inf = std::numeric_limits<float>::infinity();
  // masks as fp32 [nt][Lp] (past L: masked) and each position's visible length; the tile's first block that any
  // query sees (w.from: entries before it are masked for all, a sliding window's far past, and are never read)
  int64_t Lt = 0, first = L;
  std::vector<int64_t> lenT(nt);
  for (int64_t tl = 0; tl < nt; ++tl) {
    const T* mrow = ptr<T>(mask) + row * ms[0] + (t0 + tl) * ms[2];
    int64_t last = L, begin = 0;
    while (last > 0 && to_f(mrow[(last - 1) * ms[3]]) <= MASKED) --last;
    while (begin < std::min(last, first) && to_f(mrow[begin * ms[3]]) <= MASKED) ++begin;
    lenT[tl] = last;
    Lt = std::max(Lt, last);
    if (last > 0) first = std::min(first, begin);
  }
  const int64_t Lp = (Lt + 15) / 16 * 16, F = std::min(first, Lt) / 16 * 16;
  // Keys with contiguous entries: whole blocks of 16 are read where they are (fp32) or converted a block at a time
  // into `block` (a 16-bit cache: exact, so the bits are the same); the last partial block is copied, zero-padded
  // (never read past the cache's end).
  const int64_t Lc = ks[2] == d ? Lt / 16 * 16 : 0;  // keys read in place
  w.from = F;
  w.m.resize(nt * Lp), w.k.resize((Lp - Lc) * d), w.v.resize(Lt * d), w.q.resize(Q * d), w.s.resize(Q * Lp);
  w.len.resize(Q);
  for (int64_t tl = 0; tl < nt; ++tl) {
    const T* mrow = ptr<T>(mask) + row * ms[0] + (t0 + tl) * ms[2];
    float* mt = w.m.data() + tl * Lp;
    for (int64_t j = F; j < Lt; ++j) mt[j] = to_f(mrow[j * ms[3]]);
    std::fill(mt + Lt, mt + Lp, -inf);
  }
  const C* krow = ptr<C>(keys) + row * ks[0] + kh * ks[1];
  const C* vrow = ptr<C>(values) + row * vs[0] + kh * vs[1];
  for (int64_t j = F; j < std::min(Lt, F + PREFETCH_ENTRIES); ++j) {  // the first entries, all at once
    prefetch_entry(krow + j * ks[2], d * sizeof(C));
    prefetch_entry(vrow + j * vs[2], d * sizeof(C));
  }
  for (int64_t j = std::max(Lc, F); j < Lt; ++j) {
    const C* kj = krow + j * ks[2];
    if (j + PREFETCH_ENTRIES < Lt) prefetch_entry(kj + PREFETCH_ENTRIES * ks[2], d * sizeof(C));
    float* kw = w.k.data() + (j - Lc) * d;
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(kw + 16 * c, load16(kj + 16 * c, 0xffff));
  }
  std::fill(w.k.data() + (Lt - Lc) * d, w.k.data() + (Lp - Lc) * d, 0.0f);
  const bool copy_v = Q > QR;  // values read in more than one pass: an fp32 copy (else read where they are)
  for (int64_t j = F; copy_v && j < Lt; ++j) {
    const C* vj = vrow + j * vs[2];
    if (j + PREFETCH_ENTRIES < Lt) prefetch_entry(vj + PREFETCH_ENTRIES * vs[2], d * sizeof(C));
    float* vw = w.v.data() + j * d;
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(vw + 16 * c, load16(vj + 16 * c, 0xffff));
  }
  for (int64_t qi = 0; qi < Q; ++qi) {  // query qi: head kh g + qi / nt, position t0 + qi % nt
    const T* qrow = ptr<T>(q) + row * qs[0] + (kh * g + qi / nt) * qs[1] + (t0 + qi % nt) * qs[2];
    float* qw = w.q.data() + qi * d;
    for (int64_t i = 0; i < d; ++i) qw[i] = to_f(qrow[i]) * scale;
    w.len[qi] = lenT[qi % nt];
  }
  // scores, key blocks of 16 outside (in L1 for every query), then max, exp; p = 0 past a query's length
  std::vector<float> tops(Q * 16, -inf);  // per query, the lanes' maxima (exact: the maximum in any order)
  alignas(64) float block[16 * d];  // a 16-bit cache's block of 16 keys in fp32
  for (int64_t j0 = F; j0 < Lp; j0 += 16) {
    const float* kb = w.k.data() + (j0 - Lc) * d;
    if (j0 < Lc) {
      const C* kc = krow + j0 * d;
      if (j0 + PREFETCH_ENTRIES + 16 <= Lc)  // the block PREFETCH_ENTRIES ahead, read in place
        prefetch_entry(kc + PREFETCH_ENTRIES * d, 16 * d * sizeof(C));
      if constexpr (std::is_same<C, float>::value) {
        kb = kc;
      } else {
        for (int64_t i = 0; i < 16 * d; i += 16) _mm512_store_ps(block + i, load16(kc + i, 0xffff));
        kb = block;
      }
    }
    for (int64_t qi = 0; qi < Q; ++qi) {
      if (j0 >= w.len[qi]) continue;
      __m512 acc[16];
      for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
      if constexpr (NC <= 8) {  // the query's vectors held in registers beside the 16 sums
        __m512 qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(w.q.data() + qi * d + 16 * c);
        for (int c = 0; c < NC; ++c)
          for (int k = 0; k < 16; ++k) acc[k] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kb + k * d + 16 * c), acc[k]);
      } else {  // d = 256: one query vector at a time (the same operations in the same order)
        for (int c = 0; c < NC; ++c) {
          const __m512 qc = _mm512_loadu_ps(w.q.data() + qi * d + 16 * c);
          for (int k = 0; k < 16; ++k) acc[k] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kb + k * d + 16 * c), acc[k]);
        }
      }
      const __m512 mv = _mm512_loadu_ps(w.m.data() + (qi % nt) * Lp + j0);
      __m512 sv = _mm512_add_ps(reduce16(acc), mv);
      sv = _mm512_mask_mov_ps(sv, _mm512_cmp_ps_mask(mv, _mm512_set1_ps(MASKED), _CMP_LE_OQ), _mm512_set1_ps(-inf));
      _mm512_storeu_ps(w.s.data() + qi * Lp + j0, sv);
      float* tq = tops.data() + qi * 16;
      _mm512_storeu_ps(tq, _mm512_max_ps(_mm512_loadu_ps(tq), sv));
    }
  }
  std::vector<float> top(Q);
  for (int64_t qi = 0; qi < Q; ++qi) {
    top[qi] = _mm512_reduce_max_ps(_mm512_loadu_ps(tops.data() + qi * 16));
    float* s = w.s.data() + qi * Lp;
    const int64_t done = (w.len[qi] + 15) / 16 * 16;
    if (top[qi] != -inf) {
      const __m512 shift = _mm512_set1_ps(top[qi]);
      for (int64_t j = F; j < done; j += 16) _mm512_storeu_ps(s + j, fexp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift)));
    }
    std::fill(s + std::min(done, Lp), s + Lp, 0.0f);
  }
  // sum_j p_j v_j and sum_j p_j, QR queries at a time (then the rest together), each in j order
  if (!copy_v) return weigh_some<NC, QR, T>(Q, w, vrow, vs[2], top, 0, Lp, out, row, kh, g, nt, t0, true);
  int64_t q0 = 0;
  for (; q0 + QR <= Q; q0 += QR) weigh_values<NC, QR, T>(w, w.v.data(), d, top, q0, Lp, out, row, kh, g, nt, t0);
  if (q0 < Q) weigh_some<NC, QR, T>(Q - q0, w, w.v.data(), d, top, q0, Lp, out, row, kh, g, nt, t0);
}

// Every (row, KV head, run of positions) tile, dealt round robin into deals (runs late in a causal chunk
// attend more: the deal evens the work out).
template <int NC, typename T, typename C>
void attention_tiled(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                     const at::Tensor& out) {
  const int64_t b = q.size(0), Hk = keys.size(1), n = q.size(2), g = q.size(1) / Hk;
  const int64_t threads = verispec_pool::threads();
  int64_t run = std::max<int64_t>(1, std::min<int64_t>(n, 48 / g));
  while (run > 4 && b * Hk * ((n + run - 1) / run) < 4 * threads) run /= 2;
  const int64_t runs = (n + run - 1) / run, items = b * Hk * runs;
  const int64_t macs = 2 * b * q.size(1) * n * mask.size(3) * q.size(3);  // an upper bound (causal chunks attend less)
  // Deals of items, several per thread: whichever thread is running takes the next deal.
  const int64_t deals = std::min(items, threads * 4);
  verispec_pool::parallel_for(0, deals, attention_grain(deals, macs), [&](int64_t begin, int64_t end) {
    thread_local TileScratch w;  // each thread's own, kept across calls (grown, never zero-filled again)
    for (int64_t deal = begin; deal < end; ++deal)
      for (int64_t item = deal; item < items; item += deals) {
        const int64_t r = item / (b * Hk), row = item % (b * Hk) / Hk, kh = item % Hk;
        attend_tile<NC, T, C>(q, keys, values, mask, out, row, kh, r * run, std::min(n, (r + 1) * run), w);
      }
  });
}

template <typename T, typename C>
bool attention_tiled_if(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                        const at::Tensor& out) {
  switch (q.size(3)) {
    case 32: attention_tiled<2, T, C>(q, keys, values, mask, out); return true;
    case 64: attention_tiled<4, T, C>(q, keys, values, mask, out); return true;
    case 128: attention_tiled<8, T, C>(q, keys, values, mask, out); return true;
    case 256: attention_tiled<16, T, C>(q, keys, values, mask, out); return true;
    default: return false;
  }
}
#endif

// The paths (argument `path`; fused.py picks one, VERISPEC_ATTENTION_PATH forces one): 2 tiles of queries per KV
// head (AVX-512, d = 32, 64, 128 or 256; else path 1), 1 one query at a time in AVX-512 (else path 0), 0 scalar. Every
// path gives the same bits.
enum { SCALAR = 0, VECTOR = 1, TILED = 2 };

template <typename T, typename C>
void attention_path(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                    const at::Tensor& out, int64_t path) {
#if defined(__AVX512F__)
  if (path >= TILED && attention_tiled_if<T, C>(q, keys, values, mask, out)) return;
#endif
  attention_impl<T, C>(q, keys, values, mask, out, path >= VECTOR);
}

// The cache's entries for activations T: T itself, or float16 / bfloat16 (a 16-bit cache, --kv-cache-dtype).
template <typename T>
void attention_cache(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                     const at::Tensor& out, int64_t path) {
  if (keys.scalar_type() == q.scalar_type()) return attention_path<T, T>(q, keys, values, mask, out, path);
  if (keys.scalar_type() == at::kHalf) return attention_path<T, f16>(q, keys, values, mask, out, path);
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16, "attention: a cache of q's dtype, float16 or bfloat16");
  attention_path<T, bf16>(q, keys, values, mask, out, path);
}

// q [b, H, n, d], keys / values [b, Hk, max_len, d] (q's dtype, or a 16-bit cache's), mask [b, 1, n, L] (additive;
// L <= max_len, q's dtype), each with a contiguous last dimension -> [b, H, n, d] (a view of [b, n, H, d] memory:
// the output projection's rows).
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                     int64_t path) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 4, "attention: 4-d tensors");
  TORCH_CHECK(keys.sizes() == values.sizes() && q.size(0) == keys.size(0) && q.size(3) == keys.size(3),
              "attention: q [b, H, n, d] and keys / values [b, Hk, max_len, d]");
  TORCH_CHECK(q.size(1) % keys.size(1) == 0, "attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(mask.size(0) == q.size(0) && mask.size(1) == 1 && mask.size(2) == q.size(2) &&
              mask.size(3) <= keys.size(2), "attention: mask [b, 1, n, L <= max_len]");
  TORCH_CHECK(mask.scalar_type() == q.scalar_type() && values.scalar_type() == keys.scalar_type(),
              "attention: the mask in q's dtype, values in the keys' dtype");
  for (const auto* t : {&q, &keys, &values, &mask}) TORCH_CHECK(t->stride(3) == 1, "attention: last dim contiguous");
  auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
  if (q.scalar_type() == at::kFloat) {
    attention_cache<float>(q, keys, values, mask, out, path);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "attention: float32 or bfloat16");
    attention_cache<bf16>(q, keys, values, mask, out, path);
  }
  return out;
}

std::vector<int64_t> attention_paths() {
#if defined(__AVX512F__)
  return {TILED, VECTOR, SCALAR};
#else
  return {SCALAR};
#endif
}

}  // namespace
