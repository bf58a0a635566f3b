// CPU kernels of the vocab-parallel logprob op: OpenMP over rows (at::parallel_for), at::vec inside a row.
//
// Compiled once per instruction set (setup.py), with CPU_CAPABILITY naming both at::vec's implementation and
// this file's namespace, so the builds never share a symbol; logprob_cpu.cpp picks one at run time.
//
// Forward is one pass over each row. The row is read in L1-sized tiles: the tile max updates the running max
// once, then the tile (now in L1) is exponentiated, so each element costs one exp instead of the two of a
// per-element online softmax. A row's last tile may be short and its last vector step partial (the missing lanes
// are -inf), so a row of any length stays on the vector path; the lanes merge at the end of the row with one vector
// exponential. With one rank (`logprob_forward`) the kernel ends each row with the combine (`combine_partials`) and
// writes the op's outputs itself; with several it writes the partials for the all-gather.
// Backward recomputes p = exp(z - lse), reads each element once and writes it once, in place if asked.
//
// logit_scale: the kernels see z = scale * x. kScaled specialises on scale != 1, so that scale 1 costs nothing.
//
// Exponentials of the per-element work use `exp_nonpositive` (3 ulps, at most 15 vector operations; Sleef's 1-ulp
// exp takes up to a third more time per element, at::vec's exp_u20 errs by 20 ulps and maps NaN to a number). A NaN
// or +inf logit makes its row NaN: its exponential is NaN, and the forward also flags the row (`poisoned`). Rescaling
// the running sums keeps the exact exp.
//
// The in-place exp mode (logprob_partials_writing_exps / logprob_backward_from_exps): forward takes the row max
// first, then writes e = exp(z - m) over the logits while it sums them; backward then needs no exponential.
// A portable (non-x86) build is ATen's DEFAULT capability; setup.py names the x86 ones.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>

#include "cpu_dtypes.h"
#include "logprob_common.h"
#include "logprob_cpu.h"

