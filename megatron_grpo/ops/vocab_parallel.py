"""`vocab_parallel_logprobs`: per-token logprobs (and entropy) from tensor-parallel, vocab-sharded logits.

Forward: one pass over each local row computes softmax partials, one all-gather of the `[rows, k]` partials
combines them across ranks (see `partials`). Backward recomputes p from the logits and needs no collective;
only lse (and E[x] with entropy) is kept per row. Padded vocab columns never enter the softmax and get a
gradient of exactly 0.

With a filtered `SamplingDistribution` (top-k / top-p) the distribution is the filtered one the rollout sampler
draws from (see `filtering`): a per-row threshold is found first (a few small collectives), and the kernels count
only logits at or above it.

The op is the `torch.library` custom op `megatron_grpo::vocab_parallel_logprobs` with a fake kernel and its
backward registered, so `torch.compile(fullgraph=True)` traces it as one node. The TP group travels as its name
(`VocabShard.group_name`). The in-place backward modes (`inplace_backward=True` / `"exp"`) hand autograd the
logits' own buffer as their gradient, which an op's output may not alias: they run as an eager autograd Function
(`InplaceLogprobs`) over the same forward and backward code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, overload

import torch

from megatron_grpo.ops.core.backends import Implementation, Kernels, select_kernels
from megatron_grpo.ops.core.checks import (
    check_inplace_backward,
    check_kept_set_argument,
    check_kept_values,
    check_logits_inputs,
    check_target_ids,
)
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.core.filtering import kept_threshold
from megatron_grpo.ops.core.partials import Partials, RowStats, combine_partials, gather_partials
from megatron_grpo.ops.core.replay import RowSets, replay_gradient, replay_partials
from megatron_grpo.ops.core.rows import check_shiftable, next_token_targets, per_token, upstream_gradients
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet
from megatron_grpo.ops.vocab_shard import VocabShard


@dataclass(frozen=True)
class LogprobCall:
    """Everything a call computes with besides the logits and targets."""

    shard: VocabShard  # resolved
    valid_cols: int
    distribution: SamplingDistribution
    with_entropy: bool
    kernels: Kernels
    kept: RowSets | None = None  # the engine's kept sets of the rows, replayed instead of the filter

    @classmethod
    def of(cls, logits: torch.Tensor, shard: VocabShard, distribution: SamplingDistribution, with_entropy: bool,
           implementation: Implementation, kept: RowSets | None = None) -> LogprobCall:
        shard = shard.resolve(logits.shape[-1])
        return cls(shard=shard, valid_cols=shard.valid_cols(logits.shape[-1]), distribution=distribution,
                   with_entropy=with_entropy, kernels=select_kernels(logits, implementation), kept=kept)

    @property
    def filter_active(self) -> bool:
        return self.kept is not None or self.distribution.active(self.shard.true_vocab_size)


def logprob_forward(logits: torch.Tensor, targets: torch.Tensor, call: LogprobCall, *, write_exps: bool = False
                    ) -> tuple[RowStats, torch.Tensor | None, torch.Tensor]:
    """`(stats, threshold, partials)` of `[rows, V_local]` logits: the filter's threshold (None without one), the
    partials kernel, the one all-gather and the combine. `write_exps`: the kernel also overwrites the logits with
    `exp(z - m_local)` (the in-place exp mode)."""
    shard, scale = call.shard, call.distribution.logit_scale
    if call.kept is not None:  # the engine's kept sets instead of the filter (`core.replay`)
        with torch.no_grad():
            partials, threshold = replay_partials(logits, targets, call.kept, call.kernels, shard.start_index,
                                                  call.valid_cols, call.with_entropy, scale)
        stats = combine_partials(gather_partials(partials, shard.group), targets, call.with_entropy)
        return stats, threshold, partials
    with torch.no_grad():
        threshold = kept_threshold(logits[:, :call.valid_cols], call.distribution,
                                   true_vocab_size=shard.true_vocab_size, group=shard.group)
    partials_kernel = call.kernels.logprob_partials_writing_exps if write_exps else call.kernels.logprob_partials
    partials = partials_kernel(logits, targets, shard.start_index, call.valid_cols, call.with_entropy, threshold,
                               logit_scale=scale)
    stats = combine_partials(gather_partials(partials, shard.group), targets, call.with_entropy)
    return stats, threshold, partials


def logprob_backward(logits: torch.Tensor, targets: torch.Tensor, call: LogprobCall, stats: RowStats,
                     threshold: torch.Tensor | None, grad_logprob: torch.Tensor | None,
                     grad_entropy: torch.Tensor | None, grad_logits: torch.Tensor) -> None:
    """Writes d(objective)/d(logits) into `grad_logits` (which may be `logits` itself); no collective."""
    grad_logprob, mean_x, grad_entropy = upstream_gradients(
        grad_logprob, grad_entropy, stats.lse, stats.mean_x, None if threshold is None else stats.logprob)
    patch = None if call.kept is None else replay_gradient(
        logits, targets, call.kept, threshold, stats.lse, mean_x, grad_logprob, grad_entropy, call.shard.start_index,
        call.valid_cols, call.distribution.logit_scale)  # read before the kernel may overwrite the logits
    call.kernels.logprob_backward(logits, targets, call.shard.start_index, call.valid_cols, stats.lse, mean_x,
                                  grad_logprob, grad_entropy, grad_logits, threshold,
                                  logit_scale=call.distribution.logit_scale)
    if patch is not None:
        patch.write(grad_logits)


# ---- the traceable op (out-of-place backward) ----

def _call(logits, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, with_entropy,
          implementation, kept_offsets=None, kept_ids=None, kept_next_token=False) -> LogprobCall:
    shard = VocabShard.with_group_name(start_index, true_vocab_size, group_name)
    distribution = SamplingDistribution(logit_scale=logit_scale, top_k=top_k, top_p=top_p,
                                        replay_kept_set=kept_offsets is not None)
    kept = None if kept_offsets is None else RowSets.of_rows(KeptSet(kept_offsets, kept_ids), logits.shape[0],
                                                             kept_next_token)
    return LogprobCall.of(logits, shard, distribution, with_entropy, implementation, kept)


@torch.library.custom_op("megatron_grpo::vocab_parallel_logprobs", mutates_args=())
def _logprobs_op(logits: torch.Tensor, targets: torch.Tensor, start_index: Optional[int],
                 true_vocab_size: Optional[int], group_name: str, logit_scale: float, top_k: Optional[int],
                 top_p: Optional[float], with_entropy: bool, check_inputs: bool, implementation: str,
                 kept_offsets: Optional[torch.Tensor] = None, kept_ids: Optional[torch.Tensor] = None,
                 kept_next_token: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logprob, entropy, lse, mean_x, threshold)` of `[rows, V_local]` logits: `[rows]` each, or `[0]` for the
    entropy and E[x] without `with_entropy` and for the threshold without a filter (`-inf` rows where the filter
    keeps everything of this vocab). `kept_offsets`, `kept_ids`: a `KeptSet` to replay, its positions those of the
    targets before the shift (`kept_next_token`: row `r` scores position `r + 1`)."""
    call = _call(logits, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, with_entropy,
                 implementation, kept_offsets, kept_ids, kept_next_token)
    if check_inputs:
        check_target_ids(targets, call.shard)
        if kept_offsets is not None:
            check_kept_values(KeptSet(kept_offsets, kept_ids), targets, call.shard, kept_next_token)
    stats, threshold, _ = logprob_forward(logits, targets, call)
    if call.distribution.filtered and threshold is None:  # a filter that keeps this whole vocab
        threshold = torch.full_like(stats.lse, float("-inf"))

    def present(value: torch.Tensor | None) -> torch.Tensor:  # outputs may not alias: a new empty tensor each
        return value if value is not None else stats.lse.new_empty(0)

    return stats.logprob, present(stats.entropy), stats.lse, present(stats.mean_x), present(threshold)


