// y = x @ W^T + b with W kept as the file holds it (GGUF blocks, or 16-bit floats), for the CPU.
//
// A decode step streams every weight once, so its time is the weights' bytes over the read bandwidth:
// a Q4_1 model is 5.4x fewer bytes than its float32 expansion. Each weight is dequantized in registers
// and multiplied in float32, with float32 activations and accumulation.
//
// Numerics: a weight dequantizes to exactly the float32 that gguf-py (transformers' GGUF loader)
// computes (no contraction: built with -ffp-contract=off; the one FMA per weight below rounds where
// gguf-py's multiply-then-add does, as its product is exact), and every output y[m, n] is ONE
// fused-multiply-add chain over k = 0 .. K-1, then + bias: the chain of `specserve::packed_linear` (skinny_gemm.cpp) on the dequantized weights, bit
// for bit, whatever the number of rows, the tile or the thread split. So greedy output stays
// token-identical to the float32 model, alone or batched, with or without speculation.
//
// Layout (kernels/quantized_gemm.py packs it once, at load time): rows in groups of 16 output
// features; a group is a sequence of records, one per block of K, each a header (the 16 rows' scales,
// lane-fastest) followed by the 16 rows' quants at each k of the block. A thread walks one group's
// records as one sequential stream. Per k, 4-bit formats hold 8 bytes (byte j: row j's nibble low,
// row j + 8's high); 5- and 6-bit add a 16- or 32-bit word of high bits (row j's at bit j, or 2j).
//
// Up to 12 rows (a decode or verification step's 1 + k) share one pass over a group's stream: its
// weights are dequantized in registers once for all of them and never stored. The register blocking
// (kTileGroups) depends on the vector width, the bits do not. AVX-512 (a group's 16 outputs in one
// 512-bit register, 32 registers; 4-bit formats, Q5_0 and Q5_1 dequantize in "nibble order", see
// nibble_values):
// 1 row x 4 groups, 2-4 rows x 2 groups, 5-12 rows x 1 group. AVX2 (two 256-bit registers per group,
// 16 registers): 1 row x 4 groups (the scales spill to L1 and feed the FMAs as memory operands),
// 2-6 rows x 1 group, 7-12 rows x 1 group in two passes, one per half of its 16 lanes (the second
// reads the group from L1). More rows (prefill) dequantize a group into a float32 buffer once, then
// run tiles of float rows over it, compute-bound.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "entry_points.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define SPECSERVE_QUANTIZED_GEMM 1
#endif

namespace {

// Numbers in error messages go through std::to_string, never an ostream: streaming an integer
// instantiates libstdc++'s number formatting in this library, which crashed (SIGSEGV) against the
// locale of an older libstdc++ that torch had loaded (seen with g++ 13 on Ubuntu 24.04).
inline std::string text(int64_t value) { return std::to_string(value); }

constexpr int64_t kGroupWidth = 16;  // output features per group
// Rows that share one pass over the weights, dequantized in registers (decode: 1, verification:
// 1 + k); more rows (prefill) take the bulk path over a dequantized buffer
constexpr int64_t kFusedRows = 12;

// format ids, as kernels/quantized_gemm.py numbers them (new ones go at the end: ids are stable)
enum Format : int64_t {
  kF32 = 0, kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kF16, kBF16, kQ5_0, kQ5_1
};
constexpr int64_t kLastFormat = kQ5_1;

#ifdef SPECSERVE_QUANTIZED_GEMM

// A group's 16 outputs are kParts registers ("parts") of kPartLanes floats: one 512-bit register
// where AVX-512 is built in (32 registers), else two AVX2 ones (16 registers). Only the register
// blocking differs between the two builds; every FMA chain, and so every bit, is the same.
#if defined(__AVX512F__)
#define SPECSERVE_WIDE 1
using Part = __m512;
using PartInt = __m512i;
constexpr int kParts = 1;
inline Part zero_part() { return _mm512_setzero_ps(); }
inline Part broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Part fmadd(Part a, Part b, Part c) { return _mm512_fmadd_ps(a, b, c); }
inline Part fmsub(Part a, Part b, Part c) { return _mm512_fmsub_ps(a, b, c); }
inline Part mul(Part a, Part b) { return _mm512_mul_ps(a, b); }
inline Part to_float(PartInt v) { return _mm512_cvtepi32_ps(v); }
inline PartInt or_int(PartInt a, PartInt b) { return _mm512_or_si512(a, b); }
inline PartInt minus(PartInt a, int b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline Part load_part(const float* p) { return _mm512_loadu_ps(p); }
inline void store_part(float* out, Part v) { _mm512_storeu_ps(out, v); }
#else
using Part = __m256;
using PartInt = __m256i;
constexpr int kParts = 2;
inline Part zero_part() { return _mm256_setzero_ps(); }
inline Part broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Part fmadd(Part a, Part b, Part c) { return _mm256_fmadd_ps(a, b, c); }
inline Part fmsub(Part a, Part b, Part c) { return _mm256_fmsub_ps(a, b, c); }
inline Part mul(Part a, Part b) { return _mm256_mul_ps(a, b); }
inline Part to_float(PartInt v) { return _mm256_cvtepi32_ps(v); }
inline PartInt or_int(PartInt a, PartInt b) { return _mm256_or_si256(a, b); }
inline PartInt minus(PartInt a, int b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline Part load_part(const float* p) { return _mm256_loadu_ps(p); }
inline void store_part(float* out, Part v) { _mm256_storeu_ps(out, v); }
#endif
constexpr int64_t kPartLanes = kGroupWidth / kParts;

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// 16 float16 -> float32, exact
inline void halves16(const uint8_t* p, Part* out) {
#ifdef SPECSERVE_WIDE
  out[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  for (int part = 0; part < kParts; ++part)
    out[part] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * part)));
#endif
}
// 16 int8 or uint8 -> int32
inline void bytes16(const uint8_t* p, bool is_signed, PartInt* out) {
#ifdef SPECSERVE_WIDE
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  out[0] = is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
#else
  for (int part = 0; part < kParts; ++part) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * part));
    out[part] = is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  }
