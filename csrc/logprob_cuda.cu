// CUDA kernels of the vocab-parallel logprob op (see logprob_cuda.h for the launchers' contract).
//
// The op is memory-bound: forward streams the logits once, backward reads them once and writes the gradient
// once. So the kernels
//   - read 16-byte vectors, kUnroll of them in flight per thread before the first use, and fall back to scalar
//     accesses only for the few elements before the first 16-byte boundary of a row and after the last;
//   - give rows of up to 8K columns one warp each, on a persistent grid (no shared memory, no barrier), and longer
//     rows one block each, split across several blocks when there are too few rows to fill the GPU (forward then
//     merges the blocks' states in a tiny second kernel through a workspace); launch_plan.h has the rules;
//   - keep the forward to a single pass with an online max, updated once per vector rather than per element, in
//     the base-2 domain of the raw logits: with c = logit_scale * log2(e), exp(z - m_z) = 2^(x c - m_x c), so an
//     element costs a conversion, a max, one fma and one MUFU.EX2 and an add (the max compares raw logits: the scale
//     is positive). The partials are turned into units of z once per row;
//   - reduce a row's threads max first, then sums (one exponential per thread to move its sums to the row max);
//   - write the op's outputs from the forward kernel with one rank (the combine of one rank's partials, as the CPU
//     kernel does), and run the combine after the all-gather as one kernel with several;
//   - have an out-of-place backward whose logits and gradient pointers are __restrict__ (all unrolled loads issue
//     before the first store) and an in-place one that may alias them.
// Nothing here synchronises with the host.
#include "logprob_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <type_traits>

#include "launch_plan.h"
#include "logprob_common.h"

