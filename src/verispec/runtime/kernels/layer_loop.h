// The decoder layers of one native step in one C++ call (runtime/kernels/layer_loop.py builds the plan; layer_kernel.cpp
// exports `LlamaLoop`).
//
// It runs, layer after layer, exactly the calls `llama.layer_parts` makes on its fused path, with the same
// arguments in the same order: RMSNorm (+ the previous layer's MLP output), the q/k/v linear, rotary_write,
// attention, the output linear, RMSNorm (+ residual), the gate/up linear, silu_mul, the down linear. Every op is the
// same function Python would reach (this file's ops; the linears through quant_kernel.cpp's `quant_linear` and
// dense_kernel.cpp's `dense_linear`, whose addresses those extensions export), so the results are bitwise the
// Python loop's; what goes is the Python between the ~270 calls of a step (dispatch, views, wrappers).
// `GemmaLoop` does the same for `gemma.layer_parts`: four norms a layer, q/k normed per head, two rotary tables and
// two masks (sliding and global layers), gelu_tanh * up.
// Invariant kept: a linear here does what `llama.linear` / `QuantWeight.linear` / `dense.linear` do around their
// kernel (rows flattened, dtype conversions, the quantized linear's bias added in fp32 after the kernel).

#pragma once
#include "layer_ops.h"

namespace {

// quant_kernel.cpp's quant_linear(x [rows, in] f32, data, scales, qtype, in, out, path) -> [rows, out] f32
using QuantLinearFn = at::Tensor (*)(at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, int64_t);
// dense_kernel.cpp's dense_linear(x [rows, in], packed, bias f32 [out] or empty, path) -> [rows, out]
using DenseLinearFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);

enum { QUANT = 0, DENSE_PACKED = 1 };

// One linear of a layer: a QuantWeight's kernel arguments, or a dense packed weight (runtime/kernels/dense.py's layout).
struct LoopLinear {
  int64_t kind;
  at::Tensor data;    // QuantWeight.packed, or dense.pack's weight
  at::Tensor scales;  // QuantWeight._scales_arg (empty but for int8); dense: unused
  at::Tensor bias;    // [out] (dense: float32) or empty
  int64_t qtype, in, out;  // (qtype, in: the quantized kernel's arguments)
};

struct LoopLayer {
  LoopLinear qkv, o, gate_up, down;
  at::Tensor attn_norm, mlp_norm;  // [hidden]
};

using LinearArgs = std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t>;

// The linears of a loop: their kernels, and a linear run as `llama.linear` reaches the kernel.
class LoopKernels {
 protected:
  // quant_fn / dense_fn: the kernels' addresses (0 where a kind is not used).
  LoopKernels(int64_t quant_fn, int64_t dense_fn)
      : quant_(reinterpret_cast<QuantLinearFn>(quant_fn)), dense_(reinterpret_cast<DenseLinearFn>(dense_fn)) {}

  // (kind, data, scales, bias, qtype, in, out) -> the linear, its kernel checked
  LoopLinear make(const LinearArgs& t) const {
    LoopLinear l{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t), std::get<5>(t),
                 std::get<6>(t)};
    TORCH_CHECK(l.kind == QUANT ? quant_ != nullptr : (l.kind == DENSE_PACKED && dense_ != nullptr),
                "LlamaLoop: a linear's kernel is missing");
    return l;
  }

  // x [..., in] -> [..., out], as llama.linear reaches the kernel (QuantWeight.linear, dense.linear).
  at::Tensor linear(const at::Tensor& x, const LoopLinear& l, int64_t quant_path, int64_t dense_path) const {
    at::Tensor rows = x.reshape({-1, x.size(-1)});
    at::Tensor y;
    if (l.kind == QUANT) {
      y = quant_(rows.scalar_type() == at::kFloat ? rows : rows.to(at::kFloat), l.data, l.scales, l.qtype, l.in,
                 l.out, quant_path);
      if (l.bias.numel()) y = y + l.bias;
    } else {
      rows = rows.to(l.data.scalar_type());
      if (rows.stride(-1) != 1) rows = rows.contiguous();
      y = dense_(rows, l.data, l.bias, dense_path);
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(l.out);
    y = y.view(shape);
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }

 private:
  QuantLinearFn quant_;
  DenseLinearFn dense_;
};

