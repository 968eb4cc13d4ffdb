// The layer kernel's shared helpers (layer_kernel.cpp's header comment states the arithmetic contract): fp32 and
// bf16 conversions, exp, dot products and weighted sums in one fixed order, and the tensor pointer helpers.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "parallel.h"
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

// IEEE half bits: a KV cache's 16-bit entries (--kv-cache-dtype float16). A distinct type, so the overloads below
// tell it from bf16; converted exactly to fp32 and rounded to nearest even from it, as torch's .half() does.
struct f16 {
  uint16_t bits;
};
inline float to_f(f16 v) { return c10::detail::fp16_ieee_to_fp32_value(v.bits); }  // exact
template <> inline f16 from_f<f16>(float f) { return f16{c10::detail::fp16_ieee_from_fp32_value(f)}; }

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

inline __m512 load16(const f16* p, __mmask16 m) {  // half -> fp32, exact
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
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
    case 256: return accumulate16<16>(p, v, stride, L, out);
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

}  // namespace
