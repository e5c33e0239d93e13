// The small per-layer ops of a Llama decoder step, one pass over memory each, for float32 on the CPU.
//
// A decode step of a 30-layer model runs ~1,000 torch ops between its matmuls; each costs a dispatch
// and a sweep over the activations. These fuse them per layer: RMSNorm (with the residual add before
// it), rotary embedding of q and k in place, and SiLU(gate) * up or GeLU-tanh(gate) * up (Gemma's
// GeGLU). Every row is computed on its own in a fixed order, so results do not depend on the batch.
// Rotary uses the same rounded products and sums as the torch reference (bit-identical); RMSNorm's
// sum of squares and the activations' exp round differently from torch's vectorized ones (~1 ulp),
// like any other kernel's would.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "decoder_math.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
                  t.stride(1) == 1,
              name, " must be a 2-D float32 CPU tensor with contiguous rows");
}

using specserve_math::normalize_row;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "rms_norm: weight must be [hidden]");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* x_ptr = x.const_data_ptr<float>();
  const float* w_ptr = weight.const_data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(x_ptr + r * x_stride, w_ptr, static_cast<float>(eps), n, o_ptr + r * n);
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual add before a layer's second norm, in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  check_rows(delta, "add_rms_norm: delta");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(delta.size(0) == rows && delta.size(1) == n, "add_rms_norm: shapes differ");
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "add_rms_norm: weight must be [hidden]");
  at::Tensor sum = at::empty({rows, n}, x.options());
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* x_ptr = x.const_data_ptr<float>();
  const float* d_ptr = delta.const_data_ptr<float>();
  const float* w_ptr = weight.const_data_ptr<float>();
  float* s_ptr = sum.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), d_stride = delta.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = s_ptr + r * n;
      const float* a = x_ptr + r * x_stride;
      const float* b = d_ptr + r * d_stride;
      for (int64_t i = 0; i < n; ++i) row[i] = a[i] + b[i];
      normalize_row(row, w_ptr, static_cast<float>(eps), n, o_ptr + r * n);
    }
  });
  return {sum, out};
}

// Rotate-half RoPE in place on the first `num_rotated_heads` heads of each row of qkv ([T, heads *
// head_dim], the fused projection's output: q's heads then k's; v's are left alone).
// cos, sin: [T, head_dim / 2].
void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_rotated_heads,
             int64_t head_dim) {
  check_rows(qkv, "rotary_: qkv");
  check_rows(cos, "rotary_: cos");
  check_rows(sin, "rotary_: sin");
  const int64_t rows = qkv.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && num_rotated_heads * head_dim <= qkv.size(1) &&
                  cos.size(0) == rows && cos.size(1) == half && sin.size(0) == rows &&
                  sin.size(1) == half,
              "rotary_: shapes do not match");
  float* q_ptr = qkv.data_ptr<float>();
  const float* c_ptr = cos.const_data_ptr<float>();
  const float* s_ptr = sin.const_data_ptr<float>();
  const int64_t q_stride = qkv.stride(0), c_stride = cos.stride(0), s_stride = sin.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = c_ptr + r * c_stride;
      const float* s = s_ptr + r * s_stride;
      specserve_math::rotate_heads(q_ptr + r * q_stride, c, s, num_rotated_heads, head_dim);
    }
  });
}

// gate_up: [T, 2 * I] (gate then up) -> [T, I] = act(gate) * up, one row at a time by `row_op`
// (decoder_math.h's silu_and_mul_row or gelu_tanh_and_mul_row)
template <class RowOp>
at::Tensor gated_activation(const at::Tensor& gate_up, const char* name, RowOp row_op) {
  check_rows(gate_up, name);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * width, name, ": odd width");
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* g_ptr = gate_up.const_data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t g_stride = gate_up.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = g_ptr + r * g_stride;
      row_op(gate, gate + width, width, o_ptr + r * width);
    }
  });
  return out;
}

// silu(gate) * up, silu(g) = g / (1 + exp(-g))
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  return gated_activation(gate_up, "silu_and_mul: gate_up", specserve_math::silu_and_mul_row);
}

// gelu_tanh(gate) * up, as torch's F.gelu(gate, approximate="tanh") * up (Gemma's GeGLU)
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  return gated_activation(gate_up, "gelu_tanh_and_mul: gate_up",
                          specserve_math::gelu_tanh_and_mul_row);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_rotated_heads, int head_dim) -> ()",
        &rotary_);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor", &gelu_tanh_and_mul);
}
