// y = x @ W^T + b with W kept as the file holds it (GGUF blocks, or 16-bit floats), for the CPU.
//
// A decode step streams every weight once, so its time is the weights' bytes over the read bandwidth:
// a Q4_1 model is 5.4x fewer bytes than its float32 expansion. Each weight is dequantized in registers
// and multiplied in float32, with float32 activations and accumulation.
//
// Numerics: a weight dequantizes to exactly the float32 that gguf-py (transformers' GGUF loader)
// computes (no contraction: built with -ffp-contract=off; the one FMA per weight below rounds where
// gguf-py's multiply-then-add does, as its product is exact), and every output y[m, n] is ONE fused-multiply-add chain over k = 0 .. K-1, then
// + bias: the chain of `specserve::packed_linear` (skinny_gemm.cpp) on the dequantized weights, bit
// for bit, whatever the number of rows, the tile or the thread split. So greedy output stays
// token-identical to the float32 model, alone or batched, with or without speculation.
//
// Layout (kernels/quantized_gemm.py packs it once, at load time): rows in groups of 16 output
// features; a group is a sequence of records, one per block of K, each a header (the 16 rows' scales,
// lane-fastest) followed by the 16 rows' quants at each k of the block. A thread walks one group's
// records as one sequential stream. Per k, 4-bit formats hold 8 bytes (byte j: row j's nibble low,
// row j + 8's high); 5- and 6-bit add a 16- or 32-bit word of high bits (row j's at bit j, or 2j).
//
// Up to 12 rows (a decode or verification step's 1 + k) go in one tile: the weights are read and
// dequantized once for all of them. More rows (prefill) dequantize a group into a float32 buffer once,
// then run the float kernel's tiles over it, compute-bound.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
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

constexpr int64_t kLanes = 8;                      // output features per register
constexpr int64_t kGroupWidth = 2 * kLanes;        // output features per group
constexpr int64_t kBulkRowTile = 6;                // rows per tile over a dequantized buffer

// format ids, as kernels/quantized_gemm.py numbers them
enum Format : int64_t { kF32 = 0, kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kF16, kBF16 };

#ifdef SPECSERVE_QUANTIZED_GEMM

inline __m256 half8(const uint8_t* p) {  // 8 float16 -> float32, exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 int_bytes8(const uint8_t* p, bool is_signed) {  // 8 int8 or uint8 -> float32
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}
// 8 bytes of nibbles -> the 16 rows' 4-bit values as int32: rows 0-7 from the low nibbles, 8-15 high
inline void nibbles16(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
  hi = _mm256_srli_epi32(bytes, 4);
}
// `bits` bits per row of a little-endian word (row j's at j * bits), shifted up by 4, for rows 0-7
// and 8-15
inline void high_bits16(uint32_t word, int bits, __m256i& lo, __m256i& hi) {
  const __m256i all = _mm256_set1_epi32(static_cast<int>(word));
  const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
  const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i shift_lo = _mm256_mullo_epi32(step, _mm256_set1_epi32(bits));
  const __m256i shift_hi = _mm256_add_epi32(shift_lo, _mm256_set1_epi32(8 * bits));
  lo = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(all, shift_lo), mask), 4);
  hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(all, shift_hi), mask), 4);
}

// Each format: kBlock weights of K per record, kSub per scale, a header of kHeader bytes, kQuant
// bytes of quants per k. begin_sub(record, s) sets the scales of sub-block s; weights(q, w0, w1) gives
// the 16 rows' float32 weights at one k, as gguf-py computes them.

struct Float32 {  // a dequantized group: 16 floats per k (the bulk path's buffer)
  static constexpr int64_t kBlock = 1, kSub = 1, kHeader = 0, kQuant = 64;
  void begin_sub(const uint8_t*, int64_t) {}
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(reinterpret_cast<const float*>(q));
    w1 = _mm256_loadu_ps(reinterpret_cast<const float*>(q) + kLanes);
  }
};

struct F16 {
  static constexpr int64_t kBlock = 1, kSub = 1, kHeader = 0, kQuant = 32;
  void begin_sub(const uint8_t*, int64_t) {}
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    w0 = half8(q);
    w1 = half8(q + 16);
  }
};

