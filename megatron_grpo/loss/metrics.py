"""The loss's metrics, each declared with how it aggregates over microbatches and data-parallel ranks.

A microbatch's metrics dict holds detached 0-dim tensors. `token_mean` metrics are means over that
microbatch's trained tokens; they are combined weighted by its `num_valid_tokens`, so the aggregate is the
mean over every trained token of the step whatever the split (`sequence_mean` ones likewise, weighted by
`num_valid_samples`, and the other means by the count `MEAN_WEIGHTS` names). Tokens a metric leaves out (filtered
out by top-k / top-p, or with a non-finite generation logprob) still carry weight, so with such tokens the aggregate
is a close approximation, exact per microbatch.

`normalised_sum` metrics are shares of the step's globally normalised loss (the loss itself, VAPO's NLL): summed.
Under deferred normalisation (`LossCall.defer_normalisation`) each share is an unnormalised sum, and the step
divides the aggregate by `NORMALISER`, the count the loss reported (`megatron.step`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch
import torch.distributed as dist

from megatron_grpo.loss.prev_approximation import error_metric_names


class Aggregation(enum.Enum):
    SUM = "sum"
    NORMALISED_SUM = "normalised_sum"  # a share of the globally normalised loss: summed (see the module docstring)
    TOKEN_MEAN = "token_mean"
    SEQUENCE_MEAN = "sequence_mean"
    SEQUENCE_MEAN_BEFORE_MASK = "sequence_mean_before_mask"  # over the sequences the logprob-error mask checked
    MASKED_SEQUENCE_MEAN = "masked_sequence_mean"  # over the sequences the logprob-error mask dropped
    MIN = "min"
    MAX = "max"
    PER_TOKEN = "per_token"  # a [B, S] tensor for the training loop, not a scalar; aggregation skips it


METRIC_AGGREGATION: Mapping[str, Aggregation] = MappingProxyType(
    {
        "loss": Aggregation.NORMALISED_SUM,  # already globally normalised: the step's loss is the sum
        "loss_normaliser": Aggregation.SUM,  # deferred normalisation: the count the step's sums are divided by
        "num_valid_tokens": Aggregation.SUM,
        "num_valid_samples": Aggregation.SUM,
        "filtered_out_tokens": Aggregation.SUM,
        "nonfinite_generation_logprobs": Aggregation.SUM,
        "positive_nll_loss": Aggregation.NORMALISED_SUM,  # globally normalised like the loss
        "probs_ratio": Aggregation.TOKEN_MEAN,
        "probs_ratio_min": Aggregation.MIN,
        "probs_ratio_max": Aggregation.MAX,
        "probs_ratio_clamped": Aggregation.TOKEN_MEAN,
        "probs_ratio_clamped_min": Aggregation.MIN,
        "probs_ratio_clamped_max": Aggregation.MAX,
        "clip_fraction_lower": Aggregation.TOKEN_MEAN,
        "clip_fraction_upper": Aggregation.TOKEN_MEAN,
        "kl_penalty": Aggregation.TOKEN_MEAN,
        "entropy": Aggregation.TOKEN_MEAN,
        "approx_entropy": Aggregation.TOKEN_MEAN,
        "token_mult_prob_error": Aggregation.TOKEN_MEAN,
        "gen_kl_error": Aggregation.TOKEN_MEAN,
        "sampling_importance_ratio": Aggregation.TOKEN_MEAN,
        "gen_ratio_outside_band": Aggregation.TOKEN_MEAN,
        "kept_set_mass": Aggregation.TOKEN_MEAN,  # with the rollout engine's kept sets in the batch
        "kept_set_differs": Aggregation.TOKEN_MEAN,
        "kept_set_replayed_ratio_outside_band": Aggregation.TOKEN_MEAN,  # with generation logprobs too
        "kept_set_recomputed_ratio_outside_band": Aggregation.TOKEN_MEAN,
        "is_oob_ratio": Aggregation.TOKEN_MEAN,  # SEQUENCE_MEAN for seq-mask-tis: see ClippedPGLoss.metric_aggregation
        "is_oob_token_ratio": Aggregation.TOKEN_MEAN,
        "curr_logprobs": Aggregation.PER_TOKEN,
        "prev_logprobs": Aggregation.PER_TOKEN,  # only when prev is approximated in the loss
        **{name: Aggregation.TOKEN_MEAN for name in error_metric_names()},  # compare_approximations
        # the sequence mask by logprob error (loss.logprob_error_mask), NeMo-RL's names but the fraction and count
        "num_masked_seqs_by_logprob_error": Aggregation.SUM,
        "num_valid_samples_before_mask": Aggregation.SUM,
        "masked_seqs_by_logprob_error_fraction": Aggregation.SEQUENCE_MEAN_BEFORE_MASK,
        "max_seq_mult_prob_error": Aggregation.MAX,
        "mean_seq_mult_prob_error": Aggregation.SEQUENCE_MEAN_BEFORE_MASK,
        "min_seq_mult_prob_error": Aggregation.MIN,
        "max_seq_mult_prob_error_after_mask": Aggregation.MAX,
        "mean_seq_mult_prob_error_after_mask": Aggregation.SEQUENCE_MEAN,  # the kept ones: num_valid_samples
        "min_seq_mult_prob_error_after_mask": Aggregation.MIN,
        "masked_correct_pct": Aggregation.MASKED_SEQUENCE_MEAN,
    }
)

TOKEN_WEIGHT = "num_valid_tokens"
SEQUENCE_WEIGHT = "num_valid_samples"
NORMALISER = "loss_normaliser"
# The count each kind of mean is weighted by, a metric of the same microbatch.
MEAN_WEIGHTS: Mapping[Aggregation, str] = MappingProxyType({
    Aggregation.TOKEN_MEAN: TOKEN_WEIGHT,
    Aggregation.SEQUENCE_MEAN: SEQUENCE_WEIGHT,
    Aggregation.SEQUENCE_MEAN_BEFORE_MASK: "num_valid_samples_before_mask",
    Aggregation.MASKED_SEQUENCE_MEAN: "num_masked_seqs_by_logprob_error",
})


def aggregate_metrics(
    per_microbatch: Sequence[Mapping[str, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
    aggregation: Mapping[str, Aggregation] = METRIC_AGGREGATION,
) -> dict[str, float]:
    """Combines the scalar metrics of a step's microbatches, and over the ranks of `group` when given.

    `aggregation` says how each metric combines (a loss's own `metric_aggregation`, where it has one). Every
    rank of `group` must call this with the same metric names. One all-reduce per aggregation kind.
    """
    if not per_microbatch:
        raise ValueError("aggregate_metrics: no microbatch metrics to aggregate")
    names = _scalar_metric_names(per_microbatch, aggregation)
    stacked = {name: torch.stack([m[name].detach().to(torch.float64) for m in per_microbatch]) for name in names}
    by_kind = {kind: [name for name in names if aggregation[name] is kind] for kind in Aggregation}
    sum_names = by_kind[Aggregation.SUM] + by_kind[Aggregation.NORMALISED_SUM]
    sums = [stacked[name].sum() for name in sum_names]
    weighted_sums = [
        (stacked[name] * stacked[weight]).sum() for kind, weight in MEAN_WEIGHTS.items() for name in by_kind[kind]
    ]
    mean_names = [name for kind in MEAN_WEIGHTS for name in by_kind[kind]]
    summed = _all_reduced(sums + weighted_sums, dist.ReduceOp.SUM, group)
    result = dict(zip(sum_names + mean_names, summed, strict=True))
    for kind, weight in MEAN_WEIGHTS.items():
        for name in by_kind[kind]:
            result[name] /= max(result[weight], 1.0)
    for kind, op, reduce in (
        (Aggregation.MIN, dist.ReduceOp.MIN, torch.amin),
        (Aggregation.MAX, dist.ReduceOp.MAX, torch.amax),
    ):
        extremes = _all_reduced([reduce(stacked[name]) for name in by_kind[kind]], op, group)
        result.update(zip(by_kind[kind], extremes, strict=True))
    return {name: result[name] for name in names}


def _all_reduced(values: list[torch.Tensor], op: dist.ReduceOp, group: dist.ProcessGroup | None) -> list[float]:
    """`values` reduced element-wise over `group` (as they are without one), in one collective."""
    if not values:
        return []
    stacked = torch.stack(values)
    if group is not None:
        dist.all_reduce(stacked, op=op, group=group)
    return stacked.tolist()


def _scalar_metric_names(
    per_microbatch: Sequence[Mapping[str, torch.Tensor]], aggregation: Mapping[str, Aggregation]
) -> list[str]:
    names = list(per_microbatch[0])
    for index, metrics in enumerate(per_microbatch[1:], start=1):
        if set(metrics) != set(names):
            raise ValueError(
                f"aggregate_metrics: microbatch {index} has metrics {sorted(metrics)}, microbatch 0 has {sorted(names)}"
            )
    undeclared = [name for name in names if name not in aggregation]
    if undeclared:
        raise ValueError(f"aggregate_metrics: metrics without a declared aggregation: {undeclared}")
    if TOKEN_WEIGHT not in names:
        raise ValueError(f"aggregate_metrics: {TOKEN_WEIGHT!r} is missing; token means are weighted by it")
    for kind, weight in MEAN_WEIGHTS.items():
        if weight not in names and any(aggregation[name] is kind for name in names):
            raise ValueError(f"aggregate_metrics: {weight!r} is missing; {kind.value} metrics are weighted by it")
    return [name for name in names if aggregation[name] is not Aggregation.PER_TOKEN]
