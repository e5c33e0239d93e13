// The per-row arithmetic of the small decoder ops, shared by the ops (decoder_ops.cpp) and the
// native decoder pass (native_decoder.cpp) so both give the same bits: the library flags
// (-ffp-contract=off, no fast-math) keep every loop below in source order.
#pragma once

#include <cmath>
#include <cstdint>

namespace specserve_math {

// out = weight * (x / sqrt(mean(x^2) + eps)), the Hugging Face order of operations
inline void normalize_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  float sum_sq = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

// rotate-half RoPE in place on `num_heads` consecutive heads of one row; cos, sin: [head_dim / 2]
inline void rotate_heads(float* row, const float* cos, const float* sin, int64_t num_heads,
                         int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x1 = row + h * head_dim;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g))
inline void silu_and_mul_row(const float* gate, const float* up, int64_t width, float* out) {
  for (int64_t i = 0; i < width; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// out = gelu_tanh(gate) * up, torch's F.gelu(gate, approximate="tanh") * up (Gemma's GeGLU).
// gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3); since
// 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)), it is computed as g / (1 + exp(-2u)): one exp per
// element like SiLU (no tanh call), and no cancellation in 1 + tanh(u) where tanh(u) is near -1.
inline void gelu_tanh_and_mul_row(const float* gate, const float* up, int64_t width, float* out) {
  constexpr float kMinusTwoSqrtTwoOverPi = -1.5957691216057308f;  // -2 sqrt(2 / pi)
  constexpr float kCubic = 0.044715f;
  for (int64_t i = 0; i < width; ++i) {
    const float g = gate[i];
    const float inner = g + kCubic * (g * g * g);
    out[i] = g / (1.0f + std::exp(kMinusTwoSqrtTwoOverPi * inner)) * up[i];
  }
}

}  // namespace specserve_math
