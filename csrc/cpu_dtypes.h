// The CPU kernels' logits element types: `dispatch_dtype` calls `f` with a value of the C++ type a LogitsDType
// names. Internal linkage, so that each instruction-set build of the CPU kernels (setup.py) keeps its own copy.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "logprob_common.h"

namespace megatron_grpo {
namespace {

template <typename F>
void dispatch_dtype(LogitsDType dtype, F&& f) {
  switch (dtype) {
    case LogitsDType::kFloat32: f(float{}); break;
    case LogitsDType::kBFloat16: f(c10::BFloat16{}); break;
    case LogitsDType::kFloat16: f(c10::Half{}); break;
  }
}

}  // namespace
}  // namespace megatron_grpo
