// CPU kernels of the vocab-parallel logprob op, on raw pointers (the CPU twin of logprob_cuda.h).
//
// Layout shared by both: `rows` rows of `cols` logits, row i at logits + i * row_stride, last dim contiguous.
// Only columns [0, valid_cols) are real vocab; the rest is padding. targets: int64 [rows], < 0 = ignored row.
#pragma once

#include <cstdint>

#include "logprob_common.h"

namespace megatron_grpo {
namespace cpu {

// Writes the fp32 partials [rows, num_partials(with_entropy)] (columns as PartialsColumn).
// thresholds: fp32 [rows] or null; with it only the logits >= thresholds[row] take part (top-k/top-p), and a
// target below it has logit -inf.
void logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                      const float* thresholds, float* partials);

// Writes d(loss)/d(logits) in the logits' dtype. grad_logits may alias logits (in-place backward).
// mean_x and grad_entropy are null without entropy. thresholds as in forward: logits below it get 0.
void logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, const float* lse,
                      const float* mean_x, const float* grad_logprob, const float* grad_entropy,
                      const float* thresholds, void* grad_logits, int64_t grad_row_stride);

}  // namespace cpu
}  // namespace megatron_grpo