namespace megatron_grpo {
namespace {

using launch::kBlockThreads;
using launch::kWarpSize;
using launch::kWarpsPerBlock;
using launch::LaunchPlan;

constexpr int kVectorBytes = 16;
// Vectors each thread loads before using the first: keeps enough bytes in flight per SM to cover HBM latency.
constexpr int kUnroll = 4;
// Rows merged per block by the split-merge kernel, one warp each; rows combined per block by the combine kernel.
constexpr int kMergeRowsPerBlock = 8;
constexpr int kCombineThreads = 256;
// The most blocks of kBlockThreads each kernel is compiled to keep resident per SM (__launch_bounds__): what its
// registers allow without spilling (ptxas, sm_90: tests/ops/test_cuda_static.py checks the budget).
constexpr int kForwardMinBlocks = 4;
constexpr int kBackwardMinBlocks = 3;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------------------
// Element types and the fast exponential.

// 2^x as one MUFU.EX2 (ex2.approx.ftz): relative error about 2^-22; 2^-inf = 0, 2^NaN = NaN; results below
// ~1e-38 flush to 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// max(a, b) that is NaN when either is (PTX max.NaN, one instruction on sm_80+), unlike fmaxf, which drops NaN.
// A NaN max keeps the state's sums NaN through every later rescale and merge: a NaN sum under a finite max
// could be rescaled by 2^-large = 0 and vanish.
__device__ __forceinline__ float max_keeping_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
#else
  return (a > b || a != a) ? a : b;
#endif
}

template <typename T>
struct Element;

template <>
struct Element<float> {
  __device__ static float to_float(float v) { return v; }
  __device__ static float from_float(float v) { return v; }
};

template <>
struct Element<__nv_bfloat16> {
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Element<__half> {
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
};

// One 16-byte load or store worth of elements.
template <typename T>
struct alignas(kVectorBytes) Vector {
  static constexpr int kSize = kVectorBytes / static_cast<int>(sizeof(T));
  T elems[kSize];
};

// A 16-byte load into registers (a by-value copy, so the compiler cannot split it into element loads).
template <typename T>
__device__ __forceinline__ Vector<T> load_vector(const Vector<T>* address) {
  return *address;
}

// A run of `n` elements cut into a scalar head (up to the first 16-byte boundary), whole aligned vectors, and a
// scalar tail. Element indices are relative to the run's start.
struct VectorSpan {
  int head;
  int num_vectors;
  int tail_begin;
};

// Span of `n` elements starting at `address`, which is aligned to sizeof(T) (checked by the launchers).
template <typename T>
__device__ VectorSpan vector_span(uintptr_t address, int n) {
  constexpr int kSize = Vector<T>::kSize;
  const int offset = static_cast<int>(address % kVectorBytes) / static_cast<int>(sizeof(T));
  const int head = min(offset == 0 ? 0 : kSize - offset, n);
  const int num_vectors = (n - head) / kSize;
  return {head, num_vectors, head + num_vectors * kSize};
}

// A run that is accessed element by element only.
__device__ VectorSpan scalar_span(int n) { return {n, 0, n}; }

// The threads that share a row: a whole block, or one warp (its lanes).
struct BlockThreads {
  __device__ int index() const { return static_cast<int>(threadIdx.x); }
  __device__ int count() const { return static_cast<int>(blockDim.x); }
};

struct WarpLanes {
  __device__ int index() const { return static_cast<int>(threadIdx.x) % kWarpSize; }
  __device__ int count() const { return kWarpSize; }
};

// Columns [begin, end) of a row that block `split` of it handles, clipped to `limit` columns.
struct ColumnRange {
  int begin;
  int end;
};

__device__ ColumnRange split_columns(int split, int split_cols, int limit) {
  const int64_t begin = min(static_cast<int64_t>(split) * split_cols, static_cast<int64_t>(limit));
  const int64_t end = min(begin + split_cols, static_cast<int64_t>(limit));
  return {static_cast<int>(begin), static_cast<int>(end)};
}

// As split_columns, except that the row's last split also takes every column after it, up to `limit`: the
// splits follow the valid columns, and the last one also writes the padding's gradient.
__device__ ColumnRange split_columns_to_end(int split, int splits, int split_cols, int limit) {
  ColumnRange range = split_columns(split, split_cols, limit);
  if (split == splits - 1) range.end = limit;
  return range;
}

// ---------------------------------------------------------------------------------------------------------
// The forward's running state, in the base-2 domain of the raw logits.

// A set of logits x with max m: with c = logit_scale * log2(e) and t = (x - m) c (so 2^t = exp(z - m_z)),
//   sum = sum 2^t,   moment = sum 2^t t.
// `to_partials` turns it into the SoftmaxPartials of z = logit_scale * x (m_z = scale m, sum, moment ln 2).
struct Log2State {
  float max;
  float sum;
  float moment;
};

__device__ Log2State empty_state() { return {neg_inf(), 0.0f, 0.0f}; }

// m c, or 0 while nothing finite has been seen (so that -inf logits give t = -inf, not NaN).
__device__ __forceinline__ float shift_of(float m, float c) { return m == neg_inf() ? 0.0f : m * c; }

// Re-expresses a state relative to new_max >= p.max (rescale_to in logprob_common.h, in base 2). A NaN or +inf max
// makes r NaN or 0, which poisons or empties the sums as it should.
__device__ Log2State rescale(const Log2State& p, float new_max, float c) {
  const float delta = (p.max - new_max) * c;
  const float r = fast_exp2(delta);
  if (r == 0.0f) return {new_max, p.sum * r, p.moment * r};  // nothing left to move (or an empty state)
  return {new_max, p.sum * r, (p.moment + delta * p.sum) * r};
}

__device__ Log2State merge_states(const Log2State& a, const Log2State& b, float c) {
  const float m = max_keeping_nan(a.max, b.max);
  const Log2State ra = a.max == m ? a : rescale(a, m, c);
  const Log2State rb = b.max == m ? b : rescale(b, m, c);
  return {m, ra.sum + rb.sum, ra.moment + rb.moment};
}

__device__ SoftmaxPartials to_partials(const Log2State& p, float scale, bool with_entropy) {
  return {p.max * scale, p.sum, with_entropy ? p.moment * kLn2 : 0.0f};
}

// A logit as the (optionally top-k/top-p filtered) distribution sees it, in raw units: itself, or -inf where
// z = scale * x is below the row's threshold. Compiles to a no-op without a filter.
template <bool kFiltered>
__device__ __forceinline__ float visible(float x, float threshold, float scale) {
  return kFiltered && !kept_logit(x * scale, threshold) ? neg_inf() : x;
}

// Adds `n` (visible, raw) logits to a state: the max moves once, then each logit costs one fma, one EX2 and an add.
// The exponentials go to two accumulators (even and odd logits), which join the state once per call: two short add
// chains instead of one long one. Same conventions as `accumulate`: a NaN logit makes the max and the sums NaN (and
// a +inf one the sums), which no later merge undoes; -inf contributes nothing.
template <bool kWithEntropy, int kN>
__device__ __forceinline__ Log2State accumulate_logits(Log2State p, const float (&x)[kN], float c) {
  float vector_max = x[0];
#pragma unroll
  for (int i = 1; i < kN; ++i) vector_max = max_keeping_nan(vector_max, x[i]);
  const float m = max_keeping_nan(p.max, vector_max);
  if (!(m == p.max)) p = rescale(p, m, c);
  const float shift = shift_of(m, c);
  float sums[2] = {0.0f, 0.0f};
  float moments[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const float t = fmaf(x[i], c, -shift);
    const float e = fast_exp2(t);
    sums[i % 2] += e;
    // A -inf logit (t = -inf, 2^t = 0) adds 0 * (-FLT_MAX) = 0, not 0 * -inf = NaN.
    if (kWithEntropy) moments[i % 2] = fmaf(e, fmaxf(t, -FLT_MAX), moments[i % 2]);
  }
  p.sum += sums[0] + sums[1];
  if (kWithEntropy) p.moment += moments[0] + moments[1];
  return p;
}

template <typename T, bool kWithEntropy, bool kFiltered>
__device__ __forceinline__ Log2State accumulate_vector(const Log2State& p, const Vector<T>& v, float threshold,
                                                       float scale, float c) {
  constexpr int kSize = Vector<T>::kSize;
  float x[kSize];
#pragma unroll
  for (int i = 0; i < kSize; ++i) x[i] = visible<kFiltered>(Element<T>::to_float(v.elems[i]), threshold, scale);
  return accumulate_logits<kWithEntropy>(p, x, c);
}

template <typename T, bool kWithEntropy, bool kFiltered>
__device__ __forceinline__ Log2State accumulate_element(const Log2State& p, T v, float threshold, float scale,
                                                        float c) {
  const float x[1] = {visible<kFiltered>(Element<T>::to_float(v), threshold, scale)};
  return accumulate_logits<kWithEntropy>(p, x, c);
}

// This thread's share of the state of `n` logits starting at `logits` (the threads of `threads` interleave).
template <typename T, bool kWithEntropy, bool kFiltered, typename Threads>
__device__ Log2State thread_state(const T* __restrict__ logits, int n, float threshold, float scale, float c,
                                  Threads threads) {
  const int first = threads.index();
  const int stride = threads.count();
  const VectorSpan span = vector_span<T>(reinterpret_cast<uintptr_t>(logits), n);
  Log2State p = empty_state();
  for (int i = first; i < span.head; i += stride) {
    p = accumulate_element<T, kWithEntropy, kFiltered>(p, logits[i], threshold, scale, c);
  }
  const Vector<T>* __restrict__ vectors = reinterpret_cast<const Vector<T>*>(logits + span.head);
  int v = first;
  for (; v + (kUnroll - 1) * stride < span.num_vectors; v += kUnroll * stride) {
    Vector<T> loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) loaded[u] = load_vector(vectors + v + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      p = accumulate_vector<T, kWithEntropy, kFiltered>(p, loaded[u], threshold, scale, c);
    }
  }
  for (; v < span.num_vectors; v += stride) {
    p = accumulate_vector<T, kWithEntropy, kFiltered>(p, load_vector(vectors + v), threshold, scale, c);
  }
  for (int i = span.tail_begin + first; i < n; i += stride) {
    p = accumulate_element<T, kWithEntropy, kFiltered>(p, logits[i], threshold, scale, c);
  }
  return p;
}

// ---------------------------------------------------------------------------------------------------------
// Reductions: the max first, then the sums, moved to it with one exponential per thread.

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int lane_mask = kWarpSize / 2; lane_mask > 0; lane_mask /= 2) {
    v = max_keeping_nan(v, __shfl_xor_sync(0xffffffffu, v, lane_mask));
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int lane_mask = kWarpSize / 2; lane_mask > 0; lane_mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, lane_mask);
  return v;
}