#endif
}
inline void byte_floats16(const uint8_t* p, bool is_signed, Part* out) {
  PartInt ints[kParts];
  bytes16(p, is_signed, ints);
  for (int part = 0; part < kParts; ++part) out[part] = to_float(ints[part]);
}
// 8 bytes of nibbles -> the 16 rows' 4-bit values as int32, in row order: rows 0-7 from the low
// nibbles, 8-15 from the high ones
inline void nibbles16(const uint8_t* p, PartInt* out) {
#ifdef SPECSERVE_WIDE
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_set1_epi64x(static_cast<long long>(load_u64(p))));
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  out[0] = _mm512_and_si512(_mm512_srlv_epi32(bytes, shift), _mm512_set1_epi32(0x0F));
#else
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  out[0] = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
  out[1] = _mm256_srli_epi32(bytes, 4);
#endif
}
// `bits` bits per row of a little-endian word (row j's at j * bits), shifted up by 4, in row order
inline void high_bits16(uint32_t word, int bits, PartInt* out) {
#ifdef SPECSERVE_WIDE
  const __m512i shift = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(bits));
  const __m512i picked = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shift);
  out[0] = _mm512_slli_epi32(_mm512_and_si512(picked, _mm512_set1_epi32((1 << bits) - 1)), 4);
#else
  const __m256i all = _mm256_set1_epi32(static_cast<int>(word));
  const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
  const __m256i shift_lo = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                              _mm256_set1_epi32(bits));
  const __m256i shift_hi = _mm256_add_epi32(shift_lo, _mm256_set1_epi32(8 * bits));
  out[0] = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(all, shift_lo), mask), 4);
  out[1] = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(all, shift_hi), mask), 4);
#endif
}

