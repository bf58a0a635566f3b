// The public op `megatron_grpo::vocab_parallel_logprobs`, its schema and its autograd kernel.
//
// The op's implementation (shard, filter, kernels, all-gather) and its fake kernel are Python's
// (megatron_grpo/ops/vocab_parallel.py registers them); what is here is the part that runs on every call and needs
// no Python: the autograd kernel. Under no_grad, or when the logits do not require a gradient, it only steps below
// autograd (no autograd object is built); otherwise a C++ autograd node saves what backward needs and its backward
// calls `vocab_parallel_logprobs_backward` (Python's implementation too). torchvision registers its ops the same way,
// and torch.compile traces them as any op with a fake kernel: the dispatcher reaches the fake kernel below autograd.
//
// Without this library (no compiled extension) Python defines the same schemas and an autograd kernel of its own
// (megatron_grpo/ops/core/custom_op.py); tests/ops/test_compile.py checks that the two schemas agree.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace megatron_grpo {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using OptionalTensor = c10::optional<at::Tensor>;
using ForwardSignature = Outputs(const at::Tensor&, const at::Tensor&, c10::optional<int64_t>, c10::optional<int64_t>,
                                 c10::string_view, double, c10::optional<int64_t>, c10::optional<double>, bool, bool,
                                 c10::string_view, const OptionalTensor&, const OptionalTensor&, bool);
using BackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                                     c10::optional<int64_t>, c10::optional<int64_t>, c10::string_view, double,
                                     c10::optional<int64_t>, c10::optional<double>, c10::string_view,
                                     const OptionalTensor&, const OptionalTensor&, bool);
constexpr int kForwardArguments = 14;

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("megatron_grpo::vocab_parallel_logprobs", "")
                             .typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("megatron_grpo::vocab_parallel_logprobs_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

// The op below autograd: its implementation in eager, its fake kernel under a tracing mode.
Outputs below_autograd(const at::Tensor& logits, const at::Tensor& targets, c10::optional<int64_t> start_index,
                       c10::optional<int64_t> true_vocab_size, c10::string_view group_name, double logit_scale,
                       c10::optional<int64_t> top_k, c10::optional<double> top_p, bool with_entropy,
                       bool check_inputs, c10::string_view implementation, const OptionalTensor& kept_offsets,
                       const OptionalTensor& kept_ids, bool kept_next_token) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return forward_op().call(logits, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                           with_entropy, check_inputs, implementation, kept_offsets, kept_ids, kept_next_token);
}

OptionalTensor present(const at::Tensor& tensor) {
  return tensor.defined() ? OptionalTensor(tensor) : c10::nullopt;
}

// Outputs (logprob, entropy, lse, mean_x, threshold): the logprob and the entropy are differentiable; backward keeps
// the logits, the targets and the per-row logprob, lse, E[x] and threshold, the kept sets replayed (if any), and the
// call's arguments.
class LogprobsFunction : public torch::autograd::Function<LogprobsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                               c10::optional<int64_t> start_index, c10::optional<int64_t> true_vocab_size,
                               c10::string_view group_name, double logit_scale, c10::optional<int64_t> top_k,
                               c10::optional<double> top_p, bool with_entropy, bool check_inputs,
                               c10::string_view implementation, const OptionalTensor& kept_offsets,
                               const OptionalTensor& kept_ids, bool kept_next_token) {
    auto [logprob, entropy, lse, mean_x, threshold] =
        below_autograd(logits, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                       with_entropy, check_inputs, implementation, kept_offsets, kept_ids, kept_next_token);
    ctx->save_for_backward({logits, targets, logprob, lse, mean_x, threshold, kept_offsets.value_or(at::Tensor()),
                            kept_ids.value_or(at::Tensor())});
    auto& data = ctx->saved_data;
    data["start_index"] = start_index;
    data["true_vocab_size"] = true_vocab_size;
    data["group_name"] = std::string(group_name);
    data["logit_scale"] = logit_scale;
    data["top_k"] = top_k;
    data["top_p"] = top_p;
    data["implementation"] = std::string(implementation);
    data["kept_next_token"] = kept_next_token;
    ctx->mark_non_differentiable({lse, mean_x, threshold});
    ctx->set_materialize_grads(false);  // an entropy that is only logged passes no gradient, and its term is skipped
    return {logprob, entropy, lse, mean_x, threshold};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    variable_list out(kForwardArguments);
    out[0] = backward_op().call(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], present(grads[0]),
                                present(grads[1]), data["start_index"].toOptional<int64_t>(),
                                data["true_vocab_size"].toOptional<int64_t>(), data["group_name"].toStringRef(),
                                data["logit_scale"].toDouble(), data["top_k"].toOptional<int64_t>(),
                                data["top_p"].toOptional<double>(), data["implementation"].toStringRef(),
                                present(saved[6]), present(saved[7]), data["kept_next_token"].toBool());
    return out;
  }
};

Outputs logprobs_autograd(const at::Tensor& logits, const at::Tensor& targets, c10::optional<int64_t> start_index,
                          c10::optional<int64_t> true_vocab_size, c10::string_view group_name, double logit_scale,
                          c10::optional<int64_t> top_k, c10::optional<double> top_p, bool with_entropy,
                          bool check_inputs, c10::string_view implementation, const OptionalTensor& kept_offsets,
                          const OptionalTensor& kept_ids, bool kept_next_token) {
  if (!at::GradMode::is_enabled() || !logits.requires_grad()) {
    return below_autograd(logits, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                          with_entropy, check_inputs, implementation, kept_offsets, kept_ids, kept_next_token);
  }
  const variable_list out = LogprobsFunction::apply(logits, targets, start_index, true_vocab_size, group_name,
                                                    logit_scale, top_k, top_p, with_entropy, check_inputs,
                                                    implementation, kept_offsets, kept_ids, kept_next_token);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace
}  // namespace megatron_grpo

// The schemas, word for word those of megatron_grpo/ops/vocab_parallel.py (which defines them itself without this
// library).
TORCH_LIBRARY_FRAGMENT(megatron_grpo, m) {
  m.def(
      "vocab_parallel_logprobs(Tensor logits, Tensor targets, int? start_index, int? true_vocab_size, "
      "str group_name, float logit_scale, int? top_k, float? top_p, bool with_entropy, bool check_inputs, "
      "str implementation, Tensor? kept_offsets=None, Tensor? kept_ids=None, bool kept_next_token=False) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "vocab_parallel_logprobs_backward(Tensor logits, Tensor targets, Tensor logprob, Tensor lse, Tensor mean_x, "
      "Tensor threshold, Tensor? grad_logprob, Tensor? grad_entropy, int? start_index, int? true_vocab_size, "
      "str group_name, float logit_scale, int? top_k, float? top_p, str implementation, Tensor? kept_offsets=None, "
      "Tensor? kept_ids=None, bool kept_next_token=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatron_grpo, Autograd, m) {
  m.impl("vocab_parallel_logprobs", &megatron_grpo::logprobs_autograd);
}
