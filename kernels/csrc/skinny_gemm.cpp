// y = x @ W^T + b for float32 weights packed in groups of 16 output features, for the CPU.
//
// Built for the few rows of a decode or verification step, where the weights stream from memory once
// per call and the step is bound by read bandwidth; a prefill chunk's hundreds of rows go through the
// same arithmetic, register-blocked 6 (AVX2) or 12 (AVX-512) rows x 16 outputs.
//
// Packed layout: groups[g, k, j] = W[16g + j, k] (zero rows pad N to a multiple of 16): a thread reads
// its weights as one sequential stream, two 32-byte loads give 16 outputs' weights at one k, and the
// kernel broadcasts x[m, k] against them.
//
// Numerics: every output y[m, n] is ONE fused-multiply-add chain over k = 0 .. K-1 in order, then +
// bias. The chain does not depend on how many rows the call has, on the tile a row lands in, or on the
// thread split (threads split the output features), so a sequence's logits are bit-identical alone or
// in a batch, and a verification row equals the decode row it replaces: greedy speculation stays
// token-identical to plain decoding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 8;                         // output features per register
constexpr int64_t kPanels = 2;                        // registers of outputs per tile
constexpr int64_t kGroupWidth = kLanes * kPanels;     // output features per packed group
// Rows per tile: the accumulators (2 per row), two weight registers and a broadcast must fit the
// register file, 16 registers with AVX2 and 32 with AVX-512VL. Up to kMaxRowTile rows (a verification
// step's 1 + k) go in ONE tile, so the weights stream past them once; more rows (a prefill chunk) go in
// tiles of 6, measured faster than 12 for bulk work on a 2-core Zen 4.
constexpr int64_t kBulkRowTile = 6;
#ifdef __AVX512VL__
constexpr int64_t kMaxRowTile = 12;
#else
constexpr int64_t kMaxRowTile = 6;
#endif

constexpr int64_t kPrefetchAhead = 32;  // k steps (64-byte lines) the weight stream is fetched ahead

// One tile: rows [0, kRows) of x against one packed group; `width` of its 16 outputs are real.
template <int kRows>
void tile(const float* x, int64_t K, const float* group, float* y, int64_t y_stride, int64_t width,
          const float* bias) {
#ifdef __AVX2__
  // named accumulators, not an array: GCC keeps an array's copy in memory and stores it every k
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00,
         a70 = a00, a71 = a00, a80 = a00, a81 = a00, a90 = a00, a91 = a00, a100 = a00, a101 = a00,
         a110 = a00, a111 = a00;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(group + (k + kPrefetchAhead) * kGroupWidth),
                 _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(group + k * kGroupWidth);
    const __m256 w1 = _mm256_loadu_ps(group + k * kGroupWidth + kLanes);
#define SPECSERVE_ROW(i)                                       \
    if constexpr (kRows > i) {                                 \
      const __m256 xi = _mm256_broadcast_ss(x + i * K + k);    \
      a##i##0 = _mm256_fmadd_ps(xi, w0, a##i##0);              \
      a##i##1 = _mm256_fmadd_ps(xi, w1, a##i##1);              \
    }
    SPECSERVE_ROW(0) SPECSERVE_ROW(1) SPECSERVE_ROW(2) SPECSERVE_ROW(3) SPECSERVE_ROW(4)
    SPECSERVE_ROW(5) SPECSERVE_ROW(6) SPECSERVE_ROW(7) SPECSERVE_ROW(8) SPECSERVE_ROW(9)
    SPECSERVE_ROW(10) SPECSERVE_ROW(11)
#undef SPECSERVE_ROW
  }
  alignas(32) float out[kRows][kGroupWidth];
  const __m256 rows[12][kPanels] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31},
                                    {a40, a41}, {a50, a51}, {a60, a61}, {a70, a71},
                                    {a80, a81}, {a90, a91}, {a100, a101}, {a110, a111}};
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kPanels; ++j) _mm256_store_ps(out[i] + j * kLanes, rows[i][j]);
#else
  float out[kRows][kGroupWidth] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < kRows; ++i)
      for (int l = 0; l < kGroupWidth; ++l)
        out[i][l] = std::fma(x[i * K + k], group[k * kGroupWidth + l], out[i][l]);
#endif
  for (int i = 0; i < kRows; ++i)
    for (int64_t l = 0; l < width; ++l)
      y[i * y_stride + l] = bias ? out[i][l] + bias[l] : out[i][l];
}

using Tile = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, const float*);
constexpr Tile kTiles[13] = {nullptr,  tile<1>, tile<2>, tile<3>, tile<4>,  tile<5>, tile<6>,
                             tile<7>,  tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

// x: [M, K] float32; packed: [G, K, 16] float32; bias: [N] or none; returns [M, N].
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "packed_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGroupWidth && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed_linear: packed weight must be contiguous [G, K, 16] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), G = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && G * kGroupWidth >= N && (G - 1) * kGroupWidth < N,
              "packed_linear: shapes do not match");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "packed_linear: bias must be contiguous [N] float32");
    bias_ptr = bias->const_data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* x_ptr = xc.const_data_ptr<float>();
  const float* w_ptr = packed.const_data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  // threads split the output features; a group's weights stay in cache across its row tiles
  at::parallel_for(0, G, 1, [&](int64_t group_begin, int64_t group_end) {
    for (int64_t g = group_begin; g < group_end; ++g) {
      const int64_t n0 = g * kGroupWidth;
      const int64_t width = std::min(kGroupWidth, N - n0);
      const int64_t row_tile = M <= kMaxRowTile ? M : kBulkRowTile;
      for (int64_t m0 = 0; m0 < M; m0 += row_tile) {
        kTiles[std::min(row_tile, M - m0)](x_ptr + m0 * K, K, w_ptr + g * K * kGroupWidth,
                                           y_ptr + m0 * N + n0, N, width,
                                           bias_ptr ? bias_ptr + n0 : nullptr);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor",
        &packed_linear);
}