#ifdef SPECSERVE_WIDE
// Nibble order, for the 4-bit formats on AVX-512: lane 4a + b holds row 4b + a (a 4x4 transpose,
// its own inverse). In it a k's 8 bytes, as one 64-bit word broadcast to the 8 qwords, each shifted
// right by 4 * its index, leave every lane's nibble in its low 4 bits (lane 2j: nibble j of the
// word, lane 2j + 1: nibble j + 8), and a permute, which reads only those 4 bits, maps them to
// floats: 2 instructions (a shift, a permute) for 16 weights' values where row order takes 4.
inline __m512 nibble_order(__m512 v) {
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}
// the 16 nibbles of a k, in nibble order, as float(nibble - offset), exactly
template <int kOffset>
inline __m512 nibble_values(const uint8_t* p) {
  const __m512i word = _mm512_set1_epi64(static_cast<long long>(load_u64(p)));
  const __m512i spread = _mm512_srlv_epi64(word, _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28));
  const __m512 values = _mm512_setr_ps(0 - kOffset, 1 - kOffset, 2 - kOffset, 3 - kOffset,
                                       4 - kOffset, 5 - kOffset, 6 - kOffset, 7 - kOffset,
                                       8 - kOffset, 9 - kOffset, 10 - kOffset, 11 - kOffset,
                                       12 - kOffset, 13 - kOffset, 14 - kOffset, 15 - kOffset);
  return _mm512_permutexvar_ps(spread, values);
}
// the 16 5-bit values of a k (8 bytes of nibbles, then the 16-bit word of fifth bits), in nibble
// order, as float(value - offset), exactly: each lane's index into a 32-float table is its nibble
// (as in nibble_values) with its row's fifth bit at bit 4, which picks the table's upper half
template <int kOffset>
inline __m512 five_bit_values(const uint8_t* p) {
  const __m512i word = _mm512_set1_epi64(static_cast<long long>(load_u64(p)));
  const __m512i spread = _mm512_srlv_epi64(word, _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28));
  // the 32 bits at p + 6 (within the k's 10 bytes: a load broadcast, no scalar work) hold the
  // fifth bits' word at bits 16-31; lane 4a + b holds row 4b + a, whose bit 16 + 4b + a lands at 4
  int32_t around_word;
  std::memcpy(&around_word, p + 6, sizeof(around_word));
  const __m512i high = _mm512_srlv_epi32(
      _mm512_set1_epi32(around_word),
      _mm512_setr_epi32(12, 16, 20, 24, 13, 17, 21, 25, 14, 18, 22, 26, 15, 19, 23, 27));
  // bits 0-3 from spread, the rest from high (the permute reads bits 0-4 only)
  const __m512i index = _mm512_ternarylogic_epi32(spread, high, _mm512_set1_epi32(0x0F), 0xE4);
  const __m512 low_values = _mm512_setr_ps(
      0 - kOffset, 1 - kOffset, 2 - kOffset, 3 - kOffset, 4 - kOffset, 5 - kOffset, 6 - kOffset,
      7 - kOffset, 8 - kOffset, 9 - kOffset, 10 - kOffset, 11 - kOffset, 12 - kOffset,
      13 - kOffset, 14 - kOffset, 15 - kOffset);
  const __m512 high_values = _mm512_add_ps(low_values, _mm512_set1_ps(16.0f));  // exact: small ints
  return _mm512_permutex2var_ps(low_values, index, high_values);
}
constexpr bool kNibbleOrder = true;
#else
constexpr bool kNibbleOrder = false;
#endif

// Each format: kBlock weights of K per record, kSub per scale, a header of kHeader bytes, kQuant
// bytes of quants per k. begin_sub(record, s) sets the scales of sub-block s; weights(q, w) gives
// the 16 rows' float32 weights at one k, as gguf-py computes them, in row order, or in nibble order
// where kLaneOrder says so (to_rows puts them back).

struct Float32 {  // a dequantized group: 16 floats per k (the bulk path's buffer)
  static constexpr int64_t kBlock = 1, kSub = 1, kHeader = 0, kQuant = 64;
  static constexpr bool kLaneOrder = false;
  void begin_sub(const uint8_t*, int64_t) {}
  void weights(const uint8_t* q, Part* w) const {
    for (int part = 0; part < kParts; ++part)
      w[part] = load_part(reinterpret_cast<const float*>(q) + part * kPartLanes);
  }
};

struct F16 {
  static constexpr int64_t kBlock = 1, kSub = 1, kHeader = 0, kQuant = 32;
  static constexpr bool kLaneOrder = false;
  void begin_sub(const uint8_t*, int64_t) {}
  void weights(const uint8_t* q, Part* w) const { halves16(q, w); }
};

struct BF16 {
  static constexpr int64_t kBlock = 1, kSub = 1, kHeader = 0, kQuant = 32;
  static constexpr bool kLaneOrder = false;
  void begin_sub(const uint8_t*, int64_t) {}
  void weights(const uint8_t* q, Part* w) const {
#ifdef SPECSERVE_WIDE
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
#else
    for (int part = 0; part < kParts; ++part) {
      const __m256i h = _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * part)));
      w[part] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
#endif
  }
};

// scales read in row order, put in the format's lane order
template <bool kLaneOrder>
inline void to_lanes(Part* v) {
#ifdef SPECSERVE_WIDE
  if constexpr (kLaneOrder) v[0] = nibble_order(v[0]);
#endif
}

// The 16 rows' f16 scales d (and minimums m), at a block's start, in the nibble order the
// Q4 / Q5 formats' values come in.
struct ScaleHeader {
  Part d[kParts];
  void begin_sub(const uint8_t* rec, int64_t) {
    halves16(rec, d);
    to_lanes<kNibbleOrder>(d);
  }
};
struct ScaleMinHeader {
  Part d[kParts], m[kParts];
  void begin_sub(const uint8_t* rec, int64_t) {
    halves16(rec, d);
    halves16(rec + 32, m);
    to_lanes<kNibbleOrder>(d);
    to_lanes<kNibbleOrder>(m);
  }
};

struct Q4_0 : ScaleHeader {  // header: d[16] f16;  w = d * (q - 8)
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 32, kQuant = 8;
  static constexpr bool kLaneOrder = kNibbleOrder;
  void weights(const uint8_t* q, Part* w) const {
#ifdef SPECSERVE_WIDE
    w[0] = mul(d[0], nibble_values<8>(q));
#else
    PartInt n[kParts];
    nibbles16(q, n);
    for (int part = 0; part < kParts; ++part) w[part] = mul(d[part], to_float(minus(n[part], 8)));
#endif
  }
};