namespace megatron_grpo {
namespace cpu {
namespace CPU_CAPABILITY {
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

// One step of z = scale * x (a plain load without kScaled).
template <typename T, bool kScaled>
inline void load_scaled_step(const T* p, Vec& lo, Vec& hi, const Vec& scale) {
  load_step(p, lo, hi);
  if constexpr (kScaled) {
    lo = lo * scale;
    hi = hi * scale;
  }
}

// One logit as the kernels see it: z = scale * x.
template <bool kScaled, typename T>
inline float scaled(T x, float scale) {
  return kScaled ? static_cast<float>(x) * scale : static_cast<float>(x);
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

// The most negative finite float: a -inf logit's (x - shift) clamped to it makes exp(z) * z exactly 0, not NaN.
inline Vec lowest_vec() { return Vec(std::numeric_limits<float>::lowest()); }

// e^z for z <= 0 (a logit less its row's max or log-sum-exp), within 3 ulps (tests/ops/test_cpu_kernels.py):
// z = n ln 2 + r with n = round(z log2 e) and r by two-constant Cody-Waite (n * kLn2Hi is exact), e^r by a degree-5
// minimax polynomial on [-ln2/2, ln2/2] (relative error 9.1e-8), times 2^n: 11 vector operations with AVX-512's
// scalef, 15 elsewhere, against 19 for at::vec's exp_u20 (20 ulps). -inf gives exactly 0 and NaN gives NaN. Below
// e^-86 (4e-38, under the rounding of any sum it joins) AVX-512 rounds to a subnormal and the other builds give 0:
// they build 2^n in the exponent bits, which must stay normal.
constexpr float kExpCoefficients[6] = {1.0f, 0.999999702f, 0.499991506f, 0.166676357f, 0.0418979302f,
                                       0.00829031412f};  // e^0 is exactly 1
constexpr float kLog2e = 1.44269504f;
constexpr float kLn2Hi = 0.693145752f;     // ln 2 to 16 bits: n * kLn2Hi is exact for |n| < 2^8
constexpr float kLn2Lo = 1.42860677e-06f;  // ln 2 - kLn2Hi
#if defined(CPU_CAPABILITY_AVX512)
constexpr float kExpFloor = -110.0f;  // e^-110 rounds to 0; keeps -inf - n ln 2 from being NaN
#else
constexpr float kExpFloor = -86.0f;  // 2^n stays a normal float
#endif

inline Vec exp_nonpositive(const Vec& z) {
  const Vec floor(kExpFloor);
  const Vec zc = at::vec::clamp_min(z, floor);  // NaN stays NaN
  const Vec n = (zc * Vec(kLog2e)).round();
  const Vec r = at::vec::fnmadd(n, Vec(kLn2Lo), at::vec::fnmadd(n, Vec(kLn2Hi), zc));
  Vec p(kExpCoefficients[5]);
  for (int k = 4; k >= 0; --k) p = at::vec::fmadd(p, r, Vec(kExpCoefficients[k]));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(p, n);
#else
  // n's integer in the exponent field (NaN's integer, 0x80000000, shifts to 0 and leaves p NaN).
  using IntVec = at::vec::Vectorized<int32_t>;
  const IntVec exponent = at::vec::convert_to_int_of_same_size(n) << IntVec(23);
  return Vec::blendv(at::vec::cast<float>(at::vec::cast<int32_t>(p) + exponent), Vec(0.0f), z < floor);
#endif
}

// max(a, b) for running maxima, in one instruction: it may drop a NaN, which the exponentials carry instead (a NaN
// logit's exponential is NaN, and so is its row's sum).
inline Vec running_max(const Vec& a, const Vec& b) { return at::vec::clamp_min(a, b); }

// Adds exp(z) to d and exp(z) * z to s, for z = x - shift; a -inf logit (exp = 0) adds 0 to s, not NaN.
// Returns exp(z).
template <bool kEntropy>
inline Vec accumulate_step(const Vec& x, const Vec& shift, Vec& d, Vec& s) {
  const Vec z = x - shift;
  const Vec e = exp_nonpositive(z);
  d = d + e;
  if constexpr (kEntropy) s = at::vec::fmadd(e, at::vec::clamp_min(z, lowest_vec()), s);
  return e;
}

// Sets the logits below the row's threshold to -inf (a NaN compares false and stays NaN, as kept_logit).
template <bool kFiltered>
inline void filter_step(Vec& lo, Vec& hi, const Vec& threshold, const Vec& neg_inf_vec) {
  if constexpr (kFiltered) {
    lo = Vec::blendv(lo, neg_inf_vec, lo < threshold);
    hi = Vec::blendv(hi, neg_inf_vec, hi < threshold);
  }
}

// One step of the row as the (filtered, scaled) distribution sees it.
template <typename T, bool kFiltered, bool kScaled>
inline void visible_step(const T* p, Vec& lo, Vec& hi, const Vec& scale, const Vec& threshold, const Vec& neg_inf_vec) {
  load_scaled_step<T, kScaled>(p, lo, hi, scale);
  filter_step<kFiltered>(lo, hi, threshold, neg_inf_vec);
}

template <bool kFiltered, bool kScaled, typename T>
inline float visible_logit(T x, float scale, float threshold) {
  const float z = scaled<kScaled>(x, scale);
  return kFiltered ? filtered_logit(z, threshold) : z;
}

// The last `count` (< kStep) elements of a row as one vector step, as the distribution sees them; the missing
// lanes are -inf, which add nothing.
template <typename T, bool kFiltered, bool kScaled>
inline void partial_step(const T* p, int64_t count, Vec& lo, Vec& hi, float scale, float threshold) {
  alignas(64) float lanes[kStep];
  for (int64_t j = 0; j < kStep; ++j) {
    lanes[j] = j < count ? visible_logit<kFiltered, kScaled>(p[j], scale, threshold) : neg_inf();
  }
  lo = Vec::loadu(lanes);
  hi = Vec::loadu(lanes + Vec::size());
}

// Per-lane online-softmax state: the lanes' max m, and d, s relative to it.
struct LaneState {
  Vec m = Vec(neg_inf());
  Vec d = Vec(0.0f);
  Vec s = Vec(0.0f);
};

// Adds `steps` vector steps (`load(j, lo, hi)` loads step j) to the lanes: their max first, which moves the lanes'
// state once, then their exponentials, summed apart before they are added (keeps the fp32 error of long rows small).
// The low and high halves of a step go to accumulators of their own: two dependency chains instead of one.
template <bool kEntropy, typename Load>
inline void accumulate_block(LaneState& lanes, int64_t steps, Load&& load) {
  const Vec neg_inf_vec(neg_inf());
  const Vec zero(0.0f);
  Vec max_lo = neg_inf_vec, max_hi = neg_inf_vec;
  for (int64_t j = 0; j < steps; ++j) {
    Vec lo, hi;
    load(j, lo, hi);
    max_lo = running_max(lo, max_lo);
    max_hi = running_max(hi, max_hi);
  }
  const Vec block_max = at::vec::maximum(max_lo, max_hi);
  // Lane-wise rescale_to(new_m), as in logprob_common.h.
  const Vec new_m = at::vec::maximum(lanes.m, block_max);
  const Vec shift = Vec::blendv(new_m, zero, new_m == neg_inf_vec);
  const Vec r = (lanes.m - shift).exp();
  const Vec moved = Vec::blendv((lanes.m - shift) * lanes.d, zero, lanes.d == zero);
  lanes.s = (lanes.s + moved) * r;
  lanes.d = lanes.d * r;
  lanes.m = new_m;
  Vec d_lo = zero, s_lo = zero, d_hi = zero, s_hi = zero;
  for (int64_t j = 0; j < steps; ++j) {
    Vec lo, hi;
    load(j, lo, hi);
    accumulate_step<kEntropy>(lo, shift, d_lo, s_lo);
    accumulate_step<kEntropy>(hi, shift, d_hi, s_hi);
  }
  lanes.d = lanes.d + (d_lo + d_hi);
  lanes.s = lanes.s + (s_lo + s_hi);
}

// The row's partials from its lanes: one vector exponential moves every lane to the row max. A lane max that is NaN
// or +inf flags the row (its sum is then NaN); a NaN that the running maxima dropped made its lane's sum NaN.
inline SoftmaxPartials merge_lanes(const LaneState& lanes, bool with_entropy) {
  alignas(64) float lane_m[Vec::size()];
  lanes.m.store(lane_m);
  bool poisoned = false;
  float row_max = neg_inf();
  for (int64_t lane = 0; lane < Vec::size(); ++lane) {
    poisoned |= poisons_row(lane_m[lane]);
    row_max = max_propagating_nan(row_max, lane_m[lane]);
  }
  const Vec zero(0.0f);
  const Vec shift(safe_shift(row_max));
  const Vec r = (lanes.m - shift).exp();  // 0 for an empty lane (m = -inf)
  SoftmaxPartials row{row_max, at::vec::vec_reduce_all<float>(std::plus<Vec>(), lanes.d * r), 0.0f};
  if (with_entropy) {
    const Vec moved = Vec::blendv((lanes.m - shift) * lanes.d, zero, lanes.d == zero);
    row.sum_exp_x = at::vec::vec_reduce_all<float>(std::plus<Vec>(), (lanes.s + moved) * r);
  }
  if (poisoned) row.sum_exp = NAN;
  return row;
}

// Online-softmax partials of one row's valid columns (see SoftmaxPartials: the moment is relative to the max).
// kFiltered: only the logits >= threshold take part (top-k/top-p); the others count as -inf.
template <typename T, bool kFiltered, bool kScaled, bool kEntropy>
SoftmaxPartials row_partials(const T* x, int64_t n, float threshold, float scale) {
  const Vec neg_inf_vec(neg_inf());
  const Vec threshold_vec(threshold);
  const Vec scale_vec(scale);
  LaneState lanes;
  int64_t i = 0;
  for (; i + kTile <= n; i += kTile) {
    accumulate_block<kEntropy>(lanes, kTile / kStep, [&](int64_t j, Vec& lo, Vec& hi) {
      visible_step<T, kFiltered, kScaled>(x + i + j * kStep, lo, hi, scale_vec, threshold_vec, neg_inf_vec);
    });
  }
  // The row's last, shorter tile, whose last step may be partial.
  const int64_t full_steps = (n - i) / kStep;
  const int64_t rest = n - i - full_steps * kStep;
  if (full_steps > 0 || rest > 0) {
    accumulate_block<kEntropy>(lanes, full_steps + (rest > 0), [&](int64_t j, Vec& lo, Vec& hi) {
      if (j < full_steps) {
        visible_step<T, kFiltered, kScaled>(x + i + j * kStep, lo, hi, scale_vec, threshold_vec, neg_inf_vec);
      } else {
        partial_step<T, kFiltered, kScaled>(x + i + j * kStep, rest, lo, hi, scale, threshold);
      }
    });
  }
  return merge_lanes(lanes, kEntropy);
}

// The in-place exp mode's forward of one row: the row max first, then e = exp(z - m) is written over the
// logits while it is summed. Two reads of the row (the second from cache for rows of a few hundred KiB).
template <typename T, bool kFiltered, bool kScaled>
SoftmaxPartials row_partials_writing_exps(T* x, int64_t n, bool with_entropy, float threshold, float scale) {
  const Vec neg_inf_vec(neg_inf());
  const Vec zero(0.0f);
  const Vec threshold_vec(threshold);
  const Vec scale_vec(scale);
  Vec m = neg_inf_vec;
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vec lo, hi;
    visible_step<T, kFiltered, kScaled>(x + i, lo, hi, scale_vec, threshold_vec, neg_inf_vec);
    m = at::vec::maximum(m, at::vec::maximum(lo, hi));  // NaN-propagating
  }
  float lane_m[Vec::size()];
  m.store(lane_m);
  bool poisoned = false;
  float row_max = neg_inf();
  for (int64_t lane = 0; lane < Vec::size(); ++lane) {
    poisoned |= poisons_row(lane_m[lane]);
    row_max = std::max(row_max, lane_m[lane]);
  }
  for (int64_t j = i; j < n; ++j) {
    const float xj = visible_logit<kFiltered, kScaled>(x[j], scale, threshold);
    poisoned |= poisons_row(xj);
    row_max = std::max(row_max, xj);
  }
  if (poisoned) row_max = NAN;  // e and the sums come out NaN, as the row's logprob
  const float shift = safe_shift(row_max);
  const Vec shift_vec(shift);
  Vec d = zero, s = zero;
  i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vec lo, hi;
    visible_step<T, kFiltered, kScaled>(x + i, lo, hi, scale_vec, threshold_vec, neg_inf_vec);
    const Vec e_lo = with_entropy ? accumulate_step<true>(lo, shift_vec, d, s)
                                  : accumulate_step<false>(lo, shift_vec, d, s);
    const Vec e_hi = with_entropy ? accumulate_step<true>(hi, shift_vec, d, s)
                                  : accumulate_step<false>(hi, shift_vec, d, s);
    store_step(x + i, e_lo, e_hi);
  }
  SoftmaxPartials row{row_max, at::vec::vec_reduce_all<float>(std::plus<Vec>(), d),
                      with_entropy ? at::vec::vec_reduce_all<float>(std::plus<Vec>(), s) : 0.0f};
  for (; i < n; ++i) {
    const float z = visible_logit<kFiltered, kScaled>(x[i], scale, threshold) - shift;
    const float e = expf(z);
    row.sum_exp += e;
    if (with_entropy) row.sum_exp_x += weighted_logit(e, z);
    x[i] = static_cast<T>(e);
  }
  if (!with_entropy) row.sum_exp_x = 0.0f;
  if (poisoned) row.sum_exp = NAN;
  return row;
}

// Where a forward kernel puts each row: its partials (`partials` [rows, k], for the all-gather, or the exp mode), or,
// with one rank, the op's outputs straight away (`partials` null: the combine of one rank ends the row).
struct ForwardOutputs {
  float* partials;
  float* logprob;
  float* entropy;  // null without entropy, as mean_x
  float* lse;
  float* mean_x;
};

template <typename T, bool kFiltered, bool kScaled, bool kWriteExps>
void partials_kernel(T* logits, int64_t rows, int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                     int64_t valid_cols, bool with_entropy, const float* thresholds, float scale,
                     const ForwardOutputs& out) {
  const int k = num_partials(with_entropy);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(valid_cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = logits + r * row_stride;
      const bool ignored = targets[r] < 0;
      const int64_t target_col = local_target_column(targets[r], vocab_start, valid_cols);
      const float threshold = kFiltered ? thresholds[r] : neg_inf();
      // Read before the row is overwritten (exp mode).
      const float target_logit =
          target_col >= 0 ? visible_logit<kFiltered, kScaled>(x[target_col], scale, threshold) : neg_inf();
      SoftmaxPartials row;
      if (ignored) {
        row = {0.0f, 1.0f, 0.0f};  // ignored row: finite placeholders, masked out by the combine
      } else if constexpr (kWriteExps) {
        row = row_partials_writing_exps<T, kFiltered, kScaled>(x, valid_cols, with_entropy, threshold, scale);
      } else {
        row = with_entropy ? row_partials<T, kFiltered, kScaled, true>(x, valid_cols, threshold, scale)
                           : row_partials<T, kFiltered, kScaled, false>(x, valid_cols, threshold, scale);
      }
      float partials[4] = {row.max, row.sum_exp, target_logit, with_entropy ? row.sum_exp_x : 0.0f};
      if (out.partials != nullptr) {
        std::copy(partials, partials + k, out.partials + r * k);
        continue;
      }
      const RowStats stats = combine_partials(partials, 0, 1, with_entropy, ignored);
      out.logprob[r] = stats.logprob;
      out.lse[r] = stats.lse;
      if (with_entropy) {
        out.entropy[r] = stats.entropy;
        out.mean_x[r] = stats.mean_x;
      }
    }
  });
}

