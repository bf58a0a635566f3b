"""The loss-fused linear path: a sequence-additive loss (`ClippedPGLoss`) straight from final hidden states and the
output weight shard, its gradient computed chunk by chunk during forward.

Why: `vocab_parallel_linear_logprobs` runs 4 GEMMs per chunk over a step (forward logits; backward recomputes
them, then `dH` and `dW`), because the loss's gradient with respect to the logprobs is not known until backward.
For a loss that is a sum over sequences, normalised by global counts known beforehand (as `ClippedPGLoss` is: its
value on a microbatch is exactly that microbatch's share), the gradient of a chunk of whole sequences is known as
soon as their logprobs are. So forward, per chunk of sequences:

1. `logits = scale * h @ W_valid.T` for the chunk's trained rows (one GEMM);
2. the kernels' partials, one all-gather of them over TP, the combine: logprob, entropy and lse per row;
3. the loss on the chunk's sequences alone, and its gradient with respect to their logprobs and entropies
   (autograd over `[rows]` vectors: cheap);
4. the backward kernel in place in the chunk's logits, then `dH = scale * dlogits @ W` and
   `dW += scale * dlogits.T @ h` (two GEMMs).

3 GEMMs instead of 4, one small all-gather per chunk, and `dH`, `dW` kept for backward, which only scales them by
the upstream gradient. `dH` is this rank's partial sum over its vocab shard: the caller reduces it over TP where
Megatron's output layer does, as for the op. Chunks hold whole sequences, so a loss term that couples a
sequence's tokens (GSPO's sequence ratio, sequence-mean aggregation) is exact; a sequence whose trained rows
exceed the chunk budget is a chunk of its own. The value and metrics come from one more loss evaluation on the
whole microbatch's (detached) logprobs. No top-k / top-p here (use the recompute path, the op).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megatron_grpo.loss.batch import trained_token_mask, trained_token_targets
from megatron_grpo.ops import VocabShard
from megatron_grpo.ops.backends import Implementation, select_kernels
from megatron_grpo.ops.linear_logprobs import (LOW_PRECISION, VocabParallelLinearLogprobs, scaled_mm,
                                               add_product_in_fp32, check_linear_inputs, chunk_buffer,
                                               chunk_rows_for)
from megatron_grpo.ops.partials import combine_partials, gather_partials
from megatron_grpo.ops.shift import next_token_targets
from megatron_grpo.ops.vocab_parallel import check_target_ids

Batch = Mapping[str, torch.Tensor]
# loss_fn(batch, curr_logprobs, curr_entropy) -> (loss, metrics): a sequence-additive loss on precomputed
# `[b, S]` current logprobs and entropies, with the global counts already bound.
SequenceLoss = Callable[[Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class LossFusedCall:
    """Everything the autograd Function takes besides `hidden` and `weight`."""

    loss_fn: SequenceLoss
    batch: Batch
    targets: torch.Tensor  # [B, S] next-token targets of each row (-1: not trained)
    trained_rows: torch.Tensor  # [trained rows] int64: each trained row's index among the B * S rows, in order
    rows_per_sequence: list[int]  # trained rows of each sequence (known on the host)
    shard: VocabShard  # resolved
    valid_cols: int
    logit_scale: float
    sequences_per_chunk: list[slice]
    implementation: Implementation


class LossFusedLinear(torch.autograd.Function):
    """Returns the loss (and, as non-differentiable outputs, the logprobs and entropies `[B, S]` aligned with the
    tokens); backward scales the `dH`, `dW` computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, call: LossFusedCall, metrics_out: dict):
        kernels = select_kernels(weight, call.implementation)
        batch_size, seq_len, _ = hidden.shape
        weight_valid = weight[:call.valid_cols]
        grad_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        accumulate_fp32 = weight.dtype in LOW_PRECISION and len(call.sequences_per_chunk) > 1
        grad_weight_valid = torch.zeros(weight_valid.shape, device=weight.device,
                                        dtype=torch.float32 if accumulate_fp32 else weight.dtype)
        compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logprobs = torch.zeros(batch_size, seq_len, dtype=compute, device=hidden.device)
        entropy = torch.zeros_like(logprobs)
        largest = max((sum(call.rows_per_sequence[sl]) for sl in call.sequences_per_chunk), default=0)
        buffer = chunk_buffer(largest, call.valid_cols, hidden)  # one aligned logits buffer for every chunk
        first_row = 0  # of the chunk, among the trained rows
        for sequences in call.sequences_per_chunk:
            count = sum(call.rows_per_sequence[sequences])
            rows = call.trained_rows[first_row:first_row + count] - sequences.start * seq_len  # within the chunk
            first_row += count
            LossFusedLinear.chunk(hidden, weight_valid, sequences, rows, buffer[:count], call, kernels, grad_hidden,
                                  grad_weight_valid, logprobs, entropy)
        with torch.no_grad():
            loss, metrics = call.loss_fn(call.batch, logprobs, entropy)
        metrics_out.update(metrics)
        grad_weight = torch.zeros_like(weight)
        grad_weight[:call.valid_cols] = grad_weight_valid
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss.detach().clone(), logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprobs=None, _grad_entropy=None):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * scale, None, None

    @staticmethod
    def chunk(hidden, weight_valid, sequences: slice, rows: torch.Tensor, buffer: torch.Tensor, call: LossFusedCall,
              kernels, grad_hidden, grad_weight_valid, logprobs, entropy) -> None:
        """Forward, loss gradient and backward of one chunk of whole sequences, whose trained rows are `rows` (indices
        among the chunk's flattened rows; no host sync here), its logits in `buffer`; fills its rows of `logprobs`,
        `entropy` (aligned with the tokens) and `grad_hidden`, and adds its share to `grad_weight_valid`."""
        targets = call.targets[sequences]
        h = hidden[sequences].reshape(-1, hidden.shape[-1]).index_select(0, rows)
        row_targets = targets.reshape(-1).index_select(0, rows)
        start = call.shard.start_index
        logits = VocabParallelLinearLogprobs.chunk_logits(h, weight_valid, call.logit_scale, buffer)
        partials = kernels.logprob_partials(logits, row_targets, start, call.valid_cols, True, None)
        stats = combine_partials(gather_partials(partials, call.shard.group), row_targets, True)
        # The rows' logprobs and entropies as leaves at their tokens' positions (row t scores token t + 1).
        positions = rows + 1  # row (b, t) scores token (b, t + 1); a last position is never a trained row
        chunk_logprobs = logprobs[sequences]
        chunk_entropy = entropy[sequences]
        chunk_logprobs.view(-1)[positions] = stats.logprob
        chunk_entropy.view(-1)[positions] = stats.entropy
        with torch.enable_grad():
            leaf_logprobs = chunk_logprobs.clone().requires_grad_(True)
            leaf_entropy = chunk_entropy.clone().requires_grad_(True)
            sub_batch = {key: value[sequences] for key, value in call.batch.items()}
            loss, _ = call.loss_fn(sub_batch, leaf_logprobs, leaf_entropy)
            grad_logprobs, grad_entropy = torch.autograd.grad(loss, (leaf_logprobs, leaf_entropy),
                                                              allow_unused=True)
        grad_logprob_rows = _rows_of(grad_logprobs, positions, stats.lse)
        grad_entropy_rows = None if grad_entropy is None else _rows_of(grad_entropy, positions, stats.lse)
        kernels.logprob_backward(logits, row_targets, start, call.valid_cols, stats.lse,
                                 None if grad_entropy_rows is None else stats.mean_x, grad_logprob_rows,
                                 grad_entropy_rows, logits, None)  # in place: logits become dlogits
        dh = scaled_mm(logits, weight_valid, call.logit_scale, h.new_empty(h.shape))
        grad_hidden[sequences].view(-1, hidden.shape[-1]).index_copy_(0, rows, dh)
        if grad_weight_valid.dtype == logits.dtype:
            grad_weight_valid.addmm_(logits.t(), h, alpha=call.logit_scale)
        else:  # several low-precision chunks: summed in fp32
            add_product_in_fp32(grad_weight_valid, logits.t(), h, call.logit_scale)