// Exact products: d (a float16: 11 significant bits) times a 4- or 5-bit q, or d times a 6-bit scale
// and that times q, need at most 22 bits and round to themselves in float32, so an FMA that adds the
// offset rounds once, where gguf-py rounds the product (a no-op) and then the sum: the same float.

struct Q4_1 : ScaleMinHeader {  // header: d[16], m[16] f16;  w = d * q + m (one FMA: d * q is exact)
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 64, kQuant = 8;
  static constexpr bool kLaneOrder = kNibbleOrder;
  void weights(const uint8_t* q, Part* w) const {
#ifdef SPECSERVE_WIDE
    w[0] = fmadd(d[0], nibble_values<0>(q), m[0]);
#else
    PartInt n[kParts];
    nibbles16(q, n);
    for (int part = 0; part < kParts; ++part) w[part] = fmadd(d[part], to_float(n[part]), m[part]);
#endif
  }
};

// Q5_0 and Q5_1: per k, 8 bytes of low nibbles (as Q4_0) and a 16-bit word of fifth bits
// (row j's at bit j). AVX-512 reads them in nibble order (five_bit_values); AVX2 in row order:
#ifndef SPECSERVE_WIDE
// the 16 rows' fifth bits at bit 4 of their lanes (other bits: garbage), in row order. The 32 bits
// at q + 6 (within the k's 10 bytes: a load broadcast) hold the word at bits 16-31: row j's bit,
// 16 + j, shifts right by 12 + j to bit 4
inline void fifth_bits16(const uint8_t* q, __m256i* out) {
  int32_t around_word;
  std::memcpy(&around_word, q + 6, sizeof(around_word));
  const __m256i all = _mm256_set1_epi32(around_word);
  out[0] = _mm256_srlv_epi32(all, _mm256_setr_epi32(12, 13, 14, 15, 16, 17, 18, 19));
  out[1] = _mm256_srlv_epi32(all, _mm256_setr_epi32(20, 21, 22, 23, 24, 25, 26, 27));
}
#endif

struct Q5_0 : ScaleHeader {  // header: d[16] f16;  w = d * (q - 16)
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 32, kQuant = 10;
  static constexpr bool kLaneOrder = kNibbleOrder;
  void weights(const uint8_t* q, Part* w) const {
#ifdef SPECSERVE_WIDE
    w[0] = mul(d[0], five_bit_values<16>(q));
#else
    PartInt n[kParts], high[kParts];
    nibbles16(q, n);
    fifth_bits16(q, high);
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int part = 0; part < kParts; ++part) {  // q - 16 = nibble - (16 where the fifth bit is 0)
      const __m256i centred = _mm256_sub_epi32(n[part], _mm256_andnot_si256(high[part], sixteen));
      w[part] = mul(d[part], to_float(centred));
    }
#endif
  }
};

struct Q5_1 : ScaleMinHeader {  // header: d[16], m[16] f16;  w = d * q + m (one FMA: d * q is exact)
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 64, kQuant = 10;
  static constexpr bool kLaneOrder = kNibbleOrder;
  void weights(const uint8_t* q, Part* w) const {
#ifdef SPECSERVE_WIDE
    w[0] = fmadd(d[0], five_bit_values<0>(q), m[0]);
#else
    PartInt n[kParts], high[kParts];
    nibbles16(q, n);
    fifth_bits16(q, high);
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int part = 0; part < kParts; ++part) {
      const __m256i value = _mm256_or_si256(n[part], _mm256_and_si256(high[part], sixteen));
      w[part] = fmadd(d[part], to_float(value), m[part]);
    }
#endif
  }
};

struct Q8_0 {  // header: d[16] f16;  w = q * d
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 32, kQuant = 16;
  static constexpr bool kLaneOrder = false;
  Part d[kParts];
  void begin_sub(const uint8_t* rec, int64_t) { halves16(rec, d); }
  void weights(const uint8_t* q, Part* w) const {
    byte_floats16(q, true, w);
    for (int part = 0; part < kParts; ++part) w[part] = mul(w[part], d[part]);
  }
};