struct BF16 {
  static constexpr int64_t kBlock = 1, kSub = 1, kHeader = 0, kQuant = 32;
  void begin_sub(const uint8_t*, int64_t) {}
  static __m256 widen(const uint8_t* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    w0 = widen(q);
    w1 = widen(q + 16);
  }
};

struct Q4_0 {  // header: d[16] f16;  w = d * (q - 8)
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 32, kQuant = 8;
  __m256 d0, d1;
  void begin_sub(const uint8_t* rec, int64_t) { d0 = half8(rec); d1 = half8(rec + 16); }
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    __m256i lo, hi;
    nibbles16(q, lo, hi);
    const __m256i eight = _mm256_set1_epi32(8);
    w0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, eight)));
    w1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, eight)));
  }
};

// Exact products: d (a float16: 11 significant bits) times a 4- or 5-bit q, or d times a 6-bit scale
// and that times q, need at most 22 bits and round to themselves in float32, so an FMA that adds the
// offset rounds once, where gguf-py rounds the product (a no-op) and then the sum: the same float.

struct Q4_1 {  // header: d[16], m[16] f16;  w = d * q + m (one FMA: d * q is exact)
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 64, kQuant = 8;
  __m256 d0, d1, m0, m1;
  void begin_sub(const uint8_t* rec, int64_t) {
    d0 = half8(rec); d1 = half8(rec + 16); m0 = half8(rec + 32); m1 = half8(rec + 48);
  }
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    __m256i lo, hi;
    nibbles16(q, lo, hi);
    w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(lo), m0);
    w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(hi), m1);
  }
};

struct Q8_0 {  // header: d[16] f16;  w = q * d
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 32, kQuant = 16;
  __m256 d0, d1;
  void begin_sub(const uint8_t* rec, int64_t) { d0 = half8(rec); d1 = half8(rec + 16); }
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    w0 = _mm256_mul_ps(int_bytes8(q, true), d0);
    w1 = _mm256_mul_ps(int_bytes8(q + 8, true), d1);
  }
};

// Q4_K and Q5_K: header d[16], dmin[16] f16, then sc[8][16], m[8][16] uint8 (sub-blocks of 32);
// scale = d * sc, offset = dmin * m, w = scale * q - offset (one FMA: scale * q is exact)
template <int kBits>
struct KQuant {
  static constexpr int64_t kBlock = 256, kSub = 32, kHeader = 320, kQuant = kBits == 4 ? 8 : 10;
  __m256 s0, s1, o0, o1;
  void begin_sub(const uint8_t* rec, int64_t sub) {
    const uint8_t* sc = rec + 64 + sub * 16;
    const uint8_t* m = rec + 64 + 128 + sub * 16;
    s0 = _mm256_mul_ps(half8(rec), int_bytes8(sc, false));
    s1 = _mm256_mul_ps(half8(rec + 16), int_bytes8(sc + 8, false));
    o0 = _mm256_mul_ps(half8(rec + 32), int_bytes8(m, false));
    o1 = _mm256_mul_ps(half8(rec + 48), int_bytes8(m + 8, false));
  }
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    __m256i lo, hi;
    nibbles16(q, lo, hi);
    if constexpr (kBits == 5) {
      uint16_t word;
      std::memcpy(&word, q + 8, sizeof(word));
      __m256i high_lo, high_hi;
      high_bits16(word, 1, high_lo, high_hi);
      lo = _mm256_or_si256(lo, high_lo);
      hi = _mm256_or_si256(hi, high_hi);
    }
    w0 = _mm256_fmsub_ps(s0, _mm256_cvtepi32_ps(lo), o0);
    w1 = _mm256_fmsub_ps(s1, _mm256_cvtepi32_ps(hi), o1);
  }
};

