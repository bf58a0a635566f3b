// CUDA kernels of the vocab-parallel logprob op (see logprob_cuda.h for the launchers' contract).
//
// The op is memory-bound: forward streams the logits once, backward reads them once and writes the gradient
// once. So the kernels
//   - read 16-byte vectors, kUnroll of them in flight per thread before the first use, and fall back to scalar
//     accesses only for the few elements before the first 16-byte boundary of a row and after the last;
//   - give each row one block, or split a row across several blocks when there are too few rows to fill the
//     GPU (forward then merges the blocks' partials in a tiny second kernel through a workspace);
//   - keep the forward to a single pass with an online max, updated once per vector rather than per element,
//     so that each logit costs one exponential;
//   - merge lane, warp, block and split partials with `merge` from logprob_common.h, the same rule the CPU
//     kernel and the TP combine use.
// Nothing here synchronises with the host.
#include "logprob_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <type_traits>

#include "logprob_common.h"

namespace megatron_grpo {
namespace {

constexpr int kVectorBytes = 16;
constexpr int kWarpSize = 32;
constexpr int kMaxBlockThreads = 256;
constexpr int kMaxWarpsPerBlock = kMaxBlockThreads / kWarpSize;
// Vectors each thread loads before using the first: keeps enough bytes in flight per SM to cover HBM latency.
constexpr int kUnroll = 4;
// A block is sized so that each of its threads streams at least this many vectors of its row (chunk).
constexpr int kMinVectorsPerThread = 4;
// Rows are split across blocks while they are fewer than one wave of resident blocks (the kernel's occupancy, as
// cudaOccupancyMaxActiveBlocksPerMultiprocessor reports it for its registers and block size, times the SMs)...
// ...but no block gets fewer columns than this, so that splitting never costs more than it gains.
constexpr int64_t kMinSplitCols = 4096;
// Split boundaries are multiples of this many columns: 16 bytes of 2-byte logits, so that every split of a
// row sees the same alignment.
constexpr int64_t kSplitAlignCols = 8;
// Rows merged per block by the split-merge kernel, one warp each.
constexpr int kMergeRowsPerBlock = 8;

// ---------------------------------------------------------------------------------------------------------
// Element types and fast exponential.

// exp(x) as one multiply and one ex2.approx.ftz (MUFU.EX2): what __expf becomes under -ftz=true, without the
// ~3 instructions of denormal handling it costs otherwise. Relative error a few ulp for the arguments
// x <= 0 near 0 that dominate a softmax; results below ~1e-38 flush to 0; exp(-inf) = 0, exp(NaN) = NaN.
__device__ __forceinline__ float fast_exp(float x) {
  constexpr float kLog2e = 1.4426950408889634f;
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * kLog2e));
  return y;
}

// max(a, b) that is NaN when either is (PTX max.NaN, one instruction on sm_80+), unlike fmaxf, which drops NaN.
// A NaN max keeps the state's sums NaN through every later rescale and merge: a NaN sum under a finite max
// could be rescaled by exp(-large) = 0 and vanish.
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
// Reductions.

__device__ SoftmaxPartials shuffle_xor(const SoftmaxPartials& p, int lane_mask) {
  constexpr unsigned kFullWarp = 0xffffffffu;
  return {__shfl_xor_sync(kFullWarp, p.max, lane_mask), __shfl_xor_sync(kFullWarp, p.sum_exp, lane_mask),
          __shfl_xor_sync(kFullWarp, p.sum_exp_x, lane_mask)};
}

// Every lane ends up with the merge of all 32 lanes' partials.
__device__ SoftmaxPartials warp_reduce(SoftmaxPartials p) {
#pragma unroll
  for (int lane_mask = kWarpSize / 2; lane_mask > 0; lane_mask /= 2) p = merge(p, shuffle_xor(p, lane_mask));
  return p;
}

// Thread 0 ends up with the merge of the whole block's partials. All threads of the block must call it.
__device__ SoftmaxPartials block_reduce(SoftmaxPartials p) {
  __shared__ SoftmaxPartials warp_partials[kMaxWarpsPerBlock];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  p = warp_reduce(p);
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();
  if (warp == 0) {
    const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;
    p = warp_reduce(lane < num_warps ? warp_partials[lane] : empty_partials());
  }
  __syncthreads();  // warp_partials is reused by the block's next row
  return p;
}

