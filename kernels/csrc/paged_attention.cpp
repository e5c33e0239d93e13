// Paged attention on the CPU: every query row reads its sequence's K/V blocks where they lie in the
// cache, with no padded copy of the context and no mask (engine/runner/attention.py: the torch reference).
//
//   query                   [num_tokens, num_heads, head_dim] float32
//   key_cache, value_cache  [num_kv_heads, num_blocks, block_size, head_dim] (kv_cache[0], [1])
//   block_tables            [num_seqs, max_num_blocks] int32
//   seq_lens                [num_seqs] int32: tokens of context after this step
//   cu_num_query_tokens     [num_seqs + 1] int32: sequence i's rows are [cu[i], cu[i+1]) of
//                           `query`, at positions seq_len - query_len ... seq_len - 1
//   tree_mask (optional)    [num_tokens] int64: -1 = a causal row; else a tree row's ancestor
//                           bits (bit j = it sees its sequence's row j), the context before the
//                           sequence's row 0 from position start + popcount - sliding_window on
//                           (engine/runner/attention.py, tree_ancestor_masks). A sequence's rows are all
//                           trees or all causal.
//   returns                 [num_tokens, num_heads * head_dim] float32
//
// Batch invariance: one (sequence, row, head) output comes from the same float operations in the
// same order whatever else the batch holds and however rows, heads and sequences are split into
// work items and across threads. A row walks its keys chunk by chunk (kBlocksPerChunk of the cache's
// blocks, starting at fixed positions: the partition is a property of the sequence) with an online
// softmax in float32 (running max, sum, accumulator), and each score is one fixed-order dot product. So its bits depend neither on the
// batch, nor on how many rows its sequence brings (decode, 1 + k verification rows, a prefill
// chunk), nor on the thread count, nor on the register blocking (AVX2 or AVX-512VL builds agree).
//
// GQA: a row's query heads that share a kv head are computed together, up to kMaxHeads at a time,
// so each K and V row is loaded once for all of them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "entry_points.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int kRowsPerTile = 16;    // rows of one sequence in a work item: they share block reads
constexpr int kMaxHeads = 3;        // query heads computed together (16 AVX2 registers hold 3)
constexpr int kBlocksPerChunk = 4;  // cache blocks under one online-softmax update (see Chunk)
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

using Problem = specserve_abi::AttentionProblem;  // entry_points.h

// One unit of parallel work: some rows of one sequence against one kv head, for some of the query
// heads of that kv head.
struct WorkItem {
  int32_t seq, kv_head, first_row, num_rows, first_head, num_heads;
  int64_t cost;  // ~ query vectors x keys, for scheduling only
};

// A work item's online-softmax state per query vector i = row * num_heads + head: the running
// max, the running sum in 8 lanes (lane = key index mod 8), the output accumulator; and the scores
// of one block, per head.
struct Scratch {
  std::vector<float> running_max, sum_lanes, acc, scores;
  int score_stride = 0;  // floats per head in `scores`
};

#ifdef __AVX2__

// Register blocking: keys per score group and 8-float vectors of head_dim per accumulator chunk,
// sized for 32 vector registers with AVX-512VL and 16 without. Neither changes a result bit.
#ifdef __AVX512VL__
constexpr int kKeysPerGroup = 8;
constexpr int kAccVectors = 8;
#else
constexpr int kKeysPerGroup = 4;
constexpr int kAccVectors = 4;
#endif

// Ask for the rows of a later block while this one is computed: blocks are scattered, so the
// hardware prefetchers cannot see the next one coming. Spread over the block's work (a few rows
// at a time), the requests never pile up; _MM_HINT_T1 measured 2x faster than T0 here.
inline void prefetch_rows(const float* rows, int64_t num_floats) {
  for (int64_t i = 0; i < num_floats; i += 16) {  // one 64-byte line each
    _mm_prefetch(reinterpret_cast<const char*>(rows + i), _MM_HINT_T1);
  }
}

