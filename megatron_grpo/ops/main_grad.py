"""Megatron DDP's gradient buffers, as its `ColumnParallelLinear` uses them with `gradient_accumulation_fusion`.

Megatron-Core's `DistributedDataParallel` gives every trained parameter a `main_grad` (a view into its fp32 gradient
buffer) and a flag `grad_added_to_main_grad`, reset by `zero_grad_buffer()`. Its backward hook adds `param.grad` into
`main_grad`, unless a layer already added its weight gradient there and said so with the flag. The fused paths then
sum dW straight into `main_grad`, with no fp32 accumulator of their own and no dW in the weight's dtype, and hand
autograd the dummy gradient Megatron's layers hand it (the hook still runs, which `overlap_grad_reduce` needs). The
dummy is zeros where the weight is also used elsewhere (`zero_out_wgrad`, which Megatron sets on an output weight
tied to the input embedding: the embedding's own gradient arrives through the same hook); else uninitialised.
"""

from __future__ import annotations

import torch


def main_grad_of(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight.main_grad` where `weight` follows Megatron DDP's protocol (`main_grad` of its shape and
    `grad_added_to_main_grad`), else None. A cast or a copy of the parameter has neither: it takes the plain path."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    return main_grad if main_grad.shape == weight.shape else None


def added_to_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """Marks `weight`'s gradient as added to its `main_grad` and returns the dummy gradient autograd gets instead
    (Megatron's `LinearWithGradAccumulationAndAsyncCommunication` does the same)."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