// kFiltered: logits below `threshold` (the target included) get exactly 0; the caller passes target_col = -1
// for a filtered target. g_lp and g_h already carry the logit scale (d/dx = scale * d/dz).
// p = exp_nonpositive(z - lse): a row with a NaN lse (a NaN or +inf logit) comes out NaN.
template <typename T, bool kFiltered, bool kScaled, bool kEntropy>
void row_backward(const T* x, T* grad, int64_t cols, int64_t valid_cols, int64_t target_col, float lse,
                  float mean_x, float g_lp, float g_h, float threshold, float scale) {
  // Read before any write: grad may alias x.
  const float z_target = target_col >= 0 ? scaled<kScaled>(x[target_col], scale) : 0.0f;
  const Vec vlse(lse), vmean(mean_x), vminus_g_lp(-g_lp), vg_h(g_h), zero(0.0f), vthreshold(threshold),
      vscale(scale);
  int64_t i = 0;
  for (; i + kStep <= valid_cols; i += kStep) {
    Vec lo, hi;
    load_scaled_step<T, kScaled>(x + i, lo, hi, vscale);
    Vec out[2] = {lo, hi};
    for (Vec& v : out) {
      const Vec p = exp_nonpositive(v - vlse);
      Vec dx = vminus_g_lp * p;
      // A -inf logit (p = 0) clamped to the lowest float adds exactly 0, not 0 * inf = NaN.
      if constexpr (kEntropy) dx = at::vec::fmadd(vg_h * p, vmean - at::vec::clamp_min(v, lowest_vec()), dx);
      if constexpr (kFiltered) dx = Vec::blendv(dx, zero, v < vthreshold);
      v = dx;
    }
    store_step(grad + i, out[0], out[1]);
  }
  for (; i < valid_cols; ++i) {
    const float zi = scaled<kScaled>(x[i], scale);
    grad[i] = kFiltered && !kept_logit(zi, threshold) ? static_cast<T>(0.0f)
                                                      : static_cast<T>(logit_grad(zi, false, lse, mean_x, g_lp, g_h));
  }
  std::fill(grad + valid_cols, grad + cols, static_cast<T>(0.0f));
  if (target_col >= 0) {
    grad[target_col] = static_cast<T>(logit_grad(z_target, true, lse, mean_x, g_lp, g_h));
  }
}

