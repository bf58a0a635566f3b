"""The loss-fused head: a sequence-additive loss (`ClippedPGLoss`) straight from final hidden states and the output
weight shard, its gradient computed chunk by chunk during forward, written once into its final home.

Why: `vocab_parallel_linear_logprobs` runs 4 GEMMs per chunk over a step (forward logits; backward recomputes them,
then `dH` and `dW`), because the loss's gradient with respect to the logprobs is not known until backward. A loss
that is a sum over tokens and sequences, normalised by global counts known beforehand, knows the gradient of a chunk
as soon as the chunk's logprobs are known. So forward, per chunk of trained rows:

1. `logits = scale * h @ W_valid.T` (one GEMM, `gemm.chunk_logits`), into a reused chunk buffer;
2. the distribution's top-k / top-p threshold of each row (the filter is one number per row, and chunks hold whole
   rows), or the rollout engine's kept sets of the chunk's rows replayed (`ops.core.replay`), the kernels'
   partials, one all-gather of them over TP, the combine: logprob, entropy, lse per row;
3. the loss's gradient with respect to the rows' logprobs and entropies (`HeadLoss.row_gradients`): in closed form
   for a loss whose gradient at a token reads only that token's values (`ClippedPGLoss`'s, in most settings), a
   few elementwise kernels on `[rows]` vectors, no autograd; or, where the loss couples a sequence's tokens (GSPO's
   sequence ratio, ...), by autograd over the chunk's sequences, whose chunks then hold whole sequences;
4. the backward kernel in place in the chunk buffer (the logits become d(objective)/d(logits)), then
   `dH = scale * dlogits @ W_valid` written into the chunk's rows of the hidden gradient, and
   `dW += scale * dlogits.T @ h` (`gemm.WeightGradient`), two GEMMs.

3 GEMMs instead of 4, one small all-gather per chunk, no host sync inside the loop (top-p's threshold search runs
on pieces of a chunk's rows, `chunking.threshold_piece_rows`; only its plain-torch twin, for float64 logits or the
torch kernels, reads its candidates back, once per piece), and backward only hands `dH`, `dW` on.

**The upstream gradient.** The objective's gradient with respect to the loss, d(objective)/d(loss), scales every
row's gradient. Bound up front (`upstream_gradient`: the Megatron step knows it, the loss scale it applies times
what Megatron's schedule multiplies the loss by), the rows' gradients are multiplied by it before the backward
kernel, so `dH` and `dW` come out final: under Megatron's DDP `dW` goes straight into the weight's fp32 `main_grad`
during forward (autograd gets Megatron's dummy), otherwise into the returned gradient in the weight's dtype, and
backward only checks that the gradient it is given is the bound one (on CUDA a device-side assert, no host sync).
Unbound (None), 1 is assumed, as Liger-Kernel's fused linear cross entropy does: backward reads the gradient back
(one host sync) and, when it is not 1, scales `dH` and `dW` (one more pass over each); `dW` is then returned, never
put into `main_grad` during forward.

**Streams.** On CUDA the chunks overlap: chunk i's small kernels (threshold, partials, all-gather, combine, the
rows' gradients, the backward kernel) run on a side stream under chunk i + 1's logits GEMM, and chunk i's `dH` and
`dW` GEMMs follow on the main stream; two chunk buffers alternate (each half the size, within the same budget).
This path is written for CUDA and not yet run on a GPU. On the CPU the chunks run one after the other, one buffer.

`dH` is this rank's partial sum over its vocab shard: the caller reduces it over TP where Megatron's output layer
does, as for the op. A packed batch (`[1, T]` with `cu_seqlens`, `loss.packing`) is cut the same way; under context
parallelism (row-aligned shares, `shift=False`) whole-sequence chunks are cut alike on the CP ranks. The loss is a
Python callable, so this is an eager autograd Function, not a traceable op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_grpo.loss.packing import SequenceLayout
from megatron_grpo.ops.context_shard import ContextShard
from megatron_grpo.ops.core.backends import FusedKernels, Implementation
from megatron_grpo.ops.core.checks import (
    check_kept_set_argument,
    check_kept_values,
    check_linear_inputs,
    check_target_ids,
)
from megatron_grpo.ops.core.chunking import chunk_rows_for, head_min_chunks, row_chunks, sequence_chunks
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.core.filtering import kept_threshold, searches_in_one_call
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
from megatron_grpo.ops.core.rows import next_token_targets
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet
from megatron_grpo.ops.linear_logprobs import LinearCall
from megatron_grpo.ops.vocab_shard import VocabShard

Upstream = float | torch.Tensor  # d(objective)/d(loss): a number, or a one-element tensor (a dynamic loss scale)
# Relative tolerance of the bound upstream gradient's check: the schedule's multiplications and divisions in fp32
# round a few times (4 ulps), the bound value once.
UPSTREAM_RTOL = 16 * torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Chunk:
    """One chunk of the call's trained rows (`rows`, a slice of them in their flat order); for a loss that couples a
    sequence's tokens also the whole `sequences` it holds and their flat token positions `span`."""

    rows: slice
    sequences: slice | None = None
    span: tuple[int, int] | None = None


