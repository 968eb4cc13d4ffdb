// The native layer's small ops and attention in C++ for verispec (runtime/fused.py builds it through ext.py).
//
// fp32 and bf16 (bf16 values are converted to fp32 exactly, computed in fp32 and rounded to nearest even once
// where torch's formula rounds). Built with -O3 -march=native -ffp-contract=off: the compiler fuses no multiply-add,
// so every product and sum rounds where the code says (a fused multiply-add only where the code calls one: the
// attention's dots and weighted sums, std::fma / _mm512_fmadd_ps, the same in every path); the loops are written
// so that the compiler vectorizes them across independent elements only (never a reduction, whose order would then
// be the compiler's), and every reduction runs in one fixed order. Each (row, head, query) is computed on its own,
// so the results do not depend on the number of rows, queries, threads, padding or masked entries (batch- and
// width-invariant by construction).
//
//   attention    softmax(q k^T / sqrt(d) + mask) v, GQA, scores in fp32 (one dot order over d), the exact
//                maximum, then sum_j p_j v_j and sum_j p_j in cache order j = 0, 1, ...; masked entries skipped.
//                Three paths, the same bits: one query at a time (scalar, or AVX-512), and tiles of queries
//                of one KV head sharing each key and value (AVX-512; long chunks)
//   rotary_write rotary on q and k (Hugging Face's halves layout), k and v written into the cache
//   rms_norm     (optionally after a residual add) RMSNorm with Hugging Face's rounding
//   silu_mul     silu(gate) * up
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;  // one AVX-512 register of floats: the dot products' partial sums
constexpr float MASKED = -1e30f;  // an additive mask value at or below this hides the entry (p = 0 exactly)
// Attention of fewer multiply-adds than this runs on the calling thread: waking the other threads costs more than
// the work (a draft model's or a decode step's short rows), and a thread the OS has descheduled on a shared machine
// stalls the whole parallel region. Which thread computes an output never changes its bits.
constexpr int64_t INLINE_MACS = int64_t(1) << 18;

// at::parallel_for's grain for `tasks` items of `macs` multiply-adds in all: all of them on one thread when small.
inline int64_t attention_grain(int64_t tasks, int64_t macs) { return macs < INLINE_MACS ? std::max<int64_t>(tasks, 1) : 1; }

using bf16 = uint16_t;  // bfloat16 bits

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) {  // exact
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline bf16 from_f<bf16>(float f) {  // round to nearest even, as c10::BFloat16 does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

template <typename T> inline float round_to(float f) { return to_f(from_f<T>(f)); }

// e^x in fp32 (Cephes' expf: Cody-Waite reduction, degree-5 polynomial; ~1 ulp), branch-free so loops of it
// vectorize; every lane computes exactly what the scalar code does. x <= -88 gives 0.
inline float fexp(float x) {
  x = std::min(std::max(x, -88.0f), 88.0f);
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  float n = (x * 1.44269504088896341f + shift) - shift;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n (n = -127: 0)
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// sum_i a[i] * b[i] in one fixed order: LANES partial sums over d in steps of LANES, the tail into the first
// lanes, then the lanes halved pairwise (the AVX-512 path computes exactly the scalar path's operations).
template <typename T> inline float dot_scalar(const float* a, const T* b, int64_t d) {
  float acc[LANES] = {0};
  const int64_t body = d - d % LANES;
  for (int64_t c = 0; c < body; c += LANES)
    for (int64_t l = 0; l < LANES; ++l) acc[l] = std::fma(a[c + l], to_f(b[c + l]), acc[l]);
  for (int64_t i = body; i < d; ++i) acc[i - body] = std::fma(a[i], to_f(b[i]), acc[i - body]);
  for (int64_t w = LANES / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {  // bf16 -> fp32, exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

template <typename T> inline float dot(const float* a, const T* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  const int64_t body = d - d % LANES;
  for (int64_t c = 0; c < body; c += LANES)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), load16(b + c, 0xffff), acc);
  if (body < d) {  // the tail's lanes; the others add 0 * 0
    const __mmask16 m = static_cast<__mmask16>((1u << (d - body)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + body), load16(b + body, m), acc);
  }
  __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));  // l + 8
  __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));  // l + 4
  __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));  // l + 2
  __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));  // l + 1
  return _mm_cvtss_f32(h1);
}
#else
template <typename T> inline float dot(const float* a, const T* b, int64_t d) { return dot_scalar(a, b, d); }
#endif

