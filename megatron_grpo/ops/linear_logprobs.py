"""`vocab_parallel_linear_logprobs`: per-token logprobs (and entropy) straight from hidden states and this rank's
shard of the output weight, without ever holding the `[T, V_local]` logits.

Why: the logits of a long batch (`T x V / tp`) are the largest tensor of a policy-gradient step, and the
plain op (`vocab_parallel_logprobs`) needs all of them alive between forward and backward. This op computes
them a chunk of rows at a time (`chunks`), keeps only the `[rows, 3|4]` softmax partials, and recomputes each
chunk in backward.

Forward: the trained rows (target >= 0) are gathered out first; per chunk, `logits = scale * h @ W_valid.T`
(the real, non-padding columns only), then the existing kernels' partials, and the chunk buffer is reused. One
all-gather of the partials of the whole call (`gather_partials`) and the kernels' combine give logprob, lse and
entropy. Backward: per chunk, recompute the logits, run the existing backward kernel in place in the chunk
buffer, then `dH = scale * dlogits @ W` and `dW += scale * dlogits.T @ h` (`gemm.WeightGradient`: into
Megatron DDP's `main_grad` where the weight has one, else into the returned dW, with no fp32 accumulator of its own
unless that is small next to the logits). No collective runs in
backward: `dH` is a partial sum over the vocab shards, which the caller reduces across TP where Megatron's output
layer does (see `vocab_parallel_linear_logprobs`).

With a top-k / top-p filter, each chunk's threshold is found on its logits in forward (the collectives of
`filtering`, per chunk, identical on every TP rank since the rows are replicated) and kept, `[rows]` fp32, for
backward's recompute.

The op is the `torch.library` custom op `megatron_grpo::vocab_parallel_linear_logprobs` with a fake kernel and its
backward registered, so `torch.compile(fullgraph=True)` traces it as one node; the trained rows are gathered inside
it (their count is the one data-dependent size). Under compilation the weight is a traced tensor without
`main_grad`: its gradient is returned, as without Megatron's DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, overload

import torch

from megatron_grpo.ops.core.backends import Implementation, Kernels, select_kernels
from megatron_grpo.ops.core.checks import (
    check_kept_set_argument,
    check_kept_values,
    check_linear_inputs,
    check_target_ids,
)
from megatron_grpo.ops.core.chunking import chunk_rows_for
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.core.filtering import kept_threshold
from megatron_grpo.ops.core.gemm import (
    WeightGradient,
    added_to_main_grad,
    chunk_buffer,
    chunk_logits,
    hidden_gradient,
    main_grad_of,
)
from megatron_grpo.ops.core.partials import Partials, RowStats, gather_partials
from megatron_grpo.ops.core.replay import RowSets, replay_gradient, replay_partials
from megatron_grpo.ops.core.rows import check_shiftable, next_token_targets, per_token, upstream_gradients
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet
from megatron_grpo.ops.vocab_shard import VocabShard


@dataclass(frozen=True)
class LinearCall:
    """How a call is cut and what it computes: everything besides its tensors."""

    shard: VocabShard  # resolved
    valid_cols: int
    distribution: SamplingDistribution
    chunk_rows: int
    with_entropy: bool
    kernels: Kernels

    @classmethod
    def of(cls, weight: torch.Tensor, trained_rows: int, shard: VocabShard, distribution: SamplingDistribution,
           with_entropy: bool, chunk_rows: int | None, implementation: Implementation) -> LinearCall:
        """The call for `trained_rows` rows; `chunk_rows=None` picks the chunk size from the shard's whole width
        (`chunk_rows_for`), the same on every TP rank."""
        shard = shard.resolve(weight.shape[0])
        rows = int(chunk_rows) if chunk_rows is not None else chunk_rows_for(trained_rows, weight.shape[0],
                                                                              weight.dtype)
        return cls(shard=shard, valid_cols=shard.valid_cols(weight.shape[0]), distribution=distribution,
                   chunk_rows=rows, with_entropy=with_entropy, kernels=select_kernels(weight, implementation))

    def chunks(self, rows: int) -> list[slice]:
        return [slice(start, min(start + self.chunk_rows, rows)) for start in range(0, rows, self.chunk_rows)]

    @property
    def filter_active(self) -> bool:
        return self.distribution.restricts(self.shard.true_vocab_size)


def linear_partials(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, call: LinearCall,
                    kept: list[RowSets] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's `[rows, 3|4]` partials of the trained rows `hidden`, one chunk of logits alive at a time, and the
    rows' top-k / top-p thresholds (None without an active filter). `kept`: each chunk's kept sets to replay."""
    shard, valid = call.shard, call.valid_cols
    weight_valid = weight[:valid]
    rows = hidden.shape[0]
    filtered = call.filter_active
    partials, thresholds = [], []
    buffer = chunk_buffer(min(call.chunk_rows, rows), valid, hidden)
    for number, sl in enumerate(call.chunks(rows)):
        logits = chunk_logits(hidden[sl], weight_valid, call.distribution.logit_scale, buffer[:sl.stop - sl.start])
        if kept is not None:  # the engine's kept sets instead of the filter (`core.replay`)
            partial, threshold = replay_partials(logits, targets[sl], kept[number], call.kernels, shard.start_index,
                                                 valid, call.with_entropy)
        else:
            threshold = kept_threshold(logits, call.distribution, true_vocab_size=shard.true_vocab_size,
                                       group=shard.group, scaled=True, kernels=call.kernels,
                                       chunk_rows=call.chunk_rows)
            partial = call.kernels.logprob_partials(logits, targets[sl], shard.start_index, valid, call.with_entropy,
                                                    threshold)
        if filtered:
            thresholds.append(threshold)
        partials.append(partial)
    if not partials:  # no trained row: every rank still joins the one all-gather, with nothing
        empty = hidden.new_empty((0, Partials.width(call.with_entropy)), dtype=compute_dtype(hidden.dtype))
        return empty, (empty.new_empty(0) if filtered else None)
    return torch.cat(partials), (torch.cat(thresholds) if filtered else None)