@dataclass(frozen=True)
class RowValues:
    """The current values of a chunk's trained rows, `[rows]` each in the compute dtype."""

    logprob: torch.Tensor  # under the distribution (-inf where a filter drops the target)
    entropy: torch.Tensor  # of the distribution
    unfiltered: torch.Tensor | None  # under distribution.unfiltered(), where the loss reads them


@dataclass(frozen=True)
class RowGradients:
    """d(objective)/d(value) of a chunk's trained rows, `[rows]` each; None where nothing differentiates a value."""

    logprob: torch.Tensor
    entropy: torch.Tensor | None = None
    unfiltered: torch.Tensor | None = None


RowGradient = Callable[[Chunk, RowValues], RowGradients]
# loss_fn(batch, logprobs, entropy, unfiltered logprobs or None) -> loss: a loss on precomputed per-token values of the
# batch's sequences (the batch's token shape), sequence-additive: on some of the sequences (`SequenceLayout.select`)
# it is their share of the whole.
SequenceLoss = Callable[[Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class HeadLoss(Protocol):
    """What the loss-fused head needs of a loss (`ClippedPGLoss` builds one per microbatch)."""

    @property
    def whole_sequences(self) -> bool:
        """Whether its gradient at a token reads other tokens' current values: then chunks hold whole sequences."""

    @property
    def reads_unfiltered(self) -> bool:
        """Whether it also reads the logprobs without the distribution's top-k / top-p filter (a KL to the
        unfiltered reference)."""

    def row_gradients(self, positions: torch.Tensor, upstream: Upstream) -> RowGradient:
        """The gradient of `upstream` times the loss with respect to each chunk's row values. `positions` `[rows]`:
        each trained row's flat position among the batch's tokens (its token's, for token-aligned batches)."""

    def value(self, logprobs: torch.Tensor, entropy: torch.Tensor, unfiltered: torch.Tensor | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and its metrics on the whole batch's detached per-token values (the batch's token shape)."""


class SequenceAutograd:
    """The rows' gradients by autograd over `loss_fn` on a chunk's whole sequences, for a loss whose gradient at a
    token reads other tokens' current values (its chunks hold whole sequences: `Chunk.sequences`)."""

    def __init__(self, loss_fn: SequenceLoss, batch: Mapping[str, torch.Tensor], layout: SequenceLayout,
                 positions: torch.Tensor, upstream: Upstream, reads_unfiltered: bool) -> None:
        self.loss_fn, self.batch, self.layout = loss_fn, batch, layout
        self.positions, self.upstream, self.reads_unfiltered = positions, upstream, reads_unfiltered

    def __call__(self, chunk: Chunk, values: RowValues) -> RowGradients:
        sequences = self.layout.select(self.batch, chunk.sequences, chunk.span)
        shape = sequences["input_ids"].shape
        at = self.positions[chunk.rows] - chunk.span[0]  # the rows' tokens among the chunk's

        def leaf(rows: torch.Tensor) -> torch.Tensor:
            tokens = rows.new_zeros(shape.numel()).index_copy_(0, at, rows.detach())
            return tokens.view(shape).requires_grad_(True)

        given = [values.logprob, values.entropy] + ([values.unfiltered] if self.reads_unfiltered else [])
        leaves = [leaf(rows) for rows in given]
        with torch.enable_grad():
            loss = self.loss_fn(sequences, leaves[0], leaves[1], leaves[2] if self.reads_unfiltered else None)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)

        def rows_of(grad: torch.Tensor | None) -> torch.Tensor | None:
            return None if grad is None else grad.reshape(-1).index_select(0, at) * self.upstream

        logprob = rows_of(grads[0])
        return RowGradients(torch.zeros_like(values.logprob) if logprob is None else logprob, rows_of(grads[1]),
                            rows_of(grads[2]) if self.reads_unfiltered else None)


@dataclass(frozen=True)
class HeadCall:
    """Everything about one call besides the hidden states and the weight."""

    loss: HeadLoss
    layout: SequenceLayout
    targets: torch.Tensor  # [B, S] (or [1, T]): each row's target, -1 where the row is not trained
    index: torch.Tensor  # [trained rows] int64: each trained row's flat index, in order
    positions: torch.Tensor  # [trained rows] int64: the flat token position each trained row's values belong to
    chunks: list[Chunk]
    linear: LinearCall  # shard, valid columns, distribution and kernels
    upstream: Upstream | None  # the bound d(objective)/d(loss); None: 1, checked in backward
    buffers: int  # chunk buffers alive at once (two where chunks overlap on CUDA streams)
    # whether the loss also reads the unfiltered distribution's logprobs and the trained one keeps fewer tokens: a
    # second distribution per chunk (its partials, and a scratch buffer for its gradient)
    second: bool
    kept: list[RowSets] | None = None  # each chunk's kept sets, replayed (`ops.core.replay`)


class LossFusedHead(torch.autograd.Function):
    """Returns the loss; backward hands on the `dH`, `dW` forward computed (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, call: HeadCall, metrics_out: dict):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        main_grad = main_grad_of(weight) if call.upstream is not None and need_weight else None
        loss, metrics, grad_hidden, grad_weight = run_head(hidden, weight, call, main_grad, need_hidden, need_weight)
        metrics_out.update(metrics)
        ctx.upstream, ctx.grad_hidden, ctx.grad_weight = call.upstream, grad_hidden, grad_weight
        ctx.weight = weight if main_grad is not None else None
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
        ctx.grad_hidden = ctx.grad_weight = None
        if ctx.upstream is None:  # computed for 1 (Liger's convention): anything else costs a pass over dH and dW
            if not bool(grad_loss == 1):
                grad_hidden, grad_weight = (None if grad is None else grad * grad_loss.to(grad.dtype)
                                            for grad in (grad_hidden, grad_weight))
            return grad_hidden, grad_weight, None, None
        check_upstream(grad_loss, ctx.upstream)
        if ctx.weight is not None:  # dW is in Megatron DDP's main_grad already
            grad_weight = added_to_main_grad(ctx.weight)
        return grad_hidden, grad_weight, None, None


def check_upstream(grad_loss: torch.Tensor, bound: Upstream) -> None:
    """The gradient backward brings must be the one forward was told (within `UPSTREAM_RTOL`): on CUDA a device-side
    assert (no host sync), elsewhere a RuntimeError naming both."""
    got = grad_loss.detach().to(torch.float64).reshape(())
    want = torch.as_tensor(bound, device=got.device).to(torch.float64).reshape(())
    ok = (got - want).abs() <= UPSTREAM_RTOL * want.abs()
    message = ("loss-fused head: backward got an upstream gradient other than the one bound in forward "
               "(LossCall.upstream_gradient); dH and dW were computed, and dW written, for the bound one")
    if got.device.type == "cuda":
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise RuntimeError(f"{message}: bound {float(want):.9g}, got {float(got):.9g}")


@dataclass(frozen=True)
class ChunkStats:
    """What a chunk's small kernels found: its rows' values, the trained distribution's row statistics and filter
    threshold (None unfiltered) and, where the loss reads a second, unfiltered distribution, its row statistics."""

    values: RowValues
    stats: RowStats
    threshold: torch.Tensor | None
    unfiltered: RowStats | None


def run_head(hidden: torch.Tensor, weight: torch.Tensor, call: HeadCall, main_grad: torch.Tensor | None,
             need_hidden: bool = True, need_weight: bool = True
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop, then the loss on the rows' values: (loss, metrics, dH, dW); dW is None when it went into
    `main_grad`, either is None when not needed."""
    linear, rows = call.linear, call.index.numel()
    logprob_rows = torch.empty(rows, dtype=compute_dtype(hidden.dtype), device=hidden.device)
    entropy_rows = torch.empty_like(logprob_rows)
    second = call.second
    unfiltered_rows = torch.empty_like(logprob_rows) if second else None
    # dH: rows without a target get exactly 0; every trained row is written once, by its chunk.
    grad_hidden = None if not need_hidden else (torch.empty if rows == hidden.shape[:-1].numel() else torch.zeros)(
        hidden.shape, dtype=hidden.dtype, device=hidden.device)
    weight_gradient = WeightGradient(weight, linear.valid_cols, rows, len(call.chunks), main_grad) \
        if need_weight else None
    # The chunk buffers and the gradient's per-row terms are gone when the loss's own temporaries come.
    _run_chunks(hidden, weight, call, (logprob_rows, entropy_rows, unfiltered_rows), grad_hidden, weight_gradient)
    shape = call.targets.shape
    with torch.no_grad():
        unfiltered = None
        if call.loss.reads_unfiltered:
            unfiltered = _at_tokens(unfiltered_rows if second else logprob_rows, call.positions, shape)
        loss, metrics = call.loss.value(_at_tokens(logprob_rows, call.positions, shape),
                                        _at_tokens(entropy_rows, call.positions, shape), unfiltered)
    return loss, metrics, grad_hidden, None if weight_gradient is None else weight_gradient.gradient()


def _run_chunks(hidden: torch.Tensor, weight: torch.Tensor, call: HeadCall,
                values: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], grad_hidden: torch.Tensor | None,
                weight_gradient: WeightGradient | None) -> None:
    """Per chunk: its logits, its rows' values (into `values`: logprob, entropy and, with a second distribution,
    unfiltered logprob, `[rows]` each), its gradient in place, then its `dH` rows and its share of `dW`."""
    linear = call.linear
    logprob_rows, entropy_rows, unfiltered_rows = values
    second = unfiltered_rows is not None
    hidden_flat = hidden.reshape(-1, hidden.shape[-1])
    weight_valid = weight[:linear.valid_cols]
    gradient = call.loss.row_gradients(call.positions, 1.0 if call.upstream is None else call.upstream)
    largest = max((c.rows.stop - c.rows.start for c in call.chunks), default=0)
    buffers = [chunk_buffer(largest, linear.valid_cols, hidden) for _ in range(call.buffers)]
    scratch = chunk_buffer(largest, linear.valid_cols, hidden) if second else None
    runs = _contiguous_runs(call.index, call.chunks)
    row_targets = call.targets.reshape(-1).index_select(0, call.index)  # each trained row's target, in order
    streams = ChunkStreams(hidden.device, overlapped=call.buffers > 1)
    pending = None  # the chunk whose dH and dW GEMMs are still to run (CUDA: after the next chunk's logits GEMM)
    for number, (chunk, run) in enumerate(zip(call.chunks, runs, strict=True)):
        sl = chunk.rows
        index = call.index[sl]
        buffer = buffers[number % len(buffers)][:sl.stop - sl.start]
        h = hidden_flat[run] if run is not None else hidden_flat.index_select(0, index)
        chunk_logits(h, weight_valid, linear.distribution.logit_scale, buffer)
        ready = streams.logits_done()
        if pending is not None:
            _hidden_and_weight_gradients(*pending, weight_valid, linear, grad_hidden, weight_gradient, streams)
        with streams.side(after=ready) as done:
            targets = row_targets[sl]
            sets = None if call.kept is None else call.kept[number]
            found = _chunk_stats(buffer, targets, linear, second, call.loss.reads_unfiltered, largest, sets)
            logprob_rows[sl], entropy_rows[sl] = found.values.logprob, found.values.entropy
            if second:
                unfiltered_rows[sl] = found.values.unfiltered
            _backward_kernels(buffer, targets, linear, found, gradient(chunk, found.values), scratch, sets)
        pending = (buffer, h, index, run, done)
        if not streams.overlapped:
            _hidden_and_weight_gradients(*pending, weight_valid, linear, grad_hidden, weight_gradient, streams)
            pending = None
    if pending is not None:
        _hidden_and_weight_gradients(*pending, weight_valid, linear, grad_hidden, weight_gradient, streams)
    streams.join()


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, linear: LinearCall, second: bool,
                 reads_unfiltered: bool, chunk_rows: int, sets: RowSets | None) -> ChunkStats:
    """Each row's filter threshold (or, with `sets`, the rows' replayed kept sets), the kernels' partials, their
    all-gather over TP and the combine: the chunk's values under the distribution (and, with `second`, under its
    unfiltered twin as well)."""
    shard, valid, kernels = linear.shard, linear.valid_cols, linear.kernels
    if sets is not None:  # the engine's kept sets instead of the filter (`core.replay`)
        partials, threshold = replay_partials(logits, targets, sets, kernels, shard.start_index, valid, True)
    else:
        threshold = kept_threshold(logits, linear.distribution, true_vocab_size=shard.true_vocab_size,
                                   group=shard.group, scaled=True, kernels=kernels,
                                   chunk_rows=chunk_rows)
        partials = kernels.logprob_partials(logits, targets, shard.start_index, valid, True, threshold)
    stats = RowStats.of(kernels.combine(gather_partials(partials, shard.group), targets, True), True)
    unfiltered = None
    if second:
        unfiltered = RowStats.of(kernels.combine(gather_partials(
            kernels.logprob_partials(logits, targets, shard.start_index, valid, False, None), shard.group),
            targets, False), False)
    # Where the filter keeps every token (or there is none), the unfiltered values are the values themselves.
    unfiltered_values = unfiltered.logprob if second else (stats.logprob if reads_unfiltered else None)
    return ChunkStats(RowValues(stats.logprob, stats.entropy, unfiltered_values), stats, threshold, unfiltered)


