"""`vocab_parallel_linear_logprobs`: per-token logprobs (and entropy) straight from hidden states and this rank's
shard of the output weight, without ever holding the `[T, V_local]` logits.

Why: the logits of a long batch (`T x V / tp`) are the largest tensor of a policy-gradient step, and the
plain op (`vocab_parallel_logprobs`) needs all of them alive between forward and backward. This op computes
them a chunk of rows at a time, keeps only the `[rows, 3|4]` softmax partials, and recomputes each chunk in
backward.

Forward: the trained rows (target >= 0) are gathered out first; per chunk, `logits = scale * h @ W_valid.T`
(the real, non-padding columns only), then the existing kernels' partials, then the chunk is freed. One
all-gather of the partials of the whole call (`gather_partials`) and `combine_partials` give logprob, lse and
entropy. Backward: per chunk, recompute the logits, run the existing backward kernel in place in the chunk
buffer, then `dH = scale * dlogits @ W` and `dW += scale * dlogits.T @ h`. No collective runs in backward:
`dH` is a partial sum over the vocab shards, which the caller reduces across TP where Megatron's output layer
does (see `vocab_parallel_linear_logprobs`).

With `top_k` / `top_p`, each chunk's filter threshold is found on its logits in forward (the collectives of
`filtering`, per chunk, identical on every TP rank since the rows are replicated) and kept, `[rows]` fp32, for
backward's recompute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .backends import Implementation, Kernels, select_kernels
from .filtering import SamplingFilter, kept_threshold
from .partials import combine_partials, gather_partials
from .shift import check_shiftable, next_token_targets
from .vocab_parallel import (LOGITS_DTYPES, _row_gradient, check_target_ids, checked_logit_scale, entropy_term,
                             outputs, per_token)
from .vocab_shard import VocabShard

# Default budget for one chunk of logits (in the hidden states' dtype): large enough that each GEMM is big,
# small enough to be negligible next to the `[T, V_local]` logits the op avoids. See `chunk_rows_for` (read at each
# call, so a test may lower it).
CHUNK_BYTES = 256 * 2**20
MIN_CHUNKS = 8
MIN_CHUNK_ROWS = 256
# A chunk buffer's row stride is a multiple of this many elements (128 bytes of bf16), so every GEMM row starts
# aligned whatever the shard's valid width; the kernels take any row stride.
ROW_ALIGN = 64
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LinearCall:
    """How the call is cut and what it computes: everything the autograd Function takes besides its tensors."""

    shard: VocabShard  # resolved
    valid_cols: int
    logit_scale: float
    chunk_rows: int
    with_entropy: bool
    sampling: SamplingFilter
    kernels: Kernels

    def chunks(self, rows: int) -> list[slice]:
        return [slice(start, min(start + self.chunk_rows, rows)) for start in range(0, rows, self.chunk_rows)]


def chunk_rows_for(rows: int, shard_cols: int, dtype: torch.dtype, budget_bytes: int | None = None) -> int:
    """Rows per chunk when the caller gives none: a call of `rows` trained rows is cut into at least
    `MIN_CHUNKS` chunks (so one chunk's logits are at most 1/8 of the whole call's, the op's extra memory),
    each of at least `MIN_CHUNK_ROWS` rows (so each GEMM stays large) and at most `budget_bytes` (default
    `CHUNK_BYTES`) of logits rows of `shard_cols` columns (256 MiB: 2048 rows of a 65536-column bf16 shard, 441 of
    a 152064-column fp32 one).

    `shard_cols` must be the same on every rank of the TP group: the shard's whole width (`weight.shape[0]`,
    padding included), never its valid columns, which are fewer on the rank holding the padding. Ranks that cut
    a call differently run different numbers and shapes of per-chunk collectives (a mismatch: gloo aborts, NCCL
    hangs)."""
    budget = CHUNK_BYTES if budget_bytes is None else budget_bytes
    row_bytes = max(aligned_width(shard_cols), 1) * torch.empty((), dtype=dtype).element_size()
    by_budget = max(1, budget // row_bytes)
    by_share = max(MIN_CHUNK_ROWS, -(-rows // MIN_CHUNKS))
    return max(1, min(by_budget, by_share))


def aligned_width(cols: int) -> int:
    """`cols` rounded up to a multiple of `ROW_ALIGN`: the row stride of a chunk buffer."""
    return -(-cols // ROW_ALIGN) * ROW_ALIGN


def chunk_buffer(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised `[rows, cols]` buffer in `like`'s dtype and device whose row stride is `aligned_width(cols)`
    (the GEMMs write into it through `out=`, the kernels read and write it in place)."""
    return like.new_empty(rows, aligned_width(cols))[:, :cols]


