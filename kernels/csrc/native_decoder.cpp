// A Llama-family decoder's forward pass on packed weights, as ONE native call on the CPU (Llama,
// Mistral, Qwen2, Qwen3 and Gemma 3: the per-layer switches below).
//
// The torch path (engine/models/llama.py with specserve's ops) runs ~400 ops a decode step; each is a
// dispatch, and each parallel one an OpenMP fork and join in which every thread must turn up. On two
// cores that glue cost ~2.3 ms of a ~14 ms token, and whenever another process (the HTTP server, a
// client) takes a core, every join waits for the descheduled thread (docs/perf.md, issue 41). Here
// the whole stack runs inside one parallel region, and no thread ever waits for another to arrive:
// each stage is cut into pieces that the threads take from a shared counter, and a thread moves on
// once every piece of the stage is done (run_stage), so a descheduled thread's share is simply
// taken by the others.
//
// Per layer, for the T rows of the step:
//   each thread  RMSNorm of the residual rows (its own copy: no stage needed)
//   pieces       q|k|v = x W_qkv^T (+ bias); the residual rows EAGLE-3 reads, copied out
//   rows         per-head RMSNorm of q and k (Qwen3, Gemma 3), rotary on q and k, q to a
//                contiguous buffer, k and v to the cache
//   pieces       paged attention work items (one plan serves every full layer, another every
//                sliding one)
//   pieces       o-projection, each piece adding its features into the residual; with an
//                attention output norm (Gemma 3) each piece only writes its features, and
//   rows         the output's RMSNorm, added into the residual
//   each thread  RMSNorm of the residual rows
//   pieces       gate and up of the same features, then SiLU(gate) * up or GeLU-tanh(gate) * up
//   pieces       down-projection, added into the residual; with an MLP output norm, written, and
//   rows         the output's RMSNorm, added into the residual
// then the final RMSNorm, by rows, and, where the caller names rows and a head was added, the LM
// head on those rows only (the rows that sample), in pieces like any projection.
//
// A sliding layer of a model that mixes sliding and full layers (Gemma 3) reads the step's
// windowed layout (its own window and tree masks, the same block tables) and the local RoPE
// tables, as engine/models/llama.py's sliding layers read AttentionMetadata.windowed.
//
// The same pass runs EAGLE's draft heads, one decoder layer each: without an input norm (the
// EAGLE authors' layer reads fc's output as it is) and without a final norm (the head returns the
// residual stream); and EAGLE-3's layer (set_feature_input), whose q|k|v read the token's embedding
// and a feature side by side, each under its own norm, the feature (or its norm) being the residual.
//
// Numerics: bit for bit the torch path's. The matmuls and attention are the very same compiled
// kernels, reached through entry_points.h; the norms (per-head and output norms included), rotary
// and the gated activations share decoder_math.h with decoder_ops.cpp; residual adds are single
// IEEE adds, as torch's. Every output element is computed by one thread in a fixed order, whatever
// the split into pieces or the number of threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "decoder_math.h"
#include "entry_points.h"

namespace {

using specserve_abi::AttentionEntryPoints;
using specserve_abi::AttentionProblem;
using specserve_abi::GemmEntryPoints;

inline std::string text(int64_t value) { return std::to_string(value); }

struct LinearPart {
  int64_t format = 0, in_features = 0, out_features = 0, first_feature = 0, num_groups = 0;
  at::Tensor groups;  // uint8 [num_groups, group bytes], the kernel's layout
  at::Tensor bias;    // float32 [out_features], or undefined
};

// A span of one part's groups that a linear's pieces walk: all of a part, or the gate or up half
// of a fused gate|up part.
struct GroupSpan {
  const LinearPart* part = nullptr;
  int64_t first_group = 0, num_groups = 0;
};

struct Linear {
  std::vector<LinearPart> parts;
  int64_t in_features = 0, out_features = 0;
};

// act(gate) * up of a layer's MLP
enum class Activation { kSilu, kGeluTanh };

struct Layer {
  at::Tensor input_norm, post_norm, kv_cache;
  // RMSNorms over each head of q and of k before RoPE (Qwen3, Gemma 3); undefined: none
  at::Tensor q_norm, k_norm;
  // RMSNorms of the attention's and the MLP's outputs before each residual add (Gemma 3);
  // undefined: none
  at::Tensor attention_output_norm, mlp_output_norm;
  Activation activation = Activation::kSilu;
  // reads forward's windowed layout and local RoPE tables
  bool sliding = false;
  Linear qkv, o, gate_up, down;
};

// One stage's pieces: how many were taken, how many are done (a cache line each, not shared).
struct StageSync {
  alignas(64) std::atomic<int64_t> taken{0};
  alignas(64) std::atomic<int64_t> done{0};
};

// How many output groups one piece of a matmul takes: a whole number of the kernel's tiles, and
// about 1/kPiecesPerThread of a thread's share. Contiguous runs of groups keep each thread's reads
// one sequential stream (a piece of one group each interleaved the threads' streams: 5-row matmuls
// took 15% longer than the op's static halves), while a few pieces a thread still let the others
// take over the share of a thread the OS deschedules.
constexpr int64_t kPiecesPerThread = 4;

struct PieceSize {
  int64_t per_task;  // the kernel's groups per tile at this row count
  int threads;
  int64_t groups(int64_t num_groups) const {
    const int64_t share = std::max<int64_t>(1, num_groups / (kPiecesPerThread * threads));
    return (share + per_task - 1) / per_task * per_task;
  }
};

// ~10-50 us of pause before a waiting thread starts yielding its core
constexpr int kSpinsBeforeYield = 1024;

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

inline const float* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<float>() : nullptr;
}