struct Q6_K {  // header: d[16] f16, sc[16][16] int8 (sub-blocks of 16);  w = (d * sc) * (q - 32)
  static constexpr int64_t kBlock = 256, kSub = 16, kHeader = 288, kQuant = 12;
  __m256 s0, s1;
  void begin_sub(const uint8_t* rec, int64_t sub) {
    const uint8_t* sc = rec + 32 + sub * 16;
    s0 = _mm256_mul_ps(half8(rec), int_bytes8(sc, true));
    s1 = _mm256_mul_ps(half8(rec + 16), int_bytes8(sc + 8, true));
  }
  void weights(const uint8_t* q, __m256& w0, __m256& w1) const {
    __m256i lo, hi, high_lo, high_hi;
    nibbles16(q, lo, hi);
    uint32_t word;
    std::memcpy(&word, q + 8, sizeof(word));
    high_bits16(word, 2, high_lo, high_hi);
    const __m256i bias = _mm256_set1_epi32(32);
    w0 = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, high_lo), bias)));
    w1 = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(hi, high_hi), bias)));
  }
};

template <class F>
constexpr int64_t record_bytes() {
  return F::kHeader + F::kBlock * F::kQuant;
}

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a stream is fetched

// Calls visit(g, k, w0, w1) for k = 0 .. K-1 in order and, at each k, groups g = 0 .. kGroups-1
// (consecutive, `group_bytes` apart) with the 16 weights of group g at k.
template <class F, int kGroups, class Visit>
inline __attribute__((always_inline)) void walk_groups(const uint8_t* group, int64_t group_bytes,
                                                       int64_t K, Visit&& visit) {
  const int64_t blocks = K / F::kBlock;
  int64_t k = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = group + b * record_bytes<F>();
    F format[kGroups];
    for (int64_t sub = 0; sub < F::kBlock / F::kSub; ++sub) {
      for (int g = 0; g < kGroups; ++g) format[g].begin_sub(rec + g * group_bytes, sub);
      const uint8_t* q = rec + F::kHeader + sub * F::kSub * F::kQuant;
      for (int64_t i = 0; i < F::kSub; ++i, ++k, q += F::kQuant) {
        if (((q - group) & 63) < F::kQuant)  // once per 64-byte line of the stream
          for (int g = 0; g < kGroups; ++g)
            _mm_prefetch(reinterpret_cast<const char*>(q + g * group_bytes + kPrefetchBytes),
                         _MM_HINT_T0);
        visit(format, q, k);
      }
    }
  }
}

// rows [0, kRows) of x against kGroups consecutive groups: y = x @ W^T (+ bias) for their 16 *
// kGroups outputs, `width` of them real. Decode rows go here: few rows leave too few independent FMA
// chains to hide the FMA's latency, so each k feeds several groups' chains.
template <class F, int kRows, int kGroups>
void fused_tile(const float* x, int64_t K, const uint8_t* group, int64_t group_bytes, float* y,
                int64_t y_stride, int64_t width, const float* bias) {
  static_assert(kRows * kGroups <= 6, "accumulators must fit the 16 AVX2 registers");
  // named accumulators, not an array: GCC keeps an array's copy in memory and stores it every k.
  // Pair p holds row p / kGroups against group p % kGroups.
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  walk_groups<F, kGroups>(group, group_bytes, K,
                          [&](const F* format, const uint8_t* q, int64_t k)
                              __attribute__((always_inline)) {
    __m256 w0, w1;
#define SPECSERVE_PAIR(p, g)                                                  \
    if constexpr (kRows * kGroups > p && p % kGroups == g) {                  \
      const __m256 xi = _mm256_broadcast_ss(x + (p / kGroups) * K + k);       \
      a##p##0 = _mm256_fmadd_ps(xi, w0, a##p##0);                             \
      a##p##1 = _mm256_fmadd_ps(xi, w1, a##p##1);                             \
    }
#define SPECSERVE_GROUP(g)                                                    \
    if constexpr (kGroups > g) {                                              \
      format[g].weights(q + g * group_bytes, w0, w1);                         \
      SPECSERVE_PAIR(0, g) SPECSERVE_PAIR(1, g) SPECSERVE_PAIR(2, g)          \
      SPECSERVE_PAIR(3, g) SPECSERVE_PAIR(4, g) SPECSERVE_PAIR(5, g)          \
    }
    SPECSERVE_GROUP(0) SPECSERVE_GROUP(1) SPECSERVE_GROUP(2) SPECSERVE_GROUP(3)
    SPECSERVE_GROUP(4) SPECSERVE_GROUP(5)
#undef SPECSERVE_GROUP
#undef SPECSERVE_PAIR
  });
  const __m256 pairs[6][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                              {a30, a31}, {a40, a41}, {a50, a51}};
  for (int p = 0; p < kRows * kGroups; ++p) {
    alignas(32) float out[kGroupWidth];
    _mm256_store_ps(out, pairs[p][0]);
    _mm256_store_ps(out + kLanes, pairs[p][1]);
    const int64_t row = p / kGroups, first = (p % kGroups) * kGroupWidth;
    for (int64_t l = 0; l < kGroupWidth && first + l < width; ++l)
      y[row * y_stride + first + l] = bias ? out[l] + bias[first + l] : out[l];
  }
}