@_logprobs_op.register_fake
def _logprobs_op_fake(logits, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                      with_entropy, check_inputs, implementation, kept_offsets=None, kept_ids=None,
                      kept_next_token=False):
    rows, dtype = logits.shape[0], compute_dtype(logits.dtype)

    def per_row(present: bool = True) -> torch.Tensor:
        return logits.new_empty(rows if present else 0, dtype=dtype)

    filtered = kept_offsets is not None or SamplingDistribution(logit_scale=logit_scale, top_k=top_k,
                                                                top_p=top_p).filtered
    return per_row(), per_row(with_entropy), per_row(), per_row(with_entropy), per_row(filtered)


@torch.library.custom_op("megatron_grpo::vocab_parallel_logprobs_backward", mutates_args=())
def _logprobs_backward_op(logits: torch.Tensor, targets: torch.Tensor, logprob: torch.Tensor, lse: torch.Tensor,
                          mean_x: torch.Tensor, threshold: torch.Tensor, grad_logprob: Optional[torch.Tensor],
                          grad_entropy: Optional[torch.Tensor], start_index: Optional[int],
                          true_vocab_size: Optional[int], group_name: str, logit_scale: float,
                          top_k: Optional[int], top_p: Optional[float], implementation: str,
                          kept_offsets: Optional[torch.Tensor] = None, kept_ids: Optional[torch.Tensor] = None,
                          kept_next_token: bool = False) -> torch.Tensor:
    """d(objective)/d(logits), in a new buffer with the logits' row alignment (`empty_with_alignment_of`)."""
    with_entropy = mean_x.numel() > 0
    call = _call(logits, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, with_entropy,
                 implementation, kept_offsets, kept_ids, kept_next_token)
    stats = RowStats(logprob=logprob, lse=lse, entropy=None, mean_x=mean_x if with_entropy else None)
    grad_logits = empty_with_alignment_of(logits)
    logprob_backward(logits, targets, call, stats, threshold if call.filter_active else None, grad_logprob,
                     grad_entropy, grad_logits)
    return grad_logits