class NativeDecoder : public torch::CustomClassHolder {
 public:
  NativeDecoder(int64_t gemm_entry_points, int64_t attention_entry_points, int64_t hidden_size,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                int64_t intermediate_size, double rms_norm_eps, double attention_scale,
                std::optional<at::Tensor> final_norm)
      : gemm_(reinterpret_cast<const GemmEntryPoints*>(gemm_entry_points)),
        attention_(reinterpret_cast<const AttentionEntryPoints*>(attention_entry_points)),
        hidden_(hidden_size),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        intermediate_(intermediate_size),
        eps_(static_cast<float>(rms_norm_eps)),
        scale_(static_cast<float>(attention_scale)),
        final_norm_(final_norm.value_or(at::Tensor())) {
    TORCH_CHECK(gemm_ != nullptr && gemm_->version == specserve_abi::kVersion,
                "NativeDecoder: the packed matmul library is missing or of another version");
    TORCH_CHECK(attention_ != nullptr && attention_->version == specserve_abi::kVersion,
                "NativeDecoder: the paged attention library is missing or of another version");
    TORCH_CHECK(head_dim % 8 == 0 && num_heads % num_kv_heads == 0,
                "NativeDecoder: head_dim must be a multiple of 8 and heads a multiple of kv heads");
    if (final_norm_.defined()) check_vector(final_norm_, hidden_, "final norm");
  }

  // input_norm none: the layer's q|k|v read the residual stream as it is
  void add_layer(std::optional<at::Tensor> input_norm, at::Tensor post_norm) {
    if (input_norm.has_value() && input_norm->defined())
      check_vector(*input_norm, hidden_, "input norm");
    check_vector(post_norm, hidden_, "post-attention norm");
    Layer layer;
    layer.input_norm = input_norm.value_or(at::Tensor());
    layer.post_norm = std::move(post_norm);
    layers_.push_back(std::move(layer));
    ready_.reset();
  }

  // Qwen3's and Gemma 3's per-head norms of q and k ([head_dim] each), applied before RoPE
  void set_head_norms(int64_t layer, at::Tensor q_norm, at::Tensor k_norm) {
    check_vector(q_norm, head_dim_, "q norm");
    check_vector(k_norm, head_dim_, "k norm");
    Layer& l = layer_at(layer);
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
  }

  // Gemma 3's norms of the attention's and the MLP's outputs ([hidden] each), before each
  // residual add
  void set_output_norms(int64_t layer, at::Tensor attention_output_norm,
                        at::Tensor mlp_output_norm) {
    check_vector(attention_output_norm, hidden_, "attention output norm");
    check_vector(mlp_output_norm, hidden_, "MLP output norm");
    Layer& l = layer_at(layer);
    l.attention_output_norm = std::move(attention_output_norm);
    l.mlp_output_norm = std::move(mlp_output_norm);
  }

  // the MLP's activation by its Hugging Face name: "silu" (the default) or "gelu_pytorch_tanh"
  void set_activation(int64_t layer, const std::string& name) {
    TORCH_CHECK(name == "silu" || name == "gelu_pytorch_tanh",
                "NativeDecoder: no activation named " + name);
    layer_at(layer).activation = name == "silu" ? Activation::kSilu : Activation::kGeluTanh;
  }

  // a sliding layer reads forward's windowed layout and its local RoPE tables
  void set_sliding(int64_t layer, bool sliding) { layer_at(layer).sliding = sliding; }

  // one part of a layer's linear ("qkv", "o", "gate_up", "down"), parts in output order
  void add_linear_part(int64_t layer, std::string which, int64_t format, at::Tensor groups,
                       int64_t out_features, int64_t in_features, std::optional<at::Tensor> bias) {
    append_part(linear_named(layer_at(layer), which), format, std::move(groups), out_features,
                in_features, std::move(bias));
  }

  // EAGLE-3's layer: forward's x is [T, 2 * hidden], the token's embedding then a feature; the
  // layer's q|k|v read [input_norm(embedding), feature_norm(feature)], and the residual stream
  // starts as the feature, or as its norm where norm_before_residual. One layer only.
  void set_feature_input(at::Tensor feature_norm, bool norm_before_residual) {
    check_vector(feature_norm, hidden_, "feature norm");
    feature_norm_ = std::move(feature_norm);
    norm_before_residual_ = norm_before_residual;
    ready_.reset();
  }

  // one part of the LM head (no bias), parts in vocabulary order: forward's logits_rows need it
  void add_head_part(int64_t format, at::Tensor groups, int64_t out_features,
                     int64_t in_features) {
    TORCH_CHECK(in_features == hidden_, "NativeDecoder: the LM head must read the hidden size");
    append_part(head_, format, std::move(groups), out_features, in_features, std::nullopt);
  }