template <typename T, bool kFiltered, bool kScaled>
void backward_kernel(const T* logits, int64_t rows, int64_t cols, int64_t row_stride, const int64_t* targets,
                     int64_t vocab_start, int64_t valid_cols, const float* lse, const float* mean_x,
                     const float* logprob, const float* grad_logprob, const float* grad_entropy,
                     const float* thresholds, float scale, T* grad_logits, int64_t grad_row_stride) {
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
      if (kFiltered && target_col >= 0 && !kept_logit(scaled<kScaled>(x[target_col], scale), threshold)) {
        target_col = -1;  // a filtered target has logprob -inf and no gradient
      }
      const float g_lp = upstream_logprob_gradient(grad_logprob, logprob, r, kScaled ? scale : 1.0f);
      const float g_h = with_entropy ? (kScaled ? scale * grad_entropy[r] : grad_entropy[r]) : 0.0f;
      const float mean = with_entropy ? mean_x[r] : 0.0f;
      // kEntropy where backward differentiates the entropy.
      const auto run = [&](auto entropy) {
        row_backward<T, kFiltered, kScaled, decltype(entropy)::value>(x, grad, cols, valid_cols, target_col, lse[r],
                                                                      mean, g_lp, g_h, threshold, scale);
      };
      with_entropy ? run(std::true_type{}) : run(std::false_type{});
    }
  });
}