@_logprobs_backward_op.register_fake
def _logprobs_backward_op_fake(logits, targets, logprob, lse, mean_x, threshold, grad_logprob, grad_entropy,
                               start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, implementation,
                               kept_offsets=None, kept_ids=None, kept_next_token=False):
    return logits.new_empty_strided(logits.shape, (gradient_row_stride(logits), 1))


def _setup_context(ctx, inputs, output) -> None:
    logits, targets, *args = inputs
    logprob, _, lse, mean_x, threshold = output
    start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, _, _, implementation, *kept = args
    kept_offsets, kept_ids, kept_next_token = (kept + [None, None, False])[:3]
    ctx.save_for_backward(logits, targets, logprob, lse, mean_x, threshold, kept_offsets, kept_ids)
    ctx.args = (start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, implementation)
    ctx.kept_next_token = kept_next_token
    ctx.set_materialize_grads(False)  # an entropy that is only logged passes None, and its term is skipped


def _backward(ctx, grad_logprob, grad_entropy, *_):
    logits, targets, logprob, lse, mean_x, threshold, kept_offsets, kept_ids = ctx.saved_tensors
    grad_logits = _logprobs_backward_op(logits, targets, logprob, lse, mean_x, threshold, grad_logprob, grad_entropy,
                                        *ctx.args, kept_offsets, kept_ids, ctx.kept_next_token)
    return (grad_logits,) + (None,) * 13


torch.library.register_autograd("megatron_grpo::vocab_parallel_logprobs", _backward, setup_context=_setup_context)


# ---- the in-place modes (eager) ----

class InplaceLogprobs(torch.autograd.Function):
    """`inplace_backward=True` / `"exp"`: backward writes the gradient into the logits' buffer and returns it. Eager
    only (an op's output may not alias its input); the forward and backward code is the op's."""

    @staticmethod
    def forward(ctx, logits, targets, call: LogprobCall, mode: bool | str, check_inputs: bool):
        if check_inputs:
            check_target_ids(targets, call.shard)
        exp_mode = mode == "exp"
        stats, threshold, partials = logprob_forward(logits, targets, call, write_exps=exp_mode)
        if exp_mode:
            # The logits buffer now holds exp(z - m_local): whoever saved the logits fails loudly at unpack.
            torch.autograd.graph.increment_version(logits)
        prob_scale = _prob_scale(partials, stats.lse) if exp_mode else None
        target_prob = torch.exp(stats.logprob).contiguous() if exp_mode else None
        ctx.save_for_backward(logits, targets, stats.logprob, stats.lse, stats.mean_x, threshold, prob_scale,
                              target_prob)
        ctx.call = call
        ctx.set_materialize_grads(False)  # an entropy that is only logged passes None, and its term is skipped
        return (stats.logprob, stats.entropy) if call.with_entropy else stats.logprob

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        logits, targets, logprob, lse, mean_x, threshold, prob_scale, target_prob = ctx.saved_tensors
        call: LogprobCall = ctx.call
        stats = RowStats(logprob=logprob, lse=lse, entropy=None, mean_x=mean_x)
        if prob_scale is not None:  # inplace_backward="exp": `logits` holds exp(z - m_local)
            if grad_entropy is not None:
                raise RuntimeError(
                    "inplace_backward='exp' cannot differentiate the entropy (its gradient needs the logits, which "
                    "forward overwrote); use inplace_backward=True, or detach the entropy"
                )
            grad_logprob, _, _ = upstream_gradients(grad_logprob, None, lse, None,
                                                    None if threshold is None else logprob)
            call.kernels.logprob_backward_from_exps(logits, targets, call.shard.start_index, call.valid_cols,
                                                    prob_scale, target_prob, grad_logprob,
                                                    logit_scale=call.distribution.logit_scale)
        else:
            logprob_backward(logits, targets, call, stats, threshold, grad_logprob, grad_entropy, logits)
        # Anyone else who saved these logits now fails loudly at unpack instead of reading gradients.
        torch.autograd.graph.increment_version(logits)
        return logits, None, None, None, None