 private:
  Layer& layer_at(int64_t layer) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()),
                "NativeDecoder: no layer " + text(layer));
    return layers_[layer];
  }

  void append_part(Linear& linear, int64_t format, at::Tensor groups, int64_t out_features,
                   int64_t in_features, std::optional<at::Tensor> bias) {
    TORCH_CHECK(groups.scalar_type() == at::kByte && groups.dim() == 2 && groups.is_contiguous() &&
                    groups.device().is_cpu(),
                "NativeDecoder: packed groups must be contiguous uint8 [groups, bytes]");
    const int64_t width = gemm_->group_width, num_groups = groups.size(0);
    TORCH_CHECK(num_groups * width >= out_features && (num_groups - 1) * width < out_features,
                "NativeDecoder: " + text(num_groups) + " groups do not hold " + text(out_features));
    const int64_t bytes = gemm_->group_bytes(format, in_features);
    TORCH_CHECK(bytes > 0 && groups.size(1) == bytes,
                "NativeDecoder: format " + text(format) + " at K=" + text(in_features) +
                    " needs groups of " + text(bytes) + " bytes, got " + text(groups.size(1)));
    TORCH_CHECK(linear.parts.empty() || linear.in_features == in_features,
                "NativeDecoder: the parts of one linear differ in inputs");
    LinearPart part;
    part.format = format;
    part.in_features = in_features;
    part.out_features = out_features;
    part.first_feature = linear.out_features;
    part.num_groups = num_groups;
    part.groups = std::move(groups);
    if (bias.has_value() && bias->defined()) {
      check_vector(*bias, out_features, "bias");
      part.bias = *bias;
    }
    linear.parts.push_back(std::move(part));
    linear.in_features = in_features;
    linear.out_features += out_features;
    ready_.reset();
  }

 public:

  // per layer [2, num_kv_heads, num_blocks, block_size, head_dim] float32, as the runner holds them
  void set_kv_caches(std::vector<at::Tensor> caches) {
    TORCH_CHECK(caches.size() == layers_.size(), "NativeDecoder: one cache per layer expected");
    for (size_t i = 0; i < caches.size(); ++i) {
      const at::Tensor& c = caches[i];
      TORCH_CHECK(c.dim() == 5 && c.size(0) == 2 && c.size(1) == num_kv_heads_ &&
                      c.size(4) == head_dim_ && c.scalar_type() == at::kFloat &&
                      c.is_contiguous() && c.device().is_cpu(),
                  "NativeDecoder: layer " + text(static_cast<int64_t>(i)) +
                      "'s cache is not a contiguous float32 [2, kv heads, blocks, block, head_dim]");
      TORCH_CHECK(c.sizes() == caches[0].sizes(),
                  "NativeDecoder: every layer's cache must have the same shape");
      layers_[i].kv_cache = c;
    }
  }

  // Checks every shape once the model is in: "" if the pass can run this model, else why not.
  // Cached until a layer or a part is added: forward asks it every step.
  std::string check_ready() const {
    if (!ready_.has_value()) ready_ = find_shape_problem();
    return *ready_;
  }

 private:
  std::string find_shape_problem() const {
    if (layers_.empty()) return "no layers";
    if (feature_norm_.defined() && (layers_.size() != 1 || !layers_[0].input_norm.defined()))
      return "a feature input needs one layer, with an input norm";
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const std::string at = " (layer " + text(static_cast<int64_t>(i)) + ")";
      if (l.qkv.out_features != q_size + 2 * kv_size || l.qkv.in_features != input_width())
        return "q|k|v projection shape" + at;
      if (l.o.out_features != hidden_ || l.o.in_features != q_size) return "o projection shape" + at;
      if (l.gate_up.out_features != 2 * intermediate_ || l.gate_up.in_features != hidden_)
        return "gate|up projection shape" + at;
      if (l.down.out_features != hidden_ || l.down.in_features != intermediate_)
        return "down projection shape" + at;
      if (gate_and_up(l.gate_up).first.part == nullptr)
        return "gate|up parts do not split into gate and up" + at;
    }
    return "";
  }

 public:
  // x: [T, hidden] embedded inputs (set_feature_input: [T, 2 * hidden]); cos, sin:
  // [T, head_dim / 2]; local_cos, local_sin: the sliding layers' tables, or none (they rotate by
  // cos and sin); slot_mapping: [T] int64; block_tables [num_seqs, max_blocks], seq_lens
  // [num_seqs], cu_num_query_tokens [num_seqs + 1]: int32; tree_mask: [T] int64 or none
  // (engine/models/attention.py) and sliding_window (0: none) of the full layers, and
  // windowed_tree_mask and windowed_sliding_window of the sliding layers; logits_rows: [R] int64
  // rows of the step, or none. Returns the final-norm hidden states [T, hidden] (without a final
  // norm: the residual stream), the residual stream entering each of `aux_layers`, side by side in
  // layer order ([T, distinct aux layers * hidden]), as the torch path leaves them, and the LM
  // head's logits at logits_rows ([R, vocab]; [0, 0] without logits_rows).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
      at::Tensor x, at::Tensor cos, at::Tensor sin, std::optional<at::Tensor> local_cos,
      std::optional<at::Tensor> local_sin, at::Tensor slot_mapping, at::Tensor block_tables,
      at::Tensor seq_lens, at::Tensor cu_num_query_tokens, std::optional<at::Tensor> tree_mask,
      int64_t sliding_window, std::optional<at::Tensor> windowed_tree_mask,
      int64_t windowed_sliding_window, std::vector<int64_t> aux_layers,
      std::optional<at::Tensor> logits_rows) {
    const std::string not_ready = check_ready();
    TORCH_CHECK(not_ready.empty(), "NativeDecoder: " + not_ready);
    TORCH_CHECK(layers_[0].kv_cache.defined(), "NativeDecoder: set_kv_caches first");
    const int64_t T = x.size(0), half = head_dim_ / 2, x_width = input_width();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == x_width && x.scalar_type() == at::kFloat &&
                    x.device().is_cpu(),
                "NativeDecoder: x must be float32 [T, " + text(x_width) + "]");
    const bool has_local_rotary = local_cos.has_value() && local_cos->defined();
    TORCH_CHECK(has_local_rotary == (local_sin.has_value() && local_sin->defined()),
                "NativeDecoder: local_cos and local_sin come together");
    if (!has_local_rotary) {
      local_cos = cos;
      local_sin = sin;
    }
    for (const at::Tensor* t : {&cos, &sin, &*local_cos, &*local_sin})
      TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == half &&
                      t->scalar_type() == at::kFloat && t->stride(1) == 1,
                  "NativeDecoder: cos and sin (local ones too) must be float32 "
                  "[T, head_dim / 2] with unit stride");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == T,
                "NativeDecoder: slot_mapping must be [T] int64");
    const int num_seqs = static_cast<int>(seq_lens.numel());
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                    cu_num_query_tokens.scalar_type() == at::kInt &&
                    block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                    cu_num_query_tokens.is_contiguous() && block_tables.dim() == 2 &&
                    block_tables.size(0) == num_seqs &&
                    cu_num_query_tokens.numel() == num_seqs + 1 &&
                    cu_num_query_tokens.const_data_ptr<int32_t>()[num_seqs] == T,
                "NativeDecoder: attention metadata must be contiguous int32 of matching sizes");
    const int64_t* tree = tree_rows(tree_mask, T);
    const int64_t* windowed_tree = tree_rows(windowed_tree_mask, T);
    int64_t R = 0;
    const int64_t* head_rows = nullptr;
    if (logits_rows.has_value() && logits_rows->defined()) {
      TORCH_CHECK(!head_.parts.empty(), "NativeDecoder: logits_rows without an LM head");
      TORCH_CHECK(logits_rows->scalar_type() == at::kLong && logits_rows->is_contiguous() &&
                      logits_rows->dim() == 1 && logits_rows->device().is_cpu(),
                  "NativeDecoder: logits_rows must be [R] int64");
      R = logits_rows->numel();
      head_rows = logits_rows->const_data_ptr<int64_t>();
      for (int64_t i = 0; i < R; ++i)
        TORCH_CHECK(head_rows[i] >= 0 && head_rows[i] < T,
                    "NativeDecoder: logits row " + text(head_rows[i]) + " is not in the step");
    }
    const int64_t num_layers = static_cast<int64_t>(layers_.size());
    // the torch path's order: one column block per distinct layer, by layer index
    std::sort(aux_layers.begin(), aux_layers.end());
    aux_layers.erase(std::unique(aux_layers.begin(), aux_layers.end()), aux_layers.end());
    std::vector<int64_t> aux_slot(num_layers, -1);
    for (size_t j = 0; j < aux_layers.size(); ++j) {
      TORCH_CHECK(aux_layers[j] >= 0 && aux_layers[j] < num_layers,
                  "NativeDecoder: no layer " + text(aux_layers[j]));
      aux_slot[aux_layers[j]] = static_cast<int64_t>(j);
    }
    const int64_t num_slots = layers_[0].kv_cache.size(2) * layers_[0].kv_cache.size(3);
    const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < T; ++r)
      TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots,
                  "NativeDecoder: slot " + text(slots[r]) + " out of the cache");

    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_width = q_size + 2 * kv_size;
    const at::TensorOptions options = x.options();
    x = x.contiguous();
    at::Tensor residual = x_width == hidden_ ? x.clone() : at::empty({T, hidden_}, x.options());
    if (feature_norm_.defined()) {
      for (int64_t r = 0; r < T; ++r) {
        const float* feature = x.const_data_ptr<float>() + r * x_width + hidden_;
        float* row = residual.data_ptr<float>() + r * hidden_;
        if (norm_before_residual_)
          specserve_math::normalize_row(feature, feature_norm_.const_data_ptr<float>(), eps_,
                                        hidden_, row);
        else
          std::memcpy(row, feature, hidden_ * sizeof(float));
      }
    }
    at::Tensor out = at::empty({T, hidden_}, options);
    at::Tensor aux = at::empty({T, static_cast<int64_t>(aux_layers.size()) * hidden_}, options);
    at::Tensor logits = at::empty({R, R > 0 ? head_.out_features : 0}, options);
    // one buffer for the step's activations: q|k|v, q, attention, gate|up, act(gate) * up, and
    // the output of a projection before it joins the residual
    const int64_t floats = T * (qkv_width + q_size + q_size + 2 * intermediate_ + intermediate_ +
                                hidden_);
    std::unique_ptr<float[]> buffer(new float[floats]);
    Activations act;
    act.qkv = buffer.get();
    act.q = act.qkv + T * qkv_width;
    act.attended = act.q + T * q_size;
    act.gate_up = act.attended + T * q_size;
    act.activated = act.gate_up + T * 2 * intermediate_;
    act.projected = act.activated + T * intermediate_;

    AttentionProblem problem{act.q, nullptr, nullptr, block_tables.const_data_ptr<int32_t>(),
                             seq_lens.const_data_ptr<int32_t>(),
                             cu_num_query_tokens.const_data_ptr<int32_t>(), tree, act.attended,
                             block_tables.size(1), layers_[0].kv_cache.size(2),
                             static_cast<int>(num_heads_), static_cast<int>(num_kv_heads_),
                             static_cast<int>(head_dim_),
                             static_cast<int>(layers_[0].kv_cache.size(3)),
                             static_cast<int>(sliding_window), scale_};
    const int num_threads = std::max(1, at::get_num_threads());
    int64_t num_items = 0;
    std::unique_ptr<void, void (*)(void*)> plan(
        attention_->plan(&problem, num_seqs, num_threads, &num_items), attention_->free_plan);
    // the sliding layers' layout: the same step under their window, with its own plan (the
    // window changes the items' costs, so their order)
    AttentionProblem windowed_problem = problem;
    windowed_problem.tree_mask = windowed_tree;
    windowed_problem.sliding_window = static_cast<int>(windowed_sliding_window);
    int64_t windowed_num_items = 0;
    const bool any_sliding = std::any_of(layers_.begin(), layers_.end(),
                                         [](const Layer& l) { return l.sliding; });
    std::unique_ptr<void, void (*)(void*)> windowed_plan(
        any_sliding ? attention_->plan(&windowed_problem, num_seqs, num_threads,
                                       &windowed_num_items)
                    : nullptr,
        attention_->free_plan);

    constexpr int64_t kStagesPerLayer = 8;
    // every layer's stages, then the final norm's and the LM head's
    std::unique_ptr<StageSync[]> stages(new StageSync[num_layers * kStagesPerLayer + 2]);

    float* x_rows = residual.data_ptr<float>();
    float* aux_rows = aux.data_ptr<float>();
    const int64_t aux_width = aux.size(1);
    const PieceSize piece_size{gemm_->groups_per_task(T), num_threads};
    const PieceSize head_piece_size{gemm_->groups_per_task(std::max<int64_t>(R, 1)), num_threads};
    const int64_t scratch_floats =
        std::max({gemm_->scratch_floats(T, hidden_), gemm_->scratch_floats(T, q_size),
                  gemm_->scratch_floats(T, intermediate_), gemm_->scratch_floats(R, hidden_)});