def _backward_kernels(logits: torch.Tensor, targets: torch.Tensor, linear: LinearCall, found: ChunkStats,
                      grads: RowGradients, scratch: torch.Tensor | None, sets: RowSets | None) -> None:
    """The backward kernel in place: the chunk's logits become d(objective)/d(logits), the trained distribution's
    term (with `sets`, the replayed rows' kept columns patched in after the kernel, `core.replay`) plus, with a second
    distribution, the unfiltered one's (computed into `scratch` first, then added)."""
    stats, unfiltered = found.stats, found.unfiltered
    shard, valid, kernels = linear.shard, linear.valid_cols, linear.kernels
    grad_logprob = grads.logprob
    if grads.unfiltered is not None and unfiltered is None:  # one distribution: both gradients are its logprob's
        grad_logprob = grad_logprob + grads.unfiltered
    if found.threshold is not None:  # a target outside the kept set has logprob -inf, a constant: no gradient
        grad_logprob = grad_logprob.masked_fill(found.values.logprob == float("-inf"), 0.0)
    grad_logprob = grad_logprob.to(stats.lse.dtype).contiguous()
    grad_entropy = None if grads.entropy is None else grads.entropy.to(stats.lse.dtype).contiguous()
    if unfiltered is not None:
        scratch = scratch[:logits.shape[0]]
        kernels.logprob_backward(logits, targets, shard.start_index, valid, unfiltered.lse, None,
                                 grads.unfiltered.to(unfiltered.lse.dtype).contiguous(), None, scratch, None)
    mean_x = None if grad_entropy is None else stats.mean_x
    patch = None if sets is None else replay_gradient(logits, targets, sets, found.threshold, stats.lse, mean_x,
                                                      grad_logprob, grad_entropy, shard.start_index, valid)
    kernels.logprob_backward(logits, targets, shard.start_index, valid, stats.lse, mean_x, grad_logprob,
                             grad_entropy, logits, found.threshold)
    if patch is not None:
        patch.write(logits)
    if unfiltered is not None:
        logits.add_(scratch)


