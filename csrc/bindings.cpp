// Torch op registration for the logprob kernels: `torch.ops.megatron_grpo.*`, dispatched to CPU or CUDA.
//
// The ops take 2-D logits [rows, cols] whose last dim is contiguous, and work on raw pointers underneath, so
// the kernels themselves stay framework-agnostic. User-facing validation lives in Python; the checks here
// only guard the pointer contract.
#include <Python.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "cpu_isa.h"
#include "logprob_common.h"
#include "logprob_cpu.h"
#include "top_p.h"
#include "top_p_cpu.h"

#ifdef MEGATRON_GRPO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "logprob_cuda.h"
#include "top_p_cuda.h"
#endif

namespace megatron_grpo {
namespace {

LogitsDType logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat: return LogitsDType::kFloat32;
    case at::kBFloat16: return LogitsDType::kBFloat16;
    case at::kHalf: return LogitsDType::kFloat16;
    default: TORCH_CHECK(false, "logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  }
}

void check_rows(const at::Tensor& logits, const at::Tensor& targets, int64_t valid_cols) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be 2-D with a contiguous last dim");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous() && targets.device() == logits.device(),
              "targets must be contiguous int64 [rows] on the logits' device");
  TORCH_CHECK(valid_cols >= 0 && valid_cols <= logits.size(1), "valid_cols must lie in [0, cols]");
}

void check_row_vector(const at::Tensor& t, const at::Tensor& logits, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(0) && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.device() == logits.device(),
              name, " must be contiguous float32 [rows] on the logits' device");
}

const float* optional_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

float* optional_ptr(const at::Tensor& t, bool present) { return present ? t.data_ptr<float>() : nullptr; }

// The op's per-row outputs (logprob, entropy, lse, mean_x): fp32 [rows] each, entropy and mean_x [0] without
// entropy (each its own tensor: an op's outputs may not alias).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> empty_row_stats(const at::Tensor& like, int64_t rows,
                                                                             bool with_entropy) {
  const auto options = like.options().dtype(at::kFloat);
  const int64_t entropy_rows = with_entropy ? rows : 0;
  return {at::empty({rows}, options), at::empty({entropy_rows}, options), at::empty({rows}, options),
          at::empty({entropy_rows}, options)};
}

// An upstream gradient of a per-row output as the kernels read it: contiguous fp32 [rows] (absent: nullopt).
c10::optional<at::Tensor> row_gradient(const c10::optional<at::Tensor>& grad, int64_t rows) {
  if (!grad.has_value() || !grad->defined()) return c10::nullopt;
  TORCH_CHECK(grad->numel() == rows, "an upstream gradient must have one value per row");
  return grad->reshape({rows}).to(at::kFloat).contiguous();
}

// Bytes of the kernels' vector accesses: a gradient row takes the vector path where it shares the logits' row
// alignment modulo this.
constexpr int64_t kVectorBytes = 16;

// The row stride of `empty_with_alignment_of(logits)`: the smallest one >= cols that is congruent to the logits'
// modulo 16 bytes. The same rule as megatron_grpo/ops/vocab_parallel.py:gradient_row_stride (the backward op's fake
// kernel reports it).
int64_t gradient_row_stride(const at::Tensor& logits) {
  const int64_t rows = logits.size(0), cols = logits.size(1), element = logits.element_size();
  if (rows <= 1 || cols == 0 || kVectorBytes % element != 0) return cols;
  const int64_t per_vector = kVectorBytes / element;
  return cols + ((logits.stride(0) - cols) % per_vector + per_vector) % per_vector;
}

// An uninitialised [rows, cols] gradient whose every row has the 16-byte alignment of the logits' row: a sliced
// or offset view of logits would otherwise get a buffer aligned differently, and the kernels would fall back to
// scalar stores for most rows. At most 15 bytes per row are wasted.
at::Tensor empty_with_alignment_of(const at::Tensor& logits) {
  const int64_t rows = logits.size(0), cols = logits.size(1), element = logits.element_size();
  if (rows == 0 || cols == 0 || kVectorBytes % element != 0) {
    return at::empty_like(logits, at::MemoryFormat::Contiguous);
  }
  const int64_t per_vector = kVectorBytes / element;
  const int64_t row_stride = gradient_row_stride(logits);
  const int64_t wanted = static_cast<int64_t>(reinterpret_cast<uintptr_t>(logits.data_ptr()) % kVectorBytes) / element;
  at::Tensor storage = at::empty({wanted + (rows - 1) * row_stride + cols + per_vector}, logits.options());
  const int64_t base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(storage.data_ptr()) % kVectorBytes) / element;
  const int64_t offset = ((wanted - base) % per_vector + per_vector) % per_vector;
  return storage.as_strided({rows, cols}, {row_stride, 1}, offset);
}

