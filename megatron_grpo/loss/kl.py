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
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, with `log r = reference_logprobs - logprobs`; NeMo-RL's `calculate_kl`.

    - `k1 = -log r`, unbiased but signed;
    - `k2 = (log r)^2 / 2`;
    - `k3 = r - 1 - log r`, unbiased and never negative.
    `input_clamp` clamps `log r` to `[-c, c]` first. `weights` (e.g. the score-function weight
    `exp(curr - sg(curr))`) multiply the estimate; where the input clamp binds they are detached, so the clamp
    stops every gradient of that token. `output_clamp` then clamps the weighted estimate to `[-c, c]`, so it
    bounds what enters the loss.
    """
    log_ratio = reference_logprobs - logprobs
    if input_clamp is not None:
        clamped = log_ratio.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(log_ratio == clamped, weights, weights.detach())
        log_ratio = clamped
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    elif kl_type == "k3":
        kl = torch.exp(log_ratio) - 1 - log_ratio
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type: unknown estimator {kl_type!r}")
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl
