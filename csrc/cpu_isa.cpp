// Run-time choice between the per-instruction-set builds of the CPU kernels (logprob_cpu_kernels.cpp,
// top_p_cpu_kernels.cpp).
//
// By default the kernels follow the rule of torch's own CPU capability: the best the CPU supports (cpuid),
// capped by the ATEN_CPU_CAPABILITY environment variable as torch reads it, so `ATEN_CPU_CAPABILITY=avx2` runs
// the AVX2 kernels on an AVX-512 machine. (torch's at::native::get_cpu_capability is not exported to
// extensions; megatron_grpo.ops.backends also aligns the choice with torch.backends.cpu.get_cpu_capability().)
// `set_kernel_isa` overrides it at run time (tests compare the builds in one process with it).
#include "cpu_isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace megatron_grpo {
namespace cpu {

namespace {

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

}  // namespace

Isa active_isa() {
  static const Isa automatic = torch_isa();
  const int forced = forced_isa.load(std::memory_order_relaxed);
  return forced < 0 ? automatic : static_cast<Isa>(forced);
}

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

}  // namespace cpu
}  // namespace megatron_grpo
