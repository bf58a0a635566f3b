// Run-time choice between the per-instruction-set builds of the CPU kernels (logprob_cpu_kernels.cpp).
//
// By default the kernels follow the rule of torch's own CPU capability: the best the CPU supports (cpuid),
// capped by the ATEN_CPU_CAPABILITY environment variable as torch reads it, so `ATEN_CPU_CAPABILITY=avx2` runs
// the AVX2 kernels on an AVX-512 machine. (torch's at::native::get_cpu_capability is not exported to
// extensions; megatron_grpo.ops.backends also aligns the choice with torch.backends.cpu.get_cpu_capability().)
// `set_kernel_isa` overrides it at run time (tests compare the builds in one process with it).
#include "logprob_cpu.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

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

namespace {

enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_supports(Isa isa) {
#if defined(MEGATRON_GRPO_CPU_ISA_DISPATCH)
  switch (isa) {
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case Isa::kPortable: return false;
  }
  return false;
#else
  return isa == Isa::kPortable;
#endif
}

// torch's rule: AVX-512 where the CPU has it, unless ATEN_CPU_CAPABILITY asks for less ("avx2", "default");
// AVX2 otherwise (CPUs without AVX2 are refused by the Python side before any kernel runs).
Isa torch_isa() {
#if defined(MEGATRON_GRPO_CPU_ISA_DISPATCH)
  const char* requested = std::getenv("ATEN_CPU_CAPABILITY");
  const bool capped = requested != nullptr && (std::strcmp(requested, "avx2") == 0 ||
                                               std::strcmp(requested, "default") == 0);
  return !capped && cpu_supports(Isa::kAvx512) ? Isa::kAvx512 : Isa::kAvx2;
#else
  return Isa::kPortable;
#endif
}

std::atomic<int> forced_isa{-1};

Isa active_isa() {
  static const Isa automatic = torch_isa();
  const int forced = forced_isa.load(std::memory_order_relaxed);
  return forced < 0 ? automatic : static_cast<Isa>(forced);
}

// Calls `fn` with the entry points of the active build: MGRPO_CALL(name)(args...).
#if defined(MEGATRON_GRPO_CPU_ISA_DISPATCH)
#define MGRPO_CALL(name, ...) \
  (active_isa() == Isa::kAvx512 ? AVX512::name(__VA_ARGS__) : AVX2::name(__VA_ARGS__))
#else
#define MGRPO_CALL(name, ...) DEFAULT::name(__VA_ARGS__)
#endif

}  // namespace

const char* kernel_isa() {
  switch (active_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kPortable: return "portable";
  }
  return "portable";
}

bool set_kernel_isa(const char* isa) {
  if (std::strcmp(isa, "auto") == 0) {
    forced_isa.store(-1);
    return true;
  }
  Isa wanted;
  if (std::strcmp(isa, "avx512") == 0) {
    wanted = Isa::kAvx512;
  } else if (std::strcmp(isa, "avx2") == 0) {
    wanted = Isa::kAvx2;
  } else if (std::strcmp(isa, "portable") == 0) {
    wanted = Isa::kPortable;
  } else {
    return false;
  }
  if (!cpu_supports(wanted)) return false;
  forced_isa.store(static_cast<int>(wanted));
  return true;
}

void logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                      const float* thresholds, float logit_scale, float* partials) {
  MGRPO_CALL(logprob_partials, logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols,
             with_entropy, thresholds, logit_scale, partials);
}

void logprob_forward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                     const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                     const float* thresholds, float logit_scale, float* logprob, float* entropy, float* lse,
                     float* mean_x) {
  MGRPO_CALL(logprob_forward, logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols, with_entropy,
             thresholds, logit_scale, logprob, entropy, lse, mean_x);
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
  MGRPO_CALL(logprob_partials_writing_exps, logits, dtype, rows, cols, row_stride, targets, vocab_start,
             valid_cols, with_entropy, thresholds, logit_scale, partials);
}

void logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, const float* lse,
                      const float* mean_x, const float* logprob, const float* grad_logprob,
                      const float* grad_entropy, const float* thresholds, float logit_scale, void* grad_logits,
                      int64_t grad_row_stride) {
  MGRPO_CALL(logprob_backward, logits, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols, lse,
             mean_x, logprob, grad_logprob, grad_entropy, thresholds, logit_scale, grad_logits, grad_row_stride);
}

void logprob_backward_from_exps(void* exps, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                const int64_t* targets, int64_t vocab_start, int64_t valid_cols,
                                const float* prob_scale, const float* target_prob, const float* grad_logprob,
                                float logit_scale) {
  MGRPO_CALL(logprob_backward_from_exps, exps, dtype, rows, cols, row_stride, targets, vocab_start, valid_cols,
             prob_scale, target_prob, grad_logprob, logit_scale);
}

}  // namespace cpu
}  // namespace megatron_grpo
