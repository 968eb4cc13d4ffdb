// The 5-bit and K-quant GGUF blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) dequantized 32 weights at a time, exactly as
// gguf-py's `dequantize` does it, for quant_common.h's tiles and panels (scalar, AVX2, AVX-512).
//
// The kernels walk every type in units of 32 inputs ("blocks"). Q5_0 / Q5_1 blocks are 32 weights; a K-quant
// super-block holds 256 weights as 8 such units (`s` = 0..7 below), each with its own scale:
//   Q5_0 (22 bytes): d fp16, qh u32 (bit j: element j's fifth bit), qs[16] (low nibble element j, high j + 16)
//                    w = d * (q - 16)
//   Q5_1 (24 bytes): d, m fp16, qh u32, qs[16]                        w = d * q + m
//   Q4_K (144): d, dmin fp16, scales[12] (8 6-bit scales sc and 8 6-bit mins mn, packed), qs[128]: unit s's
//               element e is nibble s % 2 of qs[32 (s / 2) + e]           w = (d * sc[s]) * q - dmin * mn[s]
//   Q5_K (176): d, dmin, scales[12], qh[32] (bit s of qh[e]: unit s's element e's fifth bit), qs[128] as Q4_K
//   Q6_K (210): ql[128], qh[64], scales[16] int8 (one per 16 weights), d fp16: unit s = 4h + k (h = s / 4) has
//               element e's low nibble k / 2 of ql[64h + 32 (k % 2) + e], its high 2 bits (qh[32h + e] >> 2k) & 3
//                                                                          w = (d * sc[2s + e / 16]) * (q - 32)
// Exactness: the fp16 d times an integer scale of <= 8 bits is exact in fp32 (<= 19 significant bits), and that times
// a quant of <= 6 bits is exact too (<= 24 bits); so the only rounding is Q5_1's, Q4_K's and Q5_K's one addition,
// which a fused multiply-add of the exact product gives the same bits as gguf-py's product-then-subtract.
#pragma once
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#define VERISPEC_KQ_INLINE inline __attribute__((always_inline))  // tiles call these per unit: no call, no spills

// GGML type ids (the kernel ids quant.py passes for these types' file layout).
enum KQType : int64_t { Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
constexpr int64_t QK_K = 256;  // weights of a K-quant super-block
constexpr bool k_quant(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
constexpr bool kq_family(int64_t t) { return t == Q5_0 || t == Q5_1 || k_quant(t); }  // decoded by this file
// Bytes of a super-block (K-quants) or block (Q5_0, Q5_1).
constexpr int64_t kq_bytes(int64_t t) {
  return t == Q5_0 ? 22 : t == Q5_1 ? 24 : t == Q4_K ? 144 : t == Q5_K ? 176 : 210;
}
// Where unit b (32 inputs) of a row starts: its (super-)block, and its index inside it.
constexpr int64_t kq_block_offset(int64_t t, int64_t b) { return k_quant(t) ? (b >> 3) * kq_bytes(t) : b * kq_bytes(t); }

VERISPEC_KQ_INLINE float kq_half(const uint8_t* p) {  // fp16 -> fp32 is exact
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction (c10::Half's conversion is a dozen)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K: unit s's 6-bit scale and min from the 12 packed bytes (bytes 0-3: scales 0-3 low 6 bits, their top 2
// bits the high bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11: scales 4-7 low 4 bits, mins' high 4).
VERISPEC_KQ_INLINE void k4_scale_min(const uint8_t* p, int64_t s, int& sc, int& mn) {
  if (s < 4) {
    sc = p[s] & 63;
    mn = p[s + 4] & 63;
  } else {
    sc = (p[s + 4] & 0x0F) | ((p[s - 4] >> 6) << 4);
    mn = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
  }
}

// The affine form of unit s: w = a * q + c (q the unit's unsigned quant; Q5_0 / Q6_K: a * (q - offset), c = 0).
struct KUnit {
  float a[2];  // scale of elements 0..15, 16..31 (differ for Q6_K only)
  float c;     // Q5_1, Q4_K, Q5_K: the added term (m, or -dmin * mn); else 0
  int offset;  // subtracted from q before the scale: 16 (Q5_0), 32 (Q6_K), else 0
};

template <int64_t T>
VERISPEC_KQ_INLINE KUnit kq_unit(const uint8_t* blk, int64_t s) {
  KUnit u{};
  if constexpr (T == Q5_0) {
    u.a[0] = u.a[1] = kq_half(blk);
    u.offset = 16;
  } else if constexpr (T == Q5_1) {
    u.a[0] = u.a[1] = kq_half(blk);
    u.c = kq_half(blk + 2);
  } else if constexpr (T == Q4_K || T == Q5_K) {
    int sc, mn;
    k4_scale_min(blk + 4, s, sc, mn);
    u.a[0] = u.a[1] = kq_half(blk) * static_cast<float>(sc);  // exact
    u.c = -(kq_half(blk + 2) * static_cast<float>(mn));       // exact
  } else {
    const float d = kq_half(blk + 208);
    u.a[0] = d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * s]));  // exact
    u.a[1] = d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * s + 1]));
    u.offset = 32;
  }
  return u;
}