// the group's weights as float32 [K, 16], what the bulk path and row lookups read
template <class F>
void dequantize_group(const uint8_t* group, int64_t K, float* out) {
  walk_groups<F, 1>(group, 0, K, [&](const F* format, const uint8_t* q, int64_t k)
                                     __attribute__((always_inline)) {
    __m256 w0, w1;
    format[0].weights(q, w0, w1);
    _mm256_storeu_ps(out + k * kGroupWidth, w0);
    _mm256_storeu_ps(out + k * kGroupWidth + kLanes, w1);
  });
}

using TileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t,
                        const float*);

// Rows that share one pass: up to kFusedRows rows dequantize in registers, feeding this many groups;
// more rows dequantize a group into a buffer once and run float tiles of kBulkRowTile rows over it
constexpr int64_t kFusedRows = 3;
constexpr int kFusedGroups[kFusedRows + 1] = {0, 4, 3, 2};

template <class F>
struct Kernels {
  // [rows][groups]
  static constexpr TileFn fused[kFusedRows + 1][7] = {
      {},
      {nullptr, fused_tile<F, 1, 1>, fused_tile<F, 1, 2>, fused_tile<F, 1, 3>, fused_tile<F, 1, 4>,
       fused_tile<F, 1, 5>, fused_tile<F, 1, 6>},
      {nullptr, fused_tile<F, 2, 1>, fused_tile<F, 2, 2>, fused_tile<F, 2, 3>},
      {nullptr, fused_tile<F, 3, 1>, fused_tile<F, 3, 2>}};
};
constexpr TileFn kFloatTiles[kBulkRowTile + 1] = {
    nullptr, fused_tile<Float32, 1, 1>, fused_tile<Float32, 2, 1>, fused_tile<Float32, 3, 1>,
    fused_tile<Float32, 4, 1>, fused_tile<Float32, 5, 1>, fused_tile<Float32, 6, 1>};

// groups [g0, g1) of y = x @ W^T (+ bias), serially: the one body of the op's parallel loop and
// of the native pass's pieces of work (entry_points.h). `scratch`: K * kGroupWidth floats when
// rows > kFusedRows (one dequantized group), unused otherwise.
template <class F>
void linear_range(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                  const float* bias, float* y, int64_t y_stride, int64_t g0, int64_t g1,
                  float* scratch) {
  const int64_t group_bytes = K / F::kBlock * record_bytes<F>();
  if (M <= kFusedRows) {
    const int64_t per_task = kFusedGroups[M];
    for (int64_t g = g0; g < g1; g += per_task) {
      const int64_t groups = std::min(per_task, g1 - g), n0 = g * kGroupWidth;
      Kernels<F>::fused[M][groups](x, K, packed + g * group_bytes, group_bytes, y + n0, y_stride,
                                   std::min(groups * kGroupWidth, N - n0),
                                   bias ? bias + n0 : nullptr);
    }
    return;
  }
  const uint8_t* floats = reinterpret_cast<const uint8_t*>(scratch);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kGroupWidth;
    const int64_t width = std::min(kGroupWidth, N - n0);
    dequantize_group<F>(packed + g * group_bytes, K, scratch);
    for (int64_t m0 = 0; m0 < M; m0 += kBulkRowTile)
      kFloatTiles[std::min(kBulkRowTile, M - m0)](x + m0 * K, K, floats, 0, y + m0 * y_stride + n0,
                                                  y_stride, width, bias ? bias + n0 : nullptr);
  }
}

inline int64_t groups_per_task(int64_t M) { return M <= kFusedRows ? kFusedGroups[M] : 1; }

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
  if (format < kF32 || format > kBF16) return 0;
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