// The optional per-row top-k/top-p threshold: contiguous float32 [rows] on the logits' device.
void check_threshold(const c10::optional<at::Tensor>& threshold, const at::Tensor& logits) {
  if (threshold.has_value()) check_row_vector(*threshold, logits, "threshold");
}

// The kernels see z = logit_scale * x; a scale that is not a finite positive number has no meaning.
float checked_scale(double logit_scale) {
  const auto scale = static_cast<float>(logit_scale);
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0f, "logit_scale must be a finite number > 0, got ", logit_scale);
  return scale;
}

void check_backward_args(const at::Tensor& logits, const at::Tensor& targets, int64_t valid_cols,
                         const at::Tensor& lse, const c10::optional<at::Tensor>& mean_x,
                         const at::Tensor& grad_logprob, const c10::optional<at::Tensor>& grad_entropy,
                         const at::Tensor& grad_logits) {
  check_rows(logits, targets, valid_cols);
  check_row_vector(lse, logits, "lse");
  check_row_vector(grad_logprob, logits, "grad_logprob");
  TORCH_CHECK(mean_x.has_value() == grad_entropy.has_value(), "mean_x and grad_entropy come together");
  if (mean_x.has_value()) {
    check_row_vector(*mean_x, logits, "mean_x");
    check_row_vector(*grad_entropy, logits, "grad_entropy");
  }
  TORCH_CHECK(grad_logits.sizes() == logits.sizes() && grad_logits.stride(1) == 1 &&
                  grad_logits.scalar_type() == logits.scalar_type() && grad_logits.device() == logits.device(),
              "grad_logits must match the logits' shape, dtype and device, with a contiguous last dim");
}

at::Tensor partials_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                        int64_t valid_cols, bool with_entropy, const c10::optional<at::Tensor>& threshold,
                        double logit_scale) {
  check_rows(logits, targets, valid_cols);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  at::Tensor partials = at::empty({logits.size(0), num_partials(with_entropy)}, logits.options().dtype(at::kFloat));
  cpu::logprob_partials(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                        logits.stride(0), targets.data_ptr<int64_t>(), vocab_start, valid_cols, with_entropy,
                        optional_ptr(threshold), scale, partials.data_ptr<float>());
  return partials;
}

// One rank's (TP 1) outputs straight from the forward kernel: (logprob, entropy, lse, mean_x).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
    const c10::optional<at::Tensor>& threshold, double logit_scale) {
  check_rows(logits, targets, valid_cols);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  auto [logprob, entropy, lse, mean_x] = empty_row_stats(logits, logits.size(0), with_entropy);
  cpu::logprob_forward(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1), logits.stride(0),
                       targets.data_ptr<int64_t>(), vocab_start, valid_cols, with_entropy, optional_ptr(threshold),
                       scale, logprob.data_ptr<float>(), optional_ptr(entropy, with_entropy), lse.data_ptr<float>(),
                       optional_ptr(mean_x, with_entropy));
  return {logprob, entropy, lse, mean_x};
}

// The all-gathered partials [world, rows, k] and the rows' targets.
void check_gathered(const at::Tensor& gathered, const at::Tensor& targets, bool with_entropy) {
  TORCH_CHECK(gathered.dim() == 3 && gathered.size(2) == num_partials(with_entropy) &&
                  gathered.scalar_type() == at::kFloat && gathered.is_contiguous() && gathered.size(0) >= 1,
              "gathered partials must be contiguous float32 [world >= 1, rows, ", num_partials(with_entropy), "]");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == gathered.size(1) && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous() && targets.device() == gathered.device(),
              "targets must be contiguous int64 [rows] on the partials' device");
}

// The combine after the one all-gather (TP > 1): (logprob, entropy, lse, mean_x) from every rank's partials.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> combine_cpu(const at::Tensor& gathered,
                                                                       const at::Tensor& targets, bool with_entropy) {
  check_gathered(gathered, targets, with_entropy);
  const int64_t rows = gathered.size(1);
  auto [logprob, entropy, lse, mean_x] = empty_row_stats(gathered, rows, with_entropy);
  cpu::logprob_combine(gathered.data_ptr<float>(), gathered.size(0), rows, targets.data_ptr<int64_t>(), with_entropy,
                       logprob.data_ptr<float>(), optional_ptr(entropy, with_entropy), lse.data_ptr<float>(),
                       optional_ptr(mean_x, with_entropy));
  return {logprob, entropy, lse, mean_x};
}