// Every lane ends up with the merge of the warp's states.
template <bool kWithEntropy>
__device__ Log2State warp_merge(Log2State p, float c) {
  const float m = warp_max(p.max);
  if (!(p.max == m)) p = rescale(p, m, c);
  return {m, warp_sum(p.sum), kWithEntropy ? warp_sum(p.moment) : 0.0f};
}

// Thread 0 ends up with the merge of the block's states. All threads of the block must call it. Two barriers; the
// shared arrays of the max and of the sums are apart, so that the next row's call cannot overwrite what a slower
// thread still reads.
template <bool kWithEntropy>
__device__ Log2State block_merge(Log2State p, float c) {
  __shared__ float warp_maxima[kWarpsPerBlock];
  __shared__ float warp_sums[kWarpsPerBlock];
  __shared__ float warp_moments[kWarpsPerBlock];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  float m = warp_max(p.max);
  if (lane == 0) warp_maxima[warp] = m;
  __syncthreads();
  m = warp_maxima[0];
  for (int w = 1; w < warps; ++w) m = max_keeping_nan(m, warp_maxima[w]);
  if (!(p.max == m)) p = rescale(p, m, c);
  const float sum = warp_sum(p.sum);
  const float moment = kWithEntropy ? warp_sum(p.moment) : 0.0f;
  if (lane == 0) {
    warp_sums[warp] = sum;
    warp_moments[warp] = moment;
  }
  __syncthreads();
  Log2State out{m, 0.0f, 0.0f};
  if (threadIdx.x == 0) {
    for (int w = 0; w < warps; ++w) {
      out.sum += warp_sums[w];
      out.moment += warp_moments[w];
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Forward outputs.

// Where the forward puts each row: its partials (`partials` [rows, k], for the all-gather), or, with one rank, the
// op's outputs straight away (`partials` null: the combine of one rank ends the row).
struct ForwardOut {
  float* partials;
  float* logprob;
  float* entropy;  // null without entropy, as mean_x
  float* lse;
  float* mean_x;
};

__device__ void store_row(const ForwardOut& out, int64_t row, const SoftmaxPartials& p, float target_logit,
                          bool ignored, bool with_entropy) {
  const float partials[4] = {p.max, p.sum_exp, target_logit, p.sum_exp_x};
  if (out.partials != nullptr) {
    float* dst = out.partials + row * num_partials(with_entropy);
    for (int i = 0; i < num_partials(with_entropy); ++i) dst[i] = partials[i];
    return;
  }
  const RowStats stats = combine_partials(partials, 0, 1, with_entropy, ignored);
  out.logprob[row] = stats.logprob;
  out.lse[row] = stats.lse;
  if (with_entropy) {
    out.entropy[row] = stats.entropy;
    out.mean_x[row] = stats.mean_x;
  }
}

// Ignored rows get partials that combine to a finite lse across ranks: {m = 0, d = 1, x_y = -inf, s = 0}.
__device__ void store_ignored_row(const ForwardOut& out, int64_t row, bool with_entropy) {
  store_row(out, row, {0.0f, 1.0f, 0.0f}, neg_inf(), true, with_entropy);
}

// The target's logit z when this shard holds it among its valid columns (and the filter keeps it), else -inf.
template <typename T, bool kFiltered>
__device__ float target_logit(const T* row_logits, int64_t target, int64_t vocab_start, int valid_cols,
                              float threshold, float scale) {
  const int64_t col = local_target_column(target, vocab_start, valid_cols);
  if (col < 0) return neg_inf();
  const float z = Element<T>::to_float(row_logits[col]) * scale;
  return kFiltered && !kept_logit(z, threshold) ? neg_inf() : z;
}

// The row's top-k/top-p threshold, or -inf (keep all) without a filter.
template <bool kFiltered>
__device__ __forceinline__ float row_threshold(const float* __restrict__ thresholds, int64_t row) {
  return kFiltered ? thresholds[row] : neg_inf();
}

// ---------------------------------------------------------------------------------------------------------
// Forward kernels.

// One warp per row, on a persistent grid: warp w of block b takes rows b * 8 + w, then every gridDim.x * 8th.
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kBlockThreads, kForwardMinBlocks)
    forward_warp_rows_kernel(const T* __restrict__ logits, int64_t rows, int64_t row_stride,
                             const int64_t* __restrict__ targets, int64_t vocab_start, int valid_cols,
                             const float* __restrict__ thresholds, float scale, ForwardOut out) {
  const WarpLanes lanes;
  const int lane = lanes.index();
  const float c = scale * kLog2e;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  for (int64_t row = first_row; row < rows; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t target = targets[row];
    if (target < 0) {  // ignored: the row is not read (the whole warp takes this branch)
      if (lane == 0) store_ignored_row(out, row, kWithEntropy);
      continue;
    }
    const T* row_logits = logits + row * row_stride;
    const float threshold = row_threshold<kFiltered>(thresholds, row);
    const Log2State p = warp_merge<kWithEntropy>(
        thread_state<T, kWithEntropy, kFiltered>(row_logits, valid_cols, threshold, scale, c, lanes), c);
    if (lane == 0) {
      store_row(out, row, to_partials(p, scale, kWithEntropy),
                target_logit<T, kFiltered>(row_logits, target, vocab_start, valid_cols, threshold, scale), false,
                kWithEntropy);
    }
  }
}

// Floats per row and split in the forward workspace: max, sum and, with entropy, moment (base 2, raw units).
__host__ __device__ constexpr int split_state_floats(bool with_entropy) { return with_entropy ? 3 : 2; }

// Grid (row blocks, splits). Block (row, split) reduces columns [split * split_cols, +split_cols) of the row's
// valid columns. With one split it stores the row; with several it stores its state in `split_states`
// [rows, splits, split_state_floats] for merge_splits_kernel.
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kBlockThreads, kForwardMinBlocks)
    forward_block_rows_kernel(const T* __restrict__ logits, int64_t rows, int64_t row_stride,
                              const int64_t* __restrict__ targets, int64_t vocab_start, int valid_cols,
                              int split_cols, const float* __restrict__ thresholds, float scale, ForwardOut out,
                              float* __restrict__ split_states) {
  const int splits = static_cast<int>(gridDim.y);
  const int split = static_cast<int>(blockIdx.y);
  const ColumnRange columns = split_columns(split, split_cols, valid_cols);
  const float c = scale * kLog2e;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t target = targets[row];
    if (target < 0) {  // ignored: no need to read the row
      if (splits == 1 && threadIdx.x == 0) store_ignored_row(out, row, kWithEntropy);
      continue;
    }
    const T* row_logits = logits + row * row_stride;
    // With one split, thread 0 loads the target's element before streaming the row and converts it after, so
    // that the load's latency hides behind the stream.
    const int64_t target_col = local_target_column(target, vocab_start, valid_cols);
    const bool owns_target = splits == 1 && threadIdx.x == 0 && target_col >= 0;
    const T target_element = owns_target ? row_logits[target_col] : T{};
    const float threshold = row_threshold<kFiltered>(thresholds, row);
    const Log2State p = block_merge<kWithEntropy>(
        thread_state<T, kWithEntropy, kFiltered>(row_logits + columns.begin, columns.end - columns.begin, threshold,
                                                 scale, c, BlockThreads{}),
        c);
    if (threadIdx.x != 0) continue;
    if (splits == 1) {
      float x_y = neg_inf();
      if (owns_target) {
        x_y = Element<T>::to_float(target_element) * scale;
        if (kFiltered && !kept_logit(x_y, threshold)) x_y = neg_inf();
      }
      store_row(out, row, to_partials(p, scale, kWithEntropy), x_y, false, kWithEntropy);
    } else {
      float* state = split_states + (row * splits + split) * split_state_floats(kWithEntropy);
      state[0] = p.max;
      state[1] = p.sum;
      if (kWithEntropy) state[2] = p.moment;
    }
  }
}