#if defined(__AVX512F__)
// fexp on 16 lanes: the same operations as the scalar fexp, lane by lane.
inline __m512 fexp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), shift), shift);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// out[i] = sum_j p[j] v[j, i] in j order (p = 0 skipped), for d = 16 * NC: the sums held in registers.
template <int NC, typename T>
inline void accumulate16(const float* p, const T* v, int64_t stride, int64_t L, float* out) {
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == 0.0f) continue;
    const __m512 pj = _mm512_set1_ps(p[j]);
    const T* vj = v + j * stride;
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(pj, load16(vj + 16 * c, 0xffff), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}
#endif

// s[j] = fexp(s[j] - top) for j < L (vec: 16 lanes at a time where built, the same operations per lane)
inline void exp_shifted(float* s, int64_t L, float top, bool vec) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top);
  for (; vec && j + 16 <= L; j += 16) _mm512_storeu_ps(s + j, fexp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift)));
#endif
  for (; j < L; ++j) s[j] = fexp(s[j] - top);
}

// out[i] = sum_j p[j] v[j, i], each i's sum in j order (p = 0 adds nothing: skipped)
template <typename T> inline void accumulate(const float* p, const T* v, int64_t stride, int64_t L, int64_t d,
                                             float* out, bool vec) {
#if defined(__AVX512F__)
  switch (vec ? d : 0) {
    case 32: return accumulate16<2>(p, v, stride, L, out);
    case 64: return accumulate16<4>(p, v, stride, L, out);
    case 128: return accumulate16<8>(p, v, stride, L, out);
    default: break;
  }
#endif
  std::fill(out, out + d, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == 0.0f) continue;
    const T* vj = v + j * stride;
    for (int64_t i = 0; i < d; ++i) out[i] = std::fma(p[j], to_f(vj[i]), out[i]);
  }
}

template <typename T> const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T> T* mut(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// ---- attention -------------------------------------------------------------------------------------------------

// One (row, head, query) at a time (vec: the AVX-512 code where built; else the scalar code, the same operations).
template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                    const at::Tensor& out, bool vec) {
  const int64_t b = q.size(0), H = q.size(1), n = q.size(2), d = q.size(3);
  const int64_t Hk = keys.size(1), g = H / Hk, L = mask.size(3);
  const auto qs = q.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides(), os = out.strides();
  const T *qp = ptr<T>(q), *kp = ptr<T>(keys), *vp = ptr<T>(values), *mp = ptr<T>(mask);
  T* op = mut<T>(out);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  at::parallel_for(0, b * H * n, attention_grain(b * H * n, 2 * b * H * n * L * d), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(d), s(L), acc(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / (H * n), h = item / n % H, t = item % n, kh = h / g;
      const T* qrow = qp + row * qs[0] + h * qs[1] + t * qs[2];
      for (int64_t i = 0; i < d; ++i) qf[i] = to_f(qrow[i]) * scale;
      const T* mrow = mp + row * ms[0] + t * ms[2];
      const T* krow = kp + row * ks[0] + kh * ks[1];
      const T* vrow = vp + row * vs[0] + kh * vs[1];
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

struct TileScratch {
  std::vector<float> q, k, v, m, s;  // the tile's queries, keys, values, masks, scores (then p)
  std::vector<int64_t> len;  // per query: 1 + its last unmasked entry (0: none)
};

// Queries q0 .. q0 + R - 1 of a tile (scores already exponentiated in w.s): sum_j p_j v_j and sum_j p_j in j order,
// p_j = 0 skipped (a masked add: what the one-query loop's `continue` does), then acc / total into the output.
// The values come from `v` (stride `vstride` between entries): the tile's fp32 copy, or the cache itself (V).
template <int NC, int R, typename T, typename V>
void weigh_values(TileScratch& w, const V* v, int64_t vstride, const std::vector<float>& top, int64_t q0, int64_t Lp,
                  const at::Tensor& out, int64_t row, int64_t kh, int64_t g, int64_t nt, int64_t t0) {
  constexpr int64_t d = 16 * NC;
  int64_t Lr = 0;
  for (int r = 0; r < R; ++r) Lr = std::max(Lr, w.len[q0 + r]);
  __m512 acc[R][NC];
  float total[R];
  const float* p[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    total[r] = 0.0f;
    p[r] = w.s.data() + (q0 + r) * Lp;
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < Lr; ++j) {
    const V* vj = v + j * vstride;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float pj = p[r][j];
      total[r] += pj;
      const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_set1_ps(pj), _mm512_setzero_ps(), _CMP_NEQ_UQ);
      const __m512 pv = _mm512_set1_ps(pj);
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c)
        acc[r][c] = _mm512_mask3_fmadd_ps(pv, load16(vj + 16 * c, 0xffff), acc[r][c], keep);
    }
  }
  float sums[R * d], totals[R];  // out of the registers with constant indices (else the sums live in memory)
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    totals[r] = total[r];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(sums + r * d + 16 * c, acc[r][c]);
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
                int64_t Lp, const at::Tensor& out, int64_t row, int64_t kh, int64_t g, int64_t nt, int64_t t0) {
  switch (R) {
#define VERISPEC_WEIGH(N) \
  case N: \
    if constexpr (N <= QR) return weigh_values<NC, N, T>(w, v, vstride, top, q0, Lp, out, row, kh, g, nt, t0);
    VERISPEC_WEIGH(1) VERISPEC_WEIGH(2) VERISPEC_WEIGH(3) VERISPEC_WEIGH(4) VERISPEC_WEIGH(5)
    VERISPEC_WEIGH(6) VERISPEC_WEIGH(7) VERISPEC_WEIGH(8) VERISPEC_WEIGH(9) VERISPEC_WEIGH(10)
#undef VERISPEC_WEIGH
    default: TORCH_CHECK(false, "weigh_some: more queries than a pass holds");
  }
}