def _hidden_and_weight_gradients(dlogits: torch.Tensor, h: torch.Tensor, index: torch.Tensor, run: slice | None,
                                 done, weight_valid: torch.Tensor, linear: LinearCall,
                                 grad_hidden: torch.Tensor | None, weight_gradient: WeightGradient | None,
                                 streams: ChunkStreams) -> None:
    """The chunk's `dH` (into its rows of the hidden gradient, once) and its share of `dW`: two GEMMs."""
    streams.wait(done)
    scale = linear.distribution.logit_scale
    if grad_hidden is not None:
        grad_flat = grad_hidden.view(-1, grad_hidden.shape[-1])
        if run is not None:
            hidden_gradient(dlogits, weight_valid, scale, grad_flat[run])
        else:
            grad_flat.index_copy_(0, index, hidden_gradient(dlogits, weight_valid, scale, h.new_empty(h.shape)))
    if weight_gradient is not None:
        weight_gradient.add(dlogits, h, scale)


def _contiguous_runs(index: torch.Tensor, chunks: list[Chunk]) -> list[slice | None]:
    """Per chunk, the slice of flat rows its trained rows fill when they are consecutive (its hidden states are then
    a view and its `dH` is written in place), else None. One host read before the loop."""
    filled = [number for number, c in enumerate(chunks) if c.rows.stop > c.rows.start]
    runs: list[slice | None] = [None] * len(chunks)
    if not filled:
        return runs
    ends = [chunks[n].rows.start for n in filled] + [chunks[n].rows.stop - 1 for n in filled]
    flat = index[torch.tensor(ends, device=index.device)].tolist()
    for number, first, last in zip(filled, flat[:len(filled)], flat[len(filled):], strict=True):
        if last - first == chunks[number].rows.stop - chunks[number].rows.start - 1:
            runs[number] = slice(first, last + 1)
    return runs


