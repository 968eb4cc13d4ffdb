// The native layer's small ops and the attention entry point as torch sees them (layer_kernel.cpp exports them;
// layer_loop.h calls them directly): rotary and cache writes, RMSNorm, silu * up; Gemma's q/k norms per head and
// gelu_tanh * up.
#pragma once
#include "attention.h"

namespace {

// ---- rotary and cache writes -----------------------------------------------------------------------------------

// Hugging Face's rotary in torch's rounding: a = x * cos (rounded to the dtype), y = a + rotate_half(x) * sin as
// one fused multiply-add in fp32, rounded to the dtype once: what `torch.addcmul(x * cos, rotated, sin)` computes
// on this CPU (its vectorized kernel is contracted to an FMA; measured bitwise, fp32 and bf16). A cache of another
// dtype C (a 16-bit cache) holds each k and v entry as the dtype T gives it, rounded once more to C (nearest even):
// per entry, so an entry's bits never depend on the other rows.
template <typename T, typename C>
void rotary_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& index,
                 const at::Tensor& keys, const at::Tensor& values, int64_t H, const at::Tensor& q_out) {
  const int64_t b = qkv.size(0), n = qkv.size(1), Hk = keys.size(1), d = keys.size(3), half = d / 2;
  const auto xs = qkv.strides(), cs = cos.strides(), ss = sin.strides(), ks = keys.strides(), vs = values.strides();
  const auto is = index.strides();
  const T *xp = ptr<T>(qkv), *cp = ptr<T>(cos), *sp = ptr<T>(sin);
  const int64_t* ip = index.data_ptr<int64_t>();
  C *kp = mut<C>(keys), *vp = mut<C>(values);
  T* qp = mut<T>(q_out);
  std::atomic<bool> bad{false};
  verispec_pool::parallel_for(0, b * n, 16, [&](int64_t begin, int64_t end) {
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
        if (head >= H + Hk) {  // v: as it is
          C* dst = vp + row * vs[0] + (head - H - Hk) * vs[1] + at_ * vs[2];
          if constexpr (std::is_same<T, C>::value) {
            std::memcpy(dst, xh, d * sizeof(T));
          } else {
            for (int64_t i = 0; i < d; ++i) dst[i] = from_f<C>(to_f(xh[i]));
          }
          continue;
        }
        const auto rotated = [&](int64_t i) {
          const float r = i < half ? -to_f(xh[i + half]) : to_f(xh[i - half]);
          const float a = round_to<T>(to_f(xh[i]) * to_f(c[i]));
          return from_f<T>(std::fma(r, to_f(s[i]), a));
        };
        if (head < H) {
          T* dst = qp + (item * H + head) * d;
          for (int64_t i = 0; i < d; ++i) dst[i] = rotated(i);
        } else {
          C* dst = kp + row * ks[0] + (head - H) * ks[1] + at_ * ks[2];
          for (int64_t i = 0; i < d; ++i) dst[i] = from_f<C>(to_f(rotated(i)));
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
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
              values.scalar_type() == keys.scalar_type(), "rotary_write: cos / sin in qkv's dtype, values in the keys'");
  auto q = at::empty({b, n, num_heads, d}, qkv.options());
  const auto write = [&](auto activations) {  // the cache: qkv's dtype, or float16 / bfloat16
    using T = decltype(activations);
    if (keys.scalar_type() == qkv.scalar_type()) return rotary_impl<T, T>(qkv, cos, sin, index, keys, values, num_heads, q);
    if (keys.scalar_type() == at::kHalf) return rotary_impl<T, f16>(qkv, cos, sin, index, keys, values, num_heads, q);
    TORCH_CHECK(keys.scalar_type() == at::kBFloat16, "rotary_write: a cache of qkv's dtype, float16 or bfloat16");
    rotary_impl<T, bf16>(qkv, cos, sin, index, keys, values, num_heads, q);
  };
  if (qkv.scalar_type() == at::kFloat) {
    write(float{});
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rotary_write: float32 or bfloat16");
    write(bf16{});
  }
  return q.transpose(1, 2);
}

// ---- RMSNorm ---------------------------------------------------------------------------------------------------

// One row's RMSNorm of v [hidden] (fp32 values, already rounded to T) into o: weight * (v * rsqrt(mean(v^2) +
// eps)).to(T), as Hugging Face's LlamaRMSNorm rounds; only the order of the sum of squares differs from torch's
// `mean` (LANES partial sums, then halved pairwise).
template <typename T>
inline void rms_row(const float* v, int64_t hidden, const T* weight, float eps, T* o) {
  float acc[LANES] = {0};
  const int64_t body = hidden - hidden % LANES;
  for (int64_t c = 0; c < body; c += LANES)
    for (int64_t l = 0; l < LANES; ++l) acc[l] += v[c + l] * v[c + l];
  for (int64_t i = body; i < hidden; ++i) acc[i - body] += v[i] * v[i];
  for (int64_t w = LANES / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  const float inv = 1.0f / std::sqrt(acc[0] / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) o[i] = from_f<T>(to_f(weight[i]) * round_to<T>(v[i] * inv));
}

// Per row: (s = x + residual, rounded to the dtype, when a residual is given), then its RMSNorm (rms_row).
template <typename T>
void rms_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
              const at::Tensor& sum, const at::Tensor& out) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const T *xp = ptr<T>(x), *rp = residual ? ptr<T>(*residual) : nullptr, *wp = ptr<T>(weight);
  T *sp = residual ? mut<T>(sum) : nullptr, *op = mut<T>(out);
  const float epsf = static_cast<float>(eps);
  verispec_pool::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
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
      rms_row<T>(v.data(), hidden, wp, epsf, op + r * hidden);
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

// ---- q and k normed per head (Gemma) --------------------------------------------------------------------------

template <typename T>
void qk_norm_impl(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, int64_t H, int64_t Hk,
                  double eps, const at::Tensor& out) {
  const int64_t d = q_norm.numel(), width = (H + 2 * Hk) * d, items = qkv.numel() / width;
  const T *xp = ptr<T>(qkv), *qw = ptr<T>(q_norm), *kw = ptr<T>(k_norm);
  T* op = mut<T>(out);
  const float epsf = static_cast<float>(eps);
  verispec_pool::parallel_for(0, items, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> v(d);
    for (int64_t item = begin; item < end; ++item) {
      const T* x = xp + item * width;
      T* o = op + item * width;
      for (int64_t head = 0; head < H + Hk; ++head) {
        for (int64_t i = 0; i < d; ++i) v[i] = to_f(x[head * d + i]);
        rms_row<T>(v.data(), d, head < H ? qw : kw, epsf, o + head * d);
      }
      std::memcpy(o + (H + Hk) * d, x + (H + Hk) * d, Hk * d * sizeof(T));  // v: as it is
    }
  });
}

// qkv [b, n, (H + 2 Hk) d] (contiguous: the fused projection's output), q_norm / k_norm [d] -> the same layout with
// each q head RMSNormed by q_norm and each k head by k_norm (rms_norm's roundings, per head row), v copied.
at::Tensor qk_norm(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, int64_t num_heads,
                   int64_t num_kv_heads, double eps) {
  const int64_t d = q_norm.numel();
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(-1) == (num_heads + 2 * num_kv_heads) * d && k_norm.numel() == d &&
              q_norm.is_contiguous() && k_norm.is_contiguous() && q_norm.scalar_type() == qkv.scalar_type() &&
              k_norm.scalar_type() == qkv.scalar_type(), "qk_norm: contiguous qkv [..., (H + 2 Hk) d], norms [d]");
  auto out = at::empty_like(qkv);
  if (qkv.scalar_type() == at::kFloat) {
    qk_norm_impl<float>(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps, out);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "qk_norm: float32 or bfloat16");
    qk_norm_impl<bf16>(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps, out);
  }
  return out;
}