class VocabParallelLinearLogprobs(torch.autograd.Function):
    """Autograd wrapper: `hidden` holds only the trained rows; the functional API below gathers and checks."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, call: LinearCall):
        partials, threshold = VocabParallelLinearLogprobs.local_partials(hidden, weight, targets, call)
        stats = combine_partials(gather_partials(partials, call.shard.group), targets, call.with_entropy)
        # A target outside the top-k / top-p kept set has logprob -inf, a constant: it passes no gradient back.
        filtered_target = None if threshold is None else stats.logprob == float("-inf")
        ctx.save_for_backward(hidden, weight, targets, stats.lse, stats.mean_x, threshold, filtered_target)
        ctx.call = call
        ctx.set_materialize_grads(False)  # an entropy that is only logged passes None, and its term is skipped
        return outputs(stats, call.with_entropy)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        hidden, weight, targets, lse, mean_x, threshold, filtered_target = ctx.saved_tensors
        rows = hidden.shape[0]
        grad_logprob = _row_gradient(grad_logprob, rows, lse)
        if filtered_target is not None:
            grad_logprob = grad_logprob.masked_fill(filtered_target, 0.0)
        mean_x, grad_entropy = entropy_term(mean_x, grad_entropy, rows, lse)
        grad_hidden, grad_weight = VocabParallelLinearLogprobs.chunked_backward(
            hidden, weight, targets, lse, mean_x, grad_logprob, grad_entropy, threshold, ctx.call,
            need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1],
        )
        return grad_hidden, grad_weight, None, None

    # ---- stages ----

    @staticmethod
    def chunk_logits(hidden_chunk: torch.Tensor, weight_valid: torch.Tensor, scale: float,
                     out: torch.Tensor) -> torch.Tensor:
        """`out = scale * hidden_chunk @ weight_valid.T`, the chunk's logits over the real columns."""
        return scaled_mm(hidden_chunk, weight_valid.t(), scale, out)

    @staticmethod
    def local_partials(hidden, weight, targets, call: LinearCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's `[rows, 3|4]` partials, one chunk of logits alive at a time, and the rows' top-k / top-p
        thresholds (None without a filter)."""
        shard, valid = call.shard, call.valid_cols
        weight_valid = weight[:valid]
        rows = hidden.shape[0]
        filtered = call.sampling.active(shard.true_vocab_size)
        partials, thresholds = [], []
        buffer = chunk_buffer(min(call.chunk_rows, rows), valid, hidden)
        for sl in call.chunks(rows):
            logits = VocabParallelLinearLogprobs.chunk_logits(hidden[sl], weight_valid, call.logit_scale,
                                                              buffer[:sl.stop - sl.start])
            threshold = kept_threshold(logits, call.sampling, true_vocab_size=shard.true_vocab_size,
                                       group=shard.group)
            if filtered:
                thresholds.append(threshold)
            partials.append(call.kernels.logprob_partials(logits, targets[sl], shard.start_index, valid,
                                                          call.with_entropy, threshold))
        if not partials:  # no trained row: every rank still joins the one all-gather, with nothing
            compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
            empty = hidden.new_empty((0, 4 if call.with_entropy else 3), dtype=compute)
            return empty, (empty.new_empty(0) if filtered else None)
        return torch.cat(partials), (torch.cat(thresholds) if filtered else None)

    @staticmethod
    def chunked_backward(hidden, weight, targets, lse, mean_x, grad_logprob, grad_entropy, threshold,
                         call: LinearCall, need_hidden: bool, need_weight: bool):
        """`(dH, dW)` chunk by chunk; the padding rows of `dW` are exactly 0 (they never enter the GEMMs)."""
        scale, valid = call.logit_scale, call.valid_cols
        weight_valid = weight[:valid]
        rows = hidden.shape[0]
        chunks = call.chunks(rows)
        grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else None
        # Several low-precision chunks: sum dW in fp32, so its rounding does not grow with the chunk count
        # (costs an fp32 [valid_cols, H] buffer; dW itself is allocated after the loop to keep the peak lower).
        accumulate_fp32 = need_weight and weight.dtype in LOW_PRECISION and len(chunks) > 1
        weight_sum = torch.zeros(weight_valid.shape, dtype=torch.float32, device=weight.device) if accumulate_fp32 \
            else None
        grad_weight = torch.zeros_like(weight) if need_weight and not accumulate_fp32 else None
        buffer = chunk_buffer(min(call.chunk_rows, rows), valid, hidden)
        for sl in chunks:
            h = hidden[sl]
            grad_logits = VocabParallelLinearLogprobs.chunk_logits(h, weight_valid, scale,
                                                                   buffer[:sl.stop - sl.start])
            call.kernels.logprob_backward(
                grad_logits, targets[sl], call.shard.start_index, valid, lse[sl],
                None if mean_x is None else mean_x[sl], grad_logprob[sl],
                None if grad_entropy is None else grad_entropy[sl], grad_logits,
                None if threshold is None else threshold[sl],
            )  # in place: the chunk's logits become d(objective)/d(logits)
            if need_hidden:
                scaled_mm(grad_logits, weight_valid, scale, grad_hidden[sl])
            if weight_sum is not None:
                add_product_in_fp32(weight_sum, grad_logits.t(), h, scale)
            elif need_weight:
                grad_weight[:valid].addmm_(grad_logits.t(), h, alpha=scale)
        if weight_sum is not None:
            grad_weight = weight.new_zeros(weight.shape)
            grad_weight[:valid] = weight_sum
        return grad_hidden, grad_weight


def vocab_parallel_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    shard: VocabShard | None = None,
    shift: bool = False,
    with_entropy: bool = False,
    logit_scale: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_rows: int | None = None,
    check_inputs: bool = True,
    implementation: Implementation = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` under softmax(logit_scale * hidden @ weight.T) over the whole (sharded,
    unpadded) vocab, computed a chunk of rows at a time so that no `[T, V_local]` logits exist.

    Differentiable w.r.t. `hidden` and `weight`. The gradient of `hidden` is this rank's **partial sum** over
    its vocab shard: the caller reduces it across TP exactly where Megatron's output layer does (the
    all-reduce in backward of `copy_to_tensor_model_parallel_region` on the layer's input), so this op runs
    no collective in backward. Forward runs one all-gather of `[trained rows, 3|4]` fp32 partials (plus the
    filter's small collectives per chunk with `top_k` / `top_p`).

    Args:
        hidden: `[..., H]` final hidden states (after the final norm), replicated over the TP group.
        weight: `[V_local, H]` this rank's shard of the output layer (or of the tied embedding), same dtype
            and device as `hidden`.
        targets: `[...]` (`hidden.shape[:-1]`) integer global token ids; `< 0` means ignore: the row is
            never computed, and its logprob, entropy and `hidden` gradient are exactly 0.
        shard: where the weight's rows sit in the vocab, its padding (ids `>=` the true vocab size never enter
            the softmax, and their weight rows get exactly 0 gradient) and the TP group (`VocabShard`); None
            means an unsharded, unpadded vocab.
        shift: next-token mode, as in `vocab_parallel_logprobs` (`megatron_grpo.ops.shift`).
        with_entropy: also return the exact entropy of each row's distribution.
        logit_scale: logits are `logit_scale * hidden @ weight.T`; `1 / temperature` for a sampling temperature.
        top_k, top_p: the sampler's filtered distribution, as in `vocab_parallel_logprobs`.
        chunk_rows: trained rows per chunk; None picks one (`chunk_rows_for`): at least 8 chunks of at least 256
            rows, each at most 256 MiB of logits.
        check_inputs: check target ids against the vocab (a host sync); pass False in hot loops. Gathering
            the trained rows is a host sync of its own whenever some rows are ignored (always with `shift`, whose
            last position has no target) or, with `check_inputs=False`, may be.
        implementation: "auto" (fused kernels where available), "fused" or "reference".

    Returns:
        float32 logprobs `[...]` (float64 for float64 inputs), or `(logprobs, entropy)` with `with_entropy`.
    """
    rows = TrainedRows.of(hidden, weight, targets, shard=shard, shift=shift, logit_scale=logit_scale,
                          top_k=top_k, top_p=top_p, chunk_rows=chunk_rows, check_inputs=check_inputs,
                          with_entropy=with_entropy, implementation=implementation)
    out = VocabParallelLinearLogprobs.apply(rows.hidden, weight.contiguous(), rows.targets, rows.call)
    return rows.scatter(out, with_entropy)


@dataclass(frozen=True)
class TrainedRows:
    """A call's trained rows (target >= 0), gathered out of `[..., H]` before any matmul, and how to put per-row
    results back in the targets' shape (ignored rows exactly 0, passing no gradient)."""

    hidden: torch.Tensor  # [trained rows, H], contiguous
    targets: torch.Tensor  # [trained rows] int64
    index: torch.Tensor | None  # row index of each trained row among all rows; None when every row is trained
    batch_shape: torch.Size
    shift: bool
    call: LinearCall

    @staticmethod
    def of(hidden, weight, targets, *, shard, shift, logit_scale, top_k, top_p, chunk_rows, check_inputs,
           with_entropy, implementation) -> "TrainedRows":
        check_linear_inputs(hidden, weight, targets, logit_scale, chunk_rows)
        shard = (VocabShard() if shard is None else shard).resolve(weight.shape[0])
        valid_cols = shard.valid_cols(weight.shape[0])
        # Whether some rows are ignored: the target check's sync says so; a shift always ignores the last position.
        some_ignored = check_target_ids(targets, shard) if check_inputs else None
        if shift:
            check_shiftable(targets)
            targets = next_token_targets(targets)
            some_ignored = targets.shape[-1] > 0
        rows_hidden = hidden.reshape(-1, hidden.shape[-1])
        rows_targets = targets.reshape(-1).to(torch.int64)
        index = None
        if some_ignored is not False:  # nonzero is a host sync: only where rows are (or may be) ignored
            index = (rows_targets >= 0).nonzero().squeeze(1)
            if index.numel() == rows_targets.numel():
                index = None
            else:  # index_select's backward gives the ignored rows exactly 0
                rows_hidden = rows_hidden.index_select(0, index)
                rows_targets = rows_targets.index_select(0, index)
        call = LinearCall(shard=shard, valid_cols=valid_cols, logit_scale=float(logit_scale),
                          chunk_rows=int(chunk_rows) if chunk_rows is not None
                          else chunk_rows_for(rows_targets.numel(), weight.shape[0], hidden.dtype),
                          with_entropy=with_entropy, sampling=SamplingFilter(top_k=top_k, top_p=top_p),
                          kernels=select_kernels(weight, implementation))
        return TrainedRows(hidden=rows_hidden.contiguous(), targets=rows_targets.contiguous(), index=index,
                           batch_shape=targets.shape, shift=shift, call=call)

    def scatter(self, out, with_entropy: bool):
        """Per-trained-row outputs back among all rows, in the targets' shape (aligned with tokens with
        `shift`)."""
        values = out if with_entropy else (out,)
        if self.index is not None:
            values = tuple(_scatter_rows(v, self.index, self.batch_shape.numel()) for v in values)
        return per_token(values if with_entropy else values[0], self.batch_shape, with_entropy, self.shift)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """`out = scale * a @ b` in one GEMM (fp32 accumulation), the scale applied before the single rounding."""
    return torch.addmm(out.new_zeros(()), a, b, beta=0, alpha=scale, out=out)


def add_product_in_fp32(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """`total += alpha * a @ b` for an fp32 `total` and bf16/fp16 `a`, `b` (dW summed over chunks).

    On CUDA one GEMM writes its fp32 accumulator straight into `total` (`addmm` with `out_dtype=torch.float32`),
    so no chunk's product is rounded to bf16 first; where this torch cannot take an fp32 `total` there
    (`fp32_out_addmm_accumulates`), the product comes out in fp32 and is added. Elsewhere (the CPU) the product is
    rounded to `a`'s dtype, then added in fp32."""
    if a.device.type == "cuda":
        if fp32_out_addmm_accumulates(a.device, a.dtype):
            torch.addmm(total, a, b, alpha=alpha, out_dtype=torch.float32, out=total)
        else:
            total.add_(torch.mm(a, b, out_dtype=torch.float32), alpha=alpha)
        return
    total.add_(torch.mm(a, b), alpha=alpha)


@functools.cache
def fp32_out_addmm_accumulates(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(total_fp32, a, b, out_dtype=torch.float32, out=total_fp32)` runs for `dtype` a, b on
    `device` (CUDA builds of torch take it; some want `total` in `a`'s dtype), tried once on 1x1 tensors."""
    one = torch.ones(1, 1, dtype=dtype, device=device)
    total = torch.zeros(1, 1, dtype=torch.float32, device=device)
    try:
        torch.addmm(total, one, one, out_dtype=torch.float32, out=total)
    except (RuntimeError, TypeError):
        return False
    return float(total) == 1.0


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """The trained rows' values back in place among `total` rows; ignored rows are exactly 0 (and pass no
    gradient)."""
    return values.new_zeros(total).index_copy(0, rows, values)


def check_linear_inputs(hidden, weight, targets, logit_scale, chunk_rows) -> None:
    """Shape, dtype, device and argument checks: free, so they always run."""
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V_local, H], got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocab dim (V_local = 0)")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} has H = "
                         f"{hidden.shape[-1] if hidden.dim() else None}, weight {tuple(weight.shape)} has H = "
                         f"{weight.shape[1]}")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got hidden on {hidden.device}, "
                         f"weight on {weight.device}, targets on {targets.device}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must have the same dtype, got hidden {hidden.dtype} and "
                         f"weight {weight.dtype}")
    if hidden.dtype not in LOGITS_DTYPES:
        raise ValueError(f"hidden and weight must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    checked_logit_scale(logit_scale)
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                   or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be an int >= 1 (or None), got {chunk_rows!r}")