template <int NC, typename T>
void attend_tile(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                 const at::Tensor& out, int64_t row, int64_t kh, int64_t t0, int64_t t1, TileScratch& w) {
  constexpr int64_t d = 16 * NC;
  constexpr int QR = NC >= 8 ? 2 : 20 / NC;  // queries whose sums stay in registers together
  const int64_t H = q.size(1), g = H / keys.size(1), L = mask.size(3), nt = t1 - t0, Q = g * nt;
  const auto qs = q.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides(), os = out.strides();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const float inf = std::numeric_limits<float>::infinity();
  // masks as fp32 [nt][Lp] (past L: masked) and each position's visible length
  int64_t Lt = 0;
  std::vector<int64_t> lenT(nt);
  for (int64_t tl = 0; tl < nt; ++tl) {
    const T* mrow = ptr<T>(mask) + row * ms[0] + (t0 + tl) * ms[2];
    int64_t last = L;
    while (last > 0 && to_f(mrow[(last - 1) * ms[3]]) <= MASKED) --last;
    lenT[tl] = last;
    Lt = std::max(Lt, last);
  }
  const int64_t Lp = (Lt + 15) / 16 * 16;
  w.m.resize(nt * Lp), w.k.resize(Lp * d), w.v.resize(Lt * d), w.q.resize(Q * d), w.s.resize(Q * Lp);
  w.len.resize(Q);
  for (int64_t tl = 0; tl < nt; ++tl) {
    const T* mrow = ptr<T>(mask) + row * ms[0] + (t0 + tl) * ms[2];
    float* mt = w.m.data() + tl * Lp;
    for (int64_t j = 0; j < Lt; ++j) mt[j] = to_f(mrow[j * ms[3]]);
    std::fill(mt + Lt, mt + Lp, -inf);
  }
  const T* krow = ptr<T>(keys) + row * ks[0] + kh * ks[1];
  const T* vrow = ptr<T>(values) + row * vs[0] + kh * vs[1];
  // fp32 keys with contiguous entries: whole blocks of 16 are read where they are (the copy would be exact, so the
  // bits are the same); the last partial block is copied, zero-padded (never read past the cache's end).
  const int64_t Lc = std::is_same<T, float>::value && ks[2] == d ? Lt / 16 * 16 : 0;  // keys read in place
  for (int64_t j = Lc; j < Lt; ++j) {
    const T* kj = krow + j * ks[2];
    float* kw = w.k.data() + (j - Lc) * d;
    for (int64_t i = 0; i < d; ++i) kw[i] = to_f(kj[i]);
  }
  std::fill(w.k.data() + (Lt - Lc) * d, w.k.data() + (Lp - Lc) * d, 0.0f);
  const bool copy_v = Q > QR;  // values read in more than one pass: an fp32 copy (else read where they are)
  for (int64_t j = 0; copy_v && j < Lt; ++j) {
    const T* vj = vrow + j * vs[2];
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
  for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
    const float* kb = j0 < Lc ? reinterpret_cast<const float*>(krow) + j0 * d : w.k.data() + (j0 - Lc) * d;
    for (int64_t qi = 0; qi < Q; ++qi) {
      if (j0 >= w.len[qi]) continue;
      __m512 qv[NC], acc[16];
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(w.q.data() + qi * d + 16 * c);
      for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
      for (int c = 0; c < NC; ++c)
        for (int k = 0; k < 16; ++k) acc[k] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kb + k * d + 16 * c), acc[k]);
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
      for (int64_t j = 0; j < done; j += 16) _mm512_storeu_ps(s + j, fexp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift)));
    }
    std::fill(s + std::min(done, Lp), s + Lp, 0.0f);
  }
  // sum_j p_j v_j and sum_j p_j, QR queries at a time (then the rest together), each in j order
  if (!copy_v) return weigh_some<NC, QR, T>(Q, w, vrow, vs[2], top, 0, Lp, out, row, kh, g, nt, t0);
  int64_t q0 = 0;
  for (; q0 + QR <= Q; q0 += QR) weigh_values<NC, QR, T>(w, w.v.data(), d, top, q0, Lp, out, row, kh, g, nt, t0);
  if (q0 < Q) weigh_some<NC, QR, T>(Q - q0, w, w.v.data(), d, top, q0, Lp, out, row, kh, g, nt, t0);
}

