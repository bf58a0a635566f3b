"""The loss-fused linear path: a sequence-additive loss (`ClippedPGLoss`) straight from final hidden states and the
output weight shard, its gradient computed chunk by chunk during forward.

Why: `vocab_parallel_linear_logprobs` runs 4 GEMMs per chunk over a step (forward logits; backward recomputes
them, then `dH` and `dW`), because the loss's gradient with respect to the logprobs is not known until backward.
For a loss that is a sum over sequences, normalised by global counts known beforehand (as `ClippedPGLoss` is: its
value on a microbatch is exactly that microbatch's share), the gradient of a chunk of whole sequences is known as
soon as their logprobs are. So forward, per chunk of sequences:

1. `logits = scale * h @ W_valid.T` for the chunk's trained rows (one GEMM, `chunks.chunk_logits`);
2. the kernels' partials, one all-gather of them over TP, the combine: logprob, entropy and lse per row;
3. the loss on the chunk's sequences alone, and its gradient with respect to their logprobs and entropies
   (autograd over `[rows]` vectors: cheap);
4. the backward kernel in place in the chunk's logits, then `dH = scale * dlogits @ W` and
   `dW += scale * dlogits.T @ h` (two GEMMs; `chunks.WeightGradient`).

3 GEMMs instead of 4, one small all-gather per chunk, and `dH`, `dW` kept for backward, which only scales them by
the upstream gradient. `dW` waits for that gradient in an fp32 sum of its own (bf16 / fp16 weights, several chunks),
then goes into Megatron DDP's `main_grad` where the weight has one, with Megatron's dummy as its autograd gradient
(`main_grad`). `dH` is this rank's partial sum over its vocab shard: the caller reduces it over TP where Megatron's
output layer does, as for the op. Chunks hold whole sequences, so a loss term that couples a sequence's tokens
(GSPO's sequence ratio, sequence-mean aggregation) is exact; a sequence whose trained rows exceed the chunk budget is
a chunk of its own. A packed batch (`[1, T]` with `cu_seqlens`, `loss.packing`) is cut the same way, each chunk a
run of whole packed sequences (a packed sub-batch of its own); under context parallelism the CP ranks cut the same
chunks. The value and metrics come from one more loss evaluation on the whole microbatch's (detached) logprobs.
No recomputed top-k / top-p here (use the op, `vocab_parallel_linear_logprobs`); a rollout engine's kept sets are
replayed (`kept_set=`, `ops.core.replay`), each chunk reading its rows' sets. The loss is a Python callable, so
this is an eager autograd Function, not a traceable op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_grpo.loss.packing import CU_SEQLENS, SequenceLayout
from megatron_grpo.ops.context_shard import ContextShard
from megatron_grpo.ops.core.backends import Implementation
from megatron_grpo.ops.core.checks import (
    check_kept_set_argument,
    check_kept_values,
    check_linear_inputs,
    check_target_ids,
)
from megatron_grpo.ops.core.chunking import chunk_rows_for, sequence_chunks
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.core.gemm import (
    WeightGradient,
    added_to_main_grad,
    chunk_buffer,
    chunk_logits,
    hidden_gradient,
    main_grad_of,
)
from megatron_grpo.ops.core.partials import RowStats, gather_partials
from megatron_grpo.ops.core.replay import RowSets, replay_gradient, replay_partials
from megatron_grpo.ops.core.rows import next_token_targets, row_gradient
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet
from megatron_grpo.ops.linear_logprobs import LinearCall
from megatron_grpo.ops.vocab_shard import VocabShard

Batch = Mapping[str, torch.Tensor]
# loss_fn(batch, curr_logprobs, curr_entropy) -> (loss, metrics): a sequence-additive loss on precomputed
# current logprobs and entropies (`[b, S]`, or `[1, t]` packed), with the global counts already bound.
SequenceLoss = Callable[[Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class LossFusedCall:
    """Everything the autograd Function takes besides `hidden` and `weight`."""

    loss_fn: SequenceLoss
    batch: Batch  # the loss's inputs (sliced per chunk by `layout.select`)
    layout: SequenceLayout  # padded (a sequence per row) or packed
    targets: torch.Tensor  # [B, S] (or [1, T]) next-token targets of each row (-1: not trained)
    trained_rows: torch.Tensor  # [trained rows] int64: each trained row's index among the flat rows, in order
    rows_per_sequence: list[int]  # trained rows of each sequence (known on the host)
    sequences_per_chunk: list[slice]
    token_spans: list[tuple[int, int]]  # each chunk's flat rows [start, stop) (known on the host)
    linear: LinearCall  # shard, valid columns, scale and kernels
    shift: bool = True  # row t scores token t + 1 (token-aligned outputs); False: row t's own target (row-aligned)
    kept: list[RowSets] | None = None  # each chunk's kept sets, replayed (`ops.core.replay`)


class LossFusedLinear(torch.autograd.Function):
    """Returns the loss (and, as non-differentiable outputs, the logprobs and entropies `[B, S]` aligned with the
    tokens); backward scales the `dH`, `dW` computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, call: LossFusedCall, metrics_out: dict):
        valid = call.linear.valid_cols
        weight_valid = weight[:valid]
        grad_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        # Not into main_grad yet: the upstream gradient that scales dW is known in backward only.
        weight_gradient = WeightGradient(weight, valid, len(call.sequences_per_chunk))
        logprobs = torch.zeros(hidden.shape[:2], dtype=compute_dtype(hidden.dtype), device=hidden.device)
        entropy = torch.zeros_like(logprobs)
        largest = max((sum(call.rows_per_sequence[sl]) for sl in call.sequences_per_chunk), default=0)
        buffer = chunk_buffer(largest, valid, hidden)  # one aligned logits buffer for every chunk
        first_row = 0  # of the chunk, among the trained rows
        for number, (sequences, span) in enumerate(zip(call.sequences_per_chunk, call.token_spans, strict=True)):
            count = sum(call.rows_per_sequence[sequences])
            rows = call.trained_rows[first_row:first_row + count] - span[0]  # within the chunk
            first_row += count
            LossFusedLinear.chunk(hidden, weight_valid, sequences, span, rows, buffer[:count], call, grad_hidden,
                                  weight_gradient, logprobs, entropy, None if call.kept is None else call.kept[number])
        with torch.no_grad():
            loss, metrics = call.loss_fn(call.batch, logprobs, entropy)
        metrics_out.update(metrics)
        ctx.main_grad = main_grad_of(weight)
        ctx.weight = weight if ctx.main_grad is not None else None
        ctx.valid_cols = valid
        ctx.save_for_backward(grad_hidden, weight_gradient.total if ctx.main_grad is not None
                              else weight_gradient.gradient())
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss.detach().clone(), logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprobs=None, _grad_entropy=None):
        grad_hidden, grad_weight = ctx.saved_tensors
        if ctx.main_grad is not None:  # dW_valid (fp32 or the weight's dtype) into Megatron DDP's buffer
            ctx.main_grad[:ctx.valid_cols].addcmul_(grad_weight, grad_loss.to(ctx.main_grad.dtype))
            return grad_hidden * grad_loss.to(grad_hidden.dtype), added_to_main_grad(ctx.weight), None, None
        scale = grad_loss.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * scale, None, None

    @staticmethod
    def chunk(hidden, weight_valid, sequences: slice, span: tuple[int, int], rows: torch.Tensor, buffer: torch.Tensor,
              call: LossFusedCall, grad_hidden, weight_gradient: WeightGradient, logprobs, entropy,
              kept: RowSets | None = None) -> None:
        """Forward, loss gradient and backward of one chunk of whole sequences, the flat rows `span`, whose trained
        rows are `rows` (indices among the chunk's rows; no host sync here), its logits in `buffer`; fills its rows of
        `logprobs`, `entropy` (aligned with the tokens) and `grad_hidden`, and adds its share to `weight_gradient`.
        `kept`: the trained rows' kept sets, replayed."""
        linear = call.linear
        kernels, start, valid, scale = (linear.kernels, linear.shard.start_index, linear.valid_cols,
                                        linear.distribution.logit_scale)
        first, stop = span
        h = hidden.reshape(-1, hidden.shape[-1])[first:stop].index_select(0, rows)
        row_targets = call.targets.reshape(-1)[first:stop].index_select(0, rows)
        logits = chunk_logits(h, weight_valid, scale, buffer)
        threshold = None
        if kept is None:
            partials = kernels.logprob_partials(logits, row_targets, start, valid, True, None)
        else:  # the engine's kept sets (`core.replay`)
            partials, threshold = replay_partials(logits, row_targets, kept, kernels, start, valid, True)
        stats = RowStats.of(kernels.combine(gather_partials(partials, linear.shard.group), row_targets, True), True)
        # The rows' logprobs and entropies as leaves at their tokens' positions: row t scores token t + 1, or, when the
        # targets were shifted before (row-aligned: context parallelism), its own position. When shifting, a
        # sequence's last row is never a trained one (the next token starts a row or a packed sequence, and has no
        # logprob), so every position stays inside the chunk.
        positions = rows + 1 if call.shift else rows
        sub_batch = call.layout.select(call.batch, sequences, span)
        token_shape = sub_batch["input_ids"].shape
        chunk_logprobs = logprobs.view(-1)[first:stop].view(token_shape)
        chunk_entropy = entropy.view(-1)[first:stop].view(token_shape)
        chunk_logprobs.view(-1)[positions] = stats.logprob
        chunk_entropy.view(-1)[positions] = stats.entropy
        with torch.enable_grad():
            leaf_logprobs = chunk_logprobs.clone().requires_grad_(True)
            leaf_entropy = chunk_entropy.clone().requires_grad_(True)
            loss, _ = call.loss_fn(sub_batch, leaf_logprobs, leaf_entropy)
            grad_logprobs, grad_entropy = torch.autograd.grad(loss, (leaf_logprobs, leaf_entropy),
                                                              allow_unused=True)
        grad_logprob_rows = _rows_of(grad_logprobs, positions, stats.lse)
        grad_entropy_rows = None if grad_entropy is None else _rows_of(grad_entropy, positions, stats.lse)
        mean_x = None if grad_entropy_rows is None else stats.mean_x
        patch = None if kept is None else replay_gradient(logits, row_targets, kept, threshold, stats.lse, mean_x,
                                                          grad_logprob_rows, grad_entropy_rows, start, valid)
        kernels.logprob_backward(logits, row_targets, start, valid, stats.lse, mean_x, grad_logprob_rows,
                                 grad_entropy_rows, logits, threshold)  # in place: logits become dlogits
        if patch is not None:
            patch.write(logits)
        dh = hidden_gradient(logits, weight_valid, scale, h.new_empty(h.shape))
        grad_hidden.view(-1, hidden.shape[-1])[first:stop].index_copy_(0, rows, dh)
        weight_gradient.add(logits, h, scale)


