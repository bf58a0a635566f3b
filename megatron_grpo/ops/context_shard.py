"""`ContextShard`: this rank's share of every sequence's tokens under context parallelism (CP), and the one
reduction of per-sequence sums over the CP group.

Under CP each rank of the group holds some positions of every sequence (Megatron's zigzag: rank `r` holds chunks
`r` and `2·CP−1−r` of the `2·CP` equal chunks of each padded row, or of each packed sequence). The targets are
shifted before the split, so the split batch is *row-aligned* (Megatron's `labels` convention): position `j` of a
per-token tensor describes the target of row `j`, the token after it, and the ops run with `shift=False`. The ops
and every per-token term of the loss are CP-agnostic: they read one row at a time. What couples a sequence's tokens
(GSPO's sequence ratio, the sequence-level importance weights, `seq-mask-tis`, the per-sequence token counts of the
sequence-level aggregations and metrics) goes through `sum_over_context`, over the `[N]` per-sequence sums that the
batch's `loss.packing.SequenceLayout` gives (one sequence per row of a padded `[B, S]` share; a packed share is a
packed batch of the same `N` sequences, each `1 / CP` as long, with its own `cu_seqlens`).

The loss stays a per-rank share: each rank sums its own tokens, divided by global counts, so the shares add up
over the CP ranks (Megatron's DDP then averages over DP × CP, and its schedule multiplies the loss by the CP size).
A per-sequence sum therefore has the all-reduce as its adjoint: the gradient of the shared value is summed over
the CP ranks (each rank's tokens feed every rank's share of that sequence's loss), then flows on to each rank's own
tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextShard:
    """The CP group this rank's tokens are split over (Megatron's `get_context_parallel_group()`); batches are
    row-aligned (see the module docstring). `None` as a loss's or op's argument means no CP: token-aligned batches,
    the ops' `shift=True`."""

    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def counts_sequences(self) -> bool:
        """Whether this rank reports the sequence counts of a metric: one rank of the group (its first), so that a
        sum of metrics over DP × CP counts each sequence once."""
        return dist.get_rank(self.group) == 0


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a group; its adjoint, the all-reduce of the gradient, in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = tensor.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def sum_over_context(per_sequence: torch.Tensor, context: ContextShard | None) -> torch.Tensor:
    """`per_sequence` (partial sums over this rank's tokens of each sequence, any shape) summed over the CP group:
    the whole sequences' sums, the same on every CP rank. Differentiable: backward sums the gradient over the group
    (the adjoint of the sum), so a shared per-sequence value used by every rank's share of the loss sends each
    rank's tokens the gradient of the whole loss. Without `context`, `per_sequence` itself."""
    if context is None:
        return per_sequence
    if not torch.is_grad_enabled() or not per_sequence.requires_grad:
        total = per_sequence.detach().contiguous().clone()
        dist.all_reduce(total, group=context.group)
        return total
    return _SumOverGroup.apply(per_sequence, context.group)