// Q4_K and Q5_K: header d[16], dmin[16] f16, then sc[8][16], m[8][16] uint8 (sub-blocks of 32);
// scale = d * sc, offset = dmin * m, w = scale * q - offset (one FMA: scale * q is exact)
template <int kBits>
struct KQuant {
  static constexpr int64_t kBlock = 256, kSub = 32, kHeader = 320, kQuant = kBits == 4 ? 8 : 10;
  static constexpr bool kLaneOrder = kBits == 4 && kNibbleOrder;
  Part s[kParts], o[kParts];
  void begin_sub(const uint8_t* rec, int64_t sub) {
    Part d[kParts], dmin[kParts], sc[kParts], m[kParts];
    halves16(rec, d);
    halves16(rec + 32, dmin);
    byte_floats16(rec + 64 + sub * 16, false, sc);
    byte_floats16(rec + 64 + 128 + sub * 16, false, m);
    for (int part = 0; part < kParts; ++part) {
      s[part] = mul(d[part], sc[part]);
      o[part] = mul(dmin[part], m[part]);
    }
    to_lanes<kLaneOrder>(s);
    to_lanes<kLaneOrder>(o);
  }
  void weights(const uint8_t* q, Part* w) const {
#ifdef SPECSERVE_WIDE
    if constexpr (kBits == 4) {
      w[0] = fmsub(s[0], nibble_values<0>(q), o[0]);
      return;
    }
#endif
    PartInt n[kParts];
    nibbles16(q, n);
    if constexpr (kBits == 5) {
      uint16_t word;
      std::memcpy(&word, q + 8, sizeof(word));
      PartInt high[kParts];
      high_bits16(word, 1, high);
      for (int part = 0; part < kParts; ++part) n[part] = or_int(n[part], high[part]);
    }
    for (int part = 0; part < kParts; ++part) w[part] = fmsub(s[part], to_float(n[part]), o[part]);
  }
};

struct Q6_K {  // header: d[16] f16, sc[16][16] int8 (sub-blocks of 16);  w = (d * sc) * (q - 32)
  static constexpr int64_t kBlock = 256, kSub = 16, kHeader = 288, kQuant = 12;
  static constexpr bool kLaneOrder = false;
  Part s[kParts];
  void begin_sub(const uint8_t* rec, int64_t sub) {
    Part d[kParts], sc[kParts];
    halves16(rec, d);
    byte_floats16(rec + 32 + sub * 16, true, sc);
    for (int part = 0; part < kParts; ++part) s[part] = mul(d[part], sc[part]);
  }
  void weights(const uint8_t* q, Part* w) const {
    PartInt n[kParts], high[kParts];
    nibbles16(q, n);
    uint32_t word;
    std::memcpy(&word, q + 8, sizeof(word));
    high_bits16(word, 2, high);
    for (int part = 0; part < kParts; ++part)
      w[part] = mul(s[part], to_float(minus(or_int(n[part], high[part]), 32)));
  }
};

template <class F>
constexpr int64_t record_bytes() {
  return F::kHeader + F::kBlock * F::kQuant;
}

// weights in F's lane order -> row order
template <class F>
inline void to_rows(Part* w) {
#ifdef SPECSERVE_WIDE
  if constexpr (F::kLaneOrder) w[0] = nibble_order(w[0]);
#endif
}

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a stream is fetched

