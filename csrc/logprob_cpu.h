// CPU kernels of the vocab-parallel logprob op, on raw pointers (the CPU twin of logprob_cuda.h).
//
// Layout shared by both: `rows` rows of `cols` logits, row i at logits + i * row_stride, last dim contiguous.
// Only columns [0, valid_cols) are real vocab; the rest is padding. targets: int64 [rows], < 0 = ignored row.
// logit_scale (> 0, e.g. 1 / temperature): the kernels see the logits z = logit_scale * x. Partials, thresholds,
// lse and mean_x are in units of z; the gradient is d/dx = logit_scale * d/dz.
//
// logprob_cpu_kernels.cpp is compiled once per instruction set (AVX2, AVX-512; a portable build elsewhere), each
// into its own namespace named by CPU_CAPABILITY, as ATen does; logprob_cpu.cpp picks one at run time.
#pragma once

#include <cstdint>

#include "logprob_common.h"

// The kernel entry points; declared once per instruction-set namespace.
#define MEGATRON_GRPO_CPU_KERNEL_DECLARATIONS                                                                     \
  void logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,   \
                        const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,      \
                        const float* thresholds, float logit_scale, float* partials);                            \
  void logprob_forward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,    \
                       const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,       \
                       const float* thresholds, float logit_scale, float* logprob, float* entropy, float* lse,   \
                       float* mean_x);                                                                            \
  void logprob_partials_writing_exps(void* logits, LogitsDType dtype, int64_t rows, int64_t cols,                \
                                     int64_t row_stride, const int64_t* targets, int64_t vocab_start,            \
                                     int64_t valid_cols, bool with_entropy, const float* thresholds,             \
                                     float logit_scale, float* partials);                                        \
  void logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,   \
                        const int64_t* targets, int64_t vocab_start, int64_t valid_cols, const float* lse,       \
                        const float* mean_x, const float* logprob, const float* grad_logprob,                    \
                        const float* grad_entropy, const float* thresholds, float logit_scale, void* grad_logits, \
                        int64_t grad_row_stride);                                                                 \
  void logprob_backward_from_exps(void* exps, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride, \
                                  const int64_t* targets, int64_t vocab_start, int64_t valid_cols,               \
                                  const float* prob_scale, const float* target_prob, const float* grad_logprob,   \
                                  float logit_scale);

namespace megatron_grpo {
namespace cpu {

// logprob_partials: writes the fp32 partials [rows, num_partials(with_entropy)] (columns as PartialsColumn).
//   thresholds: fp32 [rows] (in units of z) or null; with it only the logits with z >= thresholds[row] take part
//   (top-k/top-p), and a target below it has logit -inf.
// logprob_forward: one rank's (TP 1) outputs straight from the kernel, each fp32 [rows]: the logprob, lse and, with
//   entropy, the entropy and E[z] (entropy and mean_x null without it); the combine of one rank's partials
//   (combine_partials in logprob_common.h): ignored rows get logprob 0, entropy 0, lse 0, mean_x 0.
// logprob_partials_writing_exps: the same partials, and, for the in-place exp mode, overwrites each valid column
//   of each non-ignored row with e = exp(z - m) in the logits' dtype, m = the row's local max (kColMax); a
//   filtered logit gets e = 0. Padding columns and ignored rows are not touched.
// logprob_backward: writes d(loss)/d(logits) in the logits' dtype. grad_logits may alias logits (in-place
//   backward). mean_x and grad_entropy are null without entropy (or an entropy nothing differentiated);
//   grad_logprob is null where nothing differentiated the logprob. thresholds as in forward: those logits get 0;
//   logprob (null without a filter) zeroes the logprob gradient of the rows whose target the filter dropped
//   (upstream_logprob_gradient).
// logprob_backward_from_exps: the in-place exp mode's backward, no exponential: from the e of
//   logprob_partials_writing_exps, p = e * prob_scale[row] (prob_scale = exp(m - lse)), and the buffer is
//   overwritten with dx = logit_scale * g_lp * (1[v == y] - p); padding and ignored rows get exactly 0. The
//   target's p is target_prob[row] (= exp(logprob), from the fp32 target logit rather than its stored e, so
//   that 1 - p does not cancel the rounding of a bf16 e). The caller zeroes grad_logprob of rows whose target
//   was filtered. No entropy term (it needs the logits).
MEGATRON_GRPO_CPU_KERNEL_DECLARATIONS

// The combine after the all-gather (TP > 1): each row's outputs from the partials of `world` ranks, `gathered`
// fp32 [world, rows, num_partials(with_entropy)] (combine_partials in logprob_common.h); outputs as logprob_forward.
void logprob_combine(const float* gathered, int64_t world, int64_t rows, const int64_t* targets, bool with_entropy,
                     float* logprob, float* entropy, float* lse, float* mean_x);

}  // namespace cpu
}  // namespace megatron_grpo
