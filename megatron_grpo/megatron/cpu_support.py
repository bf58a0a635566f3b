"""Makes Megatron-Core 0.16+ run on a machine without CUDA (checked with gloo, TP=2). A no-op when CUDA exists.

Every workaround lives here, with its reason (docs/design.md, "Platforms and Megatron-Core on the CPU"):

1. `torch.cuda.current_device()` places buffers in RoPE, `GlobalMemoryBuffer` and the TP gathers. Without CUDA
   it must name the CPU: it returns "cpu".
2. `forward_backward_no_pipelining` creates `torch.zeros([], device="cuda")` for its token count. The tensor
   factories of that one module are redirected to the CPU, so the Megatron schedule stays the only code path.
3. `dist_checkpointing` calls `torch.cuda.synchronize()`; with no device there is nothing to wait for: no-op.
4. Megatron-Core 0.19's DDP asks `torch.cuda.current_stream()` for the stream that waits on CUDA-graph events
   before each gradient reduction; without a device it gets a stream that has nothing to wait for.

Handled where they arise rather than by patching:
5. The RNG tracker: `model_parallel_cuda_manual_seed` needs CUDA RNG state, so `parallel.init_parallel` asks
   for Megatron's inference tracker on CPU (its forks are no-ops; dropout then draws from the CPU generator).
6. `sequence_parallel` needs TE's LayerNorm: `model.build_gpt_model` keeps it off (its local spec has torch's);
   a script's own GPTModel with TE can turn it on, and the fused paths then gather its hidden states
   (`hidden_states.py`).
7. `megatron.core.optimizer` allocates on "cuda" in its constructor: on the CPU the policy's optimizer is a torch
   one over the gradients Megatron's DDP reduced into `main_grad` (`optimizer.py`).
"""

from __future__ import annotations

import types

import torch

_applied = False


def apply_cpu_support() -> bool:
    """Applies workarounds 1-4 once if CUDA is unavailable; returns whether the process runs on the CPU."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        torch.cuda.current_device = _cpu_device
        torch.cuda.synchronize = _no_synchronize
        torch.cuda.current_stream = _CpuStream
        from megatron.core.pipeline_parallel import schedules

        schedules.torch = _CpuFactoryTorch()
        _applied = True
    return True


def _cpu_device() -> str:
    return "cpu"


def _no_synchronize(device: object = None) -> None:
    """There is no device stream to wait for."""


class _CpuStream:
    """The current "stream" of a process without a device: work is already done when it is issued."""

    def __init__(self, device: object = None) -> None:
        pass

    def wait_event(self, event: object) -> None:
        """Nothing is pending."""

    def wait_stream(self, stream: object) -> None:
        """Nothing is pending."""

    def synchronize(self) -> None:
        """Nothing is pending."""


class _CpuFactoryTorch(types.ModuleType):
    """`torch` as seen by one Megatron module: the same, except that `device="cuda"` factories build CPU tensors."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor")

    def __init__(self) -> None:
        super().__init__("torch")
        for name in self._FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def _on_cpu(factory):
    def build(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    build.__name__ = factory.__name__
    return build