class LlamaLoop : LoopKernels {
 public:
  // linears: per layer [qkv, o, gate_up, down], each (kind, data, scales, bias, qtype, in, out); norms: per layer
  // (attention norm, MLP norm); quant_fn / dense_fn: the kernels' addresses (0 where a kind is not used).
  LlamaLoop(const std::vector<std::vector<LinearArgs>>& linears,
            const std::vector<std::pair<at::Tensor, at::Tensor>>& norms, int64_t num_heads, double eps,
            int64_t quant_fn, int64_t dense_fn)
      : LoopKernels(quant_fn, dense_fn), num_heads_(num_heads), eps_(eps) {
    TORCH_CHECK(linears.size() == norms.size(), "LlamaLoop: one set of linears and norms per layer");
    for (size_t i = 0; i < linears.size(); ++i) {
      TORCH_CHECK(linears[i].size() == 4, "LlamaLoop: qkv, o, gate_up, down per layer");
      layers_.push_back({make(linears[i][0]), make(linears[i][1]), make(linears[i][2]), make(linears[i][3]),
                         norms[i].first, norms[i].second});
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [b, n, hidden] (the embedding), cos / sin [b, 1, n, d], index [b, n] cache indices, keys / values per layer
  // [b, Hk, max_len, d] (written at index), mask [b, 1, n, L]; attention's path; quant_path / dense_path: the
  // linears' kernel paths -> (x + attention, MLP output) of the last layer, as `layer_parts` returns them.
  std::vector<at::Tensor> run(const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& index, const std::vector<at::Tensor>& keys,
                              const std::vector<at::Tensor>& values, const at::Tensor& mask, int64_t path,
                              int64_t quant_path, int64_t dense_path) const {
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == num_layers() && keys.size() == values.size(),
                "LlamaLoop.run: one key and one value buffer per layer");
    const int64_t b = embedded.size(0), n = embedded.size(1);
    at::Tensor x = embedded.contiguous(), out;
    std::optional<at::Tensor> pending;  // the previous layer's MLP output, added by this layer's first norm
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LoopLayer& w = layers_[i];
      auto normed = rms_norm(x, pending, w.attn_norm, eps_);
      x = normed[0];
      at::Tensor qkv = linear(normed[1], w.qkv, quant_path, dense_path);  // [b, n, (H + 2 Hk) d]
      at::Tensor q = rotary_write(qkv, cos, sin, index, keys[i], values[i], num_heads_);  // [b, H, n, d]
      at::Tensor attn = attention(q, keys[i], values[i], mask, path);  // [b, H, n, d], [b, n, H, d] in memory
      at::Tensor o = linear(attn.transpose(1, 2).reshape({b, n, -1}), w.o, quant_path, dense_path);
      normed = rms_norm(o, x, w.mlp_norm, eps_);  // (o + x, its norm), as layer_parts' rms_norm(o, residual=x)
      x = normed[0];
      out = linear(silu_mul(linear(normed[1], w.gate_up, quant_path, dense_path)), w.down, quant_path, dense_path);
      pending = out;
    }
    return {x, out};
  }

 private:
  std::vector<LoopLayer> layers_;
  int64_t num_heads_;
  double eps_;
};

// One Gemma layer's weights: its linears, its norms (each held as 1 + w) and its kind.
struct GemmaLayer {
  LoopLinear qkv, o, gate_up, down;
  at::Tensor input_norm, post_attn_norm, pre_mlp_norm, post_mlp_norm;  // [hidden]
  at::Tensor q_norm, k_norm;                                           // [d]
  bool sliding;  // sliding-window (local) attention: the local rotary table and the sliding mask
};