// Register blocking (rows, groups, parts of a group in one pass over the weights): per k, a group
// costs its dequantization plus one FMA per row and part, and each accumulator is a chain of
// dependent FMAs (4 cycles each), so a tile needs enough FMAs per k to cover that latency (few
// rows: several groups) without more accumulators than registers (many rows: one group).
#ifdef SPECSERVE_WIDE
// 32 registers: up to 12 rows x 1 group, 4 x 2, or 1 x 4 accumulators and the groups' scales
constexpr int kTileGroups[kFusedRows + 1] = {0, 4, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1};
constexpr int64_t kSplitRows = kFusedRows + 1;  // never: the accumulators always fit
constexpr int64_t kBulkRowTile = 12;            // rows per tile over a dequantized buffer
#else
// 16 registers: 1 row x 4 groups takes 8 accumulators, and the 16 scale registers spill to L1,
// read back as the FMAs' memory operands (loads, no extra instructions); 2-6 rows x 1 group take up
// to 12. From kSplitRows rows a pass does one half of the group's lanes (rows 0-7, then 8-15) for
// all rows: up to 12 accumulators, and a half costs half the dequantization, so the two passes (the
// second reads the group from L1) cost no more dequantization than one.
constexpr int kTileGroups[kFusedRows + 1] = {0, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
constexpr int64_t kSplitRows = 7;
constexpr int64_t kBulkRowTile = 6;
#endif

// rows [0, kRows) of x against kGroups consecutive groups, lanes of parts [kPart0, kPart1): y = x @
// W^T (+ bias) for those outputs, the `width` first of the groups' features real
template <class F, int kRows, int kGroups, int kPart0 = 0, int kPart1 = kParts>
void fused_tile(const float* x, int64_t K, const uint8_t* group, int64_t group_bytes, float* y,
                int64_t y_stride, int64_t width, const float* bias) {
  constexpr int kTileParts = kPart1 - kPart0;
  // an array, its loops fully unrolled, so GCC keeps it in registers
  Part acc[kRows][kGroups][kTileParts];
#pragma GCC unroll 64
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 64
    for (int g = 0; g < kGroups; ++g)
#pragma GCC unroll 4
      for (int p = 0; p < kTileParts; ++p) acc[r][g][p] = zero_part();
  const uint8_t* record = group;
  int64_t k = 0;
  for (int64_t b = 0; b < K / F::kBlock; ++b, record += record_bytes<F>()) {
    F format[kGroups];
    for (int64_t sub = 0; sub < F::kBlock / F::kSub; ++sub) {
      for (int g = 0; g < kGroups; ++g) format[g].begin_sub(record + g * group_bytes, sub);
      const uint8_t* q = record + F::kHeader + sub * F::kSub * F::kQuant;
      for (int64_t i = 0; i < F::kSub; ++i, ++k, q += F::kQuant) {
        if (((q - group) & 63) < F::kQuant)  // once per 64-byte line of the stream
          for (int g = 0; g < kGroups; ++g)
            _mm_prefetch(reinterpret_cast<const char*>(q + g * group_bytes + kPrefetchBytes),
                         _MM_HINT_T0);
#pragma GCC unroll 64
        for (int g = 0; g < kGroups; ++g) {
          Part w[kParts];
          format[g].weights(q + g * group_bytes, w);
#pragma GCC unroll 64
          for (int r = 0; r < kRows; ++r) {
            const Part xr = broadcast(x + r * K + k);
#pragma GCC unroll 4
            for (int p = 0; p < kTileParts; ++p)
              acc[r][g][p] = fmadd(xr, w[kPart0 + p], acc[r][g][p]);
          }
        }
      }
    }
  }
  // the sums leave the registers through constant indices only: a loop GCC does not unroll would
  // make it keep the array in memory, stored at every k
  alignas(64) float out[kRows][kGroups][kGroupWidth];
#pragma GCC unroll 64
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 64
    for (int g = 0; g < kGroups; ++g) {
      Part sums[kParts];
#pragma GCC unroll 4
      for (int p = 0; p < kParts; ++p)
        sums[p] = p >= kPart0 && p < kPart1 ? acc[r][g][p - kPart0] : zero_part();
      to_rows<F>(sums);
#pragma GCC unroll 4
      for (int p = kPart0; p < kPart1; ++p) store_part(out[r][g] + p * kPartLanes, sums[p]);
    }
  for (int r = 0; r < kRows; ++r)
    for (int g = 0; g < kGroups; ++g) {
      const int64_t first = g * kGroupWidth;
      for (int64_t l = kPart0 * kPartLanes; l < kPart1 * kPartLanes && first + l < width; ++l)
        y[r * y_stride + first + l] = bias ? out[r][g][l] + bias[first + l] : out[r][g][l];
    }
}

// groups [g0, g1) at kRows rows, in tiles of kTileGroups[kRows] groups (the last ones one by one)
template <class F, int kRows>
void fused_rows(const float* x, int64_t K, const uint8_t* packed, int64_t group_bytes, int64_t N,
                const float* bias, float* y, int64_t y_stride, int64_t g0, int64_t g1) {
  constexpr int kGroups = kTileGroups[kRows];
  for (int64_t g = g0; g < g1;) {
    const int64_t n0 = g * kGroupWidth;
    const uint8_t* group = packed + g * group_bytes;
    const float* tile_bias = bias ? bias + n0 : nullptr;
    if constexpr (kRows >= kSplitRows) {
      const int64_t width = std::min(kGroupWidth, N - n0);
      fused_tile<F, kRows, 1, 0, 1>(x, K, group, group_bytes, y + n0, y_stride, width, tile_bias);
      fused_tile<F, kRows, 1, 1, 2>(x, K, group, group_bytes, y + n0, y_stride, width, tile_bias);
      g += 1;
    } else if (g + kGroups <= g1) {
      fused_tile<F, kRows, kGroups>(x, K, group, group_bytes, y + n0, y_stride,
                                    std::min(kGroups * kGroupWidth, N - n0), tile_bias);
      g += kGroups;
    } else {
      fused_tile<F, kRows, 1>(x, K, group, group_bytes, y + n0, y_stride,
                              std::min(kGroupWidth, N - n0), tile_bias);
      g += 1;
    }
  }
}

// the group's weights as float32 [K, 16], row order: what the bulk path and row lookups read
template <class F>
void dequantize_group(const uint8_t* group, int64_t K, float* out) {
  const uint8_t* record = group;
  int64_t k = 0;
  for (int64_t b = 0; b < K / F::kBlock; ++b, record += record_bytes<F>()) {
    F format;
    for (int64_t sub = 0; sub < F::kBlock / F::kSub; ++sub) {
      format.begin_sub(record, sub);
      const uint8_t* q = record + F::kHeader + sub * F::kSub * F::kQuant;
      for (int64_t i = 0; i < F::kSub; ++i, ++k, q += F::kQuant) {
        Part w[kParts];
        format.weights(q, w);
        to_rows<F>(w);
        for (int p = 0; p < kParts; ++p) store_part(out + k * kGroupWidth + p * kPartLanes, w[p]);
      }
    }
  }
}

using FusedFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, const float*,
                         float*, int64_t, int64_t, int64_t);