// ---------------------------------------------------------------------------------------------------------
// Forward.

// A logit as the (optionally top-k/top-p filtered) distribution sees it; compiles to a no-op without filter.
template <bool kFiltered>
__device__ __forceinline__ float visible_logit(float x, float threshold) {
  return kFiltered ? filtered_logit(x, threshold) : x;
}

// Adds one vector of logits to a thread's partials. The max moves once per vector, so each logit costs one
// exponential (plus one per vector when the max grows). Same conventions as `accumulate`: a NaN logit makes
// the max and the sums NaN (and a +inf one the sums), which no later merge undoes; -inf contributes nothing.
// kFiltered: logits below `threshold` count as -inf.
template <typename T, bool kWithEntropy, bool kFiltered>
__device__ SoftmaxPartials accumulate_vector(const SoftmaxPartials& p, const Vector<T>& v, float threshold,
                                             float scale) {
  constexpr int kSize = Vector<T>::kSize;
  float x[kSize];
#pragma unroll
  for (int i = 0; i < kSize; ++i) x[i] = visible_logit<kFiltered>(Element<T>::to_float(v.elems[i]) * scale, threshold);
  float vector_max = x[0];
#pragma unroll
  for (int i = 1; i < kSize; ++i) vector_max = max_keeping_nan(vector_max, x[i]);
  const float m = max_keeping_nan(p.max, vector_max);
  SoftmaxPartials out = m == p.max ? p : rescale_to(p, m);
  const float shift = safe_shift(m);
#pragma unroll
  for (int i = 0; i < kSize; ++i) {
    const float centered = x[i] - shift;
    const float e = fast_exp(centered);
    out.sum_exp += e;
    if (kWithEntropy) out.sum_exp_x += weighted_logit(e, centered);
  }
  return out;
}

// A 16-byte load into registers (a by-value copy, so the compiler cannot split it into element loads).
template <typename T>
__device__ Vector<T> load_vector(const Vector<T>* address) {
  return *address;
}

// This thread's share of the partials of `n` logits starting at `logits` (threads of the block interleave).
template <typename T, bool kWithEntropy, bool kFiltered>
__device__ SoftmaxPartials thread_partials(const T* __restrict__ logits, int n, float threshold, float scale) {
  const int stride = static_cast<int>(blockDim.x);
  const VectorSpan span = vector_span<T>(reinterpret_cast<uintptr_t>(logits), n);
  SoftmaxPartials p = empty_partials();
  for (int i = static_cast<int>(threadIdx.x); i < span.head; i += stride) {
    p = accumulate(p, visible_logit<kFiltered>(Element<T>::to_float(logits[i]) * scale, threshold));
  }
  const Vector<T>* __restrict__ vectors = reinterpret_cast<const Vector<T>*>(logits + span.head);
  int v = static_cast<int>(threadIdx.x);
  for (; v + (kUnroll - 1) * stride < span.num_vectors; v += kUnroll * stride) {
    Vector<T> loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) loaded[u] = load_vector(vectors + v + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) p = accumulate_vector<T, kWithEntropy, kFiltered>(p, loaded[u], threshold, scale);
  }
  for (; v < span.num_vectors; v += stride) {
    p = accumulate_vector<T, kWithEntropy, kFiltered>(p, load_vector(vectors + v), threshold, scale);
  }
  for (int i = span.tail_begin + static_cast<int>(threadIdx.x); i < n; i += stride) {
    p = accumulate(p, visible_logit<kFiltered>(Element<T>::to_float(logits[i]) * scale, threshold));
  }
  return p;
}

// Floats per row and split in the forward workspace: max, sum_exp and, with entropy, sum_exp_x.
__host__ __device__ constexpr int split_state_floats(bool with_entropy) { return with_entropy ? 3 : 2; }

__device__ void store_split_state(float* out, const SoftmaxPartials& p, bool with_entropy) {
  out[0] = p.max;
  out[1] = p.sum_exp;
  if (with_entropy) out[2] = p.sum_exp_x;
}

__device__ SoftmaxPartials load_split_state(const float* in, bool with_entropy) {
  return {in[0], in[1], with_entropy ? in[2] : 0.0f};
}

