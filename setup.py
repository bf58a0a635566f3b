"""Builds megatron-grpo and its kernel extension `megatron_grpo._C`.

The C++ CPU kernels are always built. The CUDA kernels join them when the installed torch has CUDA and nvcc is
found (a CPU torch forces CUDA_HOME to None, so CI compile-checks `csrc/*.cu` with plain nvcc instead), for the
architectures of TORCH_CUDA_ARCH_LIST (torch's variable; default `DEFAULT_CUDA_ARCHS`).
On x86 the CPU kernel sources are compiled twice, for AVX2 + FMA (x86-64-v3) and for AVX-512, each build in its
own namespace (as ATen does with CPU_CAPABILITY); the extension picks one at run time. `megatron_grpo.ops` checks
the CPU (AVX2 at least) before using them.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
# The CUDA architectures built when TORCH_CUDA_ARCH_LIST is unset: A100 and H100/H200 code, and PTX of the highest
# for later GPUs (their driver compiles it at first load).
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def kernel_extensions() -> list:
    import torch
    from torch.utils import cpp_extension

    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    sources = ["csrc/bindings.cpp", "csrc/logprob_op.cpp", "csrc/cpu_isa.cpp", "csrc/logprob_cpu.cpp",
               "csrc/top_p_cpu.cpp"]
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-Wno-unknown-pragmas"]
    if platform.machine() in ("x86_64", "AMD64"):
        cxx.append("-DMEGATRON_GRPO_CPU_ISA_DISPATCH")  # the ISA builds are compiled by KernelBuildExt
    else:
        sources.extend(CPU_KERNELS)  # one portable build
    extension = cpp_extension.CppExtension
    extra = {"cxx": cxx}
    if with_cuda:
        extension = cpp_extension.CUDAExtension
        sources += ["csrc/logprob_cuda.cu", "csrc/top_p_cuda.cu"]
        cxx.append("-DMEGATRON_GRPO_WITH_CUDA")
        # No architecture flags here: torch's extension builder then takes them from TORCH_CUDA_ARCH_LIST.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        extra["nvcc"] = ["-O3", "-std=c++17", "-DMEGATRON_GRPO_WITH_CUDA", "--expt-relaxed-constexpr"]
    return [
        extension(
            name="megatron_grpo._C",
            sources=sources,
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args=extra,
            extra_link_args=["-fopenmp", *torch_cxx_runtime()],
        )
    ]


def torch_cxx_runtime() -> list[str]:
    """The C++ runtime that torch loaded into this process (libstdc++.so.6, from /proc/self/maps), linked by path so
    that the extension shares it. Some compilers link libstdc++ statically (the CUDA image's /opt/gcc/bin/g++ did:
    the extension then had no libstdc++ dependency); the extension then has a second C++ runtime, and an error that
    torch throws through its frames (every TORCH_CHECK) crashed the process or lost its message. Linked first, the
    shared runtime resolves every C++ symbol and the static one is not pulled in. Empty where there is no such file
    (not Linux, or another C++ runtime)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libstdc++.so"):
            return [path]
    return []


CPU_KERNELS = ("csrc/logprob_cpu_kernels.cpp", "csrc/top_p_cpu_kernels.cpp")
# (name, flags) of each x86 build of CPU_KERNELS. at::vec picks its implementation, and logprob_cpu_kernels.cpp
# its namespace, from CPU_CAPABILITY; Sleef's exp comes from libtorch_cpu.
CPU_ISA_BUILDS = (
    ("avx2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    ("avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
)


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    base = BuildExtension.with_options(use_ninja=True)

    class KernelBuildExt(base):
        """Compiles CPU_KERNELS once per CPU_ISA_BUILDS entry (the same sources, per-build flags, which setuptools
        cannot give a single source) and links the objects after the extension's own. The AVX2 objects come
        first, so where both builds emit the same inline function (c10 helpers), the linker keeps the AVX2 one."""

        def build_extension(self, ext):
            if "-DMEGATRON_GRPO_CPU_ISA_DISPATCH" in ext.extra_compile_args.get("cxx", []):
                base_flags = [f for f in ext.extra_compile_args["cxx"] if f != "-DMEGATRON_GRPO_CPU_ISA_DISPATCH"]
                for name, flags in CPU_ISA_BUILDS:
                    objects = self.compiler.compile(
                        list(CPU_KERNELS), output_dir=str(Path(self.build_temp) / f"isa_{name}"),
                        include_dirs=ext.include_dirs, extra_postargs={"cxx": base_flags + flags},
                    )
                    ext.extra_objects = [o for o in ext.extra_objects if f"isa_{name}" not in o] + objects
            super().build_extension(ext)

    return KernelBuildExt


setup(
    name="megatron-grpo",
    version="0.1.0",
    description="Megatron-Core plugin for the GRPO/PPO policy-gradient step",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo", "megatron_grpo.*"]),
    package_data={"megatron_grpo.runner": ["nemo_rl_known_keys.txt"]},  # `plan --nemo-rl-config` checks keys with it
    ext_modules=kernel_extensions(),
    cmdclass={"build_ext": build_ext_class()},
    install_requires=["torch>=2.4", "megatron-core>=0.16", "pyyaml", "numpy", "psutil", "tqdm", "tensorboard"],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3", "ruff==0.17.6"],  # ruff pinned: its verdict must not move under CI
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["megatron-grpo=megatron_grpo.runner.cli:console_main"]},
)