// One warp per row: merges the row's split states and stores the row.
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void merge_splits_kernel(const T* __restrict__ logits, int64_t rows, int64_t row_stride,
                                    const int64_t* __restrict__ targets, int64_t vocab_start, int valid_cols,
                                    int splits, const float* __restrict__ thresholds, float scale,
                                    const float* __restrict__ split_states, ForwardOut out) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;  // whole warps leave together; no block-wide barrier follows
  const int64_t target = targets[row];
  if (target < 0) {
    if (lane == 0) store_ignored_row(out, row, kWithEntropy);
    return;
  }
  const float c = scale * kLog2e;
  const float* row_states = split_states + row * splits * split_state_floats(kWithEntropy);
  Log2State p = empty_state();
  for (int split = lane; split < splits; split += kWarpSize) {
    const float* state = row_states + split * split_state_floats(kWithEntropy);
    p = merge_states(p, {state[0], state[1], kWithEntropy ? state[2] : 0.0f}, c);
  }
  p = warp_merge<kWithEntropy>(p, c);
  if (lane == 0) {
    const float threshold = row_threshold<kFiltered>(thresholds, row);
    store_row(out, row, to_partials(p, scale, kWithEntropy),
              target_logit<T, kFiltered>(logits + row * row_stride, target, vocab_start, valid_cols, threshold,
                                         scale),
              false, kWithEntropy);
  }
}

