"""Tolerances of the tests that compare fp32 results computed two ways (another batching, TP/PP/DP layout, kernel
build or CPU), each with its reason. None may depend on how one CPU blocks its sums: an AVX-512 machine, another
BLAS kernel or another thread count rounds differently. Bit-exact comparisons stay only where the very same
operations run on the same machine (a resumed run, the ranks of one computation).

fp32 rounds each operation to within u = 2^-24 (6e-8) relative. A sum of n terms is off by up to about n u times the
sum of the terms' magnitudes, so an element that cancels to about 0 carries the error of its terms, not of its own
size: gradients are compared relative to their largest element, never elementwise-relative.
"""

from __future__ import annotations

import torch

FP32_U = 2.0**-24

# Logprobs of the tiny test models from two fp32 forwards of the same weights (another batching, layout, GEMM
# blocking, the fused op): each logit carries a few ulps per layer through the embedding, two layers and the head,
# at |logprob| < 4 where an ulp is 2.4e-7; 1e-5 is 40 ulps. Measured: at most 3.4e-7.
MODEL_LOGPROB_ATOL = 1e-5

# Gradients of the tiny test models from two fp32 backward passes, relative to the largest element: each element sums
# up to a few hundred token contributions through two layers, about 170 u. Measured: at most 3e-7.
MODEL_GRAD_RTOL = 1e-5


def adam_first_step_bound(grad_a: torch.Tensor, grad_b: torch.Tensor, weights: torch.Tensor, lr: float,
                          eps: float) -> torch.Tensor:
    """Elementwise bound on |w_a - w_b| after one Adam(W) step without weight decay from the same weights, taken with
    the (clipped) gradients `grad_a` and `grad_b`.

    Adam's first update is lr * g / (|g| + eps): bias correction makes m = g and v = g^2. For f(g) = g / (|g| + eps),
    |f(a) - f(b)| <= 2 |a - b| / (max(|a|, |b|) + eps), so the update is as well conditioned as the gradient where the
    gradient is large, and not at all where it is at the rounding level (an element whose exact value is 0, such as a
    key bias's under the softmax's shift invariance: Adam maps it to anything in [-lr, lr], whatever the CPU). Adam's
    own fp32 arithmetic adds a few u of lr, and each run rounds each weight once (u |w|).
    """
    a, b = grad_a.double(), grad_b.double()
    conditioned = 2 * (a - b).abs() / (torch.maximum(a.abs(), b.abs()) + eps)
    return lr * (conditioned + 16 * FP32_U) + 2 * FP32_U * weights.double().abs()
