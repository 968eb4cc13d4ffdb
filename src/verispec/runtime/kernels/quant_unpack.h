// The integer-activation tiles' unpacking, one helper per block family, shared by quant_q8.h (the V layouts of the
// blocks of 32) and quant_vk.h (the K-quants' VK records). Both keep a block's (a K-quant unit's) 32 quants as
// "V chunks": 64 bytes of [16 channels c][4 bytes k], chunk i of a 4-bit type holding elements 4i + k in its low
// nibbles and 16 + 4i + k in its high ones (Q8_0: 8 chunks of int8, elements 4i + k), the extra high bits in u32
// words per channel right after the 4 chunks (byte 256 of the block or unit):
//   Q5 (Q5_0, Q5_1, Q5_K):  [16] u32, element 4i + k's fifth bit at bit 8k + i, 16 + 4i + k's at 8k + 4 + i
//                           (quant.py `V_Q5_BITS`, v_q5_bit below)
//   Q6_K:                   [16] u32 of elements 0..15, then [16] u32 of 16..31: element 4i + k's 2 high bits at
//                           bits 8k + 2i, 8k + 2i + 1
// So the unpacked weights are 8 registers w[j] whose 32-bit lane c holds the 4 unsigned quants multiplying
// activations 4j .. 4j + 3 of channel c (what vpdpbusd takes): w[i] the low nibbles of chunk i, w[4 + i] its high
// nibbles, each byte with its high bits or-ed in at bit 4.
//
// Each helper is written once for three widths, `Lanes` below: AVX-512 (a register: 16 channels), AVX2 (8 channels:
// the caller points at byte 32h of each chunk, channels 8h .. 8h + 7) and the scalar reference (one channel's 32-bit
// lane: the caller points at byte 4c), so every path takes the same bytes to the same integers.
#pragma once
#include "quant_common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(VERISPEC_AVX512)
#define VERISPEC_VNNI512 1
#endif

namespace {

constexpr int64_t VCH = 16;       // channels of a V group, a VK record and a chunk
constexpr int64_t CHUNK = 64;     // bytes of a chunk
constexpr int64_t HIGH_AT = 256;  // where a 4-bit block's (unit's) high-bit words start: after its 4 chunks

// Bit v_q5_bit(j) of a Q5 block's spread word holds element j's fifth bit (the file's qh bit j).
constexpr int v_q5_bit(int j) { return j < 16 ? 8 * (j % 4) + j / 4 : 8 * ((j - 16) % 4) + 4 + (j - 16) / 4; }

// ---- asking for the weights ahead -----------------------------------------------------------------------------------
// The V and VK tiles stream their weights once per call, in address order on each thread. A unit's bytes asked for
// `distance` bytes ahead, into L2, a line at a time as the unit is read, arrive before the tile gets there (measured on
// the coder target, 2 threads, quiet: a decode step 32 ms against 42 ms without and 74 ms when each record's 37 lines
// were asked for at once, 4 groups ahead, into L1; a 5-token verify pass 48 ms against 93 ms without). A call of more
// than `upto_rows` rows runs several tiles over each group, the later ones from cache: it asks for nothing.
// Hints only: the values and sums are unchanged. `recipes/tile_prefetch_bench.py` measures settings (set_prefetch).
struct TilePrefetch {
  int64_t from_rows = 1;      // tiles of fewer rows ask for nothing
  int64_t upto_rows = 16;     // calls of more rows ask for nothing
  int64_t distance = 8192;    // bytes ahead of the unit being read
  bool to_l2 = true;          // _MM_HINT_T1 (else T0: into L1)
};
inline TilePrefetch tile_prefetch;

// `bytes` at p + distance, asked for by a tile of NR rows in a call of `rows` rows (a cache line at a time).
template <int NR>
VERISPEC_KQ_INLINE void ask_ahead(const uint8_t* p, int64_t bytes, int64_t rows) {
#if defined(__AVX2__) || defined(__AVX512F__)
  if (NR < tile_prefetch.from_rows || rows > tile_prefetch.upto_rows) return;
  const char* at = reinterpret_cast<const char*>(p) + tile_prefetch.distance;
  for (int64_t i = 0; i < bytes; i += 64)
    tile_prefetch.to_l2 ? _mm_prefetch(at + i, _MM_HINT_T1) : _mm_prefetch(at + i, _MM_HINT_T0);
#endif
}

// ---- the widths ----------------------------------------------------------------------------------------------------
// I: the integer register, F: the float one; load reads a chunk's bytes for the lanes' channels; halves / bytes read
// one fp16 / one byte per channel (consecutive channels) as floats (exact).

struct Lane32 {  // the scalar reference: one channel, its 4 bytes of a chunk in a 32-bit word (little-endian)
  using I = uint32_t;
  using F = float;
  static I load(const uint8_t* p) {
    I v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static I bytes_of(uint8_t b) { return 0x01010101u * b; }
  static I words_of(uint32_t v) { return v; }
  static I and_(I a, I b) { return a & b; }
  static I or_(I a, I b) { return a | b; }
  static I xor_(I a, I b) { return a ^ b; }
  static I shl(I a, int n) { return a << n; }
  static I shr(I a, int n) { return a >> n; }  // (a byte's bits that cross into its neighbour are masked by callers)
  static F halves(const uint8_t* p) { return half_at(p); }
  static F bytes(const uint8_t* p, bool sign) {
    return sign ? static_cast<float>(static_cast<int8_t>(*p)) : static_cast<float>(*p);
  }
  static F mul(F a, F b) { return a * b; }
};

#if defined(VERISPEC_VNNI512)
struct Lanes512 {  // 16 channels: a whole chunk
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bytes_of(uint8_t b) { return _mm512_set1_epi8(static_cast<char>(b)); }
  static I words_of(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I shl(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I shr(I a, int n) { return _mm512_srli_epi32(a, n); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F bytes(const uint8_t* p, bool sign) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
  }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
};
#endif

#if defined(VERISPEC_AVX2)
struct Lanes256 {  // 8 channels: half a chunk
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bytes_of(uint8_t b) { return _mm256_set1_epi8(static_cast<char>(b)); }
  static I words_of(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I shl(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I shr(I a, int n) { return _mm256_srli_epi32(a, n); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F bytes(const uint8_t* p, bool sign) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
};
#endif

// ---- one helper per family -----------------------------------------------------------------------------------------

// Q4 nibbles (every 4-bit type, and the low 4 bits of Q5 and Q6_K): w[i] = chunk i's low nibbles, w[4 + i] its high.
template <class L>
VERISPEC_KQ_INLINE void unpack_nibbles(const uint8_t* q, typename L::I* w) {
  const typename L::I low4 = L::bytes_of(0x0F);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const typename L::I v = L::load(q + CHUNK * i);
    w[i] = L::and_(v, low4);
    w[4 + i] = L::and_(L::shr(v, 4), low4);
  }
}

// Q5's fifth bits (Q5_0, Q5_1, Q5_K), or-ed in at bit 4 of each byte: chunk i's low-nibble bytes take
// (qh << (4 - i)) & 0x10101010, its high-nibble bytes (qh >> i) & 0x10101010.
template <class L>
VERISPEC_KQ_INLINE void or_fifth_bits(const uint8_t* q, typename L::I* w) {
  const typename L::I qh = L::load(q + HIGH_AT), bit4 = L::words_of(0x10101010u);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    w[i] = L::or_(w[i], L::and_(L::shl(qh, 4 - i), bit4));
    w[4 + i] = L::or_(w[4 + i], L::and_(L::shr(qh, i), bit4));
  }
}

// Q6_K's two high bits, or-ed in at bits 4, 5 of each byte: chunk i's (bits 8k + 2i) shifted to 8k + 4.
template <class L>
VERISPEC_KQ_INLINE void or_q6_high_bits(const uint8_t* q, typename L::I* w) {
  const typename L::I h0 = L::load(q + HIGH_AT), h1 = L::load(q + HIGH_AT + CHUNK), bits = L::words_of(0x30303030u);
  auto to_bit4 = [](typename L::I h, int i) { return i < 2 ? L::shl(h, 4 - 2 * i) : i == 2 ? h : L::shr(h, 2); };
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    w[i] = L::or_(w[i], L::and_(to_bit4(h0, i), bits));
    w[4 + i] = L::or_(w[4 + i], L::and_(to_bit4(h1, i), bits));
  }
}

// Q8_0: the 8 chunks of int8, as they are (signed) or as k + 128 (unsigned: vpdpbusd's left operand).
template <class L>
VERISPEC_KQ_INLINE void unpack_q8(const uint8_t* q, typename L::I* w, bool plus128) {
  for (int i = 0; i < 8; ++i) {
    w[i] = L::load(q + CHUNK * i);
    if (plus128) w[i] = L::xor_(w[i], L::bytes_of(0x80));
  }
}

// The 4-, 5- and 6-bit families by their high bits: 0 (Q4_0, Q4_1, Q4_K), 1 (Q5_0, Q5_1, Q5_K), 2 (Q6_K).
template <class L, int HIGH_BITS>
VERISPEC_KQ_INLINE void unpack_quants(const uint8_t* q, typename L::I* w) {
  unpack_nibbles<L>(q, w);
  if constexpr (HIGH_BITS == 1) or_fifth_bits<L>(q, w);
  if constexpr (HIGH_BITS == 2) or_q6_high_bits<L>(q, w);
}

// The scalar lanes' byte k of w[j]: element 4j + k's quant.
inline int lane_byte(uint32_t w, int k) { return static_cast<int>((w >> (8 * k)) & 0xFF); }

}  // namespace
