// CPU kernels of the vocab-parallel logprob op: OpenMP over rows (at::parallel_for), at::vec inside a row.
//
// Forward is one pass over each row. The row is read in L1-sized tiles: the tile max updates the running max
// once, then the tile (now in L1) is exponentiated, so each element costs one exp instead of the two of a
// per-element online softmax. Per-lane partials merge with the shared `merge` at the end of the row.
// Backward recomputes p = exp(x - lse), reads each element once and writes it once, in place if asked.
#include "logprob_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <type_traits>

#include "logprob_common.h"

namespace megatron_grpo {
namespace cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();  // elements per step: two float vectors, or one reduced-precision one
constexpr int64_t kTile = 16 * kStep;       // elements per running-max update (1-2 KiB, stays in L1)
constexpr int64_t kMinElementsPerTask = 1 << 15;

template <typename T>
inline void load_step(const T* p, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = Vec::loadu(p);
    hi = Vec::loadu(p + Vec::size());
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

template <typename T>
inline void store_step(T* p, const Vec& lo, const Vec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(p);
    hi.store(p + Vec::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(p);
  }
}

// Adds exp(z) to d and exp(z) * z to s, for z = x - shift; a -inf logit (exp = 0) adds 0 to s, not NaN.
inline void accumulate_step(const Vec& x, const Vec& shift, bool with_entropy, Vec& d, Vec& s) {
  const Vec z = x - shift;
  const Vec e = z.exp();
  d = d + e;
  if (with_entropy) {
    const Vec zero(0.0f);
    s = s + Vec::blendv(e * z, zero, e == zero);
  }
}

// Sets the logits below the row's threshold to -inf (a NaN compares false and stays NaN, as kept_logit).
template <bool kFiltered>
inline void filter_step(Vec& lo, Vec& hi, const Vec& threshold, const Vec& neg_inf_vec) {
  if constexpr (kFiltered) {
    lo = Vec::blendv(lo, neg_inf_vec, lo < threshold);
    hi = Vec::blendv(hi, neg_inf_vec, hi < threshold);
  }
}

// Online-softmax partials of one row's valid columns (see SoftmaxPartials: the moment is relative to the max).
// kFiltered: only the logits >= threshold take part (top-k/top-p); the others count as -inf.
template <typename T, bool kFiltered>
SoftmaxPartials row_partials(const T* x, int64_t n, bool with_entropy, float threshold) {
  const Vec neg_inf_vec(neg_inf());
  const Vec zero(0.0f);
  const Vec threshold_vec(threshold);
  Vec m = neg_inf_vec, d = zero, s = zero;
  int64_t i = 0;
  for (; i + kTile <= n; i += kTile) {
    Vec tile_max = neg_inf_vec;
    for (int64_t j = 0; j < kTile; j += kStep) {
      Vec lo, hi;
      load_step(x + i + j, lo, hi);
      filter_step<kFiltered>(lo, hi, threshold_vec, neg_inf_vec);
      tile_max = at::vec::maximum(tile_max, at::vec::maximum(lo, hi));  // NaN-propagating
    }
    // Lane-wise rescale_to(new_m), as in logprob_common.h.
    const Vec new_m = at::vec::maximum(m, tile_max);
    const Vec shift = Vec::blendv(new_m, zero, new_m == neg_inf_vec);
    const Vec r = (m - shift).exp();
    const Vec moved = Vec::blendv((m - shift) * d, zero, d == zero);
    s = (s + moved) * r;
    d = d * r;
    m = new_m;
    // Summing the tile apart before adding it keeps the fp32 rounding error of long rows small.
    Vec tile_d = zero, tile_s = zero;
    for (int64_t j = 0; j < kTile; j += kStep) {
      Vec lo, hi;
      load_step(x + i + j, lo, hi);
      filter_step<kFiltered>(lo, hi, threshold_vec, neg_inf_vec);
      accumulate_step(lo, shift, with_entropy, tile_d, tile_s);
      accumulate_step(hi, shift, with_entropy, tile_d, tile_s);
    }
    d = d + tile_d;
    s = s + tile_s;
  }
  float lane_m[Vec::size()], lane_d[Vec::size()], lane_s[Vec::size()];
  m.store(lane_m);
  d.store(lane_d);
  s.store(lane_s);
  // The lane maxima are NaN-propagating, so they flag a NaN or +inf anywhere in the tiles.
  bool poisoned = false;
  SoftmaxPartials row = empty_partials();
  for (int64_t lane = 0; lane < Vec::size(); ++lane) {
    poisoned |= poisons_row(lane_m[lane]);
    row = merge(row, {lane_m[lane], lane_d[lane], lane_s[lane]});
  }
  for (; i < n; ++i) {
    const float xi = kFiltered ? filtered_logit(static_cast<float>(x[i]), threshold) : static_cast<float>(x[i]);
    poisoned |= poisons_row(xi);
    row = accumulate(row, xi);
  }
  if (!with_entropy) row.sum_exp_x = 0.0f;
  // NaN or +inf anywhere in the row: the whole row is NaN, whatever the exp approximation did with it.
  if (poisoned) row.sum_exp = NAN;
  return row;
}

template <typename T, bool kFiltered>
void partials_kernel(const T* logits, int64_t rows, int64_t row_stride, const int64_t* targets,
                     int64_t vocab_start, int64_t valid_cols, bool with_entropy, const float* thresholds,
                     float* partials) {
  const int k = num_partials(with_entropy);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(valid_cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* out = partials + r * k;
      const T* x = logits + r * row_stride;
      const int64_t target_col = local_target_column(targets[r], vocab_start, valid_cols);
      const float threshold = kFiltered ? thresholds[r] : neg_inf();
      SoftmaxPartials row;
      if (targets[r] < 0) {
        row = {0.0f, 1.0f, 0.0f};  // ignored row: finite placeholders, masked out after the combine
      } else {
        row = row_partials<T, kFiltered>(x, valid_cols, with_entropy, threshold);
      }
      out[kColMax] = row.max;
      out[kColSumExp] = row.sum_exp;
      out[kColTarget] = target_col >= 0 ? filtered_logit(static_cast<float>(x[target_col]), threshold) : neg_inf();
      if (with_entropy) out[kColSumExpX] = row.sum_exp_x;
    }
  });
}