def _rows_of(per_token: torch.Tensor | None, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A `[b, S]` per-token gradient as the rows' contiguous fp32 `[rows]` vector (zeros when unused)."""
    if per_token is None:
        return torch.zeros(positions.numel(), dtype=like.dtype, device=like.device)
    return per_token.reshape(-1).index_select(0, positions).to(like.dtype).contiguous()


def sequence_chunks(trained_rows_per_sequence: list[int], chunk_rows: int) -> list[slice]:
    """Consecutive sequences grouped so each group has at most `chunk_rows` trained rows (a longer sequence is a
    group of its own); sequences without a trained row join their neighbours."""
    chunks, start, rows = [], 0, 0
    for index, count in enumerate(trained_rows_per_sequence):
        if rows and rows + count > chunk_rows:
            chunks.append(slice(start, index))
            start, rows = index, 0
        rows += count
    if start < len(trained_rows_per_sequence):
        chunks.append(slice(start, len(trained_rows_per_sequence)))
    return chunks


def loss_fused_linear(
    loss_fn: SequenceLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    batch: Batch,
    *,
    shard: VocabShard | None = None,
    logit_scale: float = 1.0,
    chunk_rows: int | None = None,
    check_inputs: bool = True,
    implementation: Implementation = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss_fn`'s loss and metrics on the current logprobs and entropies of `batch`'s trained tokens, from final
    hidden states `[B, S, H]` and this rank's `[V_local, H]` output weight shard, with the gradient computed in
    forward (see the module docstring). Differentiable w.r.t. `hidden` (a partial sum over the vocab shard, to be
    reduced over TP by the caller) and `weight`.

    `loss_fn(batch, curr_logprobs, curr_entropy)` must be sequence-additive: its value on a subset of the
    sequences is their share of the whole (e.g. `ClippedPGLoss` with the global counts bound).
    `chunk_rows`: trained rows per chunk (whole sequences); None picks one as the op does (`chunk_rows_for`).
    """
    input_ids = batch["input_ids"]
    if hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"hidden must be [B, S, H] with [B, S] = input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(hidden.shape)}")
    targets = next_token_targets(trained_token_targets(input_ids, trained_token_mask(batch)))
    check_linear_inputs(hidden, weight, targets, logit_scale, chunk_rows)
    shard = (VocabShard() if shard is None else shard).resolve(weight.shape[0])
    if check_inputs:
        check_target_ids(targets, shard)
    valid_cols = shard.valid_cols(weight.shape[0])
    trained = targets >= 0
    # The call's host syncs: the rows per sequence (to cut chunks of whole sequences) and the trained rows' indices.
    per_sequence = trained.sum(dim=1).tolist()
    trained_rows = trained.reshape(-1).nonzero().squeeze(1)
    # The shard's whole width, the same on every TP rank, so that every rank cuts the same chunks (its valid columns
    # are fewer on the rank with the padding).
    budget = int(chunk_rows) if chunk_rows is not None else chunk_rows_for(sum(per_sequence), weight.shape[0],
                                                                            hidden.dtype)
    call = LossFusedCall(loss_fn=loss_fn, batch=batch, targets=targets, trained_rows=trained_rows,
                         rows_per_sequence=per_sequence, shard=shard, valid_cols=valid_cols,
                         logit_scale=float(logit_scale), sequences_per_chunk=sequence_chunks(per_sequence, budget),
                         implementation=implementation)
    metrics: dict[str, torch.Tensor] = {}
    loss, _, _ = LossFusedLinear.apply(hidden, weight, call, metrics)
    return loss, metrics
