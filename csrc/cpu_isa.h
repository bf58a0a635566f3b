// Which instruction-set build of the CPU kernels runs. On x86 each kernel source (logprob_cpu_kernels.cpp,
// top_p_cpu_kernels.cpp) is compiled once for AVX2 and once for AVX-512 (setup.py), each build in a namespace named
// by CPU_CAPABILITY as ATen does; elsewhere once, portable (DEFAULT). The dispatching files declare each build's
// entry points in those namespaces and call the active one with MGRPO_CPU_CALL.
#pragma once

namespace megatron_grpo {
namespace cpu {

enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The build that runs: torch's rule (cpu_isa.cpp), unless set_kernel_isa forced one.
Isa active_isa();

// The instruction set whose kernels run: "avx512", "avx2" or "portable" (a non-x86 build).
const char* kernel_isa();

// Forces the kernels of `isa` ("avx512", "avx2", or "auto" for torch's own choice, which honours the
// ATEN_CPU_CAPABILITY environment variable). Returns false, changing nothing, when `isa` is unknown, not
// built, or not supported by this CPU.
bool set_kernel_isa(const char* isa);

}  // namespace cpu
}  // namespace megatron_grpo

// Calls the active build's `name` (declared in the caller's namespaces AVX2 and AVX512, or DEFAULT).
#if defined(MEGATRON_GRPO_CPU_ISA_DISPATCH)
#define MGRPO_CPU_CALL(name, ...)                                                                        \
  (::megatron_grpo::cpu::active_isa() == ::megatron_grpo::cpu::Isa::kAvx512 ? AVX512::name(__VA_ARGS__) \
                                                                             : AVX2::name(__VA_ARGS__))
#else
#define MGRPO_CPU_CALL(name, ...) DEFAULT::name(__VA_ARGS__)
#endif