template <class F, size_t... kRows>
constexpr std::array<FusedFn, sizeof...(kRows) + 1> fused_table(std::index_sequence<kRows...>) {
  return {nullptr, fused_rows<F, static_cast<int>(kRows) + 1>...};
}

// groups [g0, g1) of y = x @ W^T (+ bias), serially: the one body of the op's parallel loop and
// of the native pass's pieces of work (entry_points.h). `scratch`: K * kGroupWidth floats when rows > kFusedRows (one dequantized group), unused otherwise.
template <class F>
void linear_range(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                  const float* bias, float* y, int64_t y_stride, int64_t g0, int64_t g1,
                  float* scratch) {
  const int64_t group_bytes = K / F::kBlock * record_bytes<F>();
  if (M <= kFusedRows) {
    static constexpr auto kFused = fused_table<F>(std::make_index_sequence<kFusedRows>());
    kFused[M](x, K, packed, group_bytes, N, bias, y, y_stride, g0, g1);
    return;
  }
  static constexpr auto kBulk = fused_table<Float32>(std::make_index_sequence<kBulkRowTile>());
  const uint8_t* floats = reinterpret_cast<const uint8_t*>(scratch);
  for (int64_t g = g0; g < g1; ++g) {
    dequantize_group<F>(packed + g * group_bytes, K, scratch);
    for (int64_t m0 = 0; m0 < M; m0 += kBulkRowTile)
      kBulk[std::min(kBulkRowTile, M - m0)](x + m0 * K, K, floats, 0, N - g * kGroupWidth,
                                            bias ? bias + g * kGroupWidth : nullptr,
                                            y + m0 * y_stride + g * kGroupWidth, y_stride, 0, 1);
  }
}

inline int64_t groups_per_task(int64_t M) { return M <= kFusedRows ? kTileGroups[M] : 1; }

template <class F>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t G, int64_t N,
            const float* bias, float* y) {
  const int64_t per_task = groups_per_task(M);
  const int64_t tasks = (G + per_task - 1) / per_task;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // one dequantized group, reused across the chunk (the bulk path only)
    std::vector<float> buffer(M <= kFusedRows ? 0 : K * kGroupWidth);
    linear_range<F>(x, M, K, packed, N, bias, y, N, begin * per_task,
                    std::min(G, end * per_task), buffer.data());
  });
}

template <class F>
void rows(const uint8_t* packed, int64_t K, const int64_t* ids, int64_t count, float* out) {
  const int64_t group_bytes = K / F::kBlock * record_bytes<F>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(K * kGroupWidth);
    int64_t loaded = -1;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t g = ids[r] / kGroupWidth, lane = ids[r] % kGroupWidth;
      if (g != loaded) dequantize_group<F>(packed + g * group_bytes, K, buffer.data());
      loaded = g;
      for (int64_t k = 0; k < K; ++k) out[r * K + k] = buffer[k * kGroupWidth + lane];
    }
  });
}

template <template <class> class Op, class... Args>
void dispatch(int64_t format, Args&&... args) {
  switch (format) {
    case kF32: return Op<Float32>::run(args...);
    case kQ4_0: return Op<Q4_0>::run(args...);
    case kQ4_1: return Op<Q4_1>::run(args...);
    case kQ8_0: return Op<Q8_0>::run(args...);
    case kQ4_K: return Op<KQuant<4>>::run(args...);
    case kQ5_K: return Op<KQuant<5>>::run(args...);
    case kQ6_K: return Op<Q6_K>::run(args...);
    case kF16: return Op<F16>::run(args...);
    case kBF16: return Op<BF16>::run(args...);
    case kQ5_0: return Op<Q5_0>::run(args...);
    case kQ5_1: return Op<Q5_1>::run(args...);
  }
  TORCH_CHECK(false, "quantized_gemm: unknown format id " + text(format));
}

template <class F>
struct LinearOp {
  template <class... Args>
  static void run(Args... args) { linear<F>(args...); }
};
template <class F>
struct RowsOp {
  template <class... Args>
  static void run(Args... args) { rows<F>(args...); }
};
template <class F>
struct GroupBytesOp {
  static void run(int64_t K, int64_t* out) { *out = K / F::kBlock * record_bytes<F>(); }
};
template <class F>
struct BlockOp {
  static void run(int64_t* out) { *out = F::kBlock; }
};