// kFiltered: logits below `threshold` (the target included) get exactly 0; the caller passes target_col = -1
// for a filtered target.
template <typename T, bool kFiltered>
void row_backward(const T* x, T* grad, int64_t cols, int64_t valid_cols, int64_t target_col, float lse,
                  float mean_x, float g_lp, float g_h, bool with_entropy, float threshold) {
  // Read before any write: grad may alias x.
  const float x_target = target_col >= 0 ? static_cast<float>(x[target_col]) : 0.0f;
  const Vec vlse(lse), vmean(mean_x), vg_lp(g_lp), vg_h(g_h), zero(0.0f), vthreshold(threshold);
  int64_t i = 0;
  for (; i + kStep <= valid_cols; i += kStep) {
    Vec lo, hi;
    load_step(x + i, lo, hi);
    Vec out[2] = {lo, hi};
    for (Vec& v : out) {
      const Vec p = (v - vlse).exp();
      Vec dx = zero - vg_lp * p;
      if (with_entropy) dx = dx + Vec::blendv(vg_h * p * (vmean - v), zero, p == zero);
      if constexpr (kFiltered) dx = Vec::blendv(dx, zero, v < vthreshold);
      v = dx;
    }
    store_step(grad + i, out[0], out[1]);
  }
  for (; i < valid_cols; ++i) {
    const float xi = static_cast<float>(x[i]);
    grad[i] = kFiltered && !kept_logit(xi, threshold)
                  ? static_cast<T>(0.0f)
                  : static_cast<T>(logit_grad(xi, false, lse, mean_x, g_lp, g_h));
  }
  std::fill(grad + valid_cols, grad + cols, static_cast<T>(0.0f));
  if (target_col >= 0) {
    grad[target_col] = static_cast<T>(logit_grad(x_target, true, lse, mean_x, g_lp, g_h));
  }
}

template <typename T, bool kFiltered>
void backward_kernel(const T* logits, int64_t rows, int64_t cols, int64_t row_stride, const int64_t* targets,
                     int64_t vocab_start, int64_t valid_cols, const float* lse, const float* mean_x,
                     const float* grad_logprob, const float* grad_entropy, const float* thresholds,
                     T* grad_logits, int64_t grad_row_stride) {
  const bool with_entropy = grad_entropy != nullptr;
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* grad = grad_logits + r * grad_row_stride;
      if (targets[r] < 0) {
        std::fill(grad, grad + cols, static_cast<T>(0.0f));
        continue;
      }
      const T* x = logits + r * row_stride;
      const float threshold = kFiltered ? thresholds[r] : neg_inf();
      int64_t target_col = local_target_column(targets[r], vocab_start, valid_cols);
      if (kFiltered && target_col >= 0 && !kept_logit(static_cast<float>(x[target_col]), threshold)) {
        target_col = -1;  // a filtered target has logprob -inf and no gradient
      }
      row_backward<T, kFiltered>(x, grad, cols, valid_cols, target_col, lse[r], with_entropy ? mean_x[r] : 0.0f,
                                 grad_logprob[r], with_entropy ? grad_entropy[r] : 0.0f, with_entropy, threshold);
    }
  });
}

template <typename F>
void dispatch_dtype(LogitsDType dtype, F&& f) {
  switch (dtype) {
    case LogitsDType::kFloat32: f(float{}); break;
    case LogitsDType::kBFloat16: f(c10::BFloat16{}); break;
    case LogitsDType::kFloat16: f(c10::Half{}); break;
  }
}

}  // namespace

void logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                      const float* thresholds, float* partials) {
  (void)cols;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* typed = static_cast<const T*>(logits);
    if (thresholds != nullptr) {
      partials_kernel<T, true>(typed, rows, row_stride, targets, vocab_start, valid_cols, with_entropy, thresholds,
                               partials);
    } else {
      partials_kernel<T, false>(typed, rows, row_stride, targets, vocab_start, valid_cols, with_entropy, nullptr,
                                partials);
    }
  });
}

void logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, const float* lse,
                      const float* mean_x, const float* grad_logprob, const float* grad_entropy,
                      const float* thresholds, void* grad_logits, int64_t grad_row_stride) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* typed = static_cast<const T*>(logits);
    auto* grad = static_cast<T*>(grad_logits);
    if (thresholds != nullptr) {
      backward_kernel<T, true>(typed, rows, cols, row_stride, targets, vocab_start, valid_cols, lse, mean_x,
                               grad_logprob, grad_entropy, thresholds, grad, grad_row_stride);
    } else {
      backward_kernel<T, false>(typed, rows, cols, row_stride, targets, vocab_start, valid_cols, lse, mean_x,
                                grad_logprob, grad_entropy, nullptr, grad, grad_row_stride);
    }
  });
}

}  // namespace cpu
}  // namespace megatron_grpo
