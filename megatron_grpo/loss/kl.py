"""Per-token estimators of KL(pi || pi_ref) from logprobs of tokens sampled from pi (Schulman's k1, k2, k3)."""

from __future__ import annotations

import torch

from megatron_grpo.loss.config import KLType


def kl_estimate(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    kl_type: KLType,
    *,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, with `log r = reference_logprobs - logprobs`.

    - `k1 = -log r`, unbiased but signed;
    - `k2 = (log r)^2 / 2`;
    - `k3 = r - 1 - log r`, unbiased and never negative.
    `input_clamp` clamps `log r` to `[-c, c]` first; `output_clamp` clamps the estimate to `[-c, c]`.
    """
    log_ratio = reference_logprobs - logprobs
    if input_clamp is not None:
        log_ratio = log_ratio.clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    elif kl_type == "k3":
        kl = torch.exp(log_ratio) - 1 - log_ratio
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type: unknown estimator {kl_type!r}")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl
