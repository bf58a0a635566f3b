"""Importance-sampling weights that correct for the rollout engine's distribution, with their truncation."""

from __future__ import annotations

import dataclasses

import torch

from megatron_grpo.loss.config import TruncatedImportanceSamplingConfig
from megatron_grpo.loss.reductions import token_mean_per_sequence


@dataclasses.dataclass(frozen=True)
class ImportanceWeights:
    """Detached `[B, S]` weights, and where truncation rejected or capped them (None without truncation)."""

    weights: torch.Tensor
    out_of_bounds: torch.Tensor | None


def importance_weights(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    truncation: TruncatedImportanceSamplingConfig,
    *,
    sequence_level: bool,
) -> ImportanceWeights:
    """Weights `w = exp(prev - generation)`, truncated as `truncation.type` says.

    With `sequence_level` (GSPO) each token carries its sequence's geometric-mean weight
    `exp(mean over trained tokens of (prev - generation))`, matching GSPO's length-normalised ratio.
    - `tis`: `w = min(w, ratio_max)` per token; out of bounds means `w > ratio_max`.
    - `icepop`: `w = 0` for tokens with `w` outside `[ratio_min, ratio_max]`.
    - `seq-mask-tis`: `w = 0` for every token of a sequence whose geometric-mean weight lies outside
      `[ratio_min, ratio_max]`; kept sequences keep their weights untruncated (they are in bounds on average).
    """
    log_weights = (prev_logprobs - generation_logprobs).detach()
    sequence_log_weights = token_mean_per_sequence(log_weights, mask)[:, None].expand_as(log_weights)
    weights = torch.exp(sequence_log_weights if sequence_level else log_weights)
    if truncation.type is None:
        return ImportanceWeights(weights=weights, out_of_bounds=None)
    if truncation.type == "tis":
        out_of_bounds = weights > truncation.ratio_max
        return ImportanceWeights(weights=weights.clamp(max=truncation.ratio_max), out_of_bounds=out_of_bounds)
    if truncation.type == "icepop":
        tested = weights
    elif truncation.type == "seq-mask-tis":
        tested = torch.exp(sequence_log_weights)
    else:
        raise ValueError(f"loss_fn.truncated_importance_sampling.type: unknown type {truncation.type!r}")
    out_of_bounds = (tested < truncation.ratio_min) | (tested > truncation.ratio_max)
    return ImportanceWeights(weights=weights.masked_fill(out_of_bounds, 0.0), out_of_bounds=out_of_bounds)
