// CUDA launchers of the vocab-parallel logprob kernels, on raw pointers and a cudaStream_t.
//
// No torch headers (only logprob_common.h, for LogitsDType and the partials layout): plain nvcc compile-checks
// logprob_cuda.cu on machines without torch's CUDA build, and bindings.cpp wraps these launchers for torch.
// The launchers only enqueue work on `stream`: nothing here synchronises with the host.
//
// The launchers work on the current CUDA device (the caller sets it, e.g. with a device guard), and
// `logprob_forward_workspace_bytes` must be asked on that same device: the cut of the rows across blocks depends on
// its multiprocessor count and on the kernels' occupancy there.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "logprob_common.h"

namespace megatron_grpo {

// Bytes of scratch memory a forward launch (`launch_logprob_partials` or `launch_logprob_forward`) needs for these
// arguments on the current device; 0 when every row is reduced by one block or one warp (then `workspace` may be
// nullptr). Rows are split across blocks by their `valid_cols` while they are fewer than one wave of the kernel
// variant (dtype, entropy, filter: its occupancy); `filtered` is whether thresholds will be passed.
size_t logprob_forward_workspace_bytes(int64_t rows, int64_t cols, int64_t valid_cols, LogitsDType dtype,
                                       bool with_entropy, bool filtered);

// Forward of several ranks (TP > 1): reduces each row of the shard to fp32 partials [rows, num_partials(with_entropy)],
// columns as PartialsColumn in logprob_common.h.
// logits: `rows` rows of `cols` columns; row i starts at logits + i * row_stride elements and is contiguous.
// Only columns [0, valid_cols) are real vocab (0 <= valid_cols <= cols); the rest is padding.
// targets: int64 [rows] global token ids; < 0 marks an ignored row, whose partials are {0, 1, -inf, 0}.
// A shard with valid_cols == 0 gives {-inf, 0, -inf, 0} for every other row.
// thresholds: fp32 [rows] or nullptr. With it, only the logits with z >= thresholds[row] take part
// (top-k/top-p) and a target below it has logit -inf; without it the kernels take their unfiltered path.
// logit_scale (finite, > 0; e.g. 1 / temperature): the kernels see z = logit_scale * x, and the partials are
// those of z (cudaErrorInvalidValue otherwise).
cudaError_t launch_logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                    int64_t valid_cols, bool with_entropy, const float* thresholds,
                                    float logit_scale, float* partials, void* workspace, cudaStream_t stream);

// Forward of one rank (TP 1): the same reduction, ended in the kernel by the combine of one rank's partials
// (combine_partials in logprob_common.h), which writes the op's outputs, fp32 [rows] each: the logprob, the lse and,
// with entropy, the entropy and E[z] (entropy and mean_x nullptr without it). Ignored rows get 0 in each.
cudaError_t launch_logprob_forward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                   int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                   int64_t valid_cols, bool with_entropy, const float* thresholds, float logit_scale,
                                   float* logprob, float* entropy, float* lse, float* mean_x, void* workspace,
                                   cudaStream_t stream);

// The combine after the all-gather (TP > 1): each row's outputs, as launch_logprob_forward writes them, from the
// partials of `world` ranks, `gathered` fp32 [world, rows, num_partials(with_entropy)]. One thread per row.
cudaError_t launch_logprob_combine(const float* gathered, int64_t world, int64_t rows, const int64_t* targets,
                                   bool with_entropy, float* logprob, float* entropy, float* lse, float* mean_x,
                                   cudaStream_t stream);

// The launch plans of a call on the current device, for tests that aim at their boundaries: {warp rows (0/1),
// splits, split_cols, threads, blocks, one wave of the warp kernel, one wave of the block kernel (blocks)} of the
// forward (`backward` false, cols unused) or of the out-of-place backward.
cudaError_t logprob_launch_plan(int64_t rows, int64_t cols, int64_t valid_cols, LogitsDType dtype, bool with_entropy,
                                bool filtered, bool backward, int64_t plan[7]);

// Backward: grad_logits[rows, cols] in the logits' dtype (row stride grad_row_stride), with z = logit_scale * x,
//   dx = logit_scale * (g_lp * (1[v == y] - p) + g_h * p * (E[z] - z)),   p = exp(z - lse),
// computed in fp32 and rounded once. Padding columns get exactly 0; ignored rows are all 0.
// lse is fp32 [rows]; grad_logprob is fp32 [rows] or nullptr (no logprob gradient: g_lp = 0); mean_x (= E[z]) and
// grad_entropy are fp32 [rows] with an entropy backward differentiates and both nullptr otherwise. thresholds as in
// forward: logits below it (the target included) get exactly 0; logprob (fp32 [rows], given with the thresholds,
// else nullptr) zeroes g_lp where the filter dropped the target (logprob -inf: a constant).
// grad_logits MAY BE logits itself (in-place backward, then with the same row stride): every element is read and
// then written by the same thread, and no thread reads an element after it has been written. Any other overlap of
// the two is not allowed: a separate gradient buffer takes the kernels whose pointers are __restrict__.
cudaError_t launch_logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                                    int64_t valid_cols, const float* lse, const float* mean_x, const float* logprob,
                                    const float* grad_logprob, const float* grad_entropy,
                                    const float* thresholds, float logit_scale, void* grad_logits,
                                    int64_t grad_row_stride, cudaStream_t stream);

}  // namespace megatron_grpo
