// Run-time dispatch of the CPU logprob kernels to the active instruction-set build (cpu_isa.h), and the combine.
#include "logprob_cpu.h"

#include <ATen/Parallel.h>

#include "cpu_isa.h"

namespace megatron_grpo {
namespace cpu {

#if defined(MEGATRON_GRPO_CPU_ISA_DISPATCH)
namespace AVX2 {
MEGATRON_GRPO_CPU_KERNEL_DECLARATIONS
}
namespace AVX512 {
MEGATRON_GRPO_CPU_KERNEL_DECLARATIONS
}
#else
namespace DEFAULT {
MEGATRON_GRPO_CPU_KERNEL_DECLARATIONS
}
#endif

void logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                      const float* thresholds, float logit_scale, float* partials) {
  MGRPO_CPU_CALL(logprob_partials, logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols,
                 with_entropy, thresholds, logit_scale, partials);
}

void logprob_forward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                     const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                     const float* thresholds, float logit_scale, float* logprob, float* entropy, float* lse,
                     float* mean_x) {
  MGRPO_CPU_CALL(logprob_forward, logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols,
                 with_entropy, thresholds, logit_scale, logprob, entropy, lse, mean_x);
}

void logprob_combine(const float* gathered, int64_t world, int64_t rows, const int64_t* targets, bool with_entropy,
                     float* logprob, float* entropy, float* lse, float* mean_x) {
  const int k = num_partials(with_entropy);
  constexpr int64_t kRowsPerTask = 4096;
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowStats stats =
          combine_partials(gathered + r * k, rows * k, static_cast<int>(world), with_entropy, targets[r] < 0);
      logprob[r] = stats.logprob;
      lse[r] = stats.lse;
      if (with_entropy) {
        entropy[r] = stats.entropy;
        mean_x[r] = stats.mean_x;
      }
    }
  });
}

void logprob_partials_writing_exps(void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   const int64_t* targets, int64_t vocab_start, int64_t valid_cols,
                                   bool with_entropy, const float* thresholds, float logit_scale, float* partials) {
  MGRPO_CPU_CALL(logprob_partials_writing_exps, logits, dtype, rows, cols, row_stride, targets, vocab_start,
                 valid_cols, with_entropy, thresholds, logit_scale, partials);
}

void logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, const float* lse,
                      const float* mean_x, const float* logprob, const float* grad_logprob,
                      const float* grad_entropy, const float* thresholds, float logit_scale, void* grad_logits,
                      int64_t grad_row_stride) {
  MGRPO_CPU_CALL(logprob_backward, logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols, lse,
                 mean_x, logprob, grad_logprob, grad_entropy, thresholds, logit_scale, grad_logits, grad_row_stride);
}

void logprob_backward_from_exps(void* exps, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                const int64_t* targets, int64_t vocab_start, int64_t valid_cols,
                                const float* prob_scale, const float* target_prob, const float* grad_logprob,
                                float logit_scale) {
  MGRPO_CPU_CALL(logprob_backward_from_exps, exps, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols,
                 prob_scale, target_prob, grad_logprob, logit_scale);
}

}  // namespace cpu
}  // namespace megatron_grpo