// The in-place exp mode's forward: the partials, and e = exp(z - m_row) written over the logits' valid columns.
at::Tensor partials_writing_exps_cpu(at::Tensor logits, const at::Tensor& targets, int64_t vocab_start,
                                     int64_t valid_cols, bool with_entropy, const c10::optional<at::Tensor>& threshold,
                                     double logit_scale) {
  check_rows(logits, targets, valid_cols);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  at::Tensor partials = at::empty({logits.size(0), num_partials(with_entropy)}, logits.options().dtype(at::kFloat));
  cpu::logprob_partials_writing_exps(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                                     logits.stride(0), targets.data_ptr<int64_t>(), vocab_start, valid_cols,
                                     with_entropy, optional_ptr(threshold), scale, partials.data_ptr<float>());
  return partials;
}

// The in-place exp mode's backward: the gradient overwrites the exps (see cpu::logprob_backward_from_exps).
void backward_from_exps_cpu(at::Tensor exps, const at::Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                            const at::Tensor& prob_scale, const at::Tensor& target_prob,
                            const at::Tensor& grad_logprob, double logit_scale) {
  check_rows(exps, targets, valid_cols);
  check_row_vector(prob_scale, exps, "prob_scale");
  check_row_vector(target_prob, exps, "target_prob");
  check_row_vector(grad_logprob, exps, "grad_logprob");
  const float scale = checked_scale(logit_scale);
  cpu::logprob_backward_from_exps(exps.data_ptr(), logits_dtype(exps), exps.size(0), exps.size(1), exps.stride(0),
                                  targets.data_ptr<int64_t>(), vocab_start, valid_cols,
                                  prob_scale.data_ptr<float>(), target_prob.data_ptr<float>(),
                                  grad_logprob.data_ptr<float>(), scale);
}

// A fresh gradient buffer is first touched by the backward kernel; on Linux, asking for transparent huge pages
// turns ~250k page faults per GiB into ~500, which costs more than the kernel itself otherwise.
void advise_huge_pages(const at::Tensor& t) {
#ifdef __linux__
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data_ptr()) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes()) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

void backward_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                  const at::Tensor& lse, const c10::optional<at::Tensor>& mean_x, const at::Tensor& grad_logprob,
                  const c10::optional<at::Tensor>& grad_entropy, at::Tensor grad_logits,
                  const c10::optional<at::Tensor>& threshold, double logit_scale) {
  check_backward_args(logits, targets, valid_cols, lse, mean_x, grad_logprob, grad_entropy, grad_logits);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  if (!grad_logits.is_same(logits)) advise_huge_pages(grad_logits);
  cpu::logprob_backward(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                        logits.stride(0), targets.data_ptr<int64_t>(), vocab_start, valid_cols,
                        lse.data_ptr<float>(), optional_ptr(mean_x), nullptr, grad_logprob.data_ptr<float>(),
                        optional_ptr(grad_entropy), optional_ptr(threshold), scale, grad_logits.data_ptr(),
                        grad_logits.stride(0));
}

// The arguments of the out-of-place backward, checked, with its upstream gradients as the kernels read them.
struct GradientArgs {
  c10::optional<at::Tensor> grad_logprob;
  c10::optional<at::Tensor> grad_entropy;  // only with mean_x: an entropy that backward differentiates
  bool filtered;
};

GradientArgs gradient_args(const at::Tensor& logits, const at::Tensor& targets, int64_t valid_cols,
                           const at::Tensor& lse, const c10::optional<at::Tensor>& mean_x,
                           const c10::optional<at::Tensor>& logprob, const c10::optional<at::Tensor>& grad_logprob,
                           const c10::optional<at::Tensor>& grad_entropy,
                           const c10::optional<at::Tensor>& threshold) {
  check_rows(logits, targets, valid_cols);
  check_row_vector(lse, logits, "lse");
  check_threshold(threshold, logits);
  TORCH_CHECK(logprob.has_value() == threshold.has_value(), "logprob is given with the threshold, and only then");
  if (logprob.has_value()) check_row_vector(*logprob, logits, "logprob");
  const int64_t rows = logits.size(0);
  GradientArgs args{row_gradient(grad_logprob, rows), c10::nullopt, threshold.has_value()};
  if (mean_x.has_value()) {
    check_row_vector(*mean_x, logits, "mean_x");
    args.grad_entropy = row_gradient(grad_entropy, rows);
  }
  return args;
}