// Unit s's 32 unsigned quants (0..63).
template <int64_t T>
inline void kq_quants(const uint8_t* blk, int64_t s, int* q) {
  if constexpr (T == Q5_0 || T == Q5_1) {
    const int64_t at = T == Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, blk + at, 4);
    const uint8_t* qs = blk + at + 4;
    for (int j = 0; j < 16; ++j) {
      q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
      q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const uint8_t* qs = blk + (T == Q4_K ? 16 : 48) + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int e = 0; e < 32; ++e) {
      q[e] = (qs[e] >> shift) & 0x0F;
      if (T == Q5_K) q[e] |= ((blk[16 + e] >> s) & 1) << 4;
    }
  } else {
    const int64_t h = s / 4, k = s % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (k % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int e = 0; e < 32; ++e) q[e] = ((ql[e] >> (4 * (k / 2))) & 0x0F) | (((qh[e] >> (2 * k)) & 3) << 4);
  }
}

// Unit s of the (super-)block at blk: its 32 weights into w (the reference, any CPU).
template <int64_t T>
inline void kq_dequant_scalar(const uint8_t* blk, int64_t s, float* w) {
  const KUnit u = kq_unit<T>(blk, s);
  int q[32];
  kq_quants<T>(blk, s, q);
  for (int e = 0; e < 32; ++e) {
    const float v = u.a[e / 16] * static_cast<float>(q[e] - u.offset);  // exact
    w[e] = (T == Q5_1 || T == Q4_K || T == Q5_K) ? v + u.c : v;        // the one rounding
  }
}

#if defined(__AVX512F__)
// Unit s's weights: lo = elements 0..15, hi = 16..31 (kq_dequant_scalar's values). The 4- and 5-bit types look their
// values up: a unit's 16 (32) possible values are made once (one multiply-add each, the same rounding as the
// formula's) and picked by a lane permute, which reads only an index's low 4 (5) bits; a fifth bit is or-ed in under
// a mask made from the bit field. Q6_K's 64 levels are computed (an exact product).
template <int64_t T>
VERISPEC_KQ_INLINE void kq_dequant512(const uint8_t* blk, int64_t s, const KUnit& u, __m512& lo, __m512& hi) {
  const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i low4 = _mm512_set1_epi32(0x0F), bit4 = _mm512_set1_epi32(16);
  auto bytes = [](const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  if constexpr (T == Q5_0 || T == Q5_1) {
    const int64_t at = T == Q5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, blk + at, 4);
    const __m512i b = bytes(blk + at + 4);
    const __m512 a = _mm512_set1_ps(u.a[0]);
    const __m512 t0 = T == Q5_0 ? _mm512_mul_ps(a, _mm512_sub_ps(k, _mm512_set1_ps(16.0f)))
                                : _mm512_fmadd_ps(a, k, _mm512_set1_ps(u.c));
    const __m512 t1 = T == Q5_0 ? _mm512_mul_ps(a, k) : _mm512_fmadd_ps(a, _mm512_add_ps(k, _mm512_set1_ps(16.0f)),
                                                                       _mm512_set1_ps(u.c));
    const __m512i i0 = _mm512_and_si512(b, low4), i1 = _mm512_srli_epi32(b, 4);
    lo = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(i0, static_cast<__mmask16>(qh), i0, bit4), t1);
    hi = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(i1, static_cast<__mmask16>(qh >> 16), i1, bit4), t1);
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const uint8_t* qs = blk + (T == Q4_K ? 16 : 48) + 32 * (s / 2);
    const int shift = 4 * static_cast<int>(s % 2);
    const __m512 a = _mm512_set1_ps(u.a[0]), c = _mm512_set1_ps(u.c);
    const __m512 t0 = _mm512_fmadd_ps(a, k, c);
    __m512i q0 = _mm512_srli_epi32(bytes(qs), shift), q1 = _mm512_srli_epi32(bytes(qs + 16), shift);
    if constexpr (T == Q4_K) {
      lo = _mm512_permutexvar_ps(q0, t0);
      hi = _mm512_permutexvar_ps(q1, t0);
    } else {
      const __m512 t1 = _mm512_fmadd_ps(a, _mm512_add_ps(k, _mm512_set1_ps(16.0f)), c);
      const __m512i bit = _mm512_set1_epi32(1 << s);
      q0 = _mm512_and_si512(q0, low4);
      q1 = _mm512_and_si512(q1, low4);
      lo = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(q0, _mm512_test_epi32_mask(bytes(blk + 16), bit), q0, bit4), t1);
      hi = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(q1, _mm512_test_epi32_mask(bytes(blk + 32), bit), q1, bit4), t1);
    }
  } else {
    const int64_t h = s / 4, kk = s % 4;
    auto half = [&](int i) {
      const __m512i l = _mm512_and_si512(_mm512_srli_epi32(bytes(blk + 64 * h + 32 * (kk % 2) + 16 * i), 4 * (kk / 2)), low4);
      const __m512i m = _mm512_and_si512(_mm512_srli_epi32(bytes(blk + 128 + 32 * h + 16 * i), 2 * kk), _mm512_set1_epi32(3));
      const __m512i q = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(m, 4)), _mm512_set1_epi32(32));
      return _mm512_mul_ps(_mm512_set1_ps(u.a[i]), _mm512_cvtepi32_ps(q));  // exact
    };
    lo = half(0);
    hi = half(1);
  }
}

