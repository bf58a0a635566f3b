"""Chooses who computes the partials and the gradient: the fused kernels of `megatron_grpo._C`, or their plain-torch
twins (`torch_kernels`). Both honour the same contract; the torch kernels also cover float64 and devices the
extension was not built for. When `_C` cannot be used, a one-time warning says why.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from typing import Literal, Protocol

import torch

from megatron_grpo.ops.core import torch_kernels

Implementation = Literal["auto", "fused", "torch"]
IMPLEMENTATIONS = ("auto", "fused", "torch")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


RowOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Kernels(Protocol):
    """`threshold` (float32 `[rows]`, or None) keeps only the logits `>=` it: the top-k/top-p filter.

    `logit_scale` (> 0, e.g. 1 / temperature): the kernels see `z = logit_scale * logits`; partials, threshold,
    lse and mean_x are in units of z, and the gradient written is d/d(logits) = logit_scale * d/dz.

    The op's per-row outputs come from the kernels: `logprob_stats` (one rank: the forward kernel ends each row with
    the combine) and `combine` (after the all-gather) return `(logprob, entropy, lse, mean_x)`, entropy and E[x]
    `[0]` without entropy. `logprob_gradient` is the out-of-place backward: a new gradient buffer with the logits'
    row alignment, from the upstream gradients as autograd hands them (None, any layout); `mean_x` is given with an
    entropy, `logprob` with the threshold (a filtered target passes no gradient). `logprob_backward` writes into a
    given buffer, which may be the logits.

    The in-place exp mode: `logprob_partials_writing_exps` also overwrites each valid column of each non-ignored
    row with `exp(z - m)` (m = the row's local max, the partials' MAX column; filtered logits get 0), and
    `logprob_backward_from_exps` turns those exps into the gradient in place, with `prob_scale = exp(m - lse)`
    per row and the target's probability `target_prob = exp(logprob)` per row (exact where a bf16 e is not),
    without the entropy term.
    """

    def logprob_partials(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
        threshold: torch.Tensor | None, logit_scale: float = 1.0,
    ) -> torch.Tensor: ...

    def logprob_stats(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
        threshold: torch.Tensor | None, logit_scale: float = 1.0,
    ) -> RowOutputs: ...

    def combine(self, gathered: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> RowOutputs: ...

    def logprob_gradient(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, lse: torch.Tensor,
        mean_x: torch.Tensor | None, logprob: torch.Tensor | None, grad_logprob: torch.Tensor | None,
        grad_entropy: torch.Tensor | None, threshold: torch.Tensor | None, logit_scale: float = 1.0,
    ) -> torch.Tensor: ...

    def logprob_backward(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, lse: torch.Tensor,
        mean_x: torch.Tensor | None, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None,
        grad_logits: torch.Tensor, threshold: torch.Tensor | None, logit_scale: float = 1.0,
    ) -> None: ...

    def logprob_partials_writing_exps(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
        threshold: torch.Tensor | None, logit_scale: float = 1.0,
    ) -> torch.Tensor: ...

    def logprob_backward_from_exps(
        self, exps: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, prob_scale: torch.Tensor,
        target_prob: torch.Tensor, grad_logprob: torch.Tensor, logit_scale: float = 1.0,
    ) -> None: ...


class FusedKernels:
    """The C++/CUDA kernels, through `torch.ops.megatron_grpo` (the in-place exp mode is CPU-only)."""

    def __init__(self) -> None:
        extension_status()  # loads megatron_grpo._C, which registers the ops
        ops = torch.ops.megatron_grpo
        # The overloads themselves: a call skips the overload packet's resolution.
        self._forward, self._combine, self._gradient = (ops.logprob_forward.default, ops.logprob_combine.default,
                                                        ops.logprob_gradient.default)

    def logprob_partials(self, logits, targets, vocab_start, valid_cols, with_entropy, threshold, logit_scale=1.0):
        return torch.ops.megatron_grpo.logprob_partials(logits, targets, vocab_start, valid_cols, with_entropy,
                                                        threshold, float(logit_scale))

    def logprob_stats(self, logits, targets, vocab_start, valid_cols, with_entropy, threshold, logit_scale=1.0):
        return self._forward(logits, targets, vocab_start, valid_cols, with_entropy, threshold, float(logit_scale))

    def combine(self, gathered, targets, with_entropy):
        return self._combine(gathered, targets, with_entropy)

    def logprob_gradient(self, logits, targets, vocab_start, valid_cols, lse, mean_x, logprob, grad_logprob,
                         grad_entropy, threshold, logit_scale=1.0):
        return self._gradient(logits, targets, vocab_start, valid_cols, lse, mean_x, logprob, grad_logprob,
                              grad_entropy, threshold, float(logit_scale))

    def logprob_backward(self, logits, targets, vocab_start, valid_cols, lse, mean_x, grad_logprob, grad_entropy,
                         grad_logits, threshold, logit_scale=1.0):
        torch.ops.megatron_grpo.logprob_backward(
            logits, targets, vocab_start, valid_cols, lse, mean_x, grad_logprob, grad_entropy, grad_logits,
            threshold, float(logit_scale),
        )

    def logprob_partials_writing_exps(self, logits, targets, vocab_start, valid_cols, with_entropy, threshold,
                                      logit_scale=1.0):
        _require_cpu_for_exp_mode(logits)
        return torch.ops.megatron_grpo.logprob_partials_writing_exps(
            logits, targets, vocab_start, valid_cols, with_entropy, threshold, float(logit_scale))

    def logprob_backward_from_exps(self, exps, targets, vocab_start, valid_cols, prob_scale, target_prob,
                                   grad_logprob, logit_scale=1.0):
        _require_cpu_for_exp_mode(exps)
        torch.ops.megatron_grpo.logprob_backward_from_exps(exps, targets, vocab_start, valid_cols, prob_scale,
                                                           target_prob, grad_logprob, float(logit_scale))


def _require_cpu_for_exp_mode(logits: torch.Tensor) -> None:
    if logits.device.type != "cpu":
        raise NotImplementedError(
            f"inplace_backward='exp' has fused kernels for CPU only, not {logits.device.type}; "
            "use inplace_backward=True (or implementation='torch')"
        )


class TorchKernels:
    """The plain-torch kernels of `megatron_grpo.ops.core.torch_kernels`."""

    logprob_partials = staticmethod(torch_kernels.logprob_partials)
    logprob_stats = staticmethod(torch_kernels.logprob_stats)
    combine = staticmethod(torch_kernels.combine)
    logprob_gradient = staticmethod(torch_kernels.logprob_gradient)
    logprob_backward = staticmethod(torch_kernels.logprob_backward)
    logprob_partials_writing_exps = staticmethod(torch_kernels.logprob_partials_writing_exps)
    logprob_backward_from_exps = staticmethod(torch_kernels.logprob_backward_from_exps)


@functools.cache
def extension_status() -> tuple[bool, str]:
    """(loaded, reason): whether `megatron_grpo._C` is usable here, and why not when it is not."""
    try:
        from megatron_grpo import _C  # noqa: F401  (loading registers torch.ops.megatron_grpo)
    except ImportError as err:
        return False, f"megatron_grpo._C could not be imported ({err}); build it with `pip install -e .`"
    if torch.ops.megatron_grpo.cpu_kernel_isa() == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        torch.ops.megatron_grpo.set_cpu_kernel_isa("avx2")  # follow torch where it declines AVX-512
    return True, "loaded"


def cpu_kernel_status() -> tuple[bool, str]:
    """(usable, reason) for the CPU kernels: on x86 they are built for x86-64-v3 (AVX2 + FMA)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return True, "portable build"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        cap = os.environ.get("ATEN_CPU_CAPABILITY")
        why = (f"ATEN_CPU_CAPABILITY={cap} caps torch's CPU capability at {capability!r}" if cap
               else f"this CPU lacks AVX2 (torch reports {capability!r})")
        return False, f"{why}; the CPU kernels are built for x86-64-v3 (AVX2 + FMA) and follow torch's capability"
    return True, capability