// ---- gated activations: silu(gate) * up (Llama), gelu_tanh(gate) * up (Gemma) -----------------------------------

// silu(g) = g / (1 + exp(-g)) (fexp's exp, within an ulp of torch's)
struct Silu {
  static float of(float g) { return g / (1.0f + fexp(-g)); }
};

// the tanh-approximated GELU 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), computed as
// g / (1 + exp(-2 u)) (the same function; fexp's exp): within a few ulps of torch's
struct GeluTanh {
  static float of(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    return g / (1.0f + fexp(-2.0f * u));
  }
};

template <typename Act, typename T> void gated_impl(const at::Tensor& x, const at::Tensor& out) {
  const int64_t width = out.size(-1), rows = out.numel() / width;
  const T* xp = ptr<T>(x);
  T* op = mut<T>(out);
  verispec_pool::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *gate = xp + r * 2 * width, *up = gate + width;
      T* o = op + r * width;
      for (int64_t i = 0; i < width; ++i) o[i] = from_f<T>(round_to<T>(Act::of(to_f(gate[i]))) * to_f(up[i]));
    }
  });
}

// gate_up [..., 2 I] (contiguous: gate, then up) -> act(gate) * up [..., I]: the activation rounded to the dtype,
// then the product (F.silu(gate) * up's, F.gelu(gate, approximate="tanh") * up's roundings).
template <typename Act> at::Tensor gated_mul(const at::Tensor& gate_up, const char* name) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, name, ": contiguous [..., 2 I]");
  auto shape = gate_up.sizes().vec();
  shape.back() /= 2;
  auto out = at::empty(shape, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    gated_impl<Act, float>(gate_up, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
    gated_impl<Act, bf16>(gate_up, out);
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated_mul<Silu>(gate_up, "silu_mul"); }
at::Tensor gelu_mul(const at::Tensor& gate_up) { return gated_mul<GeluTanh>(gate_up, "gelu_mul"); }

}  // namespace