// The combine after the all-gather: one thread per row (combine_partials in logprob_common.h).
__global__ void combine_kernel(const float* __restrict__ gathered, int world, int64_t rows,
                               const int64_t* __restrict__ targets, bool with_entropy, float* __restrict__ logprob,
                               float* __restrict__ entropy, float* __restrict__ lse, float* __restrict__ mean_x) {
  const int k = num_partials(with_entropy);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const RowStats stats = combine_partials(gathered + row * k, rows * k, world, with_entropy, targets[row] < 0);
    logprob[row] = stats.logprob;
    lse[row] = stats.lse;
    if (with_entropy) {
      entropy[row] = stats.entropy;
      mean_x[row] = stats.mean_x;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward.

// Per-row constants of the gradient; `operator()` gives one logit's gradient (see prob_grad), with
// p = exp(z - lse) = 2^(x c - lse log2 e) from one fma and one EX2. kFiltered: logits below `threshold` get exactly
// 0 (target_col is then -1 for a filtered target). grad_logprob and grad_entropy already carry the scale
// (d/dx = scale * d/dz).
template <bool kWithEntropy, bool kFiltered>
struct RowGradient {
  int target_col;  // local column of the target, or -1
  float lse_log2;  // lse * log2(e)
  float mean_x;
  float grad_logprob;
  float grad_entropy;
  float threshold;
  float scale;
  float c;  // scale * log2(e)

  __device__ __forceinline__ float operator()(float x, int col) const {
    const float z = x * scale;
    if (kFiltered && !kept_logit(z, threshold)) return 0.0f;
    const float p = fast_exp2(fmaf(x, c, -lse_log2));
    float dx = grad_logprob * ((col == target_col ? 1.0f : 0.0f) - p);
    if (kWithEntropy && p != 0.0f) dx += grad_entropy * p * (mean_x - z);  // p = 0 for -inf, where p z is NaN
    return dx;
  }
};

// Writes the gradient of valid columns [begin, end) of one row. `grad` may be `logits` itself: each thread loads its
// elements before it stores them and touches no other thread's elements. Inlined into kernels whose pointers are
// __restrict__ (out of place) or not (in place).
template <typename T, typename Gradient, typename Threads>
__device__ __forceinline__ void store_row_gradient(const T* x, T* g, int n, int col0, const Gradient& row_grad,
                                                   Threads threads) {
  const int first = threads.index();
  const int stride = threads.count();
  const uintptr_t x_address = reinterpret_cast<uintptr_t>(x);
  const bool same_alignment = (x_address ^ reinterpret_cast<uintptr_t>(g)) % kVectorBytes == 0;
  const VectorSpan span = same_alignment ? vector_span<T>(x_address, n) : scalar_span(n);
  for (int i = first; i < span.head; i += stride) {
    g[i] = Element<T>::from_float(row_grad(Element<T>::to_float(x[i]), col0 + i));
  }
  constexpr int kSize = Vector<T>::kSize;
  const Vector<T>* x_vectors = reinterpret_cast<const Vector<T>*>(x + span.head);
  Vector<T>* g_vectors = reinterpret_cast<Vector<T>*>(g + span.head);
  const int vector_col0 = col0 + span.head;
  auto store_vector = [&](int v, const Vector<T>& loaded) {
    Vector<T> out;
#pragma unroll
    for (int i = 0; i < kSize; ++i) {
      out.elems[i] = Element<T>::from_float(row_grad(Element<T>::to_float(loaded.elems[i]), vector_col0 + v * kSize + i));
    }
    g_vectors[v] = out;
  };
  int v = first;
  for (; v + (kUnroll - 1) * stride < span.num_vectors; v += kUnroll * stride) {
    Vector<T> loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) loaded[u] = load_vector(x_vectors + v + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store_vector(v + u * stride, loaded[u]);
  }
  for (; v < span.num_vectors; v += stride) store_vector(v, load_vector(x_vectors + v));
  for (int i = span.tail_begin + first; i < n; i += stride) {
    g[i] = Element<T>::from_float(row_grad(Element<T>::to_float(x[i]), col0 + i));
  }
}

// Writes exact zeros to `n` elements at `grad` (padding columns, ignored rows). Reads nothing.
template <typename T, typename Threads>
__device__ void store_zeros(T* grad, int n, Threads threads) {
  const int first = threads.index();
  const int stride = threads.count();
  const T zero = Element<T>::from_float(0.0f);
  const VectorSpan span = vector_span<T>(reinterpret_cast<uintptr_t>(grad), n);
  for (int i = first; i < span.head; i += stride) grad[i] = zero;
  Vector<T> zeros;
#pragma unroll
  for (int i = 0; i < Vector<T>::kSize; ++i) zeros.elems[i] = zero;
  Vector<T>* vectors = reinterpret_cast<Vector<T>*>(grad + span.head);
  for (int v = first; v < span.num_vectors; v += stride) vectors[v] = zeros;
  for (int i = span.tail_begin + first; i < n; i += stride) grad[i] = zero;
}

// What the backward kernels read besides the logits and write besides the gradient.
struct BackwardArgs {
  int64_t rows;
  int64_t row_stride;
  const int64_t* targets;
  int64_t vocab_start;
  int valid_cols;
  int cols;
  int split_cols;
  const float* lse;
  const float* mean_x;
  const float* logprob;  // with a filter: a dropped target (-inf) passes no logprob gradient
  const float* grad_logprob;
  const float* grad_entropy;
  const float* thresholds;
  float scale;
  int64_t grad_row_stride;
};

// The gradient of one row's columns [begin, end) (the valid ones, then the padding after them).
template <typename T, bool kWithEntropy, bool kFiltered, typename Threads>
__device__ __forceinline__ void row_backward(const T* x, T* g, int64_t row, int begin, int end,
                                             const BackwardArgs& a, Threads threads) {
  const int64_t target = a.targets[row];
  if (target < 0) {
    store_zeros(g + begin, end - begin, threads);
    return;
  }
  const int valid_end = min(end, a.valid_cols);
  if (begin < valid_end) {
    // No thread reads the target's logit here: in place, another thread (or split) may already have written its
    // gradient there. A filtered target needs no special case: its own column gets 0 (below the threshold), and no
    // other column is the target's.
    const RowGradient<kWithEntropy, kFiltered> gradient{
        static_cast<int>(local_target_column(target, a.vocab_start, a.valid_cols)),
        a.lse[row] * kLog2e,
        kWithEntropy ? a.mean_x[row] : 0.0f,
        upstream_logprob_gradient(a.grad_logprob, a.logprob, row, a.scale),
        kWithEntropy ? a.scale * a.grad_entropy[row] : 0.0f,
        row_threshold<kFiltered>(a.thresholds, row),
        a.scale,
        a.scale * kLog2e};
    store_row_gradient(x + begin, g + begin, valid_end - begin, begin, gradient, threads);
  }
  const int padding_begin = max(begin, a.valid_cols);
  if (padding_begin < end) store_zeros(g + padding_begin, end - padding_begin, threads);
}

// Block rows, grid (row blocks, splits): block (row, split) writes columns [split * split_cols, +split_cols) of the
// row's gradient; the splits follow the valid columns, and the last one also writes the padding. Warp rows: as the
// forward's. Out of place: the logits and the gradient never overlap, so their pointers are __restrict__ and all
// kUnroll loads issue before the first store.
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kBlockThreads, kBackwardMinBlocks)
    backward_block_rows_kernel(const T* __restrict__ logits, T* __restrict__ grad, BackwardArgs a) {
  const ColumnRange columns =
      split_columns_to_end(static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y), a.split_cols, a.cols);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    row_backward<T, kWithEntropy, kFiltered>(logits + row * a.row_stride, grad + row * a.grad_row_stride, row,
                                             columns.begin, columns.end, a, BlockThreads{});
  }
}