// dx = g * (1[v == y] - e * c) over the valid columns, 0 over the padding; e is overwritten. g carries the scale.
// The target's p is p_target (see logprob_backward_from_exps).
template <typename T>
void row_backward_from_exps(T* e, int64_t cols, int64_t valid_cols, int64_t target_col, float c, float p_target,
                            float g) {
  const Vec vc(c), vminus_g(-g);
  int64_t i = 0;
  for (; i + kStep <= valid_cols; i += kStep) {
    Vec lo, hi;
    load_step(e + i, lo, hi);
    store_step(e + i, vminus_g * (lo * vc), vminus_g * (hi * vc));
  }
  for (; i < valid_cols; ++i) e[i] = static_cast<T>(-g * (static_cast<float>(e[i]) * c));
  std::fill(e + valid_cols, e + cols, static_cast<T>(0.0f));
  if (target_col >= 0) e[target_col] = static_cast<T>(g * (1.0f - p_target));
}

template <typename T>
void backward_from_exps_kernel(T* exps, int64_t rows, int64_t cols, int64_t row_stride, const int64_t* targets,
                               int64_t vocab_start, int64_t valid_cols, const float* prob_scale,
                               const float* target_prob, const float* grad_logprob, float scale) {
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* e = exps + r * row_stride;
      if (targets[r] < 0) {
        std::fill(e, e + cols, static_cast<T>(0.0f));
        continue;
      }
      row_backward_from_exps(e, cols, valid_cols, local_target_column(targets[r], vocab_start, valid_cols),
                             prob_scale[r], target_prob[r], scale * grad_logprob[r]);
    }
  });
}

