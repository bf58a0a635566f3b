// CUDA kernels of the top-p threshold search (see top_p_cuda.h; the maths in top_p.h). One block per row, rows in a
// grid-stride loop; the histograms live in shared memory (float64 atomics), and are written out once per row.
// The value histogram keeps one copy per warp (8 x 256 float64, 16 KiB) so that a bin's atomics collide 8 times less,
// and sums the last bin, which takes every logit more than 32 nats below the max (most of a large vocab), in each
// thread's registers.
#include "top_p_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "top_p.h"

namespace megatron_grpo {
namespace {

using top_p::kBucketSlots;
using top_p::kValueBins;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

struct RowInputs {
  float shift;
  float floor;
};

__device__ RowInputs row_inputs(const float* __restrict__ shift, const float* __restrict__ floor, int64_t row) {
  return {shift[row], floor != nullptr ? floor[row] : -INFINITY};
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    value_histogram_kernel(const T* __restrict__ logits, int64_t rows, int cols, int64_t row_stride, float scale,
                           const float* __restrict__ shift, const float* __restrict__ floor,
                           double* __restrict__ hist) {
  __shared__ double warp_hist[kWarps][kValueBins];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int i = threadIdx.x; i < kWarps * kValueBins; i += blockDim.x) (&warp_hist[0][0])[i] = 0.0;
    __syncthreads();
    const RowInputs in = row_inputs(shift, floor, row);
    const T* x = logits + row * row_stride;
    double far = 0.0;  // the last bin's mass, in a register
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
      const top_p::Element e = top_p::element_of(to_float(x[i]), scale, in.shift, in.floor);
      if (!e.kept) continue;
      const int bin = top_p::value_bin(e.centered);
      const double mass = top_p::mass_of(e);
      if (bin == kValueBins - 1) {
        far += mass;
      } else {
        atomicAdd(&warp_hist[warp][bin], mass);
      }
    }
    atomicAdd(&warp_hist[warp][kValueBins - 1], far);
    __syncthreads();
    for (int bin = threadIdx.x; bin < kValueBins; bin += blockDim.x) {
      double total = 0.0;
      for (int w = 0; w < kWarps; ++w) total += warp_hist[w][bin];
      hist[row * kValueBins + bin] = total;
    }
    __syncthreads();  // warp_hist is cleared for the next row
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    candidates_kernel(const T* __restrict__ logits, int64_t rows, int cols, int64_t row_stride, float scale,
                      const float* __restrict__ shift, const float* __restrict__ floor,
                      const int64_t* __restrict__ boundary, int64_t capacity, int32_t* __restrict__ keys,
                      int64_t* __restrict__ counts) {
  __shared__ unsigned long long count;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const RowInputs in = row_inputs(shift, floor, row);
    const int bin = static_cast<int>(boundary[row]);
    const T* x = logits + row * row_stride;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
      const top_p::Element e = top_p::element_of(to_float(x[i]), scale, in.shift, in.floor);
      if (!e.kept || top_p::value_bin(e.centered) != bin) continue;
      const auto slot = static_cast<int64_t>(atomicAdd(&count, 1ull));
      if (slot < capacity) keys[row * capacity + slot] = static_cast<int32_t>(top_p::ordered_key(e.z));
    }
    __syncthreads();
    if (threadIdx.x == 0) counts[row] = static_cast<int64_t>(count);
    __syncthreads();  // count is reset for the next row
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    bucket_masses_kernel(const T* __restrict__ logits, int64_t rows, int cols, int64_t row_stride, float scale,
                         const float* __restrict__ shift, const float* __restrict__ floor,
                         const int64_t* __restrict__ boundary, int64_t capacity, const int32_t* __restrict__ keys,
                         const int64_t* __restrict__ counts, const int64_t* __restrict__ prefix, int low_bit,
                         double* __restrict__ out) {
  __shared__ double buckets[kBucketSlots];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int i = threadIdx.x; i < kBucketSlots; i += blockDim.x) buckets[i] = 0.0;
    __syncthreads();
    const int64_t row_prefix = prefix[row];
    const int64_t count = counts[row];
    if (count <= capacity) {  // the compact candidates; the row is not read
      const float row_shift = shift[row];
      for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
        const auto key = static_cast<uint32_t>(keys[row * capacity + i]);
        atomicAdd(&buckets[top_p::bucket_slot(key, low_bit, row_prefix)], top_p::mass_of_key(key, row_shift));
      }
    } else {
      const RowInputs in = row_inputs(shift, floor, row);
      const int bin = static_cast<int>(boundary[row]);
      const T* x = logits + row * row_stride;
      for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const top_p::Element e = top_p::element_of(to_float(x[i]), scale, in.shift, in.floor);
        if (!e.kept || top_p::value_bin(e.centered) != bin) continue;
        atomicAdd(&buckets[top_p::bucket_slot(top_p::ordered_key(e.z), low_bit, row_prefix)], top_p::mass_of(e));
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kBucketSlots; i += blockDim.x) out[row * kBucketSlots + i] = buckets[i];
    __syncthreads();  // buckets is cleared for the next row
  }
}

template <typename Fn>
cudaError_t dispatch_dtype(LogitsDType dtype, Fn&& fn) {
  switch (dtype) {
    case LogitsDType::kFloat32: return fn(float{});
    case LogitsDType::kBFloat16: return fn(__nv_bfloat16{});
    case LogitsDType::kFloat16: return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

bool valid(int64_t rows, int64_t cols, float scale) {
  return rows >= 0 && cols >= 0 && cols <= INT_MAX && scale > 0.0f && std::isfinite(scale);
}

unsigned grid_for(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), INT_MAX)); }

}  // namespace

cudaError_t launch_top_p_value_histogram(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                         int64_t row_stride, float scale, const float* shift, const float* floor,
                                         double* hist, cudaStream_t stream) {
  if (!valid(rows, cols, scale)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    value_histogram_kernel<T><<<grid_for(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), rows, static_cast<int>(cols), row_stride, scale, shift, floor, hist);
    return cudaGetLastError();
  });
}

cudaError_t launch_top_p_candidates(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, float scale, const float* shift, const float* floor,
                                    const int64_t* boundary, int64_t capacity, int32_t* keys, int64_t* counts,
                                    cudaStream_t stream) {
  if (!valid(rows, cols, scale) || capacity < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    candidates_kernel<T><<<grid_for(rows), kThreads, 0, stream>>>(static_cast<const T*>(logits), rows,
                                                                  static_cast<int>(cols), row_stride, scale, shift,
                                                                  floor, boundary, capacity, keys, counts);
    return cudaGetLastError();
  });
}

cudaError_t launch_top_p_bucket_masses(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, float scale, const float* shift, const float* floor,
                                       const int64_t* boundary, int64_t capacity, const int32_t* keys,
                                       const int64_t* counts, const int64_t* prefix, int low_bit, double* out,
                                       cudaStream_t stream) {
  if (!valid(rows, cols, scale) || capacity < 0 || low_bit < 0 || low_bit + top_p::kBucketBits > top_p::kKeyBits) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bucket_masses_kernel<T><<<grid_for(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(logits), rows, static_cast<int>(cols), row_stride, scale, shift, floor, boundary,
        capacity, keys, counts, prefix, low_bit, out);
    return cudaGetLastError();
  });
}

}  // namespace megatron_grpo