template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kBlockThreads, kBackwardMinBlocks)
    backward_warp_rows_kernel(const T* __restrict__ logits, T* __restrict__ grad, BackwardArgs a) {
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  for (int64_t row = first_row; row < a.rows; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    row_backward<T, kWithEntropy, kFiltered>(logits + row * a.row_stride, grad + row * a.grad_row_stride, row, 0,
                                             a.cols, a, WarpLanes{});
  }
}

// In place: the gradient overwrites the logits (one pointer, no __restrict__).
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kBlockThreads, kBackwardMinBlocks)
    backward_block_rows_in_place_kernel(T* logits, BackwardArgs a) {
  const ColumnRange columns =
      split_columns_to_end(static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y), a.split_cols, a.cols);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    T* row_logits = logits + row * a.row_stride;
    row_backward<T, kWithEntropy, kFiltered>(row_logits, row_logits, row, columns.begin, columns.end, a,
                                             BlockThreads{});
  }
}

template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kBlockThreads, kBackwardMinBlocks)
    backward_warp_rows_in_place_kernel(T* logits, BackwardArgs a) {
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  for (int64_t row = first_row; row < a.rows; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    T* row_logits = logits + row * a.row_stride;
    row_backward<T, kWithEntropy, kFiltered>(row_logits, row_logits, row, 0, a.cols, a, WarpLanes{});
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side.

launch::OccupancyCache& occupancy_cache() {
  static launch::OccupancyCache cache;
  return cache;
}

// One wave of `kernel` on the current device at `threads` threads per block: its resident blocks per SM
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor, for its registers and shared memory) times the SMs. Asked once per
// kernel variant, block size and device (launch::OccupancyCache), then cached.
template <typename Kernel>
cudaError_t wave_blocks(Kernel kernel, int threads, int64_t* blocks) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  int sm_count = 0;
  status = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  int per_sm = 0;
  const int query_status = occupancy_cache().blocks_per_sm(
      reinterpret_cast<const void*>(kernel), device, threads, &per_sm, [&](int* value) {
        return static_cast<int>(cudaOccupancyMaxActiveBlocksPerMultiprocessor(value, kernel, threads, 0));
      });
  if (query_status != 0) return static_cast<cudaError_t>(query_status);
  *blocks = static_cast<int64_t>(sm_count) * per_sm;
  return cudaSuccess;
}

// Shape checks shared by the launchers. The kernels index columns with int (with room for split_cols to round up
// to kSplitAlignCols) and rows with a grid-stride loop.
bool valid_shape(int64_t rows, int64_t cols, int64_t valid_cols) {
  return rows >= 0 && cols >= 0 && cols <= INT_MAX - launch::kSplitAlignCols && valid_cols >= 0 &&
         valid_cols <= cols;
}

// The kernels see z = logit_scale * x: a finite positive number.
bool valid_scale(float logit_scale) { return logit_scale > 0.0f && logit_scale <= FLT_MAX; }

bool element_aligned(const void* pointer, size_t element_bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % element_bytes == 0;
}

