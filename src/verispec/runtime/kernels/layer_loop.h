// The decoder layers of one native step in one C++ call (runtime/kernels/layer_loop.py builds the plan; layer_kernel.cpp
// exports `LayerLoop`).
//
// It runs, layer after layer, exactly the calls `llama.layer_parts` makes on its fused path, with the same
// arguments in the same order: RMSNorm (+ the previous layer's MLP output), the q/k/v linear, rotary_write,
// attention, the output linear, RMSNorm (+ residual), the gate/up linear, silu_mul, the down linear. Every op is the
// same function Python would reach (this file's ops; the linears through quant_kernel.cpp's `quant_linear` and
// dense_kernel.cpp's `dense_linear`, whose addresses those extensions export), so the results are bitwise the
// Python loop's; what goes is the Python between the ~270 calls of a step (dispatch, views, wrappers).
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

class LayerLoop {
 public:
  // linears: per layer [qkv, o, gate_up, down], each (kind, data, scales, bias, qtype, in, out); norms: per layer
  // (attention norm, MLP norm); quant_fn / dense_fn: the kernels' addresses (0 where a kind is not used).
  LayerLoop(const std::vector<std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t,
                                                     int64_t>>>& linears,
            const std::vector<std::pair<at::Tensor, at::Tensor>>& norms, int64_t num_heads, double eps,
            int64_t quant_fn, int64_t dense_fn)
      : num_heads_(num_heads), eps_(eps), quant_(reinterpret_cast<QuantLinearFn>(quant_fn)),
        dense_(reinterpret_cast<DenseLinearFn>(dense_fn)) {
    TORCH_CHECK(linears.size() == norms.size(), "LayerLoop: one set of linears and norms per layer");
    auto make = [&](const auto& t) {
      LoopLinear l{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t), std::get<5>(t),
                   std::get<6>(t)};
      TORCH_CHECK(l.kind == QUANT ? quant_ != nullptr : (l.kind == DENSE_PACKED && dense_ != nullptr),
                  "LayerLoop: a linear's kernel is missing");
      return l;
    };
    for (size_t i = 0; i < linears.size(); ++i) {
      TORCH_CHECK(linears[i].size() == 4, "LayerLoop: qkv, o, gate_up, down per layer");
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
                "LayerLoop.run: one key and one value buffer per layer");
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

  std::vector<LoopLayer> layers_;
  int64_t num_heads_;
  double eps_;
  QuantLinearFn quant_;
  DenseLinearFn dense_;
};

}  // namespace