#pragma omp parallel num_threads(num_threads)
    {
      std::unique_ptr<float[]> normed(new float[T * x_width]);
      std::unique_ptr<float[]> scratch(new float[std::max<int64_t>(1, scratch_floats)]);
      std::unique_ptr<void, void (*)(void*)> attention_scratch(attention_->new_scratch(),
                                                               attention_->free_scratch);
      const int thread = omp_get_thread_num();
      // thread 0's clock, stage by stage (a stage's time includes its wait for others' pieces)
      const bool timing = profiling_ && thread == 0;
      double last = timing ? omp_get_wtime() : 0.0;
      auto mark = [&](Stage stage) {
        if (!timing) return;
        const double now = omp_get_wtime();
        stage_seconds_[stage] += now - last;
        last = now;
      };
      // a projection into the residual rows: without an output norm each piece adds its
      // features; with one the pieces write theirs and a stage of rows normalizes each output
      // row and adds it (the norm needs the whole row)
      auto project_into_residual = [&](StageSync* sync, const Linear& linear, const float* in,
                                       const at::Tensor& output_norm) {
        const bool add_now = !output_norm.defined();
        run_stage(sync[0], linear_pieces(linear, piece_size), [&](int64_t piece) {
          const auto [n0, n1] = run_piece(linear, piece, piece_size, in, T, act.projected,
                                          hidden_, scratch.get());
          if (add_now) add_columns(act.projected, x_rows, T, n0, n1);
        });
        if (add_now) return;
        run_stage(sync[1], T, [&](int64_t r) {
          float* row = act.projected + r * hidden_;
          specserve_math::normalize_row(row, output_norm.const_data_ptr<float>(), eps_, hidden_,
                                        row);
          add_columns(row, x_rows + r * hidden_, 1, 0, hidden_);
        });
      };
      for (int64_t li = 0; li < num_layers; ++li) {
        const Layer& layer = layers_[li];
        StageSync* stage = &stages[li * kStagesPerLayer];
        // what q|k|v read: the input norm of the residual stream, the stream itself (no input
        // norm), or EAGLE-3's two normed inputs side by side
        const float* qkv_in = normed.get();
        if (feature_norm_.defined()) {
          for (int64_t r = 0; r < T; ++r) {
            const float* in = x.const_data_ptr<float>() + r * x_width;
            float* row = normed.get() + r * x_width;
            specserve_math::normalize_row(in, layer.input_norm.const_data_ptr<float>(), eps_,
                                          hidden_, row);
            specserve_math::normalize_row(in + hidden_, feature_norm_.const_data_ptr<float>(),
                                          eps_, hidden_, row + hidden_);
          }
        } else if (layer.input_norm.defined()) {
          normalize_rows(x_rows, layer.input_norm.const_data_ptr<float>(), T, normed.get());
        } else {
          qkv_in = x_rows;  // unchanged until this layer's o-projection, after the q|k|v stage
        }
        mark(kNorms);
        // q|k|v; the residual rows EAGLE-3 reads are copied out by pieces of this stage, so
        // before the o-projection changes them
        const int64_t qkv_pieces = linear_pieces(layer.qkv, piece_size);
        run_stage(stage[0], qkv_pieces + (aux_slot[li] >= 0 ? T : 0), [&](int64_t piece) {
          if (piece < qkv_pieces) {
            run_piece(layer.qkv, piece, piece_size, qkv_in, T, act.qkv, qkv_width,
                      scratch.get());
            return;
          }
          const int64_t r = piece - qkv_pieces;
          std::memcpy(aux_rows + r * aux_width + aux_slot[li] * hidden_, x_rows + r * hidden_,
                      hidden_ * sizeof(float));
        });
        mark(kQkv);
        // per-head norms of q and k, rotary, q gathered, k and v into the cache
        const float* cache = layer.kv_cache.const_data_ptr<float>();
        float* key_cache = const_cast<float*>(cache);
        float* value_cache = key_cache + num_kv_heads_ * num_slots * head_dim_;
        const at::Tensor& layer_cos = layer.sliding ? *local_cos : cos;
        const at::Tensor& layer_sin = layer.sliding ? *local_sin : sin;
        run_stage(stage[1], T, [&](int64_t r) {
          float* row = act.qkv + r * qkv_width;
          if (layer.q_norm.defined()) {
            normalize_heads(row, layer.q_norm.const_data_ptr<float>(), num_heads_);
            normalize_heads(row + q_size, layer.k_norm.const_data_ptr<float>(), num_kv_heads_);
          }
          specserve_math::rotate_heads(
              row, layer_cos.const_data_ptr<float>() + r * layer_cos.stride(0),
              layer_sin.const_data_ptr<float>() + r * layer_sin.stride(0),
              num_heads_ + num_kv_heads_, head_dim_);
          std::memcpy(act.q + r * q_size, row, q_size * sizeof(float));
          for (int64_t h = 0; h < num_kv_heads_; ++h) {
            const int64_t at = (h * num_slots + slots[r]) * head_dim_;
            std::memcpy(key_cache + at, row + q_size + h * head_dim_, head_dim_ * sizeof(float));
            std::memcpy(value_cache + at, row + q_size + kv_size + h * head_dim_,
                        head_dim_ * sizeof(float));
          }
        });
        mark(kRotaryAndCache);
        AttentionProblem layer_problem = layer.sliding ? windowed_problem : problem;
        layer_problem.key_cache = key_cache;
        layer_problem.value_cache = value_cache;
        const void* layer_plan = layer.sliding ? windowed_plan.get() : plan.get();
        run_stage(stage[2], layer.sliding ? windowed_num_items : num_items, [&](int64_t item) {
          attention_->run_item(&layer_problem, layer_plan, item, attention_scratch.get());
        });
        mark(kAttention);
        // o-projection (and its output norm), into the residual
        project_into_residual(&stage[3], layer.o, act.attended, layer.attention_output_norm);
        mark(kOutProjection);
        normalize_rows(x_rows, layer.post_norm.const_data_ptr<float>(), T, normed.get());
        mark(kNorms);
        // gate and up of the same features, then act(gate) * up
        const std::pair<GroupSpan, GroupSpan> spans = gate_and_up(layer.gate_up);
        const GroupSpan &gate = spans.first, &up = spans.second;
        const int64_t gate_groups = piece_size.groups(gate.num_groups);
        const int64_t gate_pieces = (gate.num_groups + gate_groups - 1) / gate_groups;
        const auto activation_row = layer.activation == Activation::kSilu
                                        ? specserve_math::silu_and_mul_row
                                        : specserve_math::gelu_tanh_and_mul_row;
        run_stage(stage[5], gate_pieces, [&](int64_t piece) {
          const int64_t g0 = piece * gate_groups;
          const int64_t g1 = std::min(g0 + gate_groups, gate.num_groups);
          run_span(gate, g0, g1, normed.get(), T, act.gate_up, 2 * intermediate_, scratch.get());
          run_span(up, g0, g1, normed.get(), T, act.gate_up + intermediate_, 2 * intermediate_,
                   scratch.get());
          const int64_t c0 = g0 * gemm_->group_width;
          const int64_t c1 = std::min(g1 * gemm_->group_width, intermediate_);
          for (int64_t r = 0; r < T; ++r) {
            const float* g = act.gate_up + r * 2 * intermediate_;
            activation_row(g + c0, g + intermediate_ + c0, c1 - c0,
                           act.activated + r * intermediate_ + c0);
          }
        });
        mark(kGateUp);
        // down-projection (and its output norm), into the residual
        project_into_residual(&stage[6], layer.down, act.activated, layer.mlp_output_norm);
        mark(kDown);
      }
      run_stage(stages[num_layers * kStagesPerLayer], T, [&](int64_t r) {
        float* row = out.data_ptr<float>() + r * hidden_;
        if (final_norm_.defined())
          specserve_math::normalize_row(x_rows + r * hidden_, final_norm_.const_data_ptr<float>(),
                                        eps_, hidden_, row);
        else
          std::memcpy(row, x_rows + r * hidden_, hidden_ * sizeof(float));
      });
      mark(kNorms);
      if (R > 0) {
        // each thread's own copy of the rows that sample (the final norm's stage is done)
        std::unique_ptr<float[]> head_in(new float[R * hidden_]);
        for (int64_t i = 0; i < R; ++i)
          std::memcpy(head_in.get() + i * hidden_,
                      out.const_data_ptr<float>() + head_rows[i] * hidden_,
                      hidden_ * sizeof(float));
        run_stage(stages[num_layers * kStagesPerLayer + 1], linear_pieces(head_, head_piece_size),
                  [&](int64_t piece) {
                    run_piece(head_, piece, head_piece_size, head_in.get(), R,
                              logits.data_ptr<float>(), head_.out_features, scratch.get());
                  });
        mark(kLmHead);
      }
    }
    return {out, aux, logits};
  }

  // With profiling on, every forward adds thread 0's seconds per stage kind to stage_seconds()
  // (benchmarks/bench_decode_breakdown.py): norms, q|k|v, rotary and cache writes, attention,
  // o-projection, gate|up with the activation, down-projection, LM head (an output norm's rows
  // count with its projection).
  void set_profiling(bool on) {
    profiling_ = on;
    stage_seconds_.assign(kNumStages, 0.0);
  }
  std::vector<double> stage_seconds() const { return stage_seconds_; }

 private:
  struct Activations {
    float *qkv, *q, *attended, *gate_up, *activated, *projected;
  };

  // the width of forward's x and of the first layer's q|k|v input
  int64_t input_width() const { return feature_norm_.defined() ? 2 * hidden_ : hidden_; }

  static void check_vector(const at::Tensor& t, int64_t size, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.numel() == size && t.scalar_type() == at::kFloat &&
                    t.is_contiguous() && t.device().is_cpu(),
                std::string("NativeDecoder: ") + name + " must be contiguous float32 [" +
                    text(size) + "]");
  }

  static Linear& linear_named(Layer& layer, const std::string& which) {
    if (which == "qkv") return layer.qkv;
    if (which == "o") return layer.o;
    if (which == "gate_up") return layer.gate_up;
    TORCH_CHECK(which == "down", "NativeDecoder: no linear named " + which);
    return layer.down;
  }

  // the gate and up halves as group spans: one part holding both (its up half starting on a
  // group), or two parts; {nullptr} spans when neither
  std::pair<GroupSpan, GroupSpan> gate_and_up(const Linear& linear) const {
    const int64_t width = gemm_->group_width;
    if (linear.parts.size() == 1 && intermediate_ % width == 0) {
      const LinearPart* part = &linear.parts[0];
      const int64_t half = intermediate_ / width;
      return {{part, 0, half}, {part, half, half}};
    }
    if (linear.parts.size() == 2 && linear.parts[0].out_features == intermediate_ &&
        linear.parts[0].num_groups == linear.parts[1].num_groups)
      return {{&linear.parts[0], 0, linear.parts[0].num_groups},
              {&linear.parts[1], 0, linear.parts[1].num_groups}};
    return {};
  }

  static int64_t linear_pieces(const Linear& linear, const PieceSize& size) {
    int64_t pieces = 0;
    for (const LinearPart& part : linear.parts) {
      const int64_t groups = size.groups(part.num_groups);
      pieces += (part.num_groups + groups - 1) / groups;
    }
    return pieces;
  }

  // groups [g0, g1) of a span; y points at the span's feature 0 of row 0
  void run_span(const GroupSpan& span, int64_t g0, int64_t g1, const float* x, int64_t T, float* y,
                int64_t y_stride, float* scratch) const {
    const LinearPart& part = *span.part;
    const int64_t shift = span.first_group * gemm_->group_width;
    const float* bias = data_or_null(part.bias);
    gemm_->linear_groups(part.format, x, T, part.in_features,
                         part.groups.const_data_ptr<uint8_t>() +
                             span.first_group * part.groups.size(1),
                         part.out_features - shift, bias ? bias + shift : nullptr, y, y_stride,
                         g0, g1, scratch);
  }

  // piece `piece` of a linear at T rows: its features [n0, n1) of the linear's output
  std::pair<int64_t, int64_t> run_piece(const Linear& linear, int64_t piece, const PieceSize& size,
                                        const float* x, int64_t T, float* y, int64_t y_stride,
                                        float* scratch) const {
    for (const LinearPart& part : linear.parts) {
      const int64_t groups = size.groups(part.num_groups);
      const int64_t pieces = (part.num_groups + groups - 1) / groups;
      if (piece >= pieces) {
        piece -= pieces;
        continue;
      }
      const int64_t g0 = piece * groups, g1 = std::min(g0 + groups, part.num_groups);
      gemm_->linear_groups(part.format, x, T, linear.in_features,
                           part.groups.const_data_ptr<uint8_t>(), part.out_features,
                           data_or_null(part.bias), y + part.first_feature, y_stride, g0, g1,
                           scratch);
      const int64_t n0 = part.first_feature + g0 * gemm_->group_width;
      return {n0, part.first_feature + std::min(g1 * gemm_->group_width, part.out_features)};
    }
    return {0, 0};
  }

  // each of `num_heads` consecutive heads of one row through its norm, in place (q's or k's
  // heads, as Attention._normalize_heads in engine/models/llama.py)
  void normalize_heads(float* heads, const float* weight, int64_t num_heads) const {
    for (int64_t h = 0; h < num_heads; ++h)
      specserve_math::normalize_row(heads + h * head_dim_, weight, eps_, head_dim_,
                                    heads + h * head_dim_);
  }

  // a [T] int64 tree mask's rows, or nullptr where there is none
  static const int64_t* tree_rows(const std::optional<at::Tensor>& tree_mask, int64_t T) {
    if (!tree_mask.has_value() || !tree_mask->defined()) return nullptr;
    TORCH_CHECK(tree_mask->scalar_type() == at::kLong && tree_mask->is_contiguous() &&
                    tree_mask->numel() == T,
                "NativeDecoder: a tree mask must be [T] int64");
    return tree_mask->const_data_ptr<int64_t>();
  }

  void normalize_rows(const float* x, const float* weight, int64_t T, float* out) const {
    for (int64_t r = 0; r < T; ++r)
      specserve_math::normalize_row(x + r * hidden_, weight, eps_, hidden_, out + r * hidden_);
  }

  // residual[:, n0:n1] += projected[:, n0:n1]
  void add_columns(const float* projected, float* residual, int64_t T, int64_t n0,
                   int64_t n1) const {
    for (int64_t r = 0; r < T; ++r) {
      float* x = residual + r * hidden_;
      const float* p = projected + r * hidden_;
      for (int64_t n = n0; n < n1; ++n) x[n] = x[n] + p[n];
    }
  }

  // Pieces 0 .. count - 1 of a stage, taken from a shared counter by whichever threads come, and
  // back once every piece is done. No thread waits for another to turn up, only for the pieces
  // already taken: a thread the OS deschedules between pieces (on two cores, whenever the HTTP
  // server or a client runs) leaves its share to the others instead of holding them all at a
  // barrier. A late thread only finds the stage done. What a thread computes for itself between
  // stages (its copy of a norm) is used only by pieces it takes, which it can take only while
  // the stage is unfinished, i.e. before anyone moved on to change that norm's input.
  template <class Body>
  static void run_stage(StageSync& stage, int64_t count, Body&& body) {
    for (int64_t i = stage.taken.fetch_add(1, std::memory_order_acq_rel); i < count;
         i = stage.taken.fetch_add(1, std::memory_order_acq_rel)) {
      body(i);
      stage.done.fetch_add(1, std::memory_order_release);
    }
    for (int spins = 0; stage.done.load(std::memory_order_acquire) < count; ++spins) {
      if (spins < kSpinsBeforeYield) {
        spin_pause();
      } else {
        std::this_thread::yield();  // the thread we wait for may need this core
      }
    }
  }

  // engine/models/native_pass.py's NATIVE_STAGES names them, in this order
  enum Stage {
    kNorms, kQkv, kRotaryAndCache, kAttention, kOutProjection, kGateUp, kDown, kLmHead,
    kNumStages
  };

  const GemmEntryPoints* gemm_;
  const AttentionEntryPoints* attention_;
  int64_t hidden_, num_heads_, num_kv_heads_, head_dim_, intermediate_;
  float eps_, scale_;
  at::Tensor final_norm_;    // undefined: forward returns the residual stream
  at::Tensor feature_norm_;  // defined: EAGLE-3's input (set_feature_input)
  bool norm_before_residual_ = false;
  std::vector<Layer> layers_;
  Linear head_;  // the LM head, where add_head_part gave one
  mutable std::optional<std::string> ready_;  // check_ready's answer, once asked
  bool profiling_ = false;
  std::vector<double> stage_seconds_ = std::vector<double>(kNumStages, 0.0);
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.class_<NativeDecoder>("NativeDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                       double, std::optional<at::Tensor>>())
      .def("add_layer", &NativeDecoder::add_layer)
      .def("set_head_norms", &NativeDecoder::set_head_norms)
      .def("set_output_norms", &NativeDecoder::set_output_norms)
      .def("set_activation", &NativeDecoder::set_activation)
      .def("set_sliding", &NativeDecoder::set_sliding)
      .def("add_linear_part", &NativeDecoder::add_linear_part)
      .def("add_head_part", &NativeDecoder::add_head_part)
      .def("set_feature_input", &NativeDecoder::set_feature_input)
      .def("set_kv_caches", &NativeDecoder::set_kv_caches)
      .def("check_ready", &NativeDecoder::check_ready)
      .def("forward", &NativeDecoder::forward)
      .def("set_profiling", &NativeDecoder::set_profiling)
      .def("stage_seconds", &NativeDecoder::stage_seconds);
}