// exp for x <= 0 (scores minus their running max), Cephes' polynomial; exp(0) is exactly 1.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // keeps 2^n a normal float
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// out[l] = scale * (lane sum of a[l]) for l < kKeys, where a lane sum is
// ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): the same formula for 4 and 8 keys.
template <int kKeys>
inline void store_lane_sums(float* out, const __m256* a, float scale) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  if constexpr (kKeys == 4) {
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1));
    _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
  } else {
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                      _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
  }
}

// scores[h][j] = scale * q_h . k_j for the key groups that cover [begin, end) of a block. Each
// score is one 8-lane FMA chain over head_dim, then store_lane_sums: its bits depend on q_h and k_j
// only. Lanes past the block's end read key 0 (valid memory) and are never used.
template <int kHeadDim, int kHeads>
inline void block_scores(const float* const* q, const float* keys, const Problem& p, int begin,
                         int end, float* scores, int score_stride, const float* next_keys) {
  constexpr int G = kKeysPerGroup;
  const int D = kHeadDim ? kHeadDim : p.head_dim;
  for (int group = begin & ~(G - 1); group < end; group += G) {
    if (next_keys != nullptr && group + G <= p.block_size) {
      prefetch_rows(next_keys + static_cast<int64_t>(group) * D, G * D);
    }
    const float* k[G];
    for (int l = 0; l < G; ++l) {
      k[l] = keys + (group + l < p.block_size ? static_cast<int64_t>(group + l) * D : 0);
    }
    __m256 acc[kHeads][G];
    for (int h = 0; h < kHeads; ++h) {
      for (int l = 0; l < G; ++l) acc[h][l] = _mm256_setzero_ps();
    }
    for (int d = 0; d < D; d += 8) {
      __m256 qv[kHeads];
      for (int h = 0; h < kHeads; ++h) qv[h] = _mm256_loadu_ps(q[h] + d);
      for (int l = 0; l < G; ++l) {
        const __m256 kv = _mm256_loadu_ps(k[l] + d);
        for (int h = 0; h < kHeads; ++h) acc[h][l] = _mm256_fmadd_ps(qv[h], kv, acc[h][l]);
      }
    }
    for (int h = 0; h < kHeads; ++h) {
      store_lane_sums<G>(scores + h * score_stride + group, acc[h], p.scale);
    }
  }
}

// One head's online-softmax bookkeeping for keys [begin, end) of a block, whose scores are in
// `scores`: turns them into p = exp(score - new max), adds p to the 8-lane running sum (the order
// of the additions is a property of the sequence), and returns alpha = exp(old max - new max),
// which rescales everything summed before.
inline float softmax_block(float* scores, int begin, int end, float& running_max,
                           float* sum_lanes) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(kMinusInf);
  auto valid = [&](int group) {  // lanes of the 8-key group inside [begin, end)
    const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(group));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(key, _mm256_set1_epi32(begin - 1)),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(end), key)));
  };
  __m256 block_max = minus_inf;
  for (int group = begin & ~7; group < end; group += 8) {
    block_max = _mm256_max_ps(
        block_max, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(scores + group), valid(group)));
  }
  __m128 max4 =
      _mm_max_ps(_mm256_castps256_ps128(block_max), _mm256_extractf128_ps(block_max, 1));
  max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
  max4 = _mm_max_ss(max4, _mm_shuffle_ps(max4, max4, 1));
  const float new_max = std::max(running_max, _mm_cvtss_f32(max4));
  // NOTE: the first block starts from acc = 0, sum = 0: alpha = 0 there (running_max is -inf);
  // an unchanged max gives exactly exp(0) = 1 without the call
  const float alpha = running_max == kMinusInf ? 0.0f
                      : running_max == new_max ? 1.0f
                                               : std::exp(running_max - new_max);
  running_max = new_max;
  const __m256 shift = _mm256_set1_ps(new_max);
  __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(sum_lanes), _mm256_set1_ps(alpha));
  for (int group = begin & ~7; group < end; group += 8) {
    // NOTE: lanes outside [begin, end) may hold anything (keys past the context): blend them to
    // zero, never multiply
    const __m256 prob = _mm256_blendv_ps(
        _mm256_setzero_ps(),
        exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + group), shift)), valid(group));
    _mm256_storeu_ps(scores + group, prob);
    sum = _mm256_add_ps(sum, prob);
  }
  _mm256_storeu_ps(sum_lanes, sum);
  return alpha;
}