__device__ void store_partials(float* out, const SoftmaxPartials& p, float target_logit, bool with_entropy) {
  out[kColMax] = p.max;
  out[kColSumExp] = p.sum_exp;
  out[kColTarget] = target_logit;
  if (with_entropy) out[kColSumExpX] = p.sum_exp_x;
}

// Ignored rows get partials that combine to a finite lse across ranks: {m = 0, d = 1, x_y = -inf, s = 0}.
__device__ void store_ignored_partials(float* out, bool with_entropy) {
  store_partials(out, {0.0f, 1.0f, 0.0f}, neg_inf(), with_entropy);
}

// The target's logit when this shard holds it among its valid columns (and the filter keeps it), else -inf.
template <typename T, bool kFiltered>
__device__ float target_logit(const T* row_logits, int64_t target, int64_t vocab_start, int valid_cols,
                              float threshold, float scale) {
  const int64_t col = local_target_column(target, vocab_start, valid_cols);
  return col < 0 ? neg_inf() : visible_logit<kFiltered>(Element<T>::to_float(row_logits[col]) * scale, threshold);
}

// The row's top-k/top-p threshold, or -inf (keep all) without a filter.
template <bool kFiltered>
__device__ __forceinline__ float row_threshold(const float* __restrict__ thresholds, int64_t row) {
  return kFiltered ? thresholds[row] : neg_inf();
}

// Grid (row blocks, splits). Block (row, split) reduces columns [split * split_cols, +split_cols) of the row's
// valid columns. With one split it stores the row's partials; with several it stores its share in
// `split_states` [rows, splits, split_state_floats] for merge_splits_kernel.
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kMaxBlockThreads)
    partials_kernel(const T* __restrict__ logits, int64_t rows, int64_t row_stride,
                    const int64_t* __restrict__ targets, int64_t vocab_start, int valid_cols, int split_cols,
                    const float* __restrict__ thresholds, float scale, float* __restrict__ partials,
                    float* __restrict__ split_states) {
  const int splits = static_cast<int>(gridDim.y);
  const int split = static_cast<int>(blockIdx.y);
  const ColumnRange columns = split_columns(split, split_cols, valid_cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t target = targets[row];
    if (target < 0) {  // ignored: no need to read the row
      if (splits == 1 && threadIdx.x == 0) {
        store_ignored_partials(partials + row * num_partials(kWithEntropy), kWithEntropy);
      }
      continue;
    }
    const T* row_logits = logits + row * row_stride;
    // With one split, thread 0 loads the target's element before streaming the row and converts it after, so
    // that the load's latency hides behind the stream.
    const int64_t target_col = local_target_column(target, vocab_start, valid_cols);
    const bool owns_target = splits == 1 && threadIdx.x == 0 && target_col >= 0;
    const T target_element = owns_target ? row_logits[target_col] : T{};
    const float threshold = row_threshold<kFiltered>(thresholds, row);
    const SoftmaxPartials p = block_reduce(thread_partials<T, kWithEntropy, kFiltered>(
        row_logits + columns.begin, columns.end - columns.begin, threshold, scale));
    if (threadIdx.x != 0) continue;
    if (splits == 1) {
      const float x_y =
          owns_target ? visible_logit<kFiltered>(Element<T>::to_float(target_element) * scale, threshold)
                      : neg_inf();
      store_partials(partials + row * num_partials(kWithEntropy), p, x_y, kWithEntropy);
    } else {
      store_split_state(split_states + (row * splits + split) * split_state_floats(kWithEntropy), p,
                        kWithEntropy);
    }
  }
}

