"""Masked reductions over `[B, S]` per-token tensors, and the globally normalised `loss_agg_mode`s.

`mask` is the float trained-token mask (1 = trained). Values off the mask must be finite; they are ignored.
Under context parallelism (`context`, an `ops.ContextShard`) a rank holds part of each sequence's tokens: the
per-sequence sums and counts are summed over the CP group (`ops.context_shard.sum_over_context`), the scalar
reductions stay this rank's share.
"""

from __future__ import annotations

import torch

from megatron_grpo.loss.config import LossAggMode
from megatron_grpo.ops.context_shard import ContextShard, sum_over_context

Count = int | float | torch.Tensor  # a global valid-token or valid-sequence count


def token_sum_per_sequence(values: torch.Tensor, mask: torch.Tensor,
                           context: ContextShard | None = None) -> torch.Tensor:
    """`[B]`: the sum of each sequence's trained tokens (over every CP rank's tokens, with `context`)."""
    return sum_over_context((values * mask).sum(dim=-1), context)


def token_count_per_sequence(mask: torch.Tensor, context: ContextShard | None = None) -> torch.Tensor:
    """`[B]`: each sequence's trained tokens (over every CP rank's tokens, with `context`); no gradient."""
    return sum_over_context(mask.detach().sum(dim=-1), context)


def token_mean_per_sequence(values: torch.Tensor, mask: torch.Tensor,
                            context: ContextShard | None = None) -> torch.Tensor:
    """`[B]`: the mean over each sequence's trained tokens (over every CP rank's tokens, with `context`, in one
    all-reduce of the sums and counts); 0 for a sequence without any."""
    sums = (values * mask).sum(dim=-1)
    if context is None:
        return sums / mask.sum(dim=-1).clamp(min=1)
    sums, counts = sum_over_context(torch.stack([sums, mask.detach().sum(dim=-1).to(sums.dtype)]), context)
    return sums / counts.clamp(min=1)


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar: the mean over all trained tokens; 0 when there are none."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def token_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar: the minimum over trained tokens; +inf (the identity of min) when there are none."""
    return torch.where(mask.bool(), values, torch.inf).amin()


def token_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar: the maximum over trained tokens; -inf (the identity of max) when there are none."""
    return torch.where(mask.bool(), values, -torch.inf).amax()


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    *,
    global_valid_tokens: Count,
    global_valid_seqs: Count,
    max_response_length: int | None,
    context: ContextShard | None = None,
) -> torch.Tensor:
    """The microbatch's share of the optimizer step's loss.

    Every mode is a sum over this microbatch divided by a global count, so summing the result over
    microbatches and data-parallel ranks gives the loss of the whole batch:
    - `token-mean`: sum over trained tokens / `global_valid_tokens`;
    - `seq-mean-token-mean`: sum over sequences of the sequence's token mean / `global_valid_seqs`;
    - `seq-mean-token-sum`: sum over sequences of the sequence's token sum / `global_valid_seqs`;
    - `seq-mean-token-sum-norm` (Dr. GRPO): as `seq-mean-token-sum`, each sum divided by `max_response_length`.
    A global count of 0 is treated as 1, so an empty step gives a loss of exactly 0.
    Under context parallelism (`context`) the sums are over this rank's tokens and the sequences' token counts over
    the CP group, so the CP ranks' shares add up to the whole sequences' loss.
    """
    if mode == "token-mean":
        return (per_token_loss * mask).sum() / _at_least_one(global_valid_tokens, per_token_loss)
    if mode == "seq-mean-token-mean":
        per_sequence = token_sum_per_sequence(per_token_loss, mask) / token_count_per_sequence(mask, context).clamp(
            min=1)
    elif mode == "seq-mean-token-sum":
        per_sequence = token_sum_per_sequence(per_token_loss, mask)
    elif mode == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError("loss_fn.max_response_length: seq-mean-token-sum-norm needs it, got None")
        per_sequence = token_sum_per_sequence(per_token_loss, mask) / max_response_length
    else:
        raise ValueError(f"loss_fn.loss_agg_mode: unknown mode {mode!r}")
    return per_sequence.sum() / _at_least_one(global_valid_seqs, per_token_loss)


def _at_least_one(count: Count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