inline float finish_sum(const float* sum_lanes) {
  const __m256 v = _mm256_loadu_ps(sum_lanes);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// acc_h[d] = acc_h[d] * alpha_h, then acc_h[d] += p_h[j] * v_j[d] for j in order, for kVectors x 8
// floats of head_dim kept in registers across the keys. The arithmetic of one element depends
// neither on the chunking nor on kHeads.
template <int kVectors, int kHeads>
inline void accumulate_chunk(float* const* acc, const float* values, int64_t row_stride,
                             const float* prob, int score_stride, int begin, int end,
                             const float* alpha, const float* next_values) {
  __m256 a[kHeads][kVectors];
  for (int h = 0; h < kHeads; ++h) {
    const __m256 scale = _mm256_set1_ps(alpha[h]);
    for (int c = 0; c < kVectors; ++c) {
      a[h][c] = _mm256_mul_ps(_mm256_loadu_ps(acc[h] + 8 * c), scale);
    }
  }
  for (int j = begin; j < end; ++j) {
    __m256 weight[kHeads];
    for (int h = 0; h < kHeads; ++h) weight[h] = _mm256_set1_ps(prob[h * score_stride + j]);
    const float* v = values + j * row_stride;
    if (next_values != nullptr) prefetch_rows(next_values + j * row_stride, 8 * kVectors);
    for (int c = 0; c < kVectors; ++c) {
      const __m256 vv = _mm256_loadu_ps(v + 8 * c);
      for (int h = 0; h < kHeads; ++h) a[h][c] = _mm256_fmadd_ps(weight[h], vv, a[h][c]);
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kVectors; ++c) _mm256_storeu_ps(acc[h] + 8 * c, a[h][c]);
  }
}

template <int kHeadDim, int kHeads>
inline void block_accumulate(float* const* acc, const float* values, const Problem& p,
                             const float* prob, int score_stride, int begin, int end,
                             const float* alpha, const float* next_values) {
  const int D = kHeadDim ? kHeadDim : p.head_dim;
  float* chunk[kHeads];
  int d = 0;
  for (; d + 8 * kAccVectors <= D; d += 8 * kAccVectors) {
    for (int h = 0; h < kHeads; ++h) chunk[h] = acc[h] + d;
    accumulate_chunk<kAccVectors, kHeads>(chunk, values + d, D, prob, score_stride, begin, end,
                                          alpha, next_values ? next_values + d : nullptr);
  }
  for (; d < D; d += 8) {
    for (int h = 0; h < kHeads; ++h) chunk[h] = acc[h] + d;
    accumulate_chunk<1, kHeads>(chunk, values + d, D, prob, score_stride, begin, end, alpha,
                                next_values ? next_values + d : nullptr);
  }
}

constexpr bool kVectorized = true;

#else  // scalar fallback: the same algorithm, one float at a time

template <int kHeadDim, int kHeads>
inline void block_scores(const float* const* q, const float* keys, const Problem& p, int begin,
                         int end, float* scores, int score_stride, const float* /*next_keys*/) {
  for (int h = 0; h < kHeads; ++h) {
    for (int j = begin; j < end; ++j) {
      const float* k = keys + static_cast<int64_t>(j) * p.head_dim;
      float s = 0.0f;
      for (int d = 0; d < p.head_dim; ++d) s += q[h][d] * k[d];
      scores[h * score_stride + j] = s * p.scale;
    }
  }
}

inline float softmax_block(float* scores, int begin, int end, float& running_max,
                           float* sum_lanes) {
  float new_max = running_max;
  for (int j = begin; j < end; ++j) new_max = std::max(new_max, scores[j]);
  const float alpha = running_max == kMinusInf ? 0.0f : std::exp(running_max - new_max);
  running_max = new_max;
  sum_lanes[0] *= alpha;
  for (int j = begin; j < end; ++j) {
    scores[j] = std::exp(scores[j] - new_max);
    sum_lanes[0] += scores[j];
  }
  return alpha;
}

inline float finish_sum(const float* sum_lanes) { return sum_lanes[0]; }

template <int kHeadDim, int kHeads>
inline void block_accumulate(float* const* acc, const float* values, const Problem& p,
                             const float* prob, int score_stride, int begin, int end,
                             const float* alpha, const float* /*next_values*/) {
  for (int h = 0; h < kHeads; ++h) {
    for (int d = 0; d < p.head_dim; ++d) acc[h][d] *= alpha[h];
    for (int j = begin; j < end; ++j) {
      const float* v = values + static_cast<int64_t>(j) * p.head_dim;
      for (int d = 0; d < p.head_dim; ++d) acc[h][d] += prob[h * score_stride + j] * v[d];
    }
  }
}

inline void prefetch_rows(const float*, int64_t) {}

constexpr bool kVectorized = false;

#endif

// Up to kBlocksPerChunk consecutive blocks of a sequence's context: one online-softmax update
// covers them all, so the running max, the rescale of the accumulators and their loads and stores
// are paid once per chunk_keys keys, not once per block. Chunks start at multiples of chunk_keys
// positions: the partition is still a property of the sequence.
struct Chunk {
  int start = 0;       // position of the chunk's first key
  int num_blocks = 0;  // blocks of the context in it (the last chunk may have fewer)
  const float* keys[kBlocksPerChunk];
  const float* values[kBlocksPerChunk];
  const float* next_keys[kBlocksPerChunk];    // blocks to request now, or nullptr
  const float* next_values[kBlocksPerChunk];
};

// One row's online-softmax update with keys [begin, end) of a chunk (positions relative to its
// start), for kHeads query heads at once; `first` indexes the heads' state in `scratch`.
template <int kHeadDim, int kHeads>
inline void attend_chunk(const float* const* q, const Chunk& chunk, const Problem& p, int begin,
                         int end, Scratch& scratch, int first) {
  const int D = kHeadDim ? kHeadDim : p.head_dim;
  const int bs = p.block_size;
  float* scores = scratch.scores.data();
  for (int i = begin / bs; i * bs < end; ++i) {
    block_scores<kHeadDim, kHeads>(q, chunk.keys[i], p, std::max(begin - i * bs, 0),
                                   std::min(end - i * bs, bs), scores + i * bs,
                                   scratch.score_stride, chunk.next_keys[i]);
  }
  float alpha[kHeads];
  float* acc[kHeads];
  for (int h = 0; h < kHeads; ++h) {
    alpha[h] = softmax_block(scores + h * scratch.score_stride, begin, end,
                             scratch.running_max[first + h],
                             scratch.sum_lanes.data() + 8 * (first + h));
    acc[h] = scratch.acc.data() + static_cast<int64_t>(first + h) * D;
  }
  float unit[kHeads];  // the chunk's later blocks add on to what its first one rescaled
  for (int h = 0; h < kHeads; ++h) unit[h] = 1.0f;
  for (int i = begin / bs; i * bs < end; ++i) {
    block_accumulate<kHeadDim, kHeads>(acc, chunk.values[i], p, scores + i * bs,
                                       scratch.score_stride, std::max(begin - i * bs, 0),
                                       std::min(end - i * bs, bs), i == begin / bs ? alpha : unit,
                                       chunk.next_values[i]);
  }
}

// A tree row's keys in one chunk [chunk_start, chunk_start + chunk_keys): the context before the
// sequence's row 0 (from its window on) and the rows whose bits `mask` holds. Each maximal run of
// visible keys is one online-softmax update, so a row on the tree's first branch (its path is rows
// 0 .. r, its window position its slot) takes exactly the updates of the causal row it equals.
template <typename Attend>
inline void attend_tree_row(uint64_t mask, int seq_start, int seq_len, int sliding_window,
                            int chunk_start, int chunk_keys, Attend attend) {
  // NOTE: the mask holds min(depth + 1, window) bits (engine/runner/attention.py), so the window, which
  // ends at position start + depth, admits the context from start + popcount - window on
  const int context_begin =
      sliding_window > 0 ? std::max(0, seq_start + __builtin_popcountll(mask) - sliding_window) : 0;
  auto visible = [&](int key) {
    return key < seq_start ? key >= context_begin : ((mask >> (key - seq_start)) & 1) != 0;
  };
  const int chunk_end = std::min(chunk_start + chunk_keys, seq_len);
  int key = std::max(std::min(context_begin, seq_start), chunk_start);
  while (key < chunk_end) {
    if (!visible(key)) {
      ++key;
      continue;
    }
    int run_end = key + 1;
    while (run_end < chunk_end && visible(run_end)) ++run_end;
    attend(key - chunk_start, run_end - chunk_start);
    key = run_end;
  }
}

template <int kHeadDim>
void run_item(const Problem& p, const WorkItem& item, Scratch& scratch) {
  const int D = kHeadDim ? kHeadDim : p.head_dim;
  const int group = p.num_heads / p.num_kv_heads;
  const int seq_len = p.seq_lens[item.seq];
  const int first_token = p.cu_num_query_tokens[item.seq];
  const int query_len = p.cu_num_query_tokens[item.seq + 1] - first_token;
  const int seq_start = seq_len - query_len;         // position of the sequence's row 0
  const int first_pos = seq_start + item.first_row;  // position of the item's first row
  const int last_pos = first_pos + item.num_rows - 1;
  // the sequence's ancestor masks when its rows are a tree, else nullptr (the causal rows)
  const int64_t* tree = p.tree_mask != nullptr && p.tree_mask[first_token] != -1
                            ? p.tree_mask + first_token
                            : nullptr;
  auto window_start = [&](int pos) {
    return p.sliding_window > 0 ? std::max(0, pos - p.sliding_window + 1) : 0;
  };
  const int num_vectors = item.num_rows * item.num_heads;
  const int chunk_keys = kBlocksPerChunk * p.block_size;
  scratch.running_max.assign(num_vectors, kMinusInf);
  scratch.sum_lanes.assign(8 * num_vectors, 0.0f);
  scratch.acc.assign(static_cast<size_t>(num_vectors) * D, 0.0f);
  scratch.score_stride = (chunk_keys + 7) / 8 * 8 + 8;  // whole 8-key groups, with room
  scratch.scores.resize(static_cast<size_t>(kMaxHeads) * scratch.score_stride);

  const int32_t* table = p.block_tables + item.seq * p.table_stride;
  const int64_t block_elems = static_cast<int64_t>(p.block_size) * D;
  const int64_t head_offset = static_cast<int64_t>(item.kv_head) * p.num_blocks * block_elems;
  auto block_offset = [&](int b) { return head_offset + table[b] * block_elems; };
  // a tree row's window starts from its depth, which is at most its row
  const int first_chunk = window_start(tree != nullptr ? seq_start : first_pos) / chunk_keys;
  const int last_chunk = last_pos / chunk_keys;
  const int last_block = last_pos / p.block_size;
  for (int b = first_chunk * kBlocksPerChunk;
       b < std::min((first_chunk + 1) * kBlocksPerChunk, last_block + 1); ++b) {
    prefetch_rows(p.key_cache + block_offset(b), block_elems);
    prefetch_rows(p.value_cache + block_offset(b), block_elems);
  }
  Chunk chunk;
  for (int c = first_chunk; c <= last_chunk; ++c) {
    chunk.start = c * chunk_keys;
    chunk.num_blocks = std::min(kBlocksPerChunk, last_block + 1 - c * kBlocksPerChunk);
    for (int i = 0; i < chunk.num_blocks; ++i) {
      const int b = c * kBlocksPerChunk + i;
      chunk.keys[i] = p.key_cache + block_offset(b);      // [block_size, head_dim]
      chunk.values[i] = p.value_cache + block_offset(b);  // [block_size, head_dim]
      // the next chunk's block i is requested a few rows at a time, during the first heads' work
      const bool prefetch = b + kBlocksPerChunk <= last_block;
      chunk.next_keys[i] = prefetch ? p.key_cache + block_offset(b + kBlocksPerChunk) : nullptr;
      chunk.next_values[i] =
          prefetch ? p.value_cache + block_offset(b + kBlocksPerChunk) : nullptr;
    }
    // row r's online-softmax update with keys [begin, end) of the chunk, for all the item's heads
    auto attend = [&](int r, int begin, int end) {
      const int64_t token = first_token + item.first_row + r;
      for (int h = 0; h < item.num_heads; h += kMaxHeads) {
        const int num_heads = std::min(kMaxHeads, item.num_heads - h);
        const float* q[kMaxHeads];
        for (int i = 0; i < num_heads; ++i) {
          const int head = item.kv_head * group + item.first_head + h + i;
          q[i] = p.query + (token * p.num_heads + head) * D;
        }
        const int first = r * item.num_heads + h;
        if (num_heads == 3) {
          attend_chunk<kHeadDim, 3>(q, chunk, p, begin, end, scratch, first);
        } else if (num_heads == 2) {
          attend_chunk<kHeadDim, 2>(q, chunk, p, begin, end, scratch, first);
        } else {
          attend_chunk<kHeadDim, 1>(q, chunk, p, begin, end, scratch, first);
        }
        for (int i = 0; i < chunk.num_blocks; ++i) {  // requested once per chunk
          chunk.next_keys[i] = chunk.next_values[i] = nullptr;
        }
      }
    };
    for (int r = 0; r < item.num_rows; ++r) {
      if (tree != nullptr) {
        attend_tree_row(static_cast<uint64_t>(tree[item.first_row + r]), seq_start, seq_len,
                        p.sliding_window, chunk.start, chunk_keys,
                        [&](int begin, int end) { attend(r, begin, end); });
        continue;
      }
      const int pos = first_pos + r;
      const int begin = std::max(window_start(pos), chunk.start) - chunk.start;
      const int end = std::min(pos + 1, chunk.start + chunk_keys) - chunk.start;
      if (begin >= end) continue;
      attend(r, begin, end);
    }
  }
  for (int r = 0; r < item.num_rows; ++r) {
    const int64_t token = first_token + item.first_row + r;
    for (int h = 0; h < item.num_heads; ++h) {
      const int head = item.kv_head * group + item.first_head + h;
      const int i = r * item.num_heads + h;
      const float* acc = scratch.acc.data() + static_cast<int64_t>(i) * D;
      float* out = p.out + (token * p.num_heads + head) * D;
      const float sum = finish_sum(scratch.sum_lanes.data() + 8 * i);
      for (int d = 0; d < D; ++d) out[d] = acc[d] / sum;
    }
  }
}

void run_item_dispatch(const Problem& p, const WorkItem& item, Scratch& scratch) {
  if (kVectorized && p.head_dim == 64) return run_item<64>(p, item, scratch);
  if (kVectorized && p.head_dim == 128) return run_item<128>(p, item, scratch);
  run_item<0>(p, item, scratch);
}

// Tiles of rows per (sequence, kv head). When that leaves too few items to keep every thread busy,
// a tile's rows are split first (a smaller tile still loads each K/V row once for all the query
// heads of its kv head), and only a lone row's heads become items of their own (a decoding
// sequence alone). Largest first, for the shared queue.
std::vector<WorkItem> plan_work(const Problem& p, int num_seqs, int num_threads) {
  const int group = p.num_heads / p.num_kv_heads;
  const int64_t enough = 4 * static_cast<int64_t>(num_threads);
  int64_t num_items = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int query_len = p.cu_num_query_tokens[s + 1] - p.cu_num_query_tokens[s];
    num_items += (query_len + kRowsPerTile - 1) / kRowsPerTile * p.num_kv_heads;
  }
  // each tile is cut into this many pieces when the tiles alone leave threads idle
  const int64_t pieces =
      num_threads > 1 && num_items < enough ? (enough + num_items - 1) / num_items : 1;
  std::vector<WorkItem> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int query_len = p.cu_num_query_tokens[s + 1] - p.cu_num_query_tokens[s];
    const int64_t context = p.sliding_window > 0 ? std::min(p.seq_lens[s], p.sliding_window)
                                                 : p.seq_lens[s];
    const int tile = static_cast<int>(std::max<int64_t>(
        1, (std::min(query_len, kRowsPerTile) + pieces - 1) / pieces));
    for (int kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
      for (int row = 0; row < query_len; row += tile) {
        const int num_rows = std::min(tile, query_len - row);
        items.push_back({s, kv_head, row, num_rows, 0, group, num_rows * group * context});
      }
    }
  }
  if (group > 1 && num_threads > 1 && static_cast<int64_t>(items.size()) < enough) {
    std::vector<WorkItem> split;
    for (const WorkItem& item : items) {
      for (int h = 0; h < group; ++h) {
        split.push_back({item.seq, item.kv_head, item.first_row, item.num_rows, h, 1,
                         item.cost / group});
      }
    }
    items.swap(split);
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& cu_num_query_tokens,
                           double scale, int64_t sliding_window,
                           const std::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "query [T, H, D] and caches [kvH, blocks, block_size, D] expected");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat,
              "float32 query and caches expected");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                  cu_num_query_tokens.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_num_query_tokens.scalar_type() == at::kInt,
              "int32 metadata expected");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  cu_num_query_tokens.numel() == num_seqs + 1,
              "metadata sizes disagree");
  const int num_heads = static_cast<int>(query.size(1));
  const int num_kv_heads = static_cast<int>(key_cache.size(0));
  const int head_dim = static_cast<int>(query.size(2));
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "head shapes disagree");
  TORCH_CHECK(!kVectorized || head_dim % 8 == 0, "head_dim must be a multiple of 8");
  const int64_t* tree = nullptr;
  if (tree_mask.has_value()) {
    TORCH_CHECK(tree_mask->scalar_type() == at::kLong && tree_mask->is_contiguous() &&
                    tree_mask->dim() == 1 && tree_mask->size(0) == query.size(0),
                "tree_mask: [num_tokens] contiguous int64 expected");
    tree = tree_mask->data_ptr<int64_t>();
  }

  at::Tensor out = at::empty({query.size(0), num_heads * head_dim}, query.options());
  Problem p{query.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
            block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
            cu_num_query_tokens.data_ptr<int32_t>(), tree, out.data_ptr<float>(),
            block_tables.size(1), key_cache.size(1), num_heads, num_kv_heads, head_dim,
            static_cast<int>(key_cache.size(2)), static_cast<int>(sliding_window),
            static_cast<float>(scale)};
  const int num_threads = at::get_num_threads();
  const std::vector<WorkItem> items = plan_work(p, num_seqs, num_threads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};  // a shared queue: items differ too much in cost for a static split
  at::parallel_for(0, std::min<int64_t>(num_threads, num_items), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      run_item_dispatch(p, items[i], scratch);
    }
  });
  return out;
}

const specserve_abi::AttentionEntryPoints kEntryPoints = {
    specserve_abi::kVersion,
    [](const Problem* p, int num_seqs, int num_threads, int64_t* num_items) -> void* {
      auto* items = new std::vector<WorkItem>(plan_work(*p, num_seqs, num_threads));
      *num_items = static_cast<int64_t>(items->size());
      return items;
    },
    [](void* plan) { delete static_cast<std::vector<WorkItem>*>(plan); },
    []() -> void* { return new Scratch(); },
    [](void* scratch) { delete static_cast<Scratch*>(scratch); },
    [](const Problem* p, const void* plan, int64_t item, void* scratch) {
      run_item_dispatch(*p, (*static_cast<const std::vector<WorkItem>*>(plan))[item],
                        *static_cast<Scratch*>(scratch));
    }};

// the address of the entry points (entry_points.h)
int64_t paged_attention_entry_points() { return reinterpret_cast<int64_t>(&kEntryPoints); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("paged_attention_entry_points() -> int", &paged_attention_entry_points);
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor cu_num_query_tokens, float scale, int sliding_window, "
      "Tensor? tree_mask=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
