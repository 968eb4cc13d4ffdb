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
//   qk_norm      Gemma's RMSNorm of q and k per head
//   gelu_mul     gelu_tanh(gate) * up (Gemma)
#include "layer_loop.h"  // layer_ops.h, attention.h, layer_common.h

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_pool", &verispec_pool::use_pool, "run parallel regions on the work pool whose table (pool_api.h) is at this address");
  m.def("attention", &attention, "softmax(q k^T / sqrt(d) + mask) v in one fixed order (invariant); path 2 tiled, "
        "1 one query at a time, 0 scalar");
  m.def("attention_paths", &attention_paths, "the attention paths built, best first");
  m.def("rotary_write", &rotary_write, "rotary on q and k, k and v written into the cache -> q");
  m.def("rms_norm", &rms_norm, "RMSNorm (after an optional residual add) -> [sum, normed]");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("qk_norm", &qk_norm, "q and k of a fused projection RMSNormed per head, v copied");
  m.def("gelu_mul", &gelu_mul, "gelu_tanh(gate) * up");
  py::class_<LlamaLoop>(m, "LlamaLoop", "every decoder layer of a step in one call (layer_loop.h)")
      .def(py::init<const std::vector<std::vector<LinearArgs>>&, const std::vector<std::pair<at::Tensor, at::Tensor>>&,
                    int64_t, double, int64_t, int64_t>())
      .def("run", &LlamaLoop::run)
      .def_property_readonly("num_layers", &LlamaLoop::num_layers);
  py::class_<GemmaLoop>(m, "GemmaLoop", "every Gemma 3 decoder layer of a step in one call (layer_loop.h)")
      .def(py::init<const std::vector<std::vector<LinearArgs>>&, const std::vector<std::vector<at::Tensor>>&,
                    const std::vector<bool>&, int64_t, int64_t, double, int64_t, int64_t>())
      .def("run", &GemmaLoop::run)
      .def_property_readonly("num_layers", &GemmaLoop::num_layers);
}