def _at_tokens(rows: torch.Tensor, positions: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
    """Per-trained-row values at their tokens' positions, 0 elsewhere."""
    out = rows.new_zeros(token_shape.numel())
    return out.index_copy_(0, positions, rows).view(token_shape)


def overlaps_chunks(device: torch.device) -> bool:
    """Whether chunks overlap (two buffers, the next chunk's logits GEMM queued before this chunk's `dH` / `dW`): on
    CUDA, where the small kernels then run on a side stream under that GEMM."""
    return device.type == "cuda"


class ChunkStreams:
    """Where a chunk's work runs. Not `overlapped`, everything runs in order on the current stream. `overlapped`, the
    next chunk's logits GEMM is queued before this chunk's `dH` / `dW` GEMMs, and on CUDA a chunk's small kernels go
    to a side stream once its logits GEMM is done, and its `dH` / `dW` GEMMs wait for them on the main stream, so the
    two overlap (the streams are written for CUDA and not yet run on a GPU; the order runs everywhere)."""

    def __init__(self, device: torch.device, overlapped: bool) -> None:
        self.overlapped = overlapped
        self.cuda = overlapped and device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if self.cuda else None
        self.side_stream = torch.cuda.Stream(device) if self.cuda else None

    def logits_done(self) -> torch.cuda.Event | None:
        """An event after the chunk's logits GEMM on the main stream (None off CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.main)
        return event

    @contextlib.contextmanager
    def side(self, after: torch.cuda.Event | None):
        """Runs the block on the side stream once `after` is done; yields the event it records when it is done."""
        if not self.cuda:
            yield None
            return
        self.side_stream.wait_event(after)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.side_stream):
            yield done
        done.record(self.side_stream)

    def wait(self, done: torch.cuda.Event | None) -> None:
        """The main stream waits for a chunk's small kernels."""
        if done is not None:
            self.main.wait_event(done)

    def join(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.side_stream)


def loss_fused_linear(
    loss: HeadLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    layout: SequenceLayout,
    *,
    shard: VocabShard | None = None,
    distribution: SamplingDistribution | None = None,
    chunk_rows: int | None = None,
    check_inputs: bool = True,
    implementation: Implementation = "auto",
    shift: bool = True,
    context: ContextShard | None = None,
    upstream_gradient: Upstream | None = None,
    kept_set: KeptSet | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss`'s loss and metrics on the current logprobs and entropies of the trained tokens, from final hidden
    states `[B, S, H]` and this rank's `[V_local, H]` output weight shard, under `distribution` (its scale, top-k and
    top-p), with the gradient computed in forward (see the module docstring). Differentiable w.r.t. `hidden` (a
    partial sum over the vocab shard, to be reduced over TP by the caller) and `weight`.

    `targets` `[B, S]`: the sequences' token ids, < 0 where a token is not trained (the ops' `shift=True` targets).
    A packed batch (`layout` packed) has `[1, T, H]` hidden states and `[1, T]` targets, < 0 at every sequence's first
    token (`loss.packing.next_token_targets_of`), so no logprob crosses a boundary. `chunk_rows`: trained rows per
    chunk (whole sequences where the loss couples a sequence's tokens); None picks one as the op does, from as
    few chunks as keep the head's extra memory within its budget (`chunking.head_min_chunks`: 12 at a 16K-column bf16
    shard, 15 where top-p's threshold search runs in stages). `shift=False`: `targets` are each row's own (already
    shifted) targets, and the values stay with the rows, as for a context-parallel rank's row-aligned share. `context`
    (`ContextShard`): whole-sequence chunks are cut alike on the CP ranks, from each sequence's largest count of
    trained rows over the group (one all-reduce), so that a loss summing over the group (`sum_over_context`) meets
    its peers chunk by chunk.
    `upstream_gradient`: d(objective)/d(loss), bound up front (see the module docstring); None: 1, checked.
    `kept_set`: with `distribution.replay_kept_set`, the rollout engine's kept set of every position of `targets`
    (`ops.KeptSet`), replayed instead of a recomputed top-k / top-p (each chunk reads its rows' sets).
    """
    distribution = SamplingDistribution() if distribution is None else distribution
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
    trained = targets >= 0  # a trained row scores a token of its own sequence (shifting: token t + 1)
    index = trained.reshape(-1).nonzero().squeeze(1)  # the call's one host sync (two for whole-sequence chunks)
    overlapped = overlaps_chunks(hidden.device)
    second = loss.reads_unfiltered and distribution.restricts(shard.true_vocab_size)
    buffers = (2 if overlapped else 1) + (1 if second else 0)
    linear = LinearCall.of(weight, index.numel(), shard, distribution, True, chunk_rows, implementation)
    # top-p's search holds temporaries per chunk row where it runs in stages (not the CPU's one call on one rank)
    search_temporaries = (distribution.uses_top_p() and not distribution.replay_kept_set
                          and not (isinstance(linear.kernels, FusedKernels)
                                   and searches_in_one_call(hidden.device, shard.group)))
    least = head_min_chunks(weight.shape[0], hidden.dtype, search_temporaries)
    if loss.whole_sequences:
        chunks = _sequence_chunks(trained, layout, context, chunk_rows, weight, hidden.dtype, buffers, least)
    else:
        budget = chunk_rows if chunk_rows is not None else chunk_rows_for(
            index.numel(), weight.shape[0], hidden.dtype, buffers=buffers, min_chunks=least)
        chunks = [Chunk(rows) for rows in row_chunks(index.numel(), budget)]
    kept = None if kept_set is None else RowSets.of_groups(kept_set, index, [c.rows for c in chunks], shift)
    call = HeadCall(loss=loss, layout=layout, targets=targets, index=index, positions=index + 1 if shift else index,
                    chunks=chunks, linear=linear, upstream=upstream_gradient, buffers=2 if overlapped else 1,
                    second=second, kept=kept)
    metrics: dict[str, torch.Tensor] = {}
    value = LossFusedHead.apply(hidden, weight, call, metrics)
    return value, metrics


def _sequence_chunks(trained: torch.Tensor, layout: SequenceLayout, context: ContextShard | None,
                     chunk_rows: int | None, weight: torch.Tensor, dtype: torch.dtype, buffers: int,
                     min_chunks: int) -> list[Chunk]:
    """Chunks of whole sequences, each a run of the trained rows (they lie in sequence order)."""
    local_counts = layout.sum(trained.to(torch.int64))
    per_sequence = local_counts.tolist()
    # The chunks are cut alike on every rank that meets the others in the loss: the CP ranks by their largest counts.
    cut_counts = per_sequence
    if context is not None:
        largest = local_counts.clone()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=context.group)
        cut_counts = largest.tolist()
    # The shard's whole width, the same on every TP rank, so that every rank cuts the same chunks (its valid columns
    # are fewer on the rank with the padding).
    budget = chunk_rows if chunk_rows is not None else chunk_rows_for(sum(cut_counts), weight.shape[0], dtype,
                                                                      buffers=buffers, min_chunks=min_chunks)
    runs = sequence_chunks(cut_counts, budget)
    spans = layout.token_spans(runs)
    chunks, first = [], 0
    for run, span in zip(runs, spans, strict=True):
        count = sum(per_sequence[run])
        chunks.append(Chunk(slice(first, first + count), run, span))
        first += count
    return chunks
