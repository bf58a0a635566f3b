"""Masked reductions over per-token tensors, and the globally normalised `loss_agg_mode`s.

`mask` is the float trained-token mask (1 = trained). Values off the mask must be finite; they are ignored.
Every per-sequence reduction is one path: the batch's `SequenceLayout` (`megatron_grpo.loss.packing`; one sequence
per row of a padded `[B, S]` batch, the default, or the sequences of a packed `[1, T]` one) gives this rank's `[N]`
per-sequence sums from its rows, and under context parallelism (`context`, an `ops.ContextShard`: this rank holds
part of each sequence's tokens) `ops.context_shard.sum_over_context` sums them over the CP group. The scalar
reductions and the loss stay this rank's share.
"""

from __future__ import annotations

import torch

from megatron_grpo.loss.config import LossAggMode
from megatron_grpo.loss.packing import SequenceLayout
from megatron_grpo.ops.context_shard import ContextShard, sum_over_context

Count = int | float | torch.Tensor  # a global valid-token or valid-sequence count


def token_sum_per_sequence(values: torch.Tensor, mask: torch.Tensor, layout: SequenceLayout | None = None, *,
                           context: ContextShard | None = None) -> torch.Tensor:
    """`[N]`: the sum of each sequence's trained tokens (`layout` None: one sequence per row of `[B, S]`; over
    every CP rank's tokens, with `context`)."""
    return sum_over_context(_layout(layout, mask).sum(values * mask), context)


def token_count_per_sequence(mask: torch.Tensor, layout: SequenceLayout | None = None, *,
                             context: ContextShard | None = None) -> torch.Tensor:
    """`[N]`: each sequence's trained tokens (over every CP rank's tokens, with `context`); no gradient."""
    return sum_over_context(_layout(layout, mask).sum(mask.detach()), context)


def token_mean_per_sequence(values: torch.Tensor, mask: torch.Tensor, layout: SequenceLayout | None = None, *,
                            context: ContextShard | None = None) -> torch.Tensor:
    """`[N]`: the mean over each sequence's trained tokens (over every CP rank's tokens, with `context`: the sums
    and counts in one all-reduce); 0 for a sequence without any."""
    layout = _layout(layout, mask)
    sums, counts = layout.sum(values * mask), layout.sum(mask.detach())
    if context is not None:
        sums, counts = sum_over_context(torch.stack([sums, counts.to(sums.dtype)]), context)
    return sums / counts.clamp(min=1)


def sequences_with_tokens(mask: torch.Tensor, layout: SequenceLayout | None = None, *,
                          context: ContextShard | None = None) -> torch.Tensor:
    """float32 `[N]`: 1 for each sequence with a token on `mask` (on any CP rank, with `context`), else 0."""
    return (token_count_per_sequence(mask, layout, context=context) > 0).to(torch.float32)


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
    layout: SequenceLayout | None = None,
    context: ContextShard | None = None,
) -> torch.Tensor:
    """The microbatch's share of the optimizer step's loss.

    Every mode is a sum over this microbatch divided by a global count, so summing the result over
    microbatches and data-parallel ranks gives the loss of the whole batch:
    - `token-mean`: sum over trained tokens / `global_valid_tokens`;
    - `seq-mean-token-mean`: sum over sequences of the sequence's token mean / `global_valid_seqs`;
    - `seq-mean-token-sum`: sum over sequences of the sequence's token sum / `global_valid_seqs`;
    - `seq-mean-token-sum-norm` (Dr. GRPO): as `seq-mean-token-sum`, each sum divided by `max_response_length`.
    A global count of 0 is treated as 1, so an empty step gives a loss of exactly 0. `layout`: where the
    sequences lie (None: one per row). Under context parallelism (`context`) the sums are over this rank's tokens
    and the sequences' token counts over the CP group, so the CP ranks' shares add up to the whole sequences' loss.
    """
    if mode == "token-mean":
        return (per_token_loss * mask).sum() / _at_least_one(global_valid_tokens, per_token_loss)
    if mode == "seq-mean-token-mean":
        per_sequence = token_sum_per_sequence(per_token_loss, mask, layout) / token_count_per_sequence(
            mask, layout, context=context).clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_sequence = token_sum_per_sequence(per_token_loss, mask, layout)
    elif mode == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError("loss_fn.max_response_length: seq-mean-token-sum-norm needs it, got None")
        per_sequence = token_sum_per_sequence(per_token_loss, mask, layout) / max_response_length
    else:
        raise ValueError(f"loss_fn.loss_agg_mode: unknown mode {mode!r}")
    return per_sequence.sum() / _at_least_one(global_valid_seqs, per_token_loss)


def aggregation_weights(
    mask: torch.Tensor,
    mode: LossAggMode,
    *,
    global_valid_tokens: Count,
    global_valid_seqs: Count,
    max_response_length: int | None,
    layout: SequenceLayout | None = None,
    context: ContextShard | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token weights `w` (`mask`'s shape, in `dtype`) such that `aggregate_loss(x, mask, mode, ...)` equals
    `(x * w).sum()` for every per-token `x`: each mode is linear in the per-token losses. The loss-fused head's
    closed-form gradient of an aggregated term is these weights times the term's derivative. The sequences' token
    counts (`seq-mean-token-mean`) are read from `mask` (over the CP group, with `context`: one all-reduce)."""
    dtype = mask.dtype if dtype is None else dtype
    like = torch.empty((), dtype=dtype, device=mask.device)
    weights = mask.detach().to(dtype)
    if mode == "token-mean":
        return weights / _at_least_one(global_valid_tokens, like)
    layout = _layout(layout, mask)
    if mode == "seq-mean-token-mean":
        weights = weights / layout.broadcast(token_count_per_sequence(mask, layout, context=context).to(dtype)
                                             .clamp(min=1))
    elif mode == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError("loss_fn.max_response_length: seq-mean-token-sum-norm needs it, got None")
        weights = weights / max_response_length
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_fn.loss_agg_mode: unknown mode {mode!r}")
    return weights / _at_least_one(global_valid_seqs, like)


def _layout(layout: SequenceLayout | None, mask: torch.Tensor) -> SequenceLayout:
    return SequenceLayout.padded(*mask.shape, device=mask.device) if layout is None else layout


def _at_least_one(count: Count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