int64_t group_bytes_for(int64_t format, int64_t K) {
  int64_t block = 0, bytes = 0;
  dispatch<BlockOp>(format, &block);
  TORCH_CHECK(K % block == 0,
              "quantized_gemm: K=" + text(K) + " is not a multiple of the block, " + text(block));
  dispatch<GroupBytesOp>(format, K, &bytes);
  return bytes;
}

template <class F>
struct LinearRangeOp {
  template <class... Args>
  static void run(Args... args) { linear_range<F>(args...); }
};

int64_t group_bytes_or_zero(int64_t format, int64_t K) {
  if (format < kF32 || format > kLastFormat) return 0;
  int64_t block = 0, bytes = 0;
  dispatch<BlockOp>(format, &block);
  if (K <= 0 || K % block != 0) return 0;
  dispatch<GroupBytesOp>(format, K, &bytes);
  return bytes;
}

const specserve_abi::GemmEntryPoints kEntryPoints = {
    specserve_abi::kVersion,
    kGroupWidth,
    [](int64_t M) { return groups_per_task(M); },
    group_bytes_or_zero,
    [](int64_t M, int64_t K) { return M <= kFusedRows ? int64_t{0} : K * kGroupWidth; },
    [](int64_t format, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
       const float* bias, float* y, int64_t y_stride, int64_t g0, int64_t g1, float* scratch) {
      dispatch<LinearRangeOp>(format, x, M, K, packed, N, bias, y, y_stride, g0, g1, scratch);
    }};

#endif  // SPECSERVE_QUANTIZED_GEMM

// the address of the entry points (entry_points.h), or 0 where the kernel is not built in
int64_t quantized_gemm_entry_points() {
#ifdef SPECSERVE_QUANTIZED_GEMM
  return reinterpret_cast<int64_t>(&kEntryPoints);
#else
  return 0;
#endif
}

void check_packed(const at::Tensor& packed, int64_t format, int64_t N, int64_t K) {
#ifdef SPECSERVE_QUANTIZED_GEMM
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.device().is_cpu(),
              "quantized_gemm: packed weight must be contiguous uint8 [groups, bytes] on the CPU");
  const int64_t G = packed.size(0);
  TORCH_CHECK(G * kGroupWidth >= N && (G - 1) * kGroupWidth < N,
              "quantized_gemm: " + text(G) + " groups do not hold " + text(N) + " rows");
  TORCH_CHECK(packed.size(1) == group_bytes_for(format, K),
              "quantized_gemm: a group holds " + text(packed.size(1)) + " bytes, format " +
                  text(format) + " at K=" + text(K) + " needs " + text(group_bytes_for(format, K)));
#else
  TORCH_CHECK(false, "quantized_gemm: built without AVX2 and F16C");
#endif
}

// x: [M, K] float32; packed: [G, group bytes] uint8; bias: [N] or none; returns [M, N] float32.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format,
                            const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quantized_linear: x must be a 2-D float32 CPU tensor");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  check_packed(packed, format, N, K);
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "quantized_linear: bias must be contiguous [N] float32");
    bias_ptr = bias->const_data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, xc.options());
#ifdef SPECSERVE_QUANTIZED_GEMM
  if (M > 0)
    dispatch<LinearOp>(format, xc.const_data_ptr<float>(), M, K, packed.const_data_ptr<uint8_t>(),
                       packed.size(0), N, bias_ptr, y.data_ptr<float>());
#endif
  return y;
}

// rows `ids` of the dequantized weight (an embedding lookup): [len(ids), K] float32
at::Tensor quantized_rows(const at::Tensor& packed, int64_t format, const at::Tensor& ids, int64_t N,
                          int64_t K) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(),
              "quantized_rows: ids must be int64 on the CPU");
  check_packed(packed, format, N, K);
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* id_ptr = flat.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i)
    TORCH_CHECK(id_ptr[i] >= 0 && id_ptr[i] < N,
                "quantized_rows: id " + text(id_ptr[i]) + " out of [0, " + text(N) + ")");
  at::Tensor out = at::empty({flat.numel(), K}, packed.options().dtype(at::kFloat));
#ifdef SPECSERVE_QUANTIZED_GEMM
  dispatch<RowsOp>(format, packed.const_data_ptr<uint8_t>(), K, id_ptr, flat.numel(),
                   out.data_ptr<float>());
#endif
  return out;
}

bool quantized_gemm_supported() {
#ifdef SPECSERVE_QUANTIZED_GEMM
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("quantized_linear(Tensor x, Tensor packed, int format, Tensor? bias, int out_features) -> "
        "Tensor",
        &quantized_linear);
  m.def("quantized_rows(Tensor packed, int format, Tensor ids, int out_features, int in_features) -> "
        "Tensor",
        &quantized_rows);
  m.def("quantized_gemm_supported() -> bool", &quantized_gemm_supported);
  m.def("quantized_gemm_entry_points() -> int", &quantized_gemm_entry_points);
}