// Every (row, KV head, run of positions) tile, dealt round robin to the threads (runs late in a causal chunk
// attend more: the deal evens the work out).
template <int NC, typename T>
void attention_tiled(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                     const at::Tensor& out) {
  const int64_t b = q.size(0), Hk = keys.size(1), n = q.size(2), g = q.size(1) / Hk;
  const int64_t threads = at::get_num_threads();
  int64_t run = std::max<int64_t>(1, std::min<int64_t>(n, 48 / g));
  while (run > 4 && b * Hk * ((n + run - 1) / run) < 4 * threads) run /= 2;
  const int64_t runs = (n + run - 1) / run, items = b * Hk * runs;
  const int64_t macs = 2 * b * q.size(1) * n * mask.size(3) * q.size(3);  // an upper bound (causal chunks attend less)
  at::parallel_for(0, threads, attention_grain(threads, macs), [&](int64_t begin, int64_t end) {
    TileScratch w;
    for (int64_t tid = begin; tid < end; ++tid)
      for (int64_t item = tid; item < items; item += threads) {
        const int64_t r = item / (b * Hk), row = item % (b * Hk) / Hk, kh = item % Hk;
        attend_tile<NC, T>(q, keys, values, mask, out, row, kh, r * run, std::min(n, (r + 1) * run), w);
      }
  });
}

template <typename T>
bool attention_tiled_if(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                        const at::Tensor& out) {
  switch (q.size(3)) {
    case 32: attention_tiled<2, T>(q, keys, values, mask, out); return true;
    case 64: attention_tiled<4, T>(q, keys, values, mask, out); return true;
    case 128: attention_tiled<8, T>(q, keys, values, mask, out); return true;
    default: return false;
  }
}
#endif

// The paths (argument `path`; fused.py picks one, VERISPEC_ATTENTION_PATH forces one): 2 tiles of queries per KV
// head (AVX-512, d = 32, 64 or 128; else path 1), 1 one query at a time in AVX-512 (else path 0), 0 scalar. Every
// path gives the same bits.
enum { SCALAR = 0, VECTOR = 1, TILED = 2 };

template <typename T>
void attention_path(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                    const at::Tensor& out, int64_t path) {
#if defined(__AVX512F__)
  if (path >= TILED && attention_tiled_if<T>(q, keys, values, mask, out)) return;
#endif
  attention_impl<T>(q, keys, values, mask, out, path >= VECTOR);
}

// q [b, H, n, d], keys / values [b, Hk, max_len, d], mask [b, 1, n, L] (additive; L <= max_len), one dtype, each
// with a contiguous last dimension -> [b, H, n, d] (a view of [b, n, H, d] memory: the output projection's rows).
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
                     int64_t path) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 4, "attention: 4-d tensors");
  TORCH_CHECK(keys.sizes() == values.sizes() && q.size(0) == keys.size(0) && q.size(3) == keys.size(3),
              "attention: q [b, H, n, d] and keys / values [b, Hk, max_len, d]");
  TORCH_CHECK(q.size(1) % keys.size(1) == 0, "attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(mask.size(0) == q.size(0) && mask.size(1) == 1 && mask.size(2) == q.size(2) &&
              mask.size(3) <= keys.size(2), "attention: mask [b, 1, n, L <= max_len]");
  for (const auto* t : {&q, &keys, &values, &mask}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->stride(3) == 1, "attention: one dtype, last dim contiguous");
  }
  auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
  if (q.scalar_type() == at::kFloat) {
    attention_path<float>(q, keys, values, mask, out, path);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "attention: float32 or bfloat16");
    attention_path<bf16>(q, keys, values, mask, out, path);
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

