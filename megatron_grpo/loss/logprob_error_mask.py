"""NeMo-RL's sequence mask by logprob error (`grpo.seq_logprob_error_threshold`), applied inside the loss.

A sequence's error is NeMo-RL's `seq_mult_prob_error`: the mean over its trained tokens of `exp(|generation - prev|)`
(1 when the rollout engine and the trainer agree). A sequence with a trained token whose error exceeds the threshold
(or is NaN) leaves the loss, its metrics and the step's counts, as NeMo-RL's
`compute_and_apply_seq_logprob_error_masking` takes it out of `sample_mask`; a sequence without a trained token has
error 0 and stays as it is.

NeMo-RL masks before the loss, from a prev pass. Here the loss masks: from the batch's `prev_logprobs` when a prev
pass put them there, else from the training forward's `curr.detach()`, which is the prev policy exactly when the
pass is redundant (one optimizer step per rollout, no dropout: `megatron_grpo.scheduler`). The counts that normalise
the loss are then known only after every microbatch's forward, so the step defers its normalisation
(`LossCall.defer_normalisation`).

Metrics, under NeMo-RL's names where NeMo-RL has them (`train/<name>` there):
- `num_masked_seqs_by_logprob_error`: the sequences the threshold masked;
- `max_seq_mult_prob_error`, `mean_seq_mult_prob_error`, `min_seq_mult_prob_error`: over the sequences with a trained
  token before the mask, and the same with `_after_mask` over those it kept;
- `masked_correct_pct`: the fraction (in [0, 1], as NeMo-RL's) of the masked sequences whose reward is 1, when the
  batch carries `rewards`;
- this project's own: `masked_seqs_by_logprob_error_fraction`, the masked share of the sequences with a trained token
  before the mask, and `num_valid_samples_before_mask`, that count (the weight of the means before the mask).
Over no sequence a min / max is the identity (+inf / -inf) where NeMo-RL logs 0, and a mean is 0 as there. Under
context parallelism the per-sequence sums are over the CP group and one rank of it reports the counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_grpo.loss.packing import SequenceLayout
from megatron_grpo.loss.reductions import token_count_per_sequence, token_sum_per_sequence
from megatron_grpo.ops.context_shard import ContextShard

MASK_METRICS = (
    "num_masked_seqs_by_logprob_error", "num_valid_samples_before_mask", "masked_seqs_by_logprob_error_fraction",
    "max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error",
    "max_seq_mult_prob_error_after_mask", "mean_seq_mult_prob_error_after_mask", "min_seq_mult_prob_error_after_mask",
    "masked_correct_pct",
)


@dataclass(frozen=True)
class LogprobErrorMask:
    """The trained-token mask without the sequences the threshold masked, and the mask's metrics (detached)."""

    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def check_threshold(threshold: float | None) -> None:
    """A threshold is None (no mask) or a number > 0 (the error is >= 1 on any sequence with a trained token)."""
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
            or threshold <= 0:
        raise ValueError(f"seq_logprob_error_threshold: must be None or a finite number > 0, got {threshold!r}")


def sequence_mult_prob_error(prev: torch.Tensor, generation: torch.Tensor, mask: torch.Tensor,
                             layout: SequenceLayout | None = None, *,
                             context: ContextShard | None = None) -> torch.Tensor:
    """`[N]`: NeMo-RL's `seq_mult_prob_error`, the mean over each sequence's trained tokens of `exp(|generation -
    prev|)`; +inf where either logprob is infinite on a trained token, NaN where one is NaN, 0 for a sequence without
    a trained token. Over the CP group's tokens, with `context`."""
    on_mask = mask.bool()
    error = torch.where(on_mask, torch.exp((generation.detach() - prev.detach()).abs()),
                        torch.zeros((), dtype=torch.float32, device=mask.device))
    sums = token_sum_per_sequence(error, on_mask.to(error.dtype), layout, context=context)
    return sums / token_count_per_sequence(mask, layout, context=context).clamp(min=1)


def mask_by_logprob_error(prev: torch.Tensor, generation: torch.Tensor, mask: torch.Tensor, threshold: float,
                          layout: SequenceLayout, *, context: ContextShard | None = None,
                          rewards: torch.Tensor | None = None) -> LogprobErrorMask:
    """The mask of the sequences whose `sequence_mult_prob_error` is at most `threshold` (and of those without a
    trained token), and NeMo-RL's metrics of it (see the module docstring); `rewards` `[N]` for `masked_correct_pct`.
    """
    with torch.no_grad():
        error = sequence_mult_prob_error(prev, generation, mask, layout, context=context)
        valid = token_count_per_sequence(mask, layout, context=context) > 0
        rejected = valid & ~(error <= threshold)  # NaN fails the comparison: masked, as in NeMo-RL
        kept = valid & ~rejected
        counted = context is None or context.counts_sequences  # one CP rank counts the sequences
        masked = rejected.to(torch.float32).sum() if counted else torch.zeros((), device=mask.device)
        checked = valid.to(torch.float32).sum() if counted else torch.zeros((), device=mask.device)
        metrics = {
            "num_masked_seqs_by_logprob_error": masked,
            "num_valid_samples_before_mask": checked,
            "masked_seqs_by_logprob_error_fraction": rejected.sum() / valid.sum().clamp(min=1),
            **_extremes_and_mean(error, valid, ""),
            **_extremes_and_mean(error, kept, "_after_mask"),
        }
        if rewards is not None:
            correct = rejected & (rewards.to(error.device) == 1)
            metrics["masked_correct_pct"] = correct.sum() / rejected.sum().clamp(min=1)
        new_mask = mask * layout.broadcast((~rejected).to(mask.dtype))
    return LogprobErrorMask(mask=new_mask, metrics={name: value.to(torch.float32) for name, value in metrics.items()})


def _extremes_and_mean(error: torch.Tensor, over: torch.Tensor, suffix: str) -> dict[str, torch.Tensor]:
    """max / mean / min of `error` over the sequences flagged in `over` (the identities, and a mean of 0, over
    none)."""
    return {
        f"max_seq_mult_prob_error{suffix}": _extreme(torch.where(over, error, -torch.inf), torch.amax, -torch.inf),
        f"mean_seq_mult_prob_error{suffix}": torch.where(over, error, 0.0).sum() / over.sum().clamp(min=1),
        f"min_seq_mult_prob_error{suffix}": _extreme(torch.where(over, error, torch.inf), torch.amin, torch.inf),
    }


def _extreme(values: torch.Tensor, reduce, identity: float) -> torch.Tensor:
    """`reduce(values)`, or `identity` for a batch of no sequence."""
    return reduce(values) if values.numel() else torch.tensor(identity, device=values.device)
