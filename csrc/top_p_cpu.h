// CPU kernels of the top-p threshold search (top_p.h has the maths, megatron_grpo/ops/core/filtering.py the
// algorithm), on raw pointers. Each reads `rows` rows of `cols` logits (row i at logits + i * row_stride, the
// shard's valid columns only) as z = logit_scale * x; `shift` (fp32 [rows]) is the row max over every rank, finite
// or 0; `floor` (fp32 [rows], or null) the top-k threshold below which nothing is kept.
//
// top_p_cpu_kernels.cpp is compiled once per instruction set, like the logprob kernels (cpu_isa.h); top_p_cpu.cpp
// calls the active build.
#pragma once

#include <cstdint>

#include "logprob_common.h"

// The kernel entry points; declared once per instruction-set namespace.
#define MEGATRON_GRPO_TOP_P_CPU_KERNEL_DECLARATIONS                                                              \
  void value_histogram(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,   \
                       float scale, const float* shift, const float* floor, double* hist);                      \
  void candidates(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,        \
                  float scale, const float* shift, const float* floor, const int64_t* boundary, int64_t capacity, \
                  int32_t* keys, int64_t* counts);                                                               \
  void bucket_masses(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,     \
                     float scale, const float* shift, const float* floor, const int64_t* boundary,              \
                     int64_t capacity, const int32_t* keys, const int64_t* counts, const int64_t* prefix,       \
                     int low_bit, double* out);                                                                  \
  void threshold(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,         \
                 float scale, const float* floor, double top_p, int64_t capacity, int zero_bits, float* out);

namespace megatron_grpo {
namespace top_p {
namespace cpu {

// value_histogram: hist (float64 [rows, kValueBins], overwritten): each kept logit's mass in its value bin.
// candidates: the kept logits of each row's `boundary` bin: their count (int64 [rows]) and the ordered keys (int32
//   [rows, capacity], the uint32 bits) of the first `capacity` of them.
// bucket_masses: one radix pass: out (float64 [rows, kBucketSlots], overwritten) the candidates' masses
//   (mass_of_key) by bucket_slot(key, low_bit, prefix[row]). A row with more candidates than `capacity` reads them
//   again from the logits.
// threshold: the whole search on one rank (no TP group), each row on its own with per-thread temporaries only:
//   the row max, the value histogram, choose_boundary, the candidates (at most `capacity` keys), the radix passes
//   down to bit `zero_bits` (rounded down to a pass; the bits below are 0 in every key) with choose_bucket, then the
//   threshold: -inf where the row max is not finite, at least `floor` (NaN propagates). out: fp32 [rows].
MEGATRON_GRPO_TOP_P_CPU_KERNEL_DECLARATIONS

}  // namespace cpu
}  // namespace top_p
}  // namespace megatron_grpo