// The out-of-place backward: d(objective)/d(logits) in a new buffer with the logits' row alignment, from the
// upstream gradients as autograd hands them (None, any float dtype and layout of `rows` values). mean_x: with an
// entropy (its gradient is then read); logprob with the threshold: a filtered target passes no gradient.
at::Tensor gradient_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                        const at::Tensor& lse, const c10::optional<at::Tensor>& mean_x,
                        const c10::optional<at::Tensor>& logprob, const c10::optional<at::Tensor>& grad_logprob,
                        const c10::optional<at::Tensor>& grad_entropy, const c10::optional<at::Tensor>& threshold,
                        double logit_scale) {
  const GradientArgs args =
      gradient_args(logits, targets, valid_cols, lse, mean_x, logprob, grad_logprob, grad_entropy, threshold);
  const float scale = checked_scale(logit_scale);
  at::Tensor grad_logits = empty_with_alignment_of(logits);
  advise_huge_pages(grad_logits);
  const bool with_entropy = args.grad_entropy.has_value();
  cpu::logprob_backward(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1), logits.stride(0),
                        targets.data_ptr<int64_t>(), vocab_start, valid_cols, lse.data_ptr<float>(),
                        with_entropy ? mean_x->data_ptr<float>() : nullptr, optional_ptr(logprob),
                        optional_ptr(args.grad_logprob), optional_ptr(args.grad_entropy), optional_ptr(threshold),
                        scale, grad_logits.data_ptr(), grad_logits.stride(0));
  return grad_logits;
}

// ---- the top-p threshold search (top_p.h) ----

// The search's per-row inputs: logits [rows, cols] with a contiguous last dim, shift fp32 [rows], floor fp32 [rows]
// or none, and (from the second stage) the boundary bin, int64 [rows].
void check_top_p_rows(const at::Tensor& logits, const at::Tensor& shift, const c10::optional<at::Tensor>& floor,
                      const at::Tensor* boundary) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be 2-D with a contiguous last dim");
  logits_dtype(logits);
  check_row_vector(shift, logits, "shift");
  if (floor.has_value()) check_row_vector(*floor, logits, "floor");
  if (boundary != nullptr) {
    TORCH_CHECK(boundary->dim() == 1 && boundary->size(0) == logits.size(0) && boundary->scalar_type() == at::kLong &&
                    boundary->is_contiguous() && boundary->device() == logits.device(),
                "boundary must be contiguous int64 [rows] on the logits' device");
  }
}

// The candidates of the second stage: keys int32 [rows, capacity], counts int64 [rows], and the prefix chosen so
// far, int64 [rows].
void check_candidates(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& counts,
                      const at::Tensor& prefix) {
  const int64_t rows = logits.size(0);
  TORCH_CHECK(keys.dim() == 2 && keys.size(0) == rows && keys.scalar_type() == at::kInt && keys.is_contiguous() &&
                  keys.device() == logits.device(),
              "keys must be contiguous int32 [rows, capacity] on the logits' device");
  for (const at::Tensor* t : {&counts, &prefix}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kLong && t->is_contiguous() &&
                    t->device() == logits.device(),
                "counts and prefix must be contiguous int64 [rows] on the logits' device");
  }
}

at::Tensor top_p_value_histogram_cpu(const at::Tensor& logits, const at::Tensor& shift,
                                     const c10::optional<at::Tensor>& floor, double logit_scale) {
  check_top_p_rows(logits, shift, floor, nullptr);
  const float scale = checked_scale(logit_scale);
  at::Tensor hist = at::empty({logits.size(0), top_p::kValueBins}, logits.options().dtype(at::kDouble));
  top_p::cpu::value_histogram(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                              logits.stride(0), scale, shift.data_ptr<float>(), optional_ptr(floor),
                              hist.data_ptr<double>());
  return hist;
}

std::tuple<at::Tensor, at::Tensor> top_p_candidates_cpu(const at::Tensor& logits, const at::Tensor& shift,
                                                        const c10::optional<at::Tensor>& floor,
                                                        const at::Tensor& boundary, int64_t capacity,
                                                        double logit_scale) {
  check_top_p_rows(logits, shift, floor, &boundary);
  TORCH_CHECK(capacity >= 0, "capacity must be >= 0");
  const float scale = checked_scale(logit_scale);
  const int64_t rows = logits.size(0);
  at::Tensor keys = at::empty({rows, capacity}, logits.options().dtype(at::kInt));
  at::Tensor counts = at::empty({rows}, logits.options().dtype(at::kLong));
  top_p::cpu::candidates(logits.data_ptr(), logits_dtype(logits), rows, logits.size(1), logits.stride(0), scale,
                         shift.data_ptr<float>(), optional_ptr(floor), boundary.data_ptr<int64_t>(), capacity,
                         keys.data_ptr<int32_t>(), counts.data_ptr<int64_t>());
  return {keys, counts};
}