def linear_backward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                    mean_x: torch.Tensor | None, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None,
                    threshold: torch.Tensor | None, call: LinearCall, grad_hidden: torch.Tensor | None,
                    weight_gradient: WeightGradient | None, kept: list[RowSets] | None = None) -> None:
    """Writes `dH` of the trained rows into `grad_hidden` and adds `dW` to `weight_gradient` (either may be None),
    chunk by chunk; the padding rows of `dW` never enter the GEMMs. `kept`: each chunk's replayed kept sets."""
    scale, valid = call.distribution.logit_scale, call.valid_cols
    weight_valid = weight[:valid]
    rows = hidden.shape[0]
    buffer = chunk_buffer(min(call.chunk_rows, rows), valid, hidden)
    for number, sl in enumerate(call.chunks(rows)):
        h = hidden[sl]
        grad_logits = chunk_logits(h, weight_valid, scale, buffer[:sl.stop - sl.start])
        patch = None if kept is None else replay_gradient(
            grad_logits, targets[sl], kept[number], threshold[sl], lse[sl], None if mean_x is None else mean_x[sl],
            grad_logprob[sl], None if grad_entropy is None else grad_entropy[sl], call.shard.start_index, valid)
        call.kernels.logprob_backward(
            grad_logits, targets[sl], call.shard.start_index, valid, lse[sl],
            None if mean_x is None else mean_x[sl], grad_logprob[sl],
            None if grad_entropy is None else grad_entropy[sl], grad_logits,
            None if threshold is None else threshold[sl],
        )  # in place: the chunk's logits become d(objective)/d(logits)
        if patch is not None:
            patch.write(grad_logits)
        if grad_hidden is not None:
            hidden_gradient(grad_logits, weight_valid, scale, grad_hidden[sl])
        if weight_gradient is not None:
            weight_gradient.add(grad_logits, h, scale)


