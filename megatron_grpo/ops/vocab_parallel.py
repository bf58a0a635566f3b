"""`vocab_parallel_logprobs`: per-token logprobs (and entropy) from tensor-parallel, vocab-sharded logits.

Forward: one pass over each local row. With one rank the kernel writes the op's outputs itself (logprob, entropy,
and the lse and E[x] backward needs); with several it writes `[rows, k]` softmax partials, one all-gather shares
them and one combine kernel turns them into the same outputs (see `partials`). Backward recomputes p from the logits
and needs no collective; only lse (and E[x] with entropy) is kept per row. Padded vocab columns never enter the
softmax and get a gradient of exactly 0.

With a filtered `SamplingDistribution` (top-k / top-p) the distribution is the filtered one the rollout sampler
draws from (see `filtering`): a per-row threshold is found first (a few small collectives), and the kernels count
only logits at or above it.

The op is the `torch.library` op `megatron_grpo::vocab_parallel_logprobs` with a fake kernel and its backward
registered (`custom_op.define_op`: a call costs a few Python frames, and no autograd object under `no_grad`), so
`torch.compile(fullgraph=True)` traces it as one node. The TP group travels as its name (`VocabShard.group_name`);
what a call computes with besides its tensors (`LogprobCall`) is resolved once per set of arguments without a TP
group, and once per call with one. The in-place backward modes (`inplace_backward=True` / `"exp"`) hand autograd
the logits' own buffer as their gradient, which an op's output may not alias: they run as an eager autograd Function
(`InplaceLogprobs`) over the same forward and backward code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Literal, overload

import torch

from megatron_grpo.ops.core.alignment import empty_with_alignment_of, gradient_row_stride
from megatron_grpo.ops.core.backends import Implementation, Kernels, RowOutputs, extension_status, select_kernels_for
from megatron_grpo.ops.core.checks import (
    check_inplace_backward,
    check_kept_set_argument,
    check_kept_values,
    check_logits_inputs,
    check_target_ids,
)
from megatron_grpo.ops.core.custom_op import define_op
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.core.filtering import kept_threshold
from megatron_grpo.ops.core.partials import Partials, RowStats, gather_partials
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
    filter_active: bool  # the distribution's filter can drop a token of this vocab, or kept sets are replayed
    single_rank: bool  # no TP group of more than one rank: the forward kernel writes the outputs
    kept: RowSets | None = None  # the engine's kept sets of the rows, replayed instead of the filter

    @classmethod
    def of(cls, logits: torch.Tensor, shard: VocabShard, distribution: SamplingDistribution, with_entropy: bool,
           implementation: Implementation, kept: RowSets | None = None) -> LogprobCall:
        """The call for these logits; a shard without a TP group is resolved once per set of arguments."""
        cols, device, dtype = logits.shape[-1], logits.device, logits.dtype
        if shard.group is None:
            call = _call_without_group(cols, device, dtype, shard, distribution, with_entropy, implementation)
        else:
            call = cls._build(cols, device, dtype, shard, distribution, with_entropy, implementation)
        return call if kept is None else replace(call, kept=kept, filter_active=True)

    @classmethod
    def _build(cls, cols: int, device: torch.device, dtype: torch.dtype, shard: VocabShard,
               distribution: SamplingDistribution, with_entropy: bool, implementation: Implementation) -> LogprobCall:
        shard = shard.resolve(cols)
        return cls(shard=shard, valid_cols=shard.valid_cols(cols), distribution=distribution,
                   with_entropy=with_entropy, kernels=select_kernels_for(device, dtype, implementation),
                   filter_active=distribution.active(shard.true_vocab_size), single_rank=shard.tp_size == 1)

    def threshold(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The filter's per-row threshold, None where the filter keeps every token (a few small collectives)."""
        if not self.filter_active:
            return None
        with torch.no_grad():
            return kept_threshold(logits[:, :self.valid_cols], self.distribution,
                                  true_vocab_size=self.shard.true_vocab_size, group=self.shard.group,
                                  kernels=self.kernels)

    def outputs(self, logits: torch.Tensor, targets: torch.Tensor, threshold: torch.Tensor | None) -> RowOutputs:
        """`(logprob, entropy, lse, mean_x)` of `[rows, V_local]` logits (entropy and E[x] `[0]` without entropy):
        the forward kernel's own with one rank; else the partials kernel, the one all-gather and the combine."""
        scale = self.distribution.logit_scale
        if self.single_rank:
            return self.kernels.logprob_stats(logits, targets, self.shard.start_index, self.valid_cols,
                                              self.with_entropy, threshold, scale)
        partials = self.kernels.logprob_partials(logits, targets, self.shard.start_index, self.valid_cols,
                                                 self.with_entropy, threshold, scale)
        return self.kernels.combine(gather_partials(partials, self.shard.group), targets, self.with_entropy)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[RowOutputs, torch.Tensor | None]:
        """`(outputs, threshold)`: the filter's threshold (None without one) and `outputs`' outputs; with kept sets,
        their partials (`core.replay`: the threshold the kernels ran with), the all-gather and the combine."""
        if self.kept is None:
            threshold = self.threshold(logits)
            return self.outputs(logits, targets, threshold), threshold
        with torch.no_grad():
            partials, threshold = replay_partials(logits, targets, self.kept, self.kernels, self.shard.start_index,
                                                  self.valid_cols, self.with_entropy, self.distribution.logit_scale)
        gathered = gather_partials(partials, self.shard.group)
        return self.kernels.combine(gathered, targets, self.with_entropy), threshold