class GemmaLoop : LoopKernels {
 public:
  // linears: per layer [qkv, o, gate_up, down] as LlamaLoop's; norms: per layer (input, post-attention, pre-MLP,
  // post-MLP, q, k); sliding: per layer.
  GemmaLoop(const std::vector<std::vector<LinearArgs>>& linears, const std::vector<std::vector<at::Tensor>>& norms,
            const std::vector<bool>& sliding, int64_t num_heads, int64_t num_kv_heads, double eps, int64_t quant_fn,
            int64_t dense_fn)
      : LoopKernels(quant_fn, dense_fn), num_heads_(num_heads), num_kv_heads_(num_kv_heads), eps_(eps) {
    TORCH_CHECK(linears.size() == norms.size() && linears.size() == sliding.size(),
                "GemmaLoop: one set of linears, norms and a kind per layer");
    for (size_t i = 0; i < linears.size(); ++i) {
      TORCH_CHECK(linears[i].size() == 4 && norms[i].size() == 6,
                  "GemmaLoop: qkv, o, gate_up, down and six norms per layer");
      const auto& n = norms[i];
      layers_.push_back({make(linears[i][0]), make(linears[i][1]), make(linears[i][2]), make(linears[i][3]), n[0],
                         n[1], n[2], n[3], n[4], n[5], sliding[i]});
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [b, n, hidden] (the scaled embedding); rope: (cos, sin) of the global layers, then of the sliding ones, each
  // [b, 1, n, d] (an unused kind's may be empty); indices: global, sliding [b, n] (where a layer of that kind writes
  // each fed token: its cache index, or its ring index); keys / values per layer [b, Hk, entries, d]; masks: global,
  // sliding [b, 1, n, L] over that kind's entries; attention's path; the linears' kernel paths -> (x + normed
  // attention, normed MLP output) of the last layer, as `gemma.layer_parts` returns them.
  std::vector<at::Tensor> run(const at::Tensor& embedded, const std::vector<at::Tensor>& rope,
                              const std::vector<at::Tensor>& indices, const std::vector<at::Tensor>& keys,
                              const std::vector<at::Tensor>& values, const std::vector<at::Tensor>& masks,
                              int64_t path, int64_t quant_path, int64_t dense_path) const {
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == num_layers() && keys.size() == values.size(),
                "GemmaLoop.run: one key and one value buffer per layer");
    TORCH_CHECK(rope.size() == 4 && indices.size() == 2 && masks.size() == 2,
                "GemmaLoop.run: two rotary tables (cos, sin), two indices and two masks");
    const int64_t b = embedded.size(0), n = embedded.size(1);
    at::Tensor x = embedded.contiguous(), out;
    std::optional<at::Tensor> pending;  // the previous layer's normed MLP output, added by this layer's input norm
    for (size_t i = 0; i < layers_.size(); ++i) {
      const GemmaLayer& w = layers_[i];
      const int kind = w.sliding ? 1 : 0;
      auto normed = pending ? rms_norm(*pending, x, w.input_norm, eps_) : rms_norm(x, std::nullopt, w.input_norm, eps_);
      x = normed[0];
      at::Tensor qkv = qk_norm(linear(normed[1], w.qkv, quant_path, dense_path), w.q_norm, w.k_norm, num_heads_,
                               num_kv_heads_, eps_);  // [b, n, (H + 2 Hk) d]
      at::Tensor q = rotary_write(qkv, rope[2 * kind], rope[2 * kind + 1], indices[kind], keys[i], values[i],
                                  num_heads_);
      at::Tensor attn = attention(q, keys[i], values[i], masks[kind], path);  // [b, H, n, d]
      at::Tensor o = linear(attn.transpose(1, 2).reshape({b, n, -1}), w.o, quant_path, dense_path);
      normed = rms_norm(rms_norm(o, std::nullopt, w.post_attn_norm, eps_)[1], x, w.pre_mlp_norm, eps_);
      x = normed[0];  // x + normed attention, as gemma.add_norm
      out = linear(gelu_mul(linear(normed[1], w.gate_up, quant_path, dense_path)), w.down, quant_path, dense_path);
      out = rms_norm(out, std::nullopt, w.post_mlp_norm, eps_)[1];
      pending = out;
    }
    return {x, out};
  }

 private:
  std::vector<GemmaLayer> layers_;
  int64_t num_heads_, num_kv_heads_;
  double eps_;
};

}  // namespace