// ---- rotary and cache writes -----------------------------------------------------------------------------------

// Hugging Face's rotary in torch's rounding: a = x * cos (rounded to the dtype), y = a + rotate_half(x) * sin as
// one fused multiply-add in fp32, rounded to the dtype once: what `torch.addcmul(x * cos, rotated, sin)` computes
// on this CPU (its vectorized kernel is contracted to an FMA; measured bitwise, fp32 and bf16).
template <typename T>
void rotary_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& index,
                 const at::Tensor& keys, const at::Tensor& values, int64_t H, const at::Tensor& q_out) {
  const int64_t b = qkv.size(0), n = qkv.size(1), Hk = keys.size(1), d = keys.size(3), half = d / 2;
  const auto xs = qkv.strides(), cs = cos.strides(), ss = sin.strides(), ks = keys.strides(), vs = values.strides();
  const auto is = index.strides();
  const T *xp = ptr<T>(qkv), *cp = ptr<T>(cos), *sp = ptr<T>(sin);
  const int64_t* ip = index.data_ptr<int64_t>();
  T *kp = mut<T>(keys), *vp = mut<T>(values), *qp = mut<T>(q_out);
  std::atomic<bool> bad{false};
  at::parallel_for(0, b * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / n, t = item % n, at_ = ip[row * is[0] + t * is[1]];
      if (at_ < 0 || at_ >= keys.size(2)) {
        bad = true;
        continue;
      }
      const T* x = xp + row * xs[0] + t * xs[1];
      const T* c = cp + row * cs[0] + t * cs[2];
      const T* s = sp + row * ss[0] + t * ss[2];
      for (int64_t head = 0; head < H + 2 * Hk; ++head) {
        const T* xh = x + head * d;
        T* dst = head < H ? qp + (item * H + head) * d
                          : head < H + Hk ? kp + row * ks[0] + (head - H) * ks[1] + at_ * ks[2]
                                          : vp + row * vs[0] + (head - H - Hk) * vs[1] + at_ * vs[2];
        if (head >= H + Hk) {  // v: as it is
          std::memcpy(dst, xh, d * sizeof(T));
          continue;
        }
        for (int64_t i = 0; i < d; ++i) {
          const float r = i < half ? -to_f(xh[i + half]) : to_f(xh[i - half]);
          const float a = round_to<T>(to_f(xh[i]) * to_f(c[i]));
          dst[i] = from_f<T>(std::fma(r, to_f(s[i]), a));
        }
      }
    }
  });
  TORCH_CHECK(!bad, "rotary_write: cache index out of range");
}

// qkv [b, n, (H + 2 Hk) d] (the fused projection's output), cos / sin [b, 1, n, d], index [b, n] cache indices,
// keys / values [b, Hk, max_len, d] (written at index) -> rotated q [b, H, n, d] (a view of [b, n, H, d] memory).
at::Tensor rotary_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& index,
                        const at::Tensor& keys, const at::Tensor& values, int64_t num_heads) {
  const int64_t b = qkv.size(0), n = qkv.size(1), Hk = keys.size(1), d = keys.size(3);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) == (num_heads + 2 * Hk) * d && qkv.stride(2) == 1,
              "rotary_write: qkv [b, n, (H + 2 Hk) d], last dim contiguous");
  TORCH_CHECK(d % 2 == 0 && keys.sizes() == values.sizes() && keys.size(0) == b && keys.stride(3) == 1 &&
              values.stride(3) == 1, "rotary_write: keys / values [b, Hk, max_len, d]");
  TORCH_CHECK(cos.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(0) == b && cos.size(2) == n &&
              cos.size(3) == d && cos.stride(3) == 1 && sin.stride(3) == 1, "rotary_write: cos / sin [b, 1, n, d]");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == b && index.size(1) == n && index.scalar_type() == at::kLong,
              "rotary_write: index [b, n] long");
  for (const auto* t : {&cos, &sin, &keys, &values}) {
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rotary_write: one dtype");
  }
  auto q = at::empty({b, n, num_heads, d}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rotary_impl<float>(qkv, cos, sin, index, keys, values, num_heads, q);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rotary_write: float32 or bfloat16");
    rotary_impl<bf16>(qkv, cos, sin, index, keys, values, num_heads, q);
  }
  return q.transpose(1, 2);
}

