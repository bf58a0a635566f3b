// CUDA launchers of the top-p threshold search (top_p.h has the maths; top_p_cpu.h the same three steps on the CPU,
// with the same arguments). On raw pointers and a stream, no torch headers; nothing here synchronises with the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "logprob_common.h"

namespace megatron_grpo {

// hist (float64 [rows, top_p::kValueBins], overwritten): each kept logit's mass in its value bin.
cudaError_t launch_top_p_value_histogram(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                         int64_t row_stride, float scale, const float* shift, const float* floor,
                                         double* hist, cudaStream_t stream);

// The kept logits of each row's `boundary` bin: their count (int64 [rows]) and the ordered keys (int32 [rows,
// capacity]) of up to `capacity` of them, in no particular order.
cudaError_t launch_top_p_candidates(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, float scale, const float* shift, const float* floor,
                                    const int64_t* boundary, int64_t capacity, int32_t* keys, int64_t* counts,
                                    cudaStream_t stream);

// One radix pass: out (float64 [rows, top_p::kBucketSlots], overwritten) the candidates' masses
// (top_p::mass_of_key) by bucket_slot(key, low_bit, prefix[row]); a row with more candidates than `capacity` reads
// them from the logits.
cudaError_t launch_top_p_bucket_masses(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, float scale, const float* shift, const float* floor,
                                       const int64_t* boundary, int64_t capacity, const int32_t* keys,
                                       const int64_t* counts, const int64_t* prefix, int low_bit, double* out,
                                       cudaStream_t stream);

}  // namespace megatron_grpo
