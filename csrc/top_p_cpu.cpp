// Run-time dispatch of the CPU top-p kernels to the active instruction-set build (cpu_isa.h).
#include "top_p_cpu.h"

#include "cpu_isa.h"

namespace megatron_grpo {
namespace top_p {
namespace cpu {

#if defined(MEGATRON_GRPO_CPU_ISA_DISPATCH)
namespace AVX2 {
MEGATRON_GRPO_TOP_P_CPU_KERNEL_DECLARATIONS
}
namespace AVX512 {
MEGATRON_GRPO_TOP_P_CPU_KERNEL_DECLARATIONS
}
#else
namespace DEFAULT {
MEGATRON_GRPO_TOP_P_CPU_KERNEL_DECLARATIONS
}
#endif

void value_histogram(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                     float scale, const float* shift, const float* floor, double* hist) {
  MGRPO_CPU_CALL(value_histogram, logits, dtype, rows, cols, row_stride, scale, shift, floor, hist);
}

void candidates(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride, float scale,
                const float* shift, const float* floor, const int64_t* boundary, int64_t capacity, int32_t* keys,
                int64_t* counts) {
  MGRPO_CPU_CALL(candidates, logits, dtype, rows, cols, row_stride, scale, shift, floor, boundary, capacity, keys,
                 counts);
}

void bucket_masses(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                   float scale, const float* shift, const float* floor, const int64_t* boundary, int64_t capacity,
                   const int32_t* keys, const int64_t* counts, const int64_t* prefix, int low_bit, double* out) {
  MGRPO_CPU_CALL(bucket_masses, logits, dtype, rows, cols, row_stride, scale, shift, floor, boundary, capacity, keys,
                 counts, prefix, low_bit, out);
}

void threshold(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride, float scale,
               const float* floor, double top_p, int64_t capacity, int zero_bits, float* out) {
  MGRPO_CPU_CALL(threshold, logits, dtype, rows, cols, row_stride, scale, floor, top_p, capacity, zero_bits, out);
}

}  // namespace cpu
}  // namespace top_p
}  // namespace megatron_grpo
