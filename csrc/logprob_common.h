// Per-row maths of the vocab-parallel logprob kernels, shared by the CPU and CUDA implementations.
//
// A row is one token's logits over this rank's vocab shard. Only the first `valid_cols` columns take part:
// the rest is Megatron's vocab padding. Forward reduces a row to partials (max, sum of exps, optionally the
// exp-weighted sum of logits for the entropy); partials from lanes, warps, blocks and TP ranks merge with
// `merge`. Backward recomputes p = exp(x - lse) and needs no collective.
//
// Non-finite logits: -inf contributes nothing (top-k/top-p masking). NaN or +inf make the row's sum NaN, so
// that row, and only that row, comes out NaN.
//
// Filtered distributions (top-k, top-p): an optional per-row threshold keeps only the logits at or above it;
// the others count as -inf in forward and get a gradient of exactly 0 in backward. Without a threshold the
// kernels take their unfiltered path, unchanged.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MGRPO_HD __host__ __device__ __forceinline__
#else
#define MGRPO_HD inline
#endif

namespace megatron_grpo {

// Element type of the logits; the maths is fp32 whatever it is.
enum class LogitsDType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Column layout of the stacked fp32 partials tensor [rows, kNumPartials(with_entropy)].
enum PartialsColumn : int {
  kColMax = 0,        // m   = max over valid columns
  kColSumExp = 1,     // d   = sum exp(x - m)
  kColTarget = 2,     // x_y = target logit, or -inf where another rank owns the target
  kColSumExpX = 3,    // s   = sum exp(x - m) * (x - m)   (entropy only)
};

MGRPO_HD int num_partials(bool with_entropy) { return with_entropy ? 4 : 3; }

MGRPO_HD float neg_inf() { return -INFINITY; }

// Online-softmax state of a set of logits, relative to their max m:
//   sum_exp = sum exp(x - m),   sum_exp_x = sum exp(x - m) * (x - m).
// Keeping the logit moment relative to m (docs/design.md: s = sum exp(x - m) * x, shifted) avoids the
// cancellation of lse - E[x] for large logits: the entropy is log(sum_exp) - sum_exp_x / sum_exp.
struct SoftmaxPartials {
  float max;
  float sum_exp;
  float sum_exp_x;
};

MGRPO_HD SoftmaxPartials empty_partials() { return {neg_inf(), 0.0f, 0.0f}; }

// Shift used for exponentials: the max, or 0 while nothing finite has been seen (avoids -inf - -inf = NaN).
MGRPO_HD float safe_shift(float m) { return m == neg_inf() ? 0.0f : m; }

// x * e with the convention that a logit of -inf (e == 0) contributes 0, not 0 * -inf = NaN.
MGRPO_HD float weighted_logit(float e, float x) { return e == 0.0f ? 0.0f : e * x; }

// NaN and +inf logits make their row NaN (a softmax over them is undefined); -inf is an ordinary masked logit.
MGRPO_HD bool poisons_row(float x) { return x != x || x == INFINITY; }

// Re-expresses a state relative to new_max >= p.max: sum_exp *= r, sum_exp_x = r * (sum_exp_x + (m - m') sum_exp).
// A NaN or +inf max makes r NaN, which then poisons the sums.
MGRPO_HD SoftmaxPartials rescale_to(const SoftmaxPartials& p, float new_max) {
  const float r = expf(p.max - safe_shift(new_max));
  // Nothing left to move (an empty state, or one that underflows); multiplying keeps a NaN sum NaN.
  if (r == 0.0f) return {new_max, p.sum_exp * r, p.sum_exp_x * r};
  return {new_max, p.sum_exp * r, (p.sum_exp_x + (p.max - new_max) * p.sum_exp) * r};
}

// Merges two partial states (lanes, threads, blocks, TP ranks).
MGRPO_HD SoftmaxPartials merge(const SoftmaxPartials& a, const SoftmaxPartials& b) {
  const float m = a.max > b.max ? a.max : b.max;
  const SoftmaxPartials ra = rescale_to(a, m);
  const SoftmaxPartials rb = rescale_to(b, m);
  return {m, ra.sum_exp + rb.sum_exp, ra.sum_exp_x + rb.sum_exp_x};
}

// Adds one logit: the state of a single logit x is {x, 1, 0}.
MGRPO_HD SoftmaxPartials accumulate(const SoftmaxPartials& p, float x) { return merge(p, {x, 1.0f, 0.0f}); }

// Gradient of one logit from its probability p = exp(x - lse), for kernels that pick their own exponential:
//   dx = g_lp * (1[v == y] - p) + g_h * p * (E[x] - x).
// The entropy term is skipped where it is 0 anyway: for -inf logits (p == 0, where p * x would be NaN) and
// without entropy (g_h == 0, so a kernel specialised on g_h = 0 drops it at compile time).
MGRPO_HD float prob_grad(float p, float x, bool is_target, float mean_x, float g_lp, float g_h) {
  const float entropy_term = (p == 0.0f || g_h == 0.0f) ? 0.0f : g_h * p * (mean_x - x);
  return g_lp * ((is_target ? 1.0f : 0.0f) - p) + entropy_term;
}

// Gradient of one logit (see prob_grad), p = exp(x - lse).
// Callers pass g_lp = g_h = 0 for ignored rows and never call this for padding columns.
MGRPO_HD float logit_grad(float x, bool is_target, float lse, float mean_x, float g_lp, float g_h) {
  return prob_grad(expf(x - lse), x, is_target, mean_x, g_lp, g_h);
}

// The logprob's upstream gradient of row `row` times `scale` (d/dx = scale * d/dz): 0 where nothing differentiated
// the logprob (`grad_logprob` null), and 0 where the row's `logprob` is -inf, a target that the top-k/top-p filter
// drops: its logprob is a constant (`logprob` null: no filter, nothing to drop).
MGRPO_HD float upstream_logprob_gradient(const float* grad_logprob, const float* logprob, int64_t row, float scale) {
  if (grad_logprob == nullptr || (logprob != nullptr && logprob[row] == neg_inf())) return 0.0f;
  return scale * grad_logprob[row];
}

// Whether a logit survives the row's top-k/top-p threshold. NaN survives, so that it still poisons its row.
MGRPO_HD bool kept_logit(float x, float threshold) { return !(x < threshold); }

// A logit as the filtered distribution sees it: itself when kept, else -inf.
MGRPO_HD float filtered_logit(float x, float threshold) { return kept_logit(x, threshold) ? x : neg_inf(); }

// What the op returns per row (and what its backward needs back): the logprob of the target, the entropy, the
// log-sum-exp and E[x] (the last two in units of z, as the partials).
struct RowStats {
  float logprob;
  float entropy;
  float lse;
  float mean_x;
};

// max(a, b) that is NaN when either is (as torch's amax), so that a poisoned rank poisons the row.
MGRPO_HD float max_propagating_nan(float a, float b) { return (a != a || a > b) ? a : b; }

// The combine: one row's statistics from the partials of `world` ranks, rank r's at partials + r * rank_stride
// (columns as PartialsColumn). `ignored` rows (target < 0) get a logprob and an entropy of exactly 0. With M the
// largest max (0 while every rank's is -inf):
//   D = sum_r d_r exp(m_r - M),  lse = M + log D,  logprob = max_r x_y,r - lse,
//   S = sum_r exp(m_r - M) (s_r + (m_r - M) d_r),  E[x] = M + S / D,  entropy = log D - S / D.
// One rank (TP 1) is the kernels' own epilogue: exp(m - M) = 1. The same rule as the plain-torch combine
// (megatron_grpo/ops/core/partials.py), operation for operation.
MGRPO_HD RowStats combine_partials(const float* partials, int64_t rank_stride, int world, bool with_entropy,
                                   bool ignored) {
  float global_max = partials[kColMax];
  float target = partials[kColTarget];
  for (int r = 1; r < world; ++r) {
    global_max = max_propagating_nan(global_max, partials[r * rank_stride + kColMax]);
    target = max_propagating_nan(target, partials[r * rank_stride + kColTarget]);
  }
  const float shift = safe_shift(global_max);
  float sum_exp = 0.0f;
  float moment = 0.0f;
  for (int r = 0; r < world; ++r) {
    const float* p = partials + r * rank_stride;
    const float scale = expf(p[kColMax] - shift);
    sum_exp += p[kColSumExp] * scale;
    if (with_entropy) {
      const float moved = p[kColSumExp] == 0.0f ? 0.0f : (p[kColMax] - shift) * p[kColSumExp];
      moment += (p[kColSumExpX] + moved) * scale;
    }
  }
  const float log_sum = logf(sum_exp);
  RowStats out;
  out.lse = shift + log_sum;
  out.logprob = ignored ? 0.0f : target - out.lse;
  out.entropy = 0.0f;
  out.mean_x = 0.0f;
  if (with_entropy) {
    const float relative_mean = moment / sum_exp;
    out.mean_x = shift + relative_mean;
    out.entropy = ignored ? 0.0f : log_sum - relative_mean;
  }
  return out;
}

// Index of the target inside this shard's valid columns, or -1 when the target is ignored, lies on
// another rank, or falls in the padding.
MGRPO_HD int64_t local_target_column(int64_t target, int64_t vocab_start, int64_t valid_cols) {
  const int64_t col = target - vocab_start;
  return (target >= 0 && col >= 0 && col < valid_cols) ? col : -1;
}

}  // namespace megatron_grpo
