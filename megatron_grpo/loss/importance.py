"""Importance-sampling weights that correct for the rollout engine's distribution, with their truncation."""

from __future__ import annotations

import dataclasses

import torch

from megatron_grpo.loss.config import SequenceWeight, TruncatedImportanceSamplingConfig
from megatron_grpo.loss.packing import SequenceLayout
from megatron_grpo.loss.reductions import token_mean_per_sequence, token_sum_per_sequence
from megatron_grpo.ops.context_shard import ContextShard


@dataclasses.dataclass(frozen=True)
class ImportanceWeights:
    """Detached per-token weights, and where truncation rejected or capped them (None without truncation).

    `out_of_bounds` is per token for `tis` and `icepop`; for `seq-mask-tis` it is `[N]`, one flag per sequence.
    """

    weights: torch.Tensor
    out_of_bounds: torch.Tensor | None


def finite_or_zero(values: torch.Tensor) -> torch.Tensor:
    """`values` with NaN and +-inf replaced by 0: a weight from a -inf logprob must not poison the batch (NeMo-RL
    zeroes such weights the same way)."""
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


def importance_weights(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    truncation: TruncatedImportanceSamplingConfig,
    *,
    sequence_level: bool,
    sequence_weight: SequenceWeight,
    layout: SequenceLayout | None = None,
    context: ContextShard | None = None,
) -> ImportanceWeights:
    """Weights `w = exp(prev - generation)`, truncated as `truncation.type` says; non-finite weights are 0.

    With `sequence_level` (GSPO) each token carries its sequence's weight: `sequence_weight = "product"` is
    `exp(sum over trained tokens of (prev - generation))`, the probability ratio of the whole sequence (NeMo-RL,
    verl); `"geometric_mean"` is `exp(mean(...))`, length-normalised like GSPO's ratio.
    - `tis`: `w = clamp(w, ratio_min or 0, ratio_max)`; out of bounds means outside those bounds.
    - `icepop`: `w = 0` for tokens with `w` outside `[ratio_min, ratio_max]`.
    - `seq-mask-tis`: `w = 0` for every token of a sequence whose geometric-mean weight (non-finite token log
      weights counted as 0) lies outside `[ratio_min, ratio_max]`; kept sequences keep their token weights
      untruncated.
    `layout`: where the sequences lie (None: one per row of `[B, S]`). Under context parallelism (`context`) the
    sequence sums are over every CP rank's tokens.
    """
    layout = SequenceLayout.padded(*mask.shape, device=mask.device) if layout is None else layout
    log_weights = (prev_logprobs - generation_logprobs).detach()
    if sequence_level:
        if sequence_weight == "product":
            per_sequence = token_sum_per_sequence(log_weights, mask, layout, context=context)
        else:
            per_sequence = token_mean_per_sequence(log_weights, mask, layout, context=context)
        weights = layout.broadcast(torch.exp(per_sequence))
    else:
        weights = torch.exp(log_weights)
    weights = finite_or_zero(weights)
    if truncation.type is None:
        return ImportanceWeights(weights=weights, out_of_bounds=None)
    if truncation.type == "tis":
        ratio_min = 0.0 if truncation.ratio_min is None else truncation.ratio_min
        out_of_bounds = (weights < ratio_min) | (weights > truncation.ratio_max)
        return ImportanceWeights(weights=weights.clamp(ratio_min, truncation.ratio_max), out_of_bounds=out_of_bounds)
    if truncation.type == "icepop":
        out_of_bounds = (weights < truncation.ratio_min) | (weights > truncation.ratio_max)
        return ImportanceWeights(weights=weights.masked_fill(out_of_bounds, 0.0), out_of_bounds=out_of_bounds)
    if truncation.type == "seq-mask-tis":
        geometric_mean = torch.exp(token_mean_per_sequence(finite_or_zero(log_weights), mask, layout,
                                                           context=context))
        rejected = (geometric_mean < truncation.ratio_min) | (geometric_mean > truncation.ratio_max)
        return ImportanceWeights(weights=weights.masked_fill(layout.broadcast(rejected), 0.0), out_of_bounds=rejected)
    raise ValueError(f"loss_fn.truncated_importance_sampling.type: unknown type {truncation.type!r}")