def _prob_scale(partials: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(m_local - lse) per row: turns the exps left in the logits buffer into probabilities."""
    m = partials[:, Partials.MAX].to(lse.dtype)
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return torch.exp(shift - lse).contiguous()


# ---- the gradient buffer ----

VECTOR_BYTES = 16  # the kernels' vector width: a row takes the vector path where grad and logits share it


def gradient_row_stride(logits: torch.Tensor) -> int:
    """The row stride of `empty_with_alignment_of(logits)`: the smallest one `>= cols` that is congruent to the
    logits' modulo 16 bytes (so at most 15 bytes per row are wasted)."""
    rows, cols = logits.shape
    element = logits.element_size()
    if rows <= 1 or cols == 0 or VECTOR_BYTES % element:
        return cols
    return cols + (logits.stride(0) - cols) % (VECTOR_BYTES // element)


def empty_with_alignment_of(logits: torch.Tensor) -> torch.Tensor:
    """An uninitialised `[rows, cols]` tensor whose every row has the 16-byte alignment of the logits' row.

    A sliced or offset view of logits would otherwise get a gradient buffer aligned differently, and the
    kernels would fall back to scalar stores for most rows.
    """
    rows, cols = logits.shape
    element = logits.element_size()
    if rows == 0 or cols == 0 or VECTOR_BYTES % element:
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    per_vector = VECTOR_BYTES // element
    row_stride = gradient_row_stride(logits)
    offset = (logits.data_ptr() % VECTOR_BYTES) // element
    size = offset + (rows - 1) * row_stride + cols + per_vector
    storage = torch.empty(size, dtype=logits.dtype, device=logits.device)
    offset = (offset - (storage.data_ptr() % VECTOR_BYTES) // element) % per_vector
    return storage.as_strided((rows, cols), (row_stride, 1), offset)


# ---- the functional API ----

@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    shard: VocabShard | None = ...,
    distribution: SamplingDistribution | None = ...,
    shift: bool = ...,
    with_entropy: Literal[False] = ...,
    inplace_backward: bool | Literal["exp"] = ...,
    check_inputs: bool = ...,
    implementation: Implementation = ...,
    kept_set: KeptSet | None = ...,
) -> torch.Tensor: ...


@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    shard: VocabShard | None = ...,
    distribution: SamplingDistribution | None = ...,
    shift: bool = ...,
    with_entropy: Literal[True],
    inplace_backward: bool | Literal["exp"] = ...,
    check_inputs: bool = ...,
    implementation: Implementation = ...,
    kept_set: KeptSet | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    shard: VocabShard | None = None,
    distribution: SamplingDistribution | None = None,
    shift: bool = False,
    with_entropy: bool = False,
    inplace_backward: bool | Literal["exp"] = False,
    check_inputs: bool = True,
    implementation: Implementation = "auto",
    kept_set: KeptSet | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` under `distribution` over the whole (sharded, unpadded) vocab: by default
    softmax(logits).

    With a filtered distribution (top-k / top-p), under the filtered distribution the sampler draws from: the
    softmax over the kept tokens only (see `megatron_grpo.ops.core.filtering` for the exact rule, ties and collectives).
    A target outside the kept set has logprob -inf and no gradient; the entropy is that of the filtered
    distribution; filtered logits get a gradient of exactly 0.

    Args:
        logits: `[..., V_local]` float32/bfloat16/float16 (float64 on the torch kernels): this rank's shard.
        targets: `[...]` integer global token ids; `< 0` means ignore (logprob, entropy and gradient are 0).
        shard: where the logits' columns sit in the vocab, its padding and the TP group (`VocabShard`); None
            means an unsharded, unpadded vocab.
        distribution: softmax(logit_scale * logits) filtered by top-k / top-p (`SamplingDistribution`, e.g.
            `SamplingDistribution.of_sampling(temperature, top_k, top_p)`, the sampler's settings): the scale is
            applied inside the kernels (no scaled copy of the logits), and top-k / top-p select on the scaled
            distribution, as the sampler does. None: softmax(logits).
        shift: next-token mode (see `megatron_grpo.ops.core.rows`): `targets` are the sequence's tokens, the logits
            at `t` score `targets[..., t + 1]`, and the outputs are aligned with `targets` (position 0 is 0).
        with_entropy: also return the exact entropy of each row's distribution.
        inplace_backward: False, True or "exp". True: backward writes the gradient into the logits' buffer
            (saves a `[..., V_local]` allocation); the logits must not be needed after backward. "exp": forward
            already overwrites the buffer with exp(z - row max) and backward turns it into the gradient without
            an exponential (faster; fused kernels on CPU only). Then the caller's logits tensor no longer holds
            logits after this call (unless they had to be copied to a contiguous layout), nothing may read them
            between forward and backward, and the entropy cannot be differentiated (returning it for logging is
            fine; a gradient reaching it raises). Either way, whoever saved the logits for its own backward
            fails loudly at unpack (autograd's version counter). Both modes run eagerly (see the module
            docstring); False is the traceable custom op.
        check_inputs: check target ids against the vocab (a host sync); pass False in hot loops.
        implementation: "auto" (fused kernels where available), "fused" or "torch" (the plain-torch kernels).
        kept_set: with `distribution.replay_kept_set` (and only then), the rollout engine's kept set of every
            position of `targets` (`KeptSet`: CSR over the flattened targets, aligned with them as the outputs are):
            the softmax is renormalised over exactly each row's set (`megatron_grpo.ops.core.replay`); a set equal
            to the filter's recomputed one gives the filter's results bit for bit. With `check_inputs` a malformed
            set, or a scored target outside its set, is a ValueError (one host sync more). Sets at positions that
            score nothing are ignored.

    Returns:
        With `with_entropy=False` (the default) one tensor, the float32 logprobs `[...]` (float64 for float64
        logits); with `with_entropy=True` the pair `(logprobs, entropy)`.
    """
    check_logits_inputs(logits, targets)
    check_inplace_backward(inplace_backward)
    shard = VocabShard() if shard is None else shard
    distribution = SamplingDistribution() if distribution is None else distribution
    check_kept_set_argument(kept_set, distribution, targets, inplace_backward)
    if shift:
        check_shiftable(targets)
        targets = next_token_targets(targets)
    batch_shape = targets.shape
    rows_logits = logits.reshape(-1, logits.shape[-1])
    if rows_logits.stride(-1) != 1 or (rows_logits.shape[0] > 1 and rows_logits.stride(0) < rows_logits.shape[1]):
        rows_logits = rows_logits.contiguous()
    rows_targets = targets.reshape(-1).to(torch.int64).contiguous()
    if inplace_backward is False:
        kept = () if kept_set is None else (kept_set.offsets, kept_set.ids, shift)
        logprob, entropy, *_ = torch.ops.megatron_grpo.vocab_parallel_logprobs(
            rows_logits, rows_targets, shard.start_index, shard.true_vocab_size, shard.group_name,
            distribution.logit_scale, distribution.top_k, distribution.top_p, with_entropy, check_inputs,
            implementation, *kept)
        out = (logprob, entropy) if with_entropy else (logprob,)
    else:
        kept = None if kept_set is None else RowSets.of_rows(kept_set, rows_targets.numel(), shift)
        call = LogprobCall.of(rows_logits, shard, distribution, with_entropy, implementation, kept)
        if check_inputs and kept_set is not None:
            check_kept_values(kept_set, rows_targets, call.shard, shift)
        out = InplaceLogprobs.apply(rows_logits, rows_targets, call, inplace_backward, check_inputs)
        out = out if with_entropy else (out,)
    out = per_token(out, batch_shape, shift)
    return out if with_entropy else out[0]
