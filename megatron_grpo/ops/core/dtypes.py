"""The dtypes the ops take, and the one rule for the precision of their maths: float64 stays float64, every other
dtype computes in float32 (the kernels' fp32 maths, rounded once into the inputs' dtype where they write it)."""

from __future__ import annotations

import torch

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops compute in for inputs of `dtype`: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def in_compute_dtype(values: torch.Tensor) -> torch.Tensor:
    """`values` in `compute_dtype(values.dtype)` (itself when already there)."""
    return values.to(compute_dtype(values.dtype))