at::Tensor top_p_bucket_masses_cpu(const at::Tensor& logits, const at::Tensor& shift,
                                   const c10::optional<at::Tensor>& floor, const at::Tensor& boundary,
                                   const at::Tensor& keys, const at::Tensor& counts, const at::Tensor& prefix,
                                   int64_t low_bit, double logit_scale) {
  check_top_p_rows(logits, shift, floor, &boundary);
  check_candidates(logits, keys, counts, prefix);
  TORCH_CHECK(low_bit >= 0 && low_bit + top_p::kBucketBits <= top_p::kKeyBits && low_bit % top_p::kBucketBits == 0,
              "low_bit must be 0, 8, 16 or 24");
  const float scale = checked_scale(logit_scale);
  at::Tensor out = at::empty({logits.size(0), top_p::kBucketSlots}, logits.options().dtype(at::kDouble));
  top_p::cpu::bucket_masses(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                            logits.stride(0), scale, shift.data_ptr<float>(), optional_ptr(floor),
                            boundary.data_ptr<int64_t>(), keys.size(1), keys.data_ptr<int32_t>(),
                            counts.data_ptr<int64_t>(), prefix.data_ptr<int64_t>(), static_cast<int>(low_bit),
                            out.data_ptr<double>());
  return out;
}

// The whole search on one rank (top_p_cpu.h's threshold): fp32 [rows].
at::Tensor top_p_threshold_cpu(const at::Tensor& logits, const c10::optional<at::Tensor>& floor, double top_p,
                               double logit_scale, int64_t capacity, int64_t zero_bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be 2-D with a contiguous last dim");
  logits_dtype(logits);
  if (floor.has_value()) check_row_vector(*floor, logits, "floor");
  TORCH_CHECK(top_p > 0.0 && top_p < 1.0, "top_p must be in (0, 1), got ", top_p);
  TORCH_CHECK(capacity >= 0, "capacity must be >= 0");
  TORCH_CHECK(zero_bits >= 0 && zero_bits < top_p::kKeyBits, "zero_bits must be in [0, 32), got ", zero_bits);
  const float scale = checked_scale(logit_scale);
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  top_p::cpu::threshold(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1), logits.stride(0),
                        scale, optional_ptr(floor), top_p, capacity, static_cast<int>(zero_bits),
                        out.data_ptr<float>());
  return out;
}

std::string cpu_kernel_isa() { return cpu::kernel_isa(); }

// Forces the CPU kernels of one instruction set ("avx512", "avx2", "auto"); returns the one now in use.
std::string set_cpu_kernel_isa(const std::string& isa) {
  TORCH_CHECK(cpu::set_kernel_isa(isa.c_str()), "cpu kernel ISA ", isa,
              " is unknown, not built, or not supported by this CPU (choose from avx512, avx2, auto)");
  return cpu::kernel_isa();
}

#ifdef MEGATRON_GRPO_WITH_CUDA
void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// The forward's split workspace: one buffer per device and stream, kept and grown as calls need it, so that a call
// allocates nothing. Work on one stream is ordered, so its calls can share a buffer; a stream being captured into a
// CUDA graph gets one of its own from the caching allocator (the graph keeps it). The buffers live until the process
// ends (never destroyed: no CUDA call after the runtime's teardown).
at::Tensor forward_workspace(const at::Tensor& logits, size_t bytes) {
  if (bytes == 0) return at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto options = logits.options().dtype(at::kByte);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) return at::empty({static_cast<int64_t>(bytes)}, options);
  static std::mutex mutex;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buffer = (*buffers)[{logits.get_device(), stream}];
  if (!buffer.defined() || static_cast<size_t>(buffer.numel()) < bytes) {
    buffer = at::empty({static_cast<int64_t>(bytes)}, options);
  }
  return buffer;
}

void* workspace_ptr(const at::Tensor& workspace) { return workspace.defined() ? workspace.data_ptr() : nullptr; }