// One warp per row: merges the row's split states and stores its partials.
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void merge_splits_kernel(const T* __restrict__ logits, int64_t rows, int64_t row_stride,
                                    const int64_t* __restrict__ targets, int64_t vocab_start, int valid_cols,
                                    int splits, const float* __restrict__ thresholds, float scale,
                                    const float* __restrict__ split_states, float* __restrict__ partials) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;  // whole warps leave together; no block-wide barrier follows
  float* row_partials = partials + row * num_partials(kWithEntropy);
  const int64_t target = targets[row];
  if (target < 0) {
    if (lane == 0) store_ignored_partials(row_partials, kWithEntropy);
    return;
  }
  const float* row_states = split_states + row * splits * split_state_floats(kWithEntropy);
  SoftmaxPartials p = empty_partials();
  for (int split = lane; split < splits; split += kWarpSize) {
    p = merge(p, load_split_state(row_states + split * split_state_floats(kWithEntropy), kWithEntropy));
  }
  p = warp_reduce(p);
  if (lane == 0) {
    const float x_y = target_logit<T, kFiltered>(logits + row * row_stride, target, vocab_start, valid_cols,
                                                 row_threshold<kFiltered>(thresholds, row), scale);
    store_partials(row_partials, p, x_y, kWithEntropy);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward.

// Per-row constants of the gradient; `operator()` gives one logit's gradient (see prob_grad), with p from
// fast_exp: accurate enough for x - lse <= 0, and expf's extra instructions would make bf16 compute-bound.
// kFiltered: logits below `threshold` get exactly 0 (target_col is then -1 for a filtered target).
// The kernels see z = scale * x; grad_logprob and grad_entropy already carry the scale (d/dx = scale * d/dz).
template <bool kFiltered>
struct RowGradient {
  int target_col;  // local column of the target, or -1
  float lse;
  float mean_x;
  float grad_logprob;
  float grad_entropy;
  float threshold;
  float scale;

  __device__ float operator()(float x, int col) const {
    const float z = x * scale;
    if (kFiltered && !kept_logit(z, threshold)) return 0.0f;
    return prob_grad(fast_exp(z - lse), z, col == target_col, mean_x, grad_logprob, grad_entropy);
  }
};

// Writes the gradient of valid columns [begin, end) of one row. `grad` may alias `logits`: each thread loads
// its elements before it stores them and touches no other thread's elements, so no pointer is __restrict__.
template <typename T, typename Gradient>
__device__ void store_row_gradient(const T* logits, T* grad, int begin, int end, const Gradient& row_grad) {
  const int stride = static_cast<int>(blockDim.x);
  const int n = end - begin;
  const T* x = logits + begin;
  T* g = grad + begin;
  const uintptr_t x_address = reinterpret_cast<uintptr_t>(x);
  const bool same_alignment = (x_address ^ reinterpret_cast<uintptr_t>(g)) % kVectorBytes == 0;
  const VectorSpan span = same_alignment ? vector_span<T>(x_address, n) : scalar_span(n);

  for (int i = static_cast<int>(threadIdx.x); i < span.head; i += stride) {
    g[i] = Element<T>::from_float(row_grad(Element<T>::to_float(x[i]), begin + i));
  }
  constexpr int kSize = Vector<T>::kSize;
  const Vector<T>* x_vectors = reinterpret_cast<const Vector<T>*>(x + span.head);
  Vector<T>* g_vectors = reinterpret_cast<Vector<T>*>(g + span.head);
  const int vector_col0 = begin + span.head;
  auto store_vector = [&](int v, const Vector<T>& loaded) {
    Vector<T> out;
#pragma unroll
    for (int i = 0; i < kSize; ++i) {
      const float x_i = Element<T>::to_float(loaded.elems[i]);
      out.elems[i] = Element<T>::from_float(row_grad(x_i, vector_col0 + v * kSize + i));
    }
    g_vectors[v] = out;
  };
  int v = static_cast<int>(threadIdx.x);
  for (; v + (kUnroll - 1) * stride < span.num_vectors; v += kUnroll * stride) {
    Vector<T> loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) loaded[u] = load_vector(x_vectors + v + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store_vector(v + u * stride, loaded[u]);
  }
  for (; v < span.num_vectors; v += stride) store_vector(v, load_vector(x_vectors + v));
  for (int i = span.tail_begin + static_cast<int>(threadIdx.x); i < n; i += stride) {
    g[i] = Element<T>::from_float(row_grad(Element<T>::to_float(x[i]), begin + i));
  }
}

// Writes exact zeros to `n` elements at `grad` (padding columns, ignored rows). Reads nothing.
template <typename T>
__device__ void store_zeros(T* grad, int n) {
  const int stride = static_cast<int>(blockDim.x);
  const T zero = Element<T>::from_float(0.0f);
  const VectorSpan span = vector_span<T>(reinterpret_cast<uintptr_t>(grad), n);
  for (int i = static_cast<int>(threadIdx.x); i < span.head; i += stride) grad[i] = zero;
  Vector<T> zeros;
#pragma unroll
  for (int i = 0; i < Vector<T>::kSize; ++i) zeros.elems[i] = zero;
  Vector<T>* vectors = reinterpret_cast<Vector<T>*>(grad + span.head);
  for (int v = static_cast<int>(threadIdx.x); v < span.num_vectors; v += stride) vectors[v] = zeros;
  for (int i = span.tail_begin + static_cast<int>(threadIdx.x); i < n; i += stride) grad[i] = zero;
}

// Grid (row blocks, splits). Block (row, split) writes columns [split * split_cols, +split_cols) of the row's
// gradient; the splits follow the valid columns, and the last one also writes the padding.
template <typename T, bool kWithEntropy, bool kFiltered>
__global__ void __launch_bounds__(kMaxBlockThreads)
    backward_kernel(const T* logits, int64_t rows, int64_t row_stride, const int64_t* __restrict__ targets,
                    int64_t vocab_start, int valid_cols, int cols, int split_cols, const float* __restrict__ lse,
                    const float* __restrict__ mean_x, const float* __restrict__ grad_logprob,
                    const float* __restrict__ grad_entropy, const float* __restrict__ thresholds, float scale,
                    T* grad, int64_t grad_row_stride) {
  const ColumnRange columns =
      split_columns_to_end(static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y), split_cols, cols);
  const int begin = columns.begin;
  const int end = columns.end;
  const int valid_end = min(end, valid_cols);
  const int padding_begin = max(begin, valid_cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* row_grad = grad + row * grad_row_stride;
    const int64_t target = targets[row];
    if (target < 0) {
      store_zeros(row_grad + begin, end - begin);
      continue;
    }
    if (begin < valid_end) {
      const T* row_logits = logits + row * row_stride;
      const float threshold = row_threshold<kFiltered>(thresholds, row);
      // No thread reads the target's logit here: in place, another thread (or split) may already have written its
      // gradient there. A filtered target needs no special case: its own column gets 0 (below the threshold), and
      // no other column is the target's.
      const int target_col = static_cast<int>(local_target_column(target, vocab_start, valid_cols));
      const RowGradient<kFiltered> gradient{target_col,
                                            lse[row],
                                            kWithEntropy ? mean_x[row] : 0.0f,
                                            scale * grad_logprob[row],
                                            kWithEntropy ? scale * grad_entropy[row] : 0.0f,
                                            threshold,
                                            scale};
      store_row_gradient(row_logits, row_grad, begin, valid_end, gradient);
    }
    if (padding_begin < end) store_zeros(row_grad + padding_begin, end - padding_begin);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side.

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How rows are cut across blocks, and how big the blocks are.
struct LaunchPlan {
  int splits;      // blocks per row
  int split_cols;  // columns per block (the last split of a row may get fewer)
  int threads;     // threads per block
};

// Threads of a block streaming `width` columns: a power of two from a warp to kMaxBlockThreads, each thread with at
// least kMinVectorsPerThread vectors where the width allows.
int threads_for(int64_t width, int64_t vector_size) {
  const int64_t vectors = ceil_div(width, vector_size);
  int threads = kWarpSize;
  while (threads < kMaxBlockThreads && 2 * threads * kMinVectorsPerThread <= vectors) threads *= 2;
  return threads;
}

// The rows' `valid_cols` are split (a mostly-padding shard launches no idle blocks) while there are fewer rows than
// `wave_blocks` (one wave of the kernel on the device); a block's threads follow its widest share of `cols`
// (backward's last split also writes the padding after the valid columns).
LaunchPlan plan_launch(int64_t rows, int64_t valid_cols, int64_t cols, int64_t vector_size, int64_t wave_blocks) {
  int64_t splits = 1;
  const int64_t rows_to_fill = std::max<int64_t>(wave_blocks, 1);
  if (rows > 0 && rows < rows_to_fill) {
    const int64_t most_useful = std::max<int64_t>(1, ceil_div(valid_cols, kMinSplitCols));
    splits = std::min({ceil_div(rows_to_fill, rows), most_useful, static_cast<int64_t>(USHRT_MAX)});
  }
  const int64_t split_cols = ceil_div(ceil_div(valid_cols, splits), kSplitAlignCols) * kSplitAlignCols;
  if (split_cols > 0) splits = ceil_div(valid_cols, split_cols);
  const int64_t widest = std::max(split_cols, cols - (splits - 1) * split_cols);
  return {static_cast<int>(splits), static_cast<int>(split_cols), threads_for(widest, vector_size)};
}

cudaError_t current_sm_count(int* sm_count) {
  int device = 0;
  const cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  return cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
}

// One wave of `kernel` on the current device at `threads` threads per block: its resident blocks per SM
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor, for its registers and shared memory) times the SMs. Asked once per
// kernel, block size and device, then cached.
template <typename Kernel>
cudaError_t resident_blocks(Kernel kernel, int threads, int64_t* blocks) {
  constexpr int kMaxDevices = 64;
  constexpr int kBlockSizes = 4;  // 32, 64, 128, 256 threads
  static std::atomic<int64_t> cache[kMaxDevices][kBlockSizes] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  int size_index = 0;
  while ((kWarpSize << size_index) < threads && size_index < kBlockSizes - 1) ++size_index;
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && (*blocks = cache[device][size_index].load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  int sm_count = 0;
  int per_sm = 0;
  status = current_sm_count(&sm_count);
  if (status == cudaSuccess) status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
  if (status != cudaSuccess) return status;
  *blocks = static_cast<int64_t>(sm_count) * std::max(per_sm, 1);
  if (cached) cache[device][size_index].store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

// Shape checks shared by both launchers. The kernels index columns with int (with room for split_cols to round
// up to kSplitAlignCols) and rows with a grid-stride loop.
bool valid_shape(int64_t rows, int64_t cols, int64_t valid_cols) {
  return rows >= 0 && cols >= 0 && cols <= INT_MAX - kSplitAlignCols && valid_cols >= 0 && valid_cols <= cols;
}

// The kernels see z = logit_scale * x: a finite positive number.
bool valid_scale(float logit_scale) { return logit_scale > 0.0f && logit_scale <= FLT_MAX; }

bool element_aligned(const void* pointer, size_t element_bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % element_bytes == 0;
}

dim3 grid_for(int64_t rows, const LaunchPlan& plan) {
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

// The launch plan of partials_kernel<T, ...> for these sizes on the current device (and so the split workspace
// `logprob_partials_workspace_bytes` reports: both ask this).
template <typename T, bool kWithEntropy, bool kFiltered>
cudaError_t plan_partials(int64_t rows, int64_t valid_cols, LaunchPlan* plan) {
  constexpr int64_t kVector = Vector<T>::kSize;
  int64_t wave = 0;
  const cudaError_t status =
      resident_blocks(partials_kernel<T, kWithEntropy, kFiltered>, threads_for(valid_cols, kVector), &wave);
  if (status != cudaSuccess) return status;
  *plan = plan_launch(rows, valid_cols, valid_cols, kVector, wave);
  return cudaSuccess;
}

// The launch plan of backward_kernel<T, ...> for these sizes on the current device.
template <typename T, bool kWithEntropy, bool kFiltered>
cudaError_t plan_backward(int64_t rows, int64_t valid_cols, int64_t cols, LaunchPlan* plan) {
  constexpr int64_t kVector = Vector<T>::kSize;
  int64_t wave = 0;
  const cudaError_t status =
      resident_blocks(backward_kernel<T, kWithEntropy, kFiltered>, threads_for(cols, kVector), &wave);
  if (status != cudaSuccess) return status;
  *plan = plan_launch(rows, valid_cols, cols, kVector, wave);
  return cudaSuccess;
}

template <typename T, bool kWithEntropy, bool kFiltered>
cudaError_t launch_partials_typed(const T* logits, int64_t rows, int64_t row_stride, const int64_t* targets,
                                  int64_t vocab_start, int valid_cols, const LaunchPlan& plan,
                                  const float* thresholds, float scale, float* partials, float* split_states,
                                  cudaStream_t stream) {
  partials_kernel<T, kWithEntropy, kFiltered><<<grid_for(rows, plan), plan.threads, 0, stream>>>(
      logits, rows, row_stride, targets, vocab_start, valid_cols, plan.split_cols, thresholds, scale, partials,
      split_states);
  if (plan.splits > 1) {
    const auto blocks = static_cast<unsigned>(ceil_div(rows, kMergeRowsPerBlock));
    merge_splits_kernel<T, kWithEntropy, kFiltered><<<blocks, kMergeRowsPerBlock * kWarpSize, 0, stream>>>(
        logits, rows, row_stride, targets, vocab_start, valid_cols, plan.splits, thresholds, scale, split_states,
        partials);
  }
  return cudaGetLastError();
}

template <typename T, bool kWithEntropy, bool kFiltered>
cudaError_t launch_backward_typed(const T* logits, int64_t rows, int64_t row_stride, const int64_t* targets,
                                  int64_t vocab_start, int valid_cols, int cols, const LaunchPlan& plan,
                                  const float* lse, const float* mean_x, const float* grad_logprob,
                                  const float* grad_entropy, const float* thresholds, float scale, T* grad,
                                  int64_t grad_row_stride, cudaStream_t stream) {
  backward_kernel<T, kWithEntropy, kFiltered><<<grid_for(rows, plan), plan.threads, 0, stream>>>(
      logits, rows, row_stride, targets, vocab_start, valid_cols, cols, plan.split_cols, lse, mean_x,
      grad_logprob, grad_entropy, thresholds, scale, grad, grad_row_stride);
  return cudaGetLastError();
}

}  // namespace

size_t logprob_partials_workspace_bytes(int64_t rows, int64_t cols, int64_t valid_cols, LogitsDType dtype,
                                        bool with_entropy, bool filtered) {
  if (!valid_shape(rows, cols, valid_cols) || rows == 0) return 0;
  LaunchPlan plan{1, 0, 0};
  const cudaError_t status = dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return dispatch_flags(with_entropy, filtered, [&](auto entropy, auto filter) {
      return plan_partials<T, decltype(entropy)::value, decltype(filter)::value>(rows, valid_cols, &plan);
    });
  });
  if (status != cudaSuccess || plan.splits == 1) return 0;
  return static_cast<size_t>(rows) * plan.splits * split_state_floats(with_entropy) * sizeof(float);
}

cudaError_t launch_logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                    int64_t valid_cols, bool with_entropy, const float* thresholds,
                                    float logit_scale, float* partials, void* workspace, cudaStream_t stream) {
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
      LaunchPlan plan{1, 0, 0};
      const cudaError_t status = plan_partials<T, kWithEntropy, kFiltered>(rows, valid_cols, &plan);
      if (status != cudaSuccess) return status;
      if (plan.splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
      return launch_partials_typed<T, kWithEntropy, kFiltered>(typed_logits, rows, row_stride, targets, vocab_start,
                                                               valid, plan, thresholds, logit_scale, partials,
                                                               split_states, stream);
    });
  });
}