def trained_index(targets: torch.Tensor, some_ignored: bool | None) -> torch.Tensor:
    """The index of each trained row (target >= 0) among all rows. `nonzero` is a host sync: it runs only where
    some row is, or may be (`None`), ignored."""
    if some_ignored is False:
        return torch.arange(targets.shape[0], device=targets.device)
    return (targets >= 0).nonzero().squeeze(1)


def rows_at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of `values` at `index`, contiguous (itself, or a contiguous copy, when `index` is every row)."""
    return values.contiguous() if index.numel() == values.shape[0] else values.index_select(0, index)


def scattered(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-trained-row `values` back among `rows` rows; ignored rows are exactly 0."""
    if index.numel() == rows:
        return values
    return values.new_zeros((rows, *values.shape[1:])).index_copy_(0, index, values)  # in place: one buffer


# ---- the traceable op ----

def _shard_and_distribution(start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, replay=False):
    return (VocabShard.with_group_name(start_index, true_vocab_size, group_name),
            SamplingDistribution(logit_scale=logit_scale, top_k=top_k, top_p=top_p, replay_kept_set=replay))


def _chunk_sets(kept_offsets, kept_ids, next_token, index, call: LinearCall) -> list[RowSets] | None:
    """Each chunk's kept sets (`RowSets.of_groups`, one host read), or None without a kept set."""
    if kept_offsets is None:
        return None
    return RowSets.of_groups(KeptSet(kept_offsets, kept_ids), index, call.chunks(index.numel()), next_token)


@torch.library.custom_op("megatron_grpo::vocab_parallel_linear_logprobs", mutates_args=())
def _linear_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, start_index: Optional[int],
               true_vocab_size: Optional[int], group_name: str, logit_scale: float, top_k: Optional[int],
               top_p: Optional[float], with_entropy: bool, chunk_rows: Optional[int], check_inputs: bool,
               implementation: str, kept_offsets: Optional[torch.Tensor] = None,
               kept_ids: Optional[torch.Tensor] = None, kept_next_token: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          torch.Tensor]:
    """`(logprob, entropy, index, hidden_rows, lse, mean_x, threshold)` of `[rows, H]` hidden states: logprob and
    entropy `[rows]` (0 on ignored rows), `index` the trained rows' indices `[n]`, `hidden_rows` their hidden states
    `[n, H]` where some rows are ignored (a copy, which backward keeps instead of all rows; `[0, H]` when every row
    is trained: backward reads the input then), and per trained row `lse`, `mean_x` (with entropy) and the filter's
    `threshold` (with a filter); `[0]` where absent. `kept_offsets`, `kept_ids`: a `KeptSet` to replay, over the
    targets' positions before the shift (`kept_next_token`: row `r` scores position `r + 1`)."""
    shard, distribution = _shard_and_distribution(start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                                                  kept_offsets is not None)
    shard = shard.resolve(weight.shape[0])
    # Whether some rows are ignored: the target check's sync says so; without it, they may be.
    index = trained_index(targets, check_target_ids(targets, shard) if check_inputs else None)
    if check_inputs and kept_offsets is not None:
        check_kept_values(KeptSet(kept_offsets, kept_ids), targets, shard, kept_next_token)
    gathered = index.numel() != hidden.shape[0]
    hidden_rows, target_rows = rows_at(hidden, index), rows_at(targets, index)
    call = LinearCall.of(weight, index.numel(), shard, distribution, with_entropy, chunk_rows, implementation)
    partials, threshold = linear_partials(hidden_rows, weight.contiguous(), target_rows, call,
                                          _chunk_sets(kept_offsets, kept_ids, kept_next_token, index, call))
    stats = RowStats.of(call.kernels.combine(gather_partials(partials, shard.group), target_rows, with_entropy),
                        with_entropy)
    if distribution.filtered and threshold is None:  # a filter that keeps this whole vocab
        threshold = torch.full_like(stats.lse, float("-inf"))
    rows = hidden.shape[0]

    def present(value: torch.Tensor | None) -> torch.Tensor:  # outputs may not alias: a new empty tensor each
        return value if value is not None else stats.lse.new_empty(0)

    entropy = scattered(stats.entropy, index, rows) if with_entropy else None
    # An op's output may not alias its input: every row trained, the rows are the input's, and no output.
    kept_rows = hidden_rows if gathered else hidden.new_empty((0, hidden.shape[1]))
    return (scattered(stats.logprob, index, rows), present(entropy), index, kept_rows, stats.lse,
            present(stats.mean_x), present(threshold))