dim3 grid_for(const LaunchPlan& plan, int64_t rows) {
  if (plan.warp_rows) return dim3(static_cast<unsigned>(std::min<int64_t>(plan.blocks, INT_MAX)));
  return dim3(static_cast<unsigned>(std::min<int64_t>(rows, INT_MAX)), static_cast<unsigned>(plan.splits));
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with the C++ element type of `dtype`.
template <typename Fn>
cudaError_t dispatch_dtype(LogitsDType dtype, Fn&& fn) {
  switch (dtype) {
    case LogitsDType::kFloat32:
      return fn(TypeTag<float>{});
    case LogitsDType::kBFloat16:
      return fn(TypeTag<__nv_bfloat16>{});
    case LogitsDType::kFloat16:
      return fn(TypeTag<__half>{});
  }
  return cudaErrorInvalidValue;
}

// Calls fn(std::integral_constant<bool, kWithEntropy>, std::integral_constant<bool, kFiltered>).
template <typename Fn>
cudaError_t dispatch_flags(bool with_entropy, bool filtered, Fn&& fn) {
  using True = std::true_type;
  using False = std::false_type;
  if (with_entropy) return filtered ? fn(True{}, True{}) : fn(True{}, False{});
  return filtered ? fn(False{}, True{}) : fn(False{}, False{});
}

// The waves (in blocks) a plan was made from, for logprob_launch_plan.
struct Waves {
  int64_t warp_rows;
  int64_t block_rows;
};

// The launch plan of the forward for these sizes on the current device (and so the split workspace
// `logprob_forward_workspace_bytes` reports: both ask this). Warp rows where the rows are short and many enough.
template <typename T, bool kWithEntropy, bool kFiltered>
cudaError_t plan_forward(int64_t rows, int64_t valid_cols, LaunchPlan* plan, Waves* waves = nullptr) {
  constexpr int64_t kVector = Vector<T>::kSize;
  int64_t warp_wave = 0;
  cudaError_t status = wave_blocks(forward_warp_rows_kernel<T, kWithEntropy, kFiltered>, kBlockThreads, &warp_wave);
  if (status != cudaSuccess) return status;
  int64_t wave = 0;
  status = wave_blocks(forward_block_rows_kernel<T, kWithEntropy, kFiltered>,
                       launch::threads_for(valid_cols, kVector), &wave);
  if (status != cudaSuccess) return status;
  if (waves != nullptr) *waves = {warp_wave, wave};
  *plan = launch::use_warp_rows(rows, valid_cols, warp_wave)
              ? launch::plan_warp_rows(rows, warp_wave)
              : launch::plan_block_rows(rows, valid_cols, valid_cols, kVector, wave);
  return cudaSuccess;
}

// The launch plan of the backward (in place or not: each its own occupancy).
template <typename T, bool kWithEntropy, bool kFiltered, bool kInPlace>
cudaError_t plan_backward(int64_t rows, int64_t valid_cols, int64_t cols, LaunchPlan* plan, Waves* waves = nullptr) {
  constexpr int64_t kVector = Vector<T>::kSize;
  const auto warp_kernel = kInPlace ? reinterpret_cast<const void*>(
                                          backward_warp_rows_in_place_kernel<T, kWithEntropy, kFiltered>)
                                    : reinterpret_cast<const void*>(backward_warp_rows_kernel<T, kWithEntropy, kFiltered>);
  const auto block_kernel =
      kInPlace ? reinterpret_cast<const void*>(backward_block_rows_in_place_kernel<T, kWithEntropy, kFiltered>)
               : reinterpret_cast<const void*>(backward_block_rows_kernel<T, kWithEntropy, kFiltered>);
  int64_t warp_wave = 0;
  cudaError_t status = wave_blocks(warp_kernel, kBlockThreads, &warp_wave);
  if (status != cudaSuccess) return status;
  int64_t wave = 0;
  status = wave_blocks(block_kernel, launch::threads_for(cols, kVector), &wave);
  if (status != cudaSuccess) return status;
  if (waves != nullptr) *waves = {warp_wave, wave};
  *plan = launch::use_warp_rows(rows, cols, warp_wave) ? launch::plan_warp_rows(rows, warp_wave)
                                                       : launch::plan_block_rows(rows, valid_cols, cols, kVector, wave);
  return cudaSuccess;
}

template <typename T, bool kWithEntropy, bool kFiltered>
cudaError_t launch_forward_typed(const T* logits, int64_t rows, int64_t row_stride, const int64_t* targets,
                                 int64_t vocab_start, int valid_cols, const LaunchPlan& plan, const float* thresholds,
                                 float scale, const ForwardOut& out, float* split_states, cudaStream_t stream) {
  const dim3 grid = grid_for(plan, rows);
  if (plan.warp_rows) {
    forward_warp_rows_kernel<T, kWithEntropy, kFiltered><<<grid, kBlockThreads, 0, stream>>>(
        logits, rows, row_stride, targets, vocab_start, valid_cols, thresholds, scale, out);
    return cudaGetLastError();
  }
  forward_block_rows_kernel<T, kWithEntropy, kFiltered><<<grid, plan.threads, 0, stream>>>(
      logits, rows, row_stride, targets, vocab_start, valid_cols, plan.split_cols, thresholds, scale, out,
      split_states);
  if (plan.splits > 1) {
    const auto blocks = static_cast<unsigned>(launch::ceil_div(rows, kMergeRowsPerBlock));
    merge_splits_kernel<T, kWithEntropy, kFiltered><<<blocks, kMergeRowsPerBlock * kWarpSize, 0, stream>>>(
        logits, rows, row_stride, targets, vocab_start, valid_cols, plan.splits, thresholds, scale, split_states,
        out);
  }
  return cudaGetLastError();
}

// Both forwards: the partials (TP > 1) or the outputs of one rank, through `out`.
cudaError_t launch_forward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                           const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                           const float* thresholds, float logit_scale, const ForwardOut& out, void* workspace,
                           cudaStream_t stream) {
  if (!valid_shape(rows, cols, valid_cols) || !valid_scale(logit_scale)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  auto* split_states = static_cast<float*>(workspace);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* typed_logits = static_cast<const T*>(logits);
    if (!element_aligned(typed_logits, sizeof(T))) return cudaErrorMisalignedAddress;
    const int valid = static_cast<int>(valid_cols);
    return dispatch_flags(with_entropy, thresholds != nullptr, [&](auto entropy, auto filtered) {
      constexpr bool kWithEntropy = decltype(entropy)::value;
      constexpr bool kFiltered = decltype(filtered)::value;
      LaunchPlan plan{};
      const cudaError_t status = plan_forward<T, kWithEntropy, kFiltered>(rows, valid_cols, &plan);
      if (status != cudaSuccess) return status;
      if (plan.splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
      return launch_forward_typed<T, kWithEntropy, kFiltered>(typed_logits, rows, row_stride, targets, vocab_start,
                                                              valid, plan, thresholds, logit_scale, out,
                                                              split_states, stream);
    });
  });
}

template <typename T, bool kWithEntropy, bool kFiltered, bool kInPlace>
cudaError_t launch_backward_typed(const T* logits, T* grad, int64_t rows, int64_t valid_cols, int64_t cols,
                                  BackwardArgs args, cudaStream_t stream) {
  LaunchPlan plan{};
  const cudaError_t status = plan_backward<T, kWithEntropy, kFiltered, kInPlace>(rows, valid_cols, cols, &plan);
  if (status != cudaSuccess) return status;
  args.split_cols = plan.split_cols;
  const dim3 grid = grid_for(plan, rows);
  if constexpr (kInPlace) {
    if (plan.warp_rows) {
      backward_warp_rows_in_place_kernel<T, kWithEntropy, kFiltered><<<grid, kBlockThreads, 0, stream>>>(grad, args);
    } else {
      backward_block_rows_in_place_kernel<T, kWithEntropy, kFiltered><<<grid, plan.threads, 0, stream>>>(grad, args);
    }
  } else {
    if (plan.warp_rows) {
      backward_warp_rows_kernel<T, kWithEntropy, kFiltered><<<grid, kBlockThreads, 0, stream>>>(logits, grad, args);
    } else {
      backward_block_rows_kernel<T, kWithEntropy, kFiltered><<<grid, plan.threads, 0, stream>>>(logits, grad, args);
    }
  }
  return cudaGetLastError();
}

}  // namespace

