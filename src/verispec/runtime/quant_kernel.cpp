// Weight-only quantized GEMV/GEMM for verispec (runtime/quant.py builds it with torch.utils.cpp_extension).
//
// y[r, o] = sum_i w[o, i] * x[r, i], with w[o, i] dequantized exactly as gguf-py does it (in float32, one rounding
// per operation, no fused multiply-add: this file is built with -ffp-contract=off):
//   Q4_0: d * (q - 8)    Q4_1: d * q + m    Q8_0: d * q    INT8 (per output channel): scale[o] * q
// so the model is the same as the fp32 conversion's; only the summation order differs.
// Row invariance: a row's sum runs through the same 16 lanes in the same order whatever the number of rows in
// the call (rows are taken 8 at a time and each keeps its own accumulator), and threads split output channels.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, INT8 = 100 };
constexpr int64_t QK = 32;  // elements per block (Q4_0, Q4_1, Q8_0)
constexpr int64_t ROWS = 8;  // rows sharing one dequantized block

inline float half_at(const uint8_t* p) {  // fp16 -> fp32 is exact
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The 32 weights of block b of one output channel into w[32] (exactly gguf-py's values).
inline void dequant_block(int64_t qtype, const uint8_t* row, int64_t b, float scale, float* w) {
  if (qtype == Q4_0) {
    const uint8_t* blk = row + b * 18;
    const float d = half_at(blk);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(static_cast<int>(blk[2 + j] & 0x0F) - 8);
      w[j + 16] = d * static_cast<float>(static_cast<int>(blk[2 + j] >> 4) - 8);
    }
  } else if (qtype == Q4_1) {
    const uint8_t* blk = row + b * 20;
    const float d = half_at(blk), m = half_at(blk + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(blk[4 + j] & 0x0F) + m;
      w[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
    }
  } else if (qtype == Q8_0) {
    const uint8_t* blk = row + b * 34;
    const float d = half_at(blk);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
  } else {  // INT8: row holds int8 weights, scale is the channel's
    const int8_t* q = reinterpret_cast<const int8_t*>(row) + b * QK;
    for (int j = 0; j < 32; ++j) w[j] = scale * static_cast<float>(q[j]);
  }
}

#if defined(__AVX512F__)
// Same values as dequant_block, 16 lanes at a time: lo = elements 0..15, hi = 16..31.
// A 4-bit block's 16 possible values are made once (table[k] = d * k + m: d * k is exact in float32, an fp16
// times a 4-bit integer, so the fused multiply-add rounds once, as gguf-py's two operations do) and looked up by
// nibble (a lane permute reads only an index's low 4 bits: the low nibble needs no mask).
inline void dequant_block_avx512(int64_t qtype, const uint8_t* row, int64_t b, float scale, __m512& lo, __m512& hi) {
  if (qtype == Q4_1 || qtype == Q4_0) {
    const bool q41 = qtype == Q4_1;
    const uint8_t* blk = row + b * (q41 ? 20 : 18);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (q41 ? 4 : 2))));
    const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 d = _mm512_set1_ps(half_at(blk));
    const __m512 table = q41 ? _mm512_fmadd_ps(d, k, _mm512_set1_ps(half_at(blk + 2)))
                             : _mm512_mul_ps(d, _mm512_sub_ps(k, _mm512_set1_ps(8.0f)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const bool q80 = qtype == Q8_0;
    const uint8_t* q = q80 ? row + b * 34 + 2 : row + b * QK;
    const __m512 d = _mm512_set1_ps(q80 ? half_at(row + b * 34) : scale);
    const __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    const __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    lo = _mm512_mul_ps(d, flo);
    hi = _mm512_mul_ps(d, fhi);
  }
}

// NR rows (a compile-time count, so the accumulators stay in registers) against one output channel.
template <int NR>
inline void channel_rows(int64_t qtype, const uint8_t* row, int64_t blocks, float scale, const float* x, int64_t in,
                         float* y, int64_t out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo, hi;
    dequant_block_avx512(qtype, row, b, scale, lo, hi);
    for (int r = 0; r < NR; ++r) {
      const float* xr = x + r * in + b * QK;
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
      acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) y[r * out] = _mm512_reduce_add_ps(acc[r]);
}

using ChannelRows = void (*)(int64_t, const uint8_t*, int64_t, float, const float*, int64_t, float*, int64_t);
constexpr ChannelRows CHANNEL_ROWS[ROWS + 1] = {nullptr, channel_rows<1>, channel_rows<2>, channel_rows<3>,
                                                channel_rows<4>, channel_rows<5>, channel_rows<6>, channel_rows<7>,
                                                channel_rows<8>};
#endif

}  // namespace

// x [rows, in] float32, data [out, row_bytes] uint8, scales [out] float32 (INT8 only, else empty) -> [rows, out]
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, torch::Tensor scales, int64_t qtype, int64_t in) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == in, "x must be float32 [rows, in]");
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  TORCH_CHECK(in % QK == 0, "in must be a multiple of 32");
  x = x.contiguous();
  const int64_t rows = x.size(0), out = data.size(0), row_bytes = data.size(1), blocks = in / QK;
  auto y = torch::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const float* sp = qtype == INT8 ? scales.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row = dp + o * row_bytes;
      const float scale = sp ? sp[o] : 0.0f;
      for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
        const int64_t nr = std::min(ROWS, rows - r0);
#if defined(__AVX512F__)
        CHANNEL_ROWS[nr](qtype, row, blocks, scale, xp + r0 * in, in, yp + r0 * out + o, out);
#else
        float acc[ROWS][16] = {};
        float w[QK];
        for (int64_t b = 0; b < blocks; ++b) {
          dequant_block(qtype, row, b, scale, w);
          for (int64_t r = 0; r < nr; ++r) {
            const float* xr = xp + (r0 + r) * in + b * QK;
            for (int j = 0; j < 16; ++j) acc[r][j] += w[j] * xr[j] + w[j + 16] * xr[j + 16];
          }
        }
        for (int64_t r = 0; r < nr; ++r) {
          float s = 0.0f;
          for (int j = 0; j < 16; ++j) s += acc[r][j];
          yp[(r0 + r) * out + o] = s;
        }
#endif
      }
    }
  });
  return y;
}

// data [n, row_bytes] -> [n, in] float32: the dequantized weights (the embedding's rows, tests).
torch::Tensor dequantize(torch::Tensor data, torch::Tensor scales, int64_t qtype, int64_t in) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  const int64_t n = data.size(0), row_bytes = data.size(1), blocks = in / QK;
  auto w = torch::empty({n, in}, torch::kFloat32);
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const float* sp = qtype == INT8 ? scales.data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t b = 0; b < blocks; ++b) dequant_block(qtype, dp + o * row_bytes, b, sp ? sp[o] : 0.0f, wp + o * in + b * QK);
  });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "x @ dequant(W)^T, weight-only quantized");
  m.def("dequantize", &dequantize, "dequantized rows");
}