@_linear_op.register_fake
def _linear_op_fake(hidden, weight, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                    with_entropy, chunk_rows, check_inputs, implementation, kept_offsets=None, kept_ids=None,
                    kept_next_token=False):
    rows, dtype = hidden.shape[0], compute_dtype(hidden.dtype)
    ctx = torch.library.get_ctx()
    trained, kept = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    filtered = kept_offsets is not None or SamplingDistribution(logit_scale=logit_scale, top_k=top_k,
                                                                top_p=top_p).filtered

    def per_row(count, present: bool = True) -> torch.Tensor:
        return hidden.new_empty(count if present else 0, dtype=dtype)

    return (per_row(rows), per_row(rows, with_entropy), targets.new_empty(trained, dtype=torch.int64),
            hidden.new_empty(kept, hidden.shape[1]), per_row(trained), per_row(trained, with_entropy),
            per_row(trained, filtered))


@torch.library.custom_op("megatron_grpo::vocab_parallel_linear_logprobs_backward", mutates_args=("main_grad",))
def _linear_backward_op(hidden: torch.Tensor, hidden_rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        index: torch.Tensor, logprob: torch.Tensor, lse: torch.Tensor, mean_x: torch.Tensor,
                        threshold: torch.Tensor,
                        grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                        main_grad: Optional[torch.Tensor], rows: int, start_index: Optional[int],
                        true_vocab_size: Optional[int], group_name: str, logit_scale: float, top_k: Optional[int],
                        top_p: Optional[float], chunk_rows: Optional[int], implementation: str, need_hidden: bool,
                        need_weight: bool, kept_offsets: Optional[torch.Tensor] = None,
                        kept_ids: Optional[torch.Tensor] = None, kept_next_token: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dH [rows, H], dW [V_local, H])` from the trained rows' hidden states (`hidden_rows`, or all of `hidden` when
    every row is trained); `[0]` for one not needed, and for dW when it was added to `main_grad`."""
    hidden_rows = hidden_rows if index.numel() != rows else hidden.contiguous()
    shard, distribution = _shard_and_distribution(start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                                                  kept_offsets is not None)
    with_entropy = mean_x.numel() > 0
    call = LinearCall.of(weight, index.numel(), shard, distribution, with_entropy, chunk_rows, implementation)
    target_rows = rows_at(targets, index)
    grad_logprob, mean_x_rows, grad_entropy = upstream_gradients(
        None if grad_logprob is None else rows_at(grad_logprob, index),
        None if grad_entropy is None else rows_at(grad_entropy, index), lse, mean_x if with_entropy else None,
        rows_at(logprob, index) if call.filter_active else None)
    weight = weight.contiguous()
    grad_hidden_rows = hidden_rows.new_empty(hidden_rows.shape) if need_hidden else None
    weight_gradient = WeightGradient(weight, call.valid_cols, index.numel(), len(call.chunks(index.numel())),
                                     main_grad) if need_weight else None
    linear_backward(hidden_rows, weight, target_rows, lse, mean_x_rows, grad_logprob, grad_entropy,
                    threshold if call.filter_active else None, call, grad_hidden_rows, weight_gradient,
                    _chunk_sets(kept_offsets, kept_ids, kept_next_token, index, call))
    grad_hidden = scattered(grad_hidden_rows, index, rows) if need_hidden else hidden_rows.new_empty(0)
    grad_weight = weight_gradient.gradient() if need_weight else None
    return grad_hidden, grad_weight if grad_weight is not None else weight.new_empty(0)


@_linear_backward_op.register_fake
def _linear_backward_op_fake(hidden, hidden_rows, weight, targets, index, logprob, lse, mean_x, threshold,
                             grad_logprob, grad_entropy, main_grad, rows, start_index, true_vocab_size, group_name,
                             logit_scale, top_k, top_p, chunk_rows, implementation, need_hidden, need_weight,
                             kept_offsets=None, kept_ids=None, kept_next_token=False):
    grad_hidden = hidden_rows.new_empty((rows, hidden_rows.shape[1]) if need_hidden else (0,))
    return grad_hidden, weight.new_empty(weight.shape if need_weight and main_grad is None else (0,))


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, targets, *args = inputs
    logprob, _, index, hidden_rows, lse, mean_x, threshold = output
    # Eager: the input only where every row is trained (then `hidden_rows` is empty), so that a gathered call keeps
    # just its trained rows. Traced, the count is symbolic: both are kept.
    traced = isinstance(hidden_rows.shape[0], torch.SymInt)
    keep_input = traced or hidden_rows.shape[0] == 0
    (start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, _, chunk_rows, _, implementation,
     *kept) = args
    kept_offsets, kept_ids, kept_next_token = (kept + [None, None, False])[:3]
    ctx.save_for_backward(hidden if keep_input else hidden.new_empty((0, hidden.shape[1])), hidden_rows, weight,
                          targets, index, logprob, lse, mean_x, threshold, kept_offsets, kept_ids)
    ctx.rows = hidden.shape[0]
    ctx.weight = weight  # eager: the parameter itself, whose `main_grad` backward may add dW into
    ctx.args = (start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, chunk_rows, implementation)
    ctx.kept_next_token = kept_next_token
    ctx.set_materialize_grads(False)  # an entropy that is only logged passes None, and its term is skipped


def _backward(ctx, grad_logprob, grad_entropy, *_):
    hidden, hidden_rows, weight, targets, index, logprob, lse, mean_x, threshold, kept_offsets, kept_ids = \
        ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    main_grad = main_grad_of(ctx.weight) if need_weight else None
    grad_hidden, grad_weight = _linear_backward_op(hidden, hidden_rows, weight, targets, index, logprob, lse, mean_x,
                                                   threshold, grad_logprob, grad_entropy, main_grad, ctx.rows,
                                                   *ctx.args, need_hidden, need_weight, kept_offsets, kept_ids,
                                                   ctx.kept_next_token)
    if main_grad is not None:
        grad_weight = added_to_main_grad(ctx.weight)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None) + (None,) * 14


torch.library.register_autograd("megatron_grpo::vocab_parallel_linear_logprobs", _backward,
                                setup_context=_setup_context)


@overload
def vocab_parallel_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    shard: VocabShard | None = ...,
    distribution: SamplingDistribution | None = ...,
    shift: bool = ...,
    with_entropy: Literal[False] = ...,
    chunk_rows: int | None = ...,
    check_inputs: bool = ...,
    implementation: Implementation = ...,
    kept_set: KeptSet | None = ...,
) -> torch.Tensor: ...


@overload
def vocab_parallel_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    shard: VocabShard | None = ...,
    distribution: SamplingDistribution | None = ...,
    shift: bool = ...,
    with_entropy: Literal[True],
    chunk_rows: int | None = ...,
    check_inputs: bool = ...,
    implementation: Implementation = ...,
    kept_set: KeptSet | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def vocab_parallel_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    shard: VocabShard | None = None,
    distribution: SamplingDistribution | None = None,
    shift: bool = False,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
    check_inputs: bool = True,
    implementation: Implementation = "auto",
    kept_set: KeptSet | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` under `distribution` over the logits `hidden @ weight.T` of the whole (sharded,
    unpadded) vocab, computed a chunk of rows at a time so that no `[T, V_local]` logits exist.

    Differentiable w.r.t. `hidden` and `weight`. The gradient of `hidden` is this rank's **partial sum** over
    its vocab shard: the caller reduces it across TP exactly where Megatron's output layer does (the
    all-reduce in backward of `copy_to_tensor_model_parallel_region` on the layer's input), so this op runs
    no collective in backward. Forward runs one all-gather of `[trained rows, 3|4]` fp32 partials (plus the
    filter's small collectives per chunk with top-k / top-p). Under Megatron's DDP (the weight has `main_grad`
    and `grad_added_to_main_grad`), dW is summed straight into `main_grad` and autograd gets Megatron's dummy
    gradient (`megatron_grpo.ops.core.gemm`).

    Args:
        hidden: `[..., H]` final hidden states (after the final norm), replicated over the TP group.
        weight: `[V_local, H]` this rank's shard of the output layer (or of the tied embedding), same dtype
            and device as `hidden`.
        targets: `[...]` (`hidden.shape[:-1]`) integer global token ids; `< 0` means ignore: the row is
            never computed, and its logprob, entropy and `hidden` gradient are exactly 0.
        shard: where the weight's rows sit in the vocab, its padding (ids `>=` the true vocab size never enter
            the softmax, and their weight rows get exactly 0 gradient) and the TP group (`VocabShard`); None
            means an unsharded, unpadded vocab.
        distribution: softmax(logit_scale * logits) filtered by top-k / top-p (`SamplingDistribution`), as in
            `vocab_parallel_logprobs`; the scale enters the chunk GEMMs. None: softmax(hidden @ weight.T).
        shift: next-token mode, as in `vocab_parallel_logprobs` (`megatron_grpo.ops.core.rows`).
        with_entropy: also return the exact entropy of each row's distribution.
        chunk_rows: trained rows per chunk; None picks one (`chunk_rows_for`): at least 16 chunks of at least 64
            rows, each at most 256 MiB of logits.
        check_inputs: check target ids against the vocab (a host sync); pass False in hot loops. Gathering
            the trained rows is a host sync of its own whenever some rows are ignored (always with `shift`, whose
            last position has no target) or, with `check_inputs=False`, may be.
        implementation: "auto" (fused kernels where available), "fused" or "torch" (the plain-torch kernels).
        kept_set: with `distribution.replay_kept_set`, the engine's kept set of every position of `targets`, as in
            `vocab_parallel_logprobs`; each chunk reads its rows' sets (one more host sync per call, and per
            backward, for the chunks' bounds). No `[T, V]` mask is built.

    Returns:
        With `with_entropy=False` (the default) one tensor, the float32 logprobs `[...]` (float64 for float64
        inputs); with `with_entropy=True` the pair `(logprobs, entropy)`.
    """
    check_linear_inputs(hidden, weight, targets, chunk_rows)
    shard = VocabShard() if shard is None else shard
    distribution = SamplingDistribution() if distribution is None else distribution
    check_kept_set_argument(kept_set, distribution, targets)
    if shift:
        check_shiftable(targets)
        targets = next_token_targets(targets)
    batch_shape = targets.shape
    logprob, entropy, *_ = torch.ops.megatron_grpo.vocab_parallel_linear_logprobs(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).to(torch.int64), shard.start_index,
        shard.true_vocab_size, shard.group_name, distribution.logit_scale, distribution.top_k, distribution.top_p,
        with_entropy, chunk_rows, check_inputs, implementation,
        *(() if kept_set is None else (kept_set.offsets, kept_set.ids, shift)))
    out = per_token((logprob, entropy) if with_entropy else (logprob,), batch_shape, shift)
    return out if with_entropy else out[0]