size_t logprob_forward_workspace_bytes(int64_t rows, int64_t cols, int64_t valid_cols, LogitsDType dtype,
                                       bool with_entropy, bool filtered) {
  if (!valid_shape(rows, cols, valid_cols) || rows == 0) return 0;
  LaunchPlan plan{};
  const cudaError_t status = dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return dispatch_flags(with_entropy, filtered, [&](auto entropy, auto filter) {
      return plan_forward<T, decltype(entropy)::value, decltype(filter)::value>(rows, valid_cols, &plan);
    });
  });
  if (status != cudaSuccess || plan.splits <= 1) return 0;
  return static_cast<size_t>(rows) * plan.splits * split_state_floats(with_entropy) * sizeof(float);
}

cudaError_t logprob_launch_plan(int64_t rows, int64_t cols, int64_t valid_cols, LogitsDType dtype, bool with_entropy,
                                bool filtered, bool backward, int64_t plan[7]) {
  if (!valid_shape(rows, cols, valid_cols)) return cudaErrorInvalidValue;
  LaunchPlan chosen{};
  Waves waves{};
  const cudaError_t status = dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return dispatch_flags(with_entropy, filtered, [&](auto entropy, auto filter) {
      constexpr bool kWithEntropy = decltype(entropy)::value;
      constexpr bool kFiltered = decltype(filter)::value;
      return backward ? plan_backward<T, kWithEntropy, kFiltered, false>(rows, valid_cols, cols, &chosen, &waves)
                      : plan_forward<T, kWithEntropy, kFiltered>(rows, valid_cols, &chosen, &waves);
    });
  });
  if (status != cudaSuccess) return status;
  const int64_t values[7] = {chosen.warp_rows ? 1 : 0, chosen.splits, chosen.split_cols, chosen.threads,
                             chosen.blocks, waves.warp_rows, waves.block_rows};
  std::copy(values, values + 7, plan);
  return cudaSuccess;
}

cudaError_t launch_logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                    int64_t valid_cols, bool with_entropy, const float* thresholds,
                                    float logit_scale, float* partials, void* workspace, cudaStream_t stream) {
  if (partials == nullptr && rows > 0) return cudaErrorInvalidValue;
  return launch_forward(logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols, with_entropy,
                        thresholds, logit_scale, {partials, nullptr, nullptr, nullptr, nullptr}, workspace, stream);
}

cudaError_t launch_logprob_forward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                   int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                   int64_t valid_cols, bool with_entropy, const float* thresholds, float logit_scale,
                                   float* logprob, float* entropy, float* lse, float* mean_x, void* workspace,
                                   cudaStream_t stream) {
  if (rows > 0 && (logprob == nullptr || lse == nullptr || (with_entropy && (entropy == nullptr || mean_x == nullptr)))) {
    return cudaErrorInvalidValue;
  }
  return launch_forward(logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols, with_entropy,
                        thresholds, logit_scale, {nullptr, logprob, entropy, lse, mean_x}, workspace, stream);
}

cudaError_t launch_logprob_combine(const float* gathered, int64_t world, int64_t rows, const int64_t* targets,
                                   bool with_entropy, float* logprob, float* entropy, float* lse, float* mean_x,
                                   cudaStream_t stream) {
  if (world < 1 || world > INT_MAX || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(launch::ceil_div(rows, kCombineThreads), INT_MAX));
  combine_kernel<<<blocks, kCombineThreads, 0, stream>>>(gathered, static_cast<int>(world), rows, targets,
                                                         with_entropy, logprob, entropy, lse, mean_x);
  return cudaGetLastError();
}

cudaError_t launch_logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                    int64_t valid_cols, const float* lse, const float* mean_x, const float* logprob,
                                    const float* grad_logprob, const float* grad_entropy,
                                    const float* thresholds, float logit_scale, void* grad_logits,
                                    int64_t grad_row_stride, cudaStream_t stream) {
  if (!valid_shape(rows, cols, valid_cols) || !valid_scale(logit_scale)) return cudaErrorInvalidValue;
  if ((mean_x == nullptr) != (grad_entropy == nullptr)) return cudaErrorInvalidValue;
  const bool in_place = grad_logits == logits;
  if (in_place && grad_row_stride != row_stride) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool with_entropy = mean_x != nullptr;
  const BackwardArgs args{rows, row_stride, targets, vocab_start, static_cast<int>(valid_cols), static_cast<int>(cols),
                          0, lse, mean_x, logprob, grad_logprob, grad_entropy, thresholds, logit_scale,
                          grad_row_stride};
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* typed_logits = static_cast<const T*>(logits);
    auto* typed_grad = static_cast<T*>(grad_logits);
    if (!element_aligned(typed_logits, sizeof(T)) || !element_aligned(typed_grad, sizeof(T))) {
      return cudaErrorMisalignedAddress;
    }
    return dispatch_flags(with_entropy, thresholds != nullptr, [&](auto entropy, auto filtered) {
      constexpr bool kWithEntropy = decltype(entropy)::value;
      constexpr bool kFiltered = decltype(filtered)::value;
      if (in_place) {
        return launch_backward_typed<T, kWithEntropy, kFiltered, true>(typed_logits, typed_grad, rows, valid_cols,
                                                                       cols, args, stream);
      }
      return launch_backward_typed<T, kWithEntropy, kFiltered, false>(typed_logits, typed_grad, rows, valid_cols,
                                                                      cols, args, stream);
    });
  });
}

}  // namespace megatron_grpo