// Calls f(std::integral_constant<bool, filtered>, std::integral_constant<bool, scale != 1>).
template <typename F>
void dispatch_flags(const float* thresholds, float scale, F&& f) {
  using True = std::true_type;
  using False = std::false_type;
  const bool is_scaled = scale != 1.0f;
  if (thresholds != nullptr) {
    is_scaled ? f(True{}, True{}) : f(True{}, False{});
  } else {
    is_scaled ? f(False{}, True{}) : f(False{}, False{});
  }
}

template <bool kWriteExps>
void partials_dispatch(void* logits, LogitsDType dtype, int64_t rows, int64_t row_stride, const int64_t* targets,
                       int64_t vocab_start, int64_t valid_cols, bool with_entropy, const float* thresholds,
                       float logit_scale, const ForwardOutputs& partials) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_flags(thresholds, logit_scale, [&](auto filtered, auto is_scaled) {
      partials_kernel<T, decltype(filtered)::value, decltype(is_scaled)::value, kWriteExps>(
          static_cast<T*>(logits), rows, row_stride, targets, vocab_start, valid_cols, with_entropy, thresholds,
          logit_scale, partials);
    });
  });
}

}  // namespace

void logprob_partials(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                      const float* thresholds, float logit_scale, float* partials) {
  (void)cols;
  // The read-only kernel never writes through this pointer (kWriteExps = false).
  partials_dispatch<false>(const_cast<void*>(logits), dtype, rows, row_stride, targets, vocab_start, valid_cols,
                           with_entropy, thresholds, logit_scale, {partials, nullptr, nullptr, nullptr, nullptr});
}

