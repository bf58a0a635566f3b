"""The policy under Megatron-Core's `DistributedDataParallel`: the data-parallel gradient reduction is Megatron's.

`wrap_in_ddp` puts the GPTModel in Megatron's DDP and sets the model config's `finalize_model_grads_func`, so
the pipeline schedule ends every training call with Megatron's `finalize_model_grads`: the DP all-reduce of the
gradient buffers (a reduce-scatter with the distributed optimizer), and the other cross-rank sums Megatron
needs, such as the tied embedding's between the first and last pipeline stages. Gradients then live in each
parameter's fp32 `main_grad` (a view into DDP's buffer), not in `.grad`.

Megatron's DDP averages over the DP ranks: it assumes each rank's loss is the mean over its own share. The
GRPO loss is normalised over the global batch instead (`make_forward_step`), so the forward step scales the
loss it hands to the schedule by the DP size, and the average is the global loss's gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.utils import unwrap_model


def wrap_in_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool = False) -> DistributedDataParallel:
    """`model` in Megatron's DDP (fp32 gradient buffers, float64 ones for a float64 model; no overlap: one reduction
    after the last microbatch), with Megatron's `finalize_model_grads` as its config's `finalize_model_grads_func`.

    `use_distributed_optimizer`: lay the buffers out for Megatron's distributed optimizer (ZeRO-1, CUDA only).
    """
    ddp_config = DistributedDataParallelConfig(
        # fp32 buffers for fp32 and bf16 parameters; Megatron's own dtype, the parameters', for float64 ones
        grad_reduce_in_fp32=model.config.params_dtype != torch.float64,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = DistributedDataParallel(model.config, ddp_config, model)
    model.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module), or `model` itself."""
    return unwrap_model(model)


def is_ddp(model: torch.nn.Module) -> bool:
    """Whether `model` accumulates its gradients in Megatron DDP's `main_grad` buffers."""
    return isinstance(model, DistributedDataParallel)


def zero_grads(model: torch.nn.Module) -> None:
    """Fresh gradients for the next optimizer step: DDP's buffers (and `.grad`) zeroed, or `.grad` cleared."""
    if is_ddp(model):
        model.zero_grad_buffer()
    for param in model.parameters():
        param.grad = None


def scale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiplies the step's gradients by `factor` in place: each parameter's DDP `main_grad` (views of DDP's
    buffers), or its `.grad` outside DDP. Deferred normalisation divides them so, once, before clipping."""
    for param in model.parameters():
        grad = gradient(param)
        if grad is not None:
            grad.mul_(factor)


def gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The reduced gradient of `param`: DDP's `main_grad` when wrapped, else `.grad`."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


@contextlib.contextmanager
def main_grad_as_grad(params: Iterable[torch.nn.Parameter]) -> Iterator[int]:
    """While the block runs, each parameter's `.grad` is its DDP `main_grad` (a view, no copy), so that any torch
    optimizer's `step()` reads the gradients DDP reduced, as Megatron's own FP32 optimizer does; yields how many
    parameters had one. The views are dropped after: left in place, the next backward would accumulate into
    `main_grad` through `.grad`, and DDP's hook would then add that sum to itself.

    A parameter whose `main_grad` has another dtype than its own (bf16 weights over DDP's fp32 buffers) cannot take
    the view, and an update of bf16 weights would need fp32 master weights anyway: a ValueError names Megatron's
    optimizer, which keeps them."""
    viewed = []
    try:
        for param in params:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is None:
                continue
            if main_grad.dtype != param.dtype:
                raise ValueError(
                    f"optimizer: a {param.dtype} parameter's gradient is in DDP's {main_grad.dtype} main_grad, which a "
                    "torch optimizer cannot step it with; use Megatron's optimizer (fp32 master weights: "
                    "megatron.core.optimizer.get_megatron_optimizer, or megatron_grpo.megatron.build_optimizer)")
            param.grad = main_grad
            viewed.append(param)
        yield len(viewed)
    finally:
        for param in viewed:
            param.grad = None