at::Tensor partials_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                         int64_t valid_cols, bool with_entropy, const c10::optional<at::Tensor>& threshold,
                         double logit_scale) {
  check_rows(logits, targets, valid_cols);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor partials = at::empty({logits.size(0), num_partials(with_entropy)}, logits.options().dtype(at::kFloat));
  const at::Tensor workspace = forward_workspace(
      logits, logprob_forward_workspace_bytes(logits.size(0), logits.size(1), valid_cols, logits_dtype(logits),
                                              with_entropy, threshold.has_value()));
  check_cuda(launch_logprob_partials(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                                     logits.stride(0), targets.data_ptr<int64_t>(), vocab_start, valid_cols,
                                     with_entropy, optional_ptr(threshold), scale, partials.data_ptr<float>(),
                                     workspace_ptr(workspace), c10::cuda::getCurrentCUDAStream()),
             "launch_logprob_partials");
  return partials;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, int64_t valid_cols, bool with_entropy,
    const c10::optional<at::Tensor>& threshold, double logit_scale) {
  check_rows(logits, targets, valid_cols);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  auto [logprob, entropy, lse, mean_x] = empty_row_stats(logits, logits.size(0), with_entropy);
  const at::Tensor workspace = forward_workspace(
      logits, logprob_forward_workspace_bytes(logits.size(0), logits.size(1), valid_cols, logits_dtype(logits),
                                              with_entropy, threshold.has_value()));
  check_cuda(launch_logprob_forward(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                                    logits.stride(0), targets.data_ptr<int64_t>(), vocab_start, valid_cols,
                                    with_entropy, optional_ptr(threshold), scale, logprob.data_ptr<float>(),
                                    optional_ptr(entropy, with_entropy), lse.data_ptr<float>(),
                                    optional_ptr(mean_x, with_entropy), workspace_ptr(workspace),
                                    c10::cuda::getCurrentCUDAStream()),
             "launch_logprob_forward");
  return {logprob, entropy, lse, mean_x};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> combine_cuda(const at::Tensor& gathered,
                                                                        const at::Tensor& targets, bool with_entropy) {
  check_gathered(gathered, targets, with_entropy);
  const c10::cuda::CUDAGuard guard(gathered.device());
  const int64_t rows = gathered.size(1);
  auto [logprob, entropy, lse, mean_x] = empty_row_stats(gathered, rows, with_entropy);
  check_cuda(launch_logprob_combine(gathered.data_ptr<float>(), gathered.size(0), rows, targets.data_ptr<int64_t>(),
                                    with_entropy, logprob.data_ptr<float>(), optional_ptr(entropy, with_entropy),
                                    lse.data_ptr<float>(), optional_ptr(mean_x, with_entropy),
                                    c10::cuda::getCurrentCUDAStream()),
             "launch_logprob_combine");
  return {logprob, entropy, lse, mean_x};
}

void backward_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                   const at::Tensor& lse, const c10::optional<at::Tensor>& mean_x, const at::Tensor& grad_logprob,
                   const c10::optional<at::Tensor>& grad_entropy, at::Tensor grad_logits,
                   const c10::optional<at::Tensor>& threshold, double logit_scale) {
  check_backward_args(logits, targets, valid_cols, lse, mean_x, grad_logprob, grad_entropy, grad_logits);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  check_cuda(launch_logprob_backward(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                                     logits.stride(0), targets.data_ptr<int64_t>(), vocab_start, valid_cols,
                                     lse.data_ptr<float>(), optional_ptr(mean_x), nullptr,
                                     grad_logprob.data_ptr<float>(), optional_ptr(grad_entropy),
                                     optional_ptr(threshold), scale, grad_logits.data_ptr(), grad_logits.stride(0),
                                     c10::cuda::getCurrentCUDAStream()),
             "launch_logprob_backward");
}

at::Tensor gradient_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                         int64_t valid_cols, const at::Tensor& lse, const c10::optional<at::Tensor>& mean_x,
                         const c10::optional<at::Tensor>& logprob, const c10::optional<at::Tensor>& grad_logprob,
                         const c10::optional<at::Tensor>& grad_entropy, const c10::optional<at::Tensor>& threshold,
                         double logit_scale) {
  const GradientArgs args =
      gradient_args(logits, targets, valid_cols, lse, mean_x, logprob, grad_logprob, grad_entropy, threshold);
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad_logits = empty_with_alignment_of(logits);
  const bool with_entropy = args.grad_entropy.has_value();
  check_cuda(launch_logprob_backward(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                                     logits.stride(0), targets.data_ptr<int64_t>(), vocab_start, valid_cols,
                                     lse.data_ptr<float>(), with_entropy ? mean_x->data_ptr<float>() : nullptr,
                                     optional_ptr(logprob), optional_ptr(args.grad_logprob),
                                     optional_ptr(args.grad_entropy), optional_ptr(threshold), scale,
                                     grad_logits.data_ptr(), grad_logits.stride(0),
                                     c10::cuda::getCurrentCUDAStream()),
             "launch_logprob_backward");
  return grad_logits;
}

at::Tensor top_p_value_histogram_cuda(const at::Tensor& logits, const at::Tensor& shift,
                                      const c10::optional<at::Tensor>& floor, double logit_scale) {
  check_top_p_rows(logits, shift, floor, nullptr);
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor hist = at::empty({logits.size(0), top_p::kValueBins}, logits.options().dtype(at::kDouble));
  check_cuda(launch_top_p_value_histogram(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                                          logits.stride(0), scale, shift.data_ptr<float>(), optional_ptr(floor),
                                          hist.data_ptr<double>(), c10::cuda::getCurrentCUDAStream()),
             "launch_top_p_value_histogram");
  return hist;
}