@functools.lru_cache(maxsize=256)
def _call_without_group(cols: int, device: torch.device, dtype: torch.dtype, shard: VocabShard,
                        distribution: SamplingDistribution, with_entropy: bool,
                        implementation: Implementation) -> LogprobCall:
    return LogprobCall._build(cols, device, dtype, shard, distribution, with_entropy, implementation)


@functools.lru_cache(maxsize=256)
def _shard_and_distribution(start_index: int | None, true_vocab_size: int | None, logit_scale: float,
                            top_k: int | None, top_p: float | None,
                            replay_kept_set: bool) -> tuple[VocabShard, SamplingDistribution]:
    """The values a call without a TP group carries, built (and checked) once per set of op arguments."""
    return (VocabShard(start_index=start_index, true_vocab_size=true_vocab_size),
            SamplingDistribution(logit_scale=logit_scale, top_k=top_k, top_p=top_p, replay_kept_set=replay_kept_set))


def _op_call(logits, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, with_entropy,
             implementation, kept_offsets=None, kept_ids=None, kept_next_token=False) -> LogprobCall:
    """The call of the op's arguments. A group name is resolved at each call: a name can outlive its group (a
    destroyed group's name is given to the next one). Kept sets (`kept_offsets`, `kept_ids`) are the call's own."""
    replay = kept_offsets is not None
    kept = None if not replay else RowSets.of_rows(KeptSet(kept_offsets, kept_ids), logits.shape[0], kept_next_token)
    if group_name:
        return LogprobCall.of(logits, VocabShard.with_group_name(start_index, true_vocab_size, group_name),
                              SamplingDistribution(logit_scale=logit_scale, top_k=top_k, top_p=top_p,
                                                   replay_kept_set=replay), with_entropy, implementation, kept)
    shard, distribution = _shard_and_distribution(start_index, true_vocab_size, logit_scale, top_k, top_p, replay)
    call = _call_without_group(logits.shape[-1], logits.device, logits.dtype, shard, distribution, with_entropy,
                               implementation)
    return call if kept is None else replace(call, kept=kept, filter_active=True)


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

extension_status()  # loads megatron_grpo._C where it can: it defines the op and its autograd kernel in C++


