// The native layer's small ops and attention in C++ for verispec (runtime/kernels/fused.py builds it through ext.py).
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

#include "attention.h"

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