template <int64_t T>
inline void kq_dequant512(const uint8_t* blk, int64_t s, __m512& lo, __m512& hi) {
  kq_dequant512<T>(blk, s, kq_unit<T>(blk, s), lo, hi);
}

// A K-quant super-block's 8 units' affine forms at once (kq_unit's values: the same exact products), for tiles that
// take a super-block of a channel at a time.
template <int64_t T>
VERISPEC_KQ_INLINE void kq_units(const uint8_t* blk, KUnit* u) {
  if constexpr (T == Q6_K) {
    alignas(32) float a[16];
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
    _mm512_store_ps(a, _mm512_mul_ps(_mm512_set1_ps(kq_half(blk + 208)), sc));  // exact
    for (int s = 0; s < 8; ++s) u[s] = KUnit{{a[2 * s], a[2 * s + 1]}, 0.0f, 32};
  } else {
    // scalar: packing the 6-bit fields into a vector cost store-forwarding stalls (narrow stores, one wide load)
    const float d = kq_half(blk), dmin = kq_half(blk + 2);
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      k4_scale_min(blk + 4, s, sc, mn);
      const float a = d * static_cast<float>(sc);  // exact
      u[s] = KUnit{{a, a}, -(dmin * static_cast<float>(mn)), 0};
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Unit s's weights, elements 8i .. 8i + 7 in v[i] (kq_dequant_scalar's values).
template <int64_t T>
inline void kq_dequant256(const uint8_t* blk, int64_t s, __m256* v) {
  const KUnit u = kq_unit<T>(blk, s);
  const __m256i low4 = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
  auto bytes = [](const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); };
  for (int i = 0; i < 4; ++i) {
    __m256i q;
    if constexpr (T == Q5_0 || T == Q5_1) {
      const int64_t at = T == Q5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, blk + at, 4);
      const int half = i / 2;  // elements 0..15: low nibbles of bytes 0..15; 16..31: high nibbles
      const __m256i nib = _mm256_and_si256(_mm256_srli_epi32(bytes(blk + at + 4 + 8 * (i % 2)), 4 * half), low4);
      const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh >> (8 * i))), iota), one);
      q = _mm256_or_si256(nib, _mm256_slli_epi32(hb, 4));
    } else if constexpr (T == Q4_K || T == Q5_K) {
      const uint8_t* qs = blk + (T == Q4_K ? 16 : 48) + 32 * (s / 2) + 8 * i;
      q = _mm256_and_si256(_mm256_srli_epi32(bytes(qs), 4 * static_cast<int>(s % 2)), low4);
      if (T == Q5_K)
        q = _mm256_or_si256(q, _mm256_slli_epi32(
                                   _mm256_and_si256(_mm256_srli_epi32(bytes(blk + 16 + 8 * i), static_cast<int>(s)), one), 4));
    } else {
      const int64_t h = s / 4, k = s % 4;
      const __m256i lo = _mm256_and_si256(
          _mm256_srli_epi32(bytes(blk + 64 * h + 32 * (k % 2) + 8 * i), static_cast<int>(4 * (k / 2))), low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(bytes(blk + 128 + 32 * h + 8 * i), static_cast<int>(2 * k)),
                                          _mm256_set1_epi32(3));
      q = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
    }
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(u.offset)));
    const __m256 a = _mm256_set1_ps(u.a[i / 2]);
    v[i] = (T == Q5_1 || T == Q4_K || T == Q5_K) ? _mm256_fmadd_ps(a, qf, _mm256_set1_ps(u.c)) : _mm256_mul_ps(a, qf);
  }
}
#endif

}  // namespace