def _logprobs(logits, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, with_entropy,
              check_inputs, implementation, kept_offsets=None, kept_ids=None, kept_next_token=False):
    """`(logprob, entropy, lse, mean_x, threshold)` of `[rows, V_local]` logits: `[rows]` each, or `[0]` for the
    entropy and E[x] without `with_entropy` and for the threshold without a filter (`-inf` rows where the filter
    keeps everything of this vocab). `kept_offsets`, `kept_ids`: a `KeptSet` to replay, its positions those of the
    targets before the shift (`kept_next_token`: row `r` scores position `r + 1`)."""
    call = _op_call(logits, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, with_entropy,
                    implementation, kept_offsets, kept_ids, kept_next_token)
    if check_inputs:
        check_target_ids(targets, call.shard)
        if kept_offsets is not None:
            check_kept_values(KeptSet(kept_offsets, kept_ids), targets, call.shard, kept_next_token)
    (logprob, entropy, lse, mean_x), threshold = call.forward(logits, targets)
    if threshold is None:  # outputs may not alias: a new tensor each
        threshold = (torch.full_like(lse, float("-inf")) if call.distribution.filtered  # keeps this whole vocab
                     else lse.new_empty(0))
    return logprob, entropy, lse, mean_x, threshold


def _logprobs_op_fake(logits, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p,
                      with_entropy, check_inputs, implementation, kept_offsets=None, kept_ids=None,
                      kept_next_token=False):
    rows, dtype = logits.shape[0], compute_dtype(logits.dtype)

    def per_row(present: bool = True) -> torch.Tensor:
        return logits.new_empty(rows if present else 0, dtype=dtype)

    filtered = kept_offsets is not None or SamplingDistribution(logit_scale=logit_scale, top_k=top_k,
                                                                top_p=top_p).filtered
    return per_row(), per_row(with_entropy), per_row(), per_row(with_entropy), per_row(filtered)


def _logprobs_backward(logits, targets, logprob, lse, mean_x, threshold, grad_logprob, grad_entropy, start_index,
                       true_vocab_size, group_name, logit_scale, top_k, top_p, implementation, kept_offsets=None,
                       kept_ids=None, kept_next_token=False):
    """d(objective)/d(logits), in a new buffer with the logits' row alignment (`alignment.empty_with_alignment_of`)."""
    with_entropy = mean_x.numel() > 0
    call = _op_call(logits, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, with_entropy,
                    implementation, kept_offsets, kept_ids, kept_next_token)
    active = call.filter_active
    if call.kept is not None:  # the kernel, then the gathered rows' kept columns (`core.replay`)
        stats = RowStats(logprob=logprob, lse=lse, entropy=None, mean_x=mean_x if with_entropy else None)
        grad_logits = empty_with_alignment_of(logits)
        logprob_backward(logits, targets, call, stats, threshold, grad_logprob, grad_entropy, grad_logits)
        return grad_logits
    return call.kernels.logprob_gradient(logits, targets, call.shard.start_index, call.valid_cols, lse,
                                        mean_x if with_entropy else None, logprob if active else None, grad_logprob,
                                        grad_entropy, threshold if active else None, logit_scale)


def _logprobs_backward_op_fake(logits, targets, logprob, lse, mean_x, threshold, grad_logprob, grad_entropy,
                               start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, implementation,
                               kept_offsets=None, kept_ids=None, kept_next_token=False):
    return logits.new_empty_strided(logits.shape, (gradient_row_stride(logits), 1))


_backward_op = define_op(
    "megatron_grpo::vocab_parallel_logprobs_backward",
    "(Tensor logits, Tensor targets, Tensor logprob, Tensor lse, Tensor mean_x, Tensor threshold, "
    "Tensor? grad_logprob, Tensor? grad_entropy, int? start_index, int? true_vocab_size, str group_name, "
    "float logit_scale, int? top_k, float? top_p, str implementation, Tensor? kept_offsets=None, "
    "Tensor? kept_ids=None, bool kept_next_token=False) -> Tensor",
    _logprobs_backward, _logprobs_backward_op_fake)


def _setup_context(ctx, inputs, output) -> None:
    logits, targets, start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, _, _, implementation, \
        *kept = inputs
    kept_offsets, kept_ids, kept_next_token = (list(kept) + [None, None, False])[:3]
    logprob, _, lse, mean_x, threshold = output
    ctx.save_for_backward(logits, targets, logprob, lse, mean_x, threshold, kept_offsets, kept_ids)
    ctx.args = (start_index, true_vocab_size, group_name, logit_scale, top_k, top_p, implementation)
    ctx.kept_next_token = kept_next_token
    ctx.set_materialize_grads(False)  # an entropy that is only logged passes None, and its term is skipped