cudaError_t launch_logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                    int64_t valid_cols, const float* lse, const float* mean_x,
                                    const float* grad_logprob, const float* grad_entropy,
                                    const float* thresholds, float logit_scale, void* grad_logits,
                                    int64_t grad_row_stride, cudaStream_t stream) {
  if (!valid_shape(rows, cols, valid_cols) || !valid_scale(logit_scale)) return cudaErrorInvalidValue;
  if ((mean_x == nullptr) != (grad_entropy == nullptr)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool with_entropy = mean_x != nullptr;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* typed_logits = static_cast<const T*>(logits);
    auto* typed_grad = static_cast<T*>(grad_logits);
    if (!element_aligned(typed_logits, sizeof(T)) || !element_aligned(typed_grad, sizeof(T))) {
      return cudaErrorMisalignedAddress;
    }
    const int valid = static_cast<int>(valid_cols);
    const int width = static_cast<int>(cols);
    return dispatch_flags(with_entropy, thresholds != nullptr, [&](auto entropy, auto filtered) {
      constexpr bool kWithEntropy = decltype(entropy)::value;
      constexpr bool kFiltered = decltype(filtered)::value;
      LaunchPlan plan{1, 0, 0};
      const cudaError_t status = plan_backward<T, kWithEntropy, kFiltered>(rows, valid_cols, cols, &plan);
      if (status != cudaSuccess) return status;
      return launch_backward_typed<T, kWithEntropy, kFiltered>(typed_logits, rows, row_stride, targets, vocab_start,
                                                               valid, width, plan, lse, mean_x, grad_logprob,
                                                               grad_entropy, thresholds, logit_scale, typed_grad,
                                                               grad_row_stride, stream);
    });
  });
}

}  // namespace megatron_grpo