void logprob_forward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                     const int64_t* targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
                     const float* thresholds, float logit_scale, float* logprob, float* entropy, float* lse,
                     float* mean_x) {
  (void)cols;
  partials_dispatch<false>(const_cast<void*>(logits), dtype, rows, row_stride, targets, vocab_start, valid_cols,
                           with_entropy, thresholds, logit_scale, {nullptr, logprob, entropy, lse, mean_x});
}

void logprob_partials_writing_exps(void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   const int64_t* targets, int64_t vocab_start, int64_t valid_cols,
                                   bool with_entropy, const float* thresholds, float logit_scale, float* partials) {
  (void)cols;
  partials_dispatch<true>(logits, dtype, rows, row_stride, targets, vocab_start, valid_cols, with_entropy,
                          thresholds, logit_scale, {partials, nullptr, nullptr, nullptr, nullptr});
}

void logprob_backward(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                      const int64_t* targets, int64_t vocab_start, int64_t valid_cols, const float* lse,
                      const float* mean_x, const float* logprob, const float* grad_logprob,
                      const float* grad_entropy, const float* thresholds, float logit_scale, void* grad_logits,
                      int64_t grad_row_stride) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_flags(thresholds, logit_scale, [&](auto filtered, auto is_scaled) {
      backward_kernel<T, decltype(filtered)::value, decltype(is_scaled)::value>(
          static_cast<const T*>(logits), rows, cols, row_stride, targets, vocab_start, valid_cols, lse, mean_x,
          logprob, grad_logprob, grad_entropy, thresholds, logit_scale, static_cast<T*>(grad_logits),
          grad_row_stride);
    });
  });
}

void logprob_backward_from_exps(void* exps, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                const int64_t* targets, int64_t vocab_start, int64_t valid_cols,
                                const float* prob_scale, const float* target_prob, const float* grad_logprob,
                                float logit_scale) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    backward_from_exps_kernel<T>(static_cast<T*>(exps), rows, cols, row_stride, targets, vocab_start, valid_cols,
                                 prob_scale, target_prob, grad_logprob, logit_scale);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace megatron_grpo