std::tuple<at::Tensor, at::Tensor> top_p_candidates_cuda(const at::Tensor& logits, const at::Tensor& shift,
                                                         const c10::optional<at::Tensor>& floor,
                                                         const at::Tensor& boundary, int64_t capacity,
                                                         double logit_scale) {
  check_top_p_rows(logits, shift, floor, &boundary);
  TORCH_CHECK(capacity >= 0, "capacity must be >= 0");
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  at::Tensor keys = at::empty({rows, capacity}, logits.options().dtype(at::kInt));
  at::Tensor counts = at::empty({rows}, logits.options().dtype(at::kLong));
  check_cuda(launch_top_p_candidates(logits.data_ptr(), logits_dtype(logits), rows, logits.size(1), logits.stride(0),
                                     scale, shift.data_ptr<float>(), optional_ptr(floor),
                                     boundary.data_ptr<int64_t>(), capacity, keys.data_ptr<int32_t>(),
                                     counts.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
             "launch_top_p_candidates");
  return {keys, counts};
}

at::Tensor top_p_bucket_masses_cuda(const at::Tensor& logits, const at::Tensor& shift,
                                    const c10::optional<at::Tensor>& floor, const at::Tensor& boundary,
                                    const at::Tensor& keys, const at::Tensor& counts, const at::Tensor& prefix,
                                    int64_t low_bit, double logit_scale) {
  check_top_p_rows(logits, shift, floor, &boundary);
  check_candidates(logits, keys, counts, prefix);
  TORCH_CHECK(low_bit >= 0 && low_bit + top_p::kBucketBits <= top_p::kKeyBits && low_bit % top_p::kBucketBits == 0,
              "low_bit must be 0, 8, 16 or 24");
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor out = at::empty({logits.size(0), top_p::kBucketSlots}, logits.options().dtype(at::kDouble));
  check_cuda(launch_top_p_bucket_masses(logits.data_ptr(), logits_dtype(logits), logits.size(0), logits.size(1),
                                        logits.stride(0), scale, shift.data_ptr<float>(), optional_ptr(floor),
                                        boundary.data_ptr<int64_t>(), keys.size(1), keys.data_ptr<int32_t>(),
                                        counts.data_ptr<int64_t>(), prefix.data_ptr<int64_t>(),
                                        static_cast<int>(low_bit), out.data_ptr<double>(),
                                        c10::cuda::getCurrentCUDAStream()),
             "launch_top_p_bucket_masses");
  return out;
}

// The CUDA launch plan of a call on the current device (logprob_launch_plan), for the GPU tests: {warp rows, splits,
// split_cols, threads, blocks, warp-kernel wave, block-kernel wave}. dtype: "float32", "bfloat16" or "float16".
std::vector<int64_t> cuda_launch_plan(int64_t rows, int64_t cols, int64_t valid_cols, const std::string& dtype,
                                      bool with_entropy, bool filtered, bool backward) {
  const LogitsDType code = dtype == "float32" ? LogitsDType::kFloat32
                           : dtype == "bfloat16" ? LogitsDType::kBFloat16
                                                 : LogitsDType::kFloat16;
  TORCH_CHECK(dtype == "float32" || dtype == "bfloat16" || dtype == "float16", "unknown logits dtype ", dtype);
  std::vector<int64_t> plan(7);
  check_cuda(logprob_launch_plan(rows, cols, valid_cols, code, with_entropy, filtered, backward, plan.data()),
             "logprob_launch_plan");
  return plan;
}
#endif

bool compiled_with_cuda() {
#ifdef MEGATRON_GRPO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace megatron_grpo

TORCH_LIBRARY(megatron_grpo, m) {
  m.def(
      "logprob_partials(Tensor logits, Tensor targets, int vocab_start, int valid_cols, bool with_entropy, "
      "Tensor? threshold, float logit_scale=1.0) -> Tensor");
  m.def(
      "logprob_backward(Tensor logits, Tensor targets, int vocab_start, int valid_cols, Tensor lse, Tensor? mean_x, "
      "Tensor grad_logprob, Tensor? grad_entropy, Tensor(a!) grad_logits, Tensor? threshold, "
      "float logit_scale=1.0) -> ()");
  // One rank's outputs straight from the forward kernel, (logprob, entropy, lse, mean_x); entropy and mean_x are
  // [0] without entropy.
  m.def(
      "logprob_forward(Tensor logits, Tensor targets, int vocab_start, int valid_cols, bool with_entropy, "
      "Tensor? threshold, float logit_scale=1.0) -> (Tensor, Tensor, Tensor, Tensor)");
  // The combine of the all-gathered partials [world, rows, k], with the same outputs.
  m.def("logprob_combine(Tensor gathered, Tensor targets, bool with_entropy) -> (Tensor, Tensor, Tensor, Tensor)");
  // The out-of-place backward: a new gradient buffer with the logits' row alignment.
  m.def(
      "logprob_gradient(Tensor logits, Tensor targets, int vocab_start, int valid_cols, Tensor lse, Tensor? mean_x, "
      "Tensor? logprob, Tensor? grad_logprob, Tensor? grad_entropy, Tensor? threshold, float logit_scale=1.0) "
      "-> Tensor");
  m.def("gradient_row_stride(Tensor logits) -> int", &megatron_grpo::gradient_row_stride);
  // The top-p threshold search's kernels (top_p.h): the value histogram, the boundary bin's candidates, one radix
  // pass over them.
  m.def("top_p_value_histogram(Tensor logits, Tensor shift, Tensor? floor, float logit_scale) -> Tensor");
  m.def(
      "top_p_candidates(Tensor logits, Tensor shift, Tensor? floor, Tensor boundary, int capacity, "
      "float logit_scale) -> (Tensor, Tensor)");
  m.def(
      "top_p_bucket_masses(Tensor logits, Tensor shift, Tensor? floor, Tensor boundary, Tensor keys, Tensor counts, "
      "Tensor prefix, int low_bit, float logit_scale) -> Tensor");
  // The whole search on one rank (CPU): the stages above and their choices in one call, no [rows, ...] temporaries.
  m.def(
      "top_p_threshold(Tensor logits, Tensor? floor, float top_p, float logit_scale, int capacity, int zero_bits) "
      "-> Tensor");
  // The in-place exp mode (CPU only): forward overwrites the logits with exp(z - m_row), backward the exps
  // with the gradient.
  m.def(
      "logprob_partials_writing_exps(Tensor(a!) logits, Tensor targets, int vocab_start, int valid_cols, "
      "bool with_entropy, Tensor? threshold, float logit_scale=1.0) -> Tensor");
  m.def(
      "logprob_backward_from_exps(Tensor(a!) exps, Tensor targets, int vocab_start, int valid_cols, "
      "Tensor prob_scale, Tensor target_prob, Tensor grad_logprob, float logit_scale=1.0) -> ()");
  m.def("compiled_with_cuda() -> bool", &megatron_grpo::compiled_with_cuda);
#ifdef MEGATRON_GRPO_WITH_CUDA
  m.def(
      "cuda_launch_plan(int rows, int cols, int valid_cols, str dtype, bool with_entropy, bool filtered, "
      "bool backward) -> int[]",
      &megatron_grpo::cuda_launch_plan);
#endif
  m.def("cpu_kernel_isa() -> str", &megatron_grpo::cpu_kernel_isa);
  m.def("set_cpu_kernel_isa(str isa) -> str", &megatron_grpo::set_cpu_kernel_isa);
}

TORCH_LIBRARY_IMPL(megatron_grpo, CPU, m) {
  m.impl("logprob_partials", &megatron_grpo::partials_cpu);
  m.impl("logprob_forward", &megatron_grpo::forward_cpu);
  m.impl("logprob_combine", &megatron_grpo::combine_cpu);
  m.impl("logprob_backward", &megatron_grpo::backward_cpu);
  m.impl("logprob_gradient", &megatron_grpo::gradient_cpu);
  m.impl("top_p_value_histogram", &megatron_grpo::top_p_value_histogram_cpu);
  m.impl("top_p_candidates", &megatron_grpo::top_p_candidates_cpu);
  m.impl("top_p_bucket_masses", &megatron_grpo::top_p_bucket_masses_cpu);
  m.impl("top_p_threshold", &megatron_grpo::top_p_threshold_cpu);
  m.impl("logprob_partials_writing_exps", &megatron_grpo::partials_writing_exps_cpu);
  m.impl("logprob_backward_from_exps", &megatron_grpo::backward_from_exps_cpu);
}

#ifdef MEGATRON_GRPO_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_grpo, CUDA, m) {
  m.impl("logprob_partials", &megatron_grpo::partials_cuda);
  m.impl("logprob_forward", &megatron_grpo::forward_cuda);
  m.impl("logprob_combine", &megatron_grpo::combine_cuda);
  m.impl("logprob_backward", &megatron_grpo::backward_cuda);
  m.impl("logprob_gradient", &megatron_grpo::gradient_cuda);
  m.impl("top_p_value_histogram", &megatron_grpo::top_p_value_histogram_cuda);
  m.impl("top_p_candidates", &megatron_grpo::top_p_candidates_cuda);
  m.impl("top_p_bucket_masses", &megatron_grpo::top_p_bucket_masses_cuda);
}
#endif

// `import megatron_grpo._C` loads the library, which registers the ops above.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "megatron-grpo kernels (see torch.ops.megatron_grpo)",
                               -1, nullptr};
  return PyModule_Create(&module);
}