def _backward(ctx, grad_logprob, grad_entropy, *_):
    logits, targets, logprob, lse, mean_x, threshold, kept_offsets, kept_ids = ctx.saved_tensors
    grad_logits = _backward_op(logits, targets, logprob, lse, mean_x, threshold, grad_logprob, grad_entropy,
                               *ctx.args, kept_offsets, kept_ids, ctx.kept_next_token)
    return (grad_logits,) + (None,) * 13


_logprobs_op = define_op(
    "megatron_grpo::vocab_parallel_logprobs",
    "(Tensor logits, Tensor targets, int? start_index, int? true_vocab_size, str group_name, float logit_scale, "
    "int? top_k, float? top_p, bool with_entropy, bool check_inputs, str implementation, "
    "Tensor? kept_offsets=None, Tensor? kept_ids=None, bool kept_next_token=False) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _logprobs, _logprobs_op_fake, differentiable=(0,), setup_context=_setup_context, backward=_backward,
    non_differentiable_outputs=(2, 3, 4))


# ---- the in-place modes (eager) ----

class InplaceLogprobs(torch.autograd.Function):
    """`inplace_backward=True` / `"exp"`: backward writes the gradient into the logits' buffer and returns it. Eager
    only (an op's output may not alias its input); the forward and backward code is the op's."""

    @staticmethod
    def forward(ctx, logits, targets, call: LogprobCall, mode: bool | str, check_inputs: bool):
        if check_inputs:
            check_target_ids(targets, call.shard)
        prob_scale = target_prob = None
        if mode == "exp":  # no kept sets (`check_kept_set_argument`)
            shard, threshold = call.shard, call.threshold(logits)
            partials = call.kernels.logprob_partials_writing_exps(logits, targets, shard.start_index,
                                                                  call.valid_cols, call.with_entropy, threshold,
                                                                  logit_scale=call.distribution.logit_scale)
            stats = RowStats.of(call.kernels.combine(gather_partials(partials, shard.group), targets,
                                                     call.with_entropy), call.with_entropy)
            # The logits buffer now holds exp(z - m_local): whoever saved the logits fails loudly at unpack.
            torch.autograd.graph.increment_version(logits)
            prob_scale = _prob_scale(partials, stats.lse)
            target_prob = torch.exp(stats.logprob).contiguous()
        else:
            outputs, threshold = call.forward(logits, targets)
            stats = RowStats.of(outputs, call.with_entropy)
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
    if inplace_backward is not False:
        check_inplace_backward(inplace_backward)
    shard = _UNSHARDED if shard is None else shard
    distribution = _SOFTMAX if distribution is None else distribution
    if kept_set is not None or distribution.replay_kept_set:
        check_kept_set_argument(kept_set, distribution, targets, inplace_backward)
    if shift:
        check_shiftable(targets)
        targets = next_token_targets(targets)
    batch_shape = targets.shape
    rows_logits = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])
    if rows_logits.stride(-1) != 1 or (rows_logits.shape[0] > 1 and rows_logits.stride(0) < rows_logits.shape[1]):
        rows_logits = rows_logits.contiguous()
    rows_targets = targets if targets.dim() == 1 else targets.reshape(-1)
    if rows_targets.dtype != torch.int64 or not rows_targets.is_contiguous():
        rows_targets = rows_targets.to(torch.int64).contiguous()
    if inplace_backward is False:
        kept = () if kept_set is None else (kept_set.offsets, kept_set.ids, shift)
        logprob, entropy, *_ = _logprobs_op(
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
    if shift or len(batch_shape) != 1:
        out = per_token(out, batch_shape, shift)
    return out if with_entropy else out[0]


_UNSHARDED = VocabShard()
_SOFTMAX = SamplingDistribution()
