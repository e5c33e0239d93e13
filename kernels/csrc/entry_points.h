// The in-process interface between specserve's CPU kernel libraries.
//
// The native decoder pass (native_decoder.cpp) runs a whole forward inside one OpenMP parallel
// region, so it needs the packed matmul and paged attention as serial pieces of work, not as ops
// that fork their own threads. Each kernel library exports a table of plain function pointers (its
// op `<library>_entry_points()` returns the table's address), and the pass calls the very same
// compiled kernels through it: one source of truth for their numerics, and no second compile of
// their templates (each takes ~25-35 s). Tables carry kVersion; a pass refuses a table of another.
#pragma once

#include <cstdint>

namespace specserve_abi {

constexpr int64_t kVersion = 1;

struct GemmEntryPoints {
  int64_t version;
  // output groups (of kGroupWidth features) that one piece of work takes at `rows` rows; a piece
  // starts at a multiple of it
  int64_t group_width;
  int64_t (*groups_per_task)(int64_t rows);
  // bytes one group of `format` holds at K inputs; 0 for a format or K the kernel does not take
  int64_t (*group_bytes)(int64_t format, int64_t K);
  // floats of scratch one thread needs to run linear_groups at `rows` rows and K inputs
  int64_t (*scratch_floats)(int64_t rows, int64_t K);
  // y[m, n] = x[m] . W[n] (+ bias[n]) for m < rows and the features of groups [g0, g1) below N,
  // serially (the caller's thread). y[m] starts at y + m * y_stride, feature 0; the same bits as
  // the `quantized_linear` op, whatever the split into pieces.
  void (*linear_groups)(int64_t format, const float* x, int64_t rows, int64_t K,
                        const uint8_t* packed, int64_t N, const float* bias, float* y,
                        int64_t y_stride, int64_t g0, int64_t g1, float* scratch);
};

// One attention call: the fields of kernels/csrc/paged_attention.cpp's header, as pointers.
struct AttentionProblem {
  const float* query;                  // [num_tokens, num_heads, head_dim]
  const float* key_cache;              // [num_kv_heads, num_blocks, block_size, head_dim]
  const float* value_cache;            // [num_kv_heads, num_blocks, block_size, head_dim]
  const int32_t* block_tables;         // [num_seqs, table_stride]
  const int32_t* seq_lens;             // [num_seqs]
  const int32_t* cu_num_query_tokens;  // [num_seqs + 1]
  const int64_t* tree_mask;            // [num_tokens], or nullptr: no tree in the step
  float* out;                          // [num_tokens, num_heads, head_dim]
  int64_t table_stride, num_blocks;
  int num_heads, num_kv_heads, head_dim, block_size, sliding_window;
  float scale;
};

struct AttentionEntryPoints {
  int64_t version;
  // the step's work items for `num_threads` threads (they depend on the metadata and the shapes,
  // not on the data pointers: one plan serves every layer); an opaque handle, and their count
  void* (*plan)(const AttentionProblem* problem, int num_seqs, int num_threads,
                int64_t* num_items);
  void (*free_plan)(void* plan);
  void* (*new_scratch)();
  void (*free_scratch)(void* scratch);
  // one work item, serially; items of one plan are independent
  void (*run_item)(const AttentionProblem* problem, const void* plan, int64_t item, void* scratch);
};

}  // namespace specserve_abi