// ---- RMSNorm ---------------------------------------------------------------------------------------------------

// Per row: (s = x + residual, rounded to the dtype, when a residual is given), then
// weight * (s32 * rsqrt(mean(s32^2) + eps)).to(dtype), as Hugging Face's LlamaRMSNorm rounds; only the order of
// the sum of squares differs from torch's `mean` (LANES partial sums, then halved pairwise).
template <typename T>
void rms_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
              const at::Tensor& sum, const at::Tensor& out) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const T *xp = ptr<T>(x), *rp = residual ? ptr<T>(*residual) : nullptr, *wp = ptr<T>(weight);
  T *sp = residual ? mut<T>(sum) : nullptr, *op = mut<T>(out);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> v(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * hidden;
      if (rp) {
        const T* rr = rp + r * hidden;
        T* sr = sp + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          sr[i] = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
          v[i] = to_f(sr[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) v[i] = to_f(xr[i]);
      }
      float acc[LANES] = {0};
      const int64_t body = hidden - hidden % LANES;
      for (int64_t c = 0; c < body; c += LANES)
        for (int64_t l = 0; l < LANES; ++l) acc[l] += v[c + l] * v[c + l];
      for (int64_t i = body; i < hidden; ++i) acc[i - body] += v[i] * v[i];
      for (int64_t w = LANES / 2; w > 0; w /= 2)
        for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
      const float inv = 1.0f / std::sqrt(acc[0] / static_cast<float>(hidden) + epsf);
      T* o = op + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = from_f<T>(to_f(wp[i]) * round_to<T>(v[i] * inv));
    }
  });
}

// x [..., hidden] (contiguous), residual like x or None, weight [hidden] -> [x + residual (or x), normed]
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(-1) &&
              weight.scalar_type() == x.scalar_type(), "rms_norm: contiguous x [..., hidden], weight [hidden]");
  const at::Tensor* res = residual.has_value() ? &*residual : nullptr;
  if (res) {
    TORCH_CHECK(res->is_contiguous() && res->sizes() == x.sizes() && res->scalar_type() == x.scalar_type(),
                "rms_norm: residual like x");
  }
  auto sum = res ? at::empty_like(x) : x;
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_impl<float>(x, res, weight, eps, sum, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
    rms_impl<bf16>(x, res, weight, eps, sum, out);
  }
  return {sum, out};
}

// ---- silu(gate) * up -------------------------------------------------------------------------------------------

template <typename T> void silu_impl(const at::Tensor& x, const at::Tensor& out) {
  const int64_t width = out.size(-1), rows = out.numel() / width;
  const T* xp = ptr<T>(x);
  T* op = mut<T>(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *gate = xp + r * 2 * width, *up = gate + width;
      T* o = op + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = to_f(gate[i]);
        o[i] = from_f<T>(round_to<T>(g / (1.0f + fexp(-g))) * to_f(up[i]));
      }
    }
  });
}

// gate_up [..., 2 I] (contiguous: gate, then up) -> silu(gate) * up [..., I]: silu rounded to the dtype, then the
// product (F.silu(gate) * up's roundings; silu's exp is fexp's, within an ulp of torch's).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: contiguous [..., 2 I]");
  auto shape = gate_up.sizes().vec();
  shape.back() /= 2;
  auto out = at::empty(shape, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_impl<float>(gate_up, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16");
    silu_impl<bf16>(gate_up, out);
  }
  return out;
}

}  // namespace

#include "layer_loop.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "softmax(q k^T / sqrt(d) + mask) v in one fixed order (invariant); path 2 tiled, "
        "1 one query at a time, 0 scalar");
  m.def("attention_paths", &attention_paths, "the attention paths built, best first");
  m.def("rotary_write", &rotary_write, "rotary on q and k, k and v written into the cache -> q");
  m.def("rms_norm", &rms_norm, "RMSNorm (after an optional residual add) -> [sum, normed]");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  py::class_<LayerLoop>(m, "LayerLoop", "every decoder layer of a step in one call (layer_loop.h)")
      .def(py::init<const std::vector<std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t,
                                                             int64_t, int64_t>>>&,
                    const std::vector<std::pair<at::Tensor, at::Tensor>>&, int64_t, double, int64_t, int64_t>())
      .def("run", &LayerLoop::run)
      .def_property_readonly("num_layers", &LayerLoop::num_layers);
}
