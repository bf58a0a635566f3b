"""Builds megatron-grpo and its kernel extension `megatron_grpo._C`.

The C++ CPU kernels are always built. The CUDA kernels join them when the installed torch has CUDA and nvcc is
found (a CPU torch forces CUDA_HOME to None, so CI compile-checks `csrc/*.cu` with plain nvcc instead).
The CPU kernels target x86-64-v3 (AVX2 + FMA); `megatron_grpo.ops` checks the CPU before loading them.
"""

from __future__ import annotations

import platform
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def kernel_extensions() -> list:
    import torch
    from torch.utils import cpp_extension

    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    sources = ["csrc/bindings.cpp", "csrc/logprob_cpu.cpp"]
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-Wno-unknown-pragmas"]
    if platform.machine() in ("x86_64", "AMD64"):
        # at::vec picks its AVX2 implementation from this macro; Sleef's exp comes from libtorch_cpu.
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    extension = cpp_extension.CppExtension
    extra = {"cxx": cxx}
    if with_cuda:
        extension = cpp_extension.CUDAExtension
        sources.append("csrc/logprob_cuda.cu")
        cxx.append("-DMEGATRON_GRPO_WITH_CUDA")
        extra["nvcc"] = ["-O3", "-std=c++17", "-DMEGATRON_GRPO_WITH_CUDA", "--expt-relaxed-constexpr"] + [
            f"-gencode=arch=compute_{sm},code=sm_{sm}" for sm in ("80", "90")
        ]
    return [
        extension(
            name="megatron_grpo._C",
            sources=sources,
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
        )
    ]


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


setup(
    name="megatron-grpo",
    version="0.1.0",
    description="Megatron-Core plugin for the GRPO/PPO policy-gradient step",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_grpo", "megatron_grpo.*"]),
    ext_modules=kernel_extensions(),
    cmdclass={"build_ext": build_ext_class()},
    install_requires=["torch>=2.4", "megatron-core>=0.16", "pyyaml", "numpy", "psutil", "tqdm", "tensorboard"],
    extras_require={
        "test": ["pytest>=8"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["megatron-grpo=megatron_grpo.__main__:main"]},
)