def cpu_kernel_isa() -> str | None:
    """The instruction set the fused CPU kernels run with: "avx512", "avx2" or "portable"; None without `_C`.

    Chosen once per process like torch's own kernels: ATEN_CPU_CAPABILITY=avx2 (read at start) forces AVX2.
    """
    if not extension_status()[0]:
        return None
    return str(torch.ops.megatron_grpo.cpu_kernel_isa())


def set_cpu_kernel_isa(isa: Literal["avx512", "avx2", "auto"]) -> str:
    """Forces the fused CPU kernels of one instruction set ("auto": torch's choice); returns the one in use.

    Raises RuntimeError when that build is missing or this CPU cannot run it.
    """
    if not extension_status()[0]:
        raise RuntimeError(extension_status()[1])
    return str(torch.ops.megatron_grpo.set_cpu_kernel_isa(isa))


def fused_supports(device: torch.device) -> bool:
    """Whether the fused kernels exist for `device` in this build and can run on this machine."""
    if not extension_status()[0]:
        return False
    if device.type == "cpu":
        return cpu_kernel_status()[0]
    return device.type == "cuda" and bool(torch.ops.megatron_grpo.compiled_with_cuda())


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"megatron_grpo: using the plain-torch logprob kernels: {reason}", stacklevel=3)


def select_kernels(logits: torch.Tensor, implementation: Implementation) -> Kernels:
    """The kernels for these logits; `auto` prefers fused and falls back to the torch kernels with a warning."""
    return select_kernels_for(logits.device, logits.dtype, implementation)


def select_kernels_for(device: torch.device, dtype: torch.dtype, implementation: Implementation) -> Kernels:
    """`select_kernels` for logits of this device and dtype."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, "
                         f"got {implementation!r}")
    if implementation == "torch":
        return TorchKernels()
    if dtype not in FUSED_DTYPES:
        if implementation == "fused":
            raise ValueError(f"the fused kernels support float32, bfloat16 and float16 logits, got {dtype}")
        return TorchKernels()
    if fused_supports(device):
        return FusedKernels()
    loaded, reason = extension_status()
    if loaded and device.type == "cpu":
        reason = cpu_kernel_status()[1]
    elif loaded:
        reason = f"megatron_grpo._C was built without kernels for {device.type} devices"
    if implementation == "fused":
        raise RuntimeError(f"fused logprob kernels unavailable: {reason}")
    _warn_fallback(reason)
    return TorchKernels()
