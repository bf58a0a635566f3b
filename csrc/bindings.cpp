// Torch op registration for the logprob kernels: `torch.ops.megatron_grpo.*`, dispatched to CPU or CUDA.
//
// The ops take 2-D logits [rows, cols] whose last dim is contiguous, and work on raw pointers underneath, so
// the kernels themselves stay framework-agnostic. User-facing validation lives in Python; the checks here
// only guard the pointer contract.
#include <Python.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "logprob_common.h"
#include "logprob_cpu.h"

#ifdef MEGATRON_GRPO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "logprob_cuda.h"
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
                        lse.data_ptr<float>(), optional_ptr(mean_x), grad_logprob.data_ptr<float>(),
                        optional_ptr(grad_entropy), optional_ptr(threshold), scale, grad_logits.data_ptr(),
                        grad_logits.stride(0));
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

at::Tensor partials_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                         int64_t valid_cols, bool with_entropy, const c10::optional<at::Tensor>& threshold,
                         double logit_scale) {
  check_rows(logits, targets, valid_cols);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor partials = at::empty({logits.size(0), num_partials(with_entropy)}, logits.options().dtype(at::kFloat));
  const size_t workspace_bytes =
      logprob_partials_workspace_bytes(logits.size(0), logits.size(1), valid_cols, logits_dtype(logits), with_entropy,
                                       threshold.has_value());
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, logits.options().dtype(at::kByte));
  check_cuda(launch_logprob_partials(logits.data_ptr(), logits_dtype(logits), logits.size(0),
                                     logits.size(1), logits.stride(0), targets.data_ptr<int64_t>(), vocab_start,
                                     valid_cols, with_entropy, optional_ptr(threshold), scale,
                                     partials.data_ptr<float>(),
                                     workspace_bytes ? workspace.data_ptr() : nullptr,
                                     c10::cuda::getCurrentCUDAStream()),
             "launch_logprob_partials");
  return partials;
}

void backward_cuda(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                   const at::Tensor& lse, const c10::optional<at::Tensor>& mean_x, const at::Tensor& grad_logprob,
                   const c10::optional<at::Tensor>& grad_entropy, at::Tensor grad_logits,
                   const c10::optional<at::Tensor>& threshold, double logit_scale) {
  check_backward_args(logits, targets, valid_cols, lse, mean_x, grad_logprob, grad_entropy, grad_logits);
  check_threshold(threshold, logits);
  const float scale = checked_scale(logit_scale);
  const c10::cuda::CUDAGuard guard(logits.device());
  check_cuda(launch_logprob_backward(logits.data_ptr(), logits_dtype(logits), logits.size(0),
                                     logits.size(1), logits.stride(0), targets.data_ptr<int64_t>(), vocab_start,
                                     valid_cols, lse.data_ptr<float>(), optional_ptr(mean_x),
                                     grad_logprob.data_ptr<float>(), optional_ptr(grad_entropy),
                                     optional_ptr(threshold), scale, grad_logits.data_ptr(), grad_logits.stride(0),
                                     c10::cuda::getCurrentCUDAStream()),
             "launch_logprob_backward");
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
  // The in-place exp mode (CPU only): forward overwrites the logits with exp(z - m_row), backward the exps
  // with the gradient.
  m.def(
      "logprob_partials_writing_exps(Tensor(a!) logits, Tensor targets, int vocab_start, int valid_cols, "
      "bool with_entropy, Tensor? threshold, float logit_scale=1.0) -> Tensor");
  m.def(
      "logprob_backward_from_exps(Tensor(a!) exps, Tensor targets, int vocab_start, int valid_cols, "
      "Tensor prob_scale, Tensor target_prob, Tensor grad_logprob, float logit_scale=1.0) -> ()");
  m.def("compiled_with_cuda() -> bool", &megatron_grpo::compiled_with_cuda);
  m.def("cpu_kernel_isa() -> str", &megatron_grpo::cpu_kernel_isa);
  m.def("set_cpu_kernel_isa(str isa) -> str", &megatron_grpo::set_cpu_kernel_isa);
}

TORCH_LIBRARY_IMPL(megatron_grpo, CPU, m) {
  m.impl("logprob_partials", &megatron_grpo::partials_cpu);
  m.impl("logprob_backward", &megatron_grpo::backward_cpu);
  m.impl("logprob_partials_writing_exps", &megatron_grpo::partials_writing_exps_cpu);
  m.impl("logprob_backward_from_exps", &megatron_grpo::backward_from_exps_cpu);
}

#ifdef MEGATRON_GRPO_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_grpo, CUDA, m) {
  m.impl("logprob_partials", &megatron_grpo::partials_cuda);
  m.impl("logprob_backward", &megatron_grpo::backward_cuda);
}
#endif

// `import megatron_grpo._C` loads the library, which registers the ops above.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "megatron-grpo kernels (see torch.ops.megatron_grpo)",
                               -1, nullptr};
  return PyModule_Create(&module);
}