def _rows_of(per_token: torch.Tensor | None, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-token gradient as the rows' contiguous `[rows]` vector in `like`'s dtype (zeros when
    unused)."""
    if per_token is None:
        return row_gradient(None, positions.numel(), like)
    return row_gradient(per_token.reshape(-1).index_select(0, positions), positions.numel(), like)


def loss_fused_linear(
    loss_fn: SequenceLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    batch: Batch,
    *,
    shard: VocabShard | None = None,
    distribution: SamplingDistribution | None = None,
    chunk_rows: int | None = None,
    check_inputs: bool = True,
    implementation: Implementation = "auto",
    shift: bool = True,
    context: ContextShard | None = None,
    kept_set: KeptSet | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss_fn`'s loss and metrics on the current logprobs and entropies of the trained tokens, from final hidden
    states `[B, S, H]` and this rank's `[V_local, H]` output weight shard, with the gradient computed in forward
    (see the module docstring). Differentiable w.r.t. `hidden` (a partial sum over the vocab shard, to be reduced
    over TP by the caller) and `weight`.

    `targets` `[B, S]`: the sequences' token ids, < 0 where a token is not trained (the ops' `shift=True` targets).
    A packed batch (`batch['cu_seqlens']`, `loss.packing`) has `[1, T, H]` hidden states and `[1, T]` targets, < 0 at
    every sequence's first token (`loss.packing.next_token_targets_of`), so no logprob crosses a boundary.
    `loss_fn(batch, curr_logprobs, curr_entropy)` must be sequence-additive: its value on a subset of the
    sequences (`batch` cut by `SequenceLayout.select`) is their share of the whole (e.g. `ClippedPGLoss` with the
    global counts bound). `distribution`: its scale, or its replayed kept sets (`replay_kept_set` with `kept_set`,
    the `KeptSet` of the positions of `targets`); a recomputed top-k / top-p is a ValueError.
    `chunk_rows`: trained rows per chunk (whole sequences); None picks one as the op does (`chunk_rows_for`).
    `shift=False`: `targets` are each row's own (already shifted) targets, and the logprobs stay with the rows, as
    for a context-parallel rank's row-aligned share (padded, or packed with the share's own `cu_seqlens`).
    `context` (an `ContextShard`): the CP ranks cut the same chunks of sequences, from each sequence's largest count
    of trained rows over the group (one all-reduce), so that a loss summing over the group (`sum_over_context`)
    meets its peers chunk by chunk.
    """
    distribution = SamplingDistribution() if distribution is None else distribution
    if distribution.recomputes_filter:
        raise ValueError(f"distribution: the loss-fused path has no top-k / top-p (got top_k={distribution.top_k!r}, "
                         f"top_p={distribution.top_p!r}); use vocab_parallel_linear_logprobs and the loss on its "
                         "logprobs, or replay the engine's kept sets (replay_kept_set)")
    check_kept_set_argument(kept_set, distribution, targets)
    if hidden.dim() != 3 or hidden.shape[:2] != targets.shape:
        raise ValueError(f"hidden must be [B, S, H] with [B, S] = the targets' shape {tuple(targets.shape)}, got "
                         f"{tuple(hidden.shape)}")
    if shift:
        targets = next_token_targets(targets)
    check_linear_inputs(hidden, weight, targets, chunk_rows)
    shard = (VocabShard() if shard is None else shard).resolve(weight.shape[0])
    if check_inputs:
        check_target_ids(targets, shard)
        if kept_set is not None:
            check_kept_values(kept_set, targets.reshape(-1), shard, shift)
    layout = (SequenceLayout.packed(batch[CU_SEQLENS], targets.shape[1]) if CU_SEQLENS in batch
              else SequenceLayout.padded(*targets.shape, device=targets.device))
    trained = targets >= 0  # a trained row scores a token of its own sequence (shifting: token t + 1)
    # The call's host syncs: the rows per sequence (to cut chunks of whole sequences) and the trained rows' indices.
    local_counts = layout.sum(trained.to(torch.int64))
    per_sequence = local_counts.tolist()
    trained_rows = trained.reshape(-1).nonzero().squeeze(1)
    # The chunks are cut alike on every rank that meets the others in the loss: the CP ranks by their largest counts.
    cut_counts = per_sequence
    if context is not None:
        largest = local_counts.clone()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=context.group)
        cut_counts = largest.tolist()
    # The shard's whole width, the same on every TP rank, so that every rank cuts the same chunks (its valid columns
    # are fewer on the rank with the padding).
    budget = int(chunk_rows) if chunk_rows is not None else chunk_rows_for(sum(cut_counts), weight.shape[0],
                                                                            hidden.dtype)
    linear = LinearCall.of(weight, sum(per_sequence), shard, distribution, True, budget, implementation)
    chunks = sequence_chunks(cut_counts, budget)
    kept = None
    if kept_set is not None:  # each chunk's trained rows, a run of `trained_rows`
        bounds = [0]
        for sequences in chunks:
            bounds.append(bounds[-1] + sum(per_sequence[sequences]))
        kept = RowSets.of_groups(kept_set, trained_rows, [slice(a, b) for a, b in zip(bounds, bounds[1:])], shift)
    call = LossFusedCall(loss_fn=loss_fn, batch=batch, layout=layout, targets=targets, trained_rows=trained_rows,
                         rows_per_sequence=per_sequence, sequences_per_chunk=chunks,
                         token_spans=layout.token_spans(chunks), linear=linear, shift=shift, kept=kept)
    metrics: dict[str, torch.Tensor] = {}
    loss, _, _ = LossFusedLinear.apply(hidden, weight, call, metrics)
    return loss, metrics
