"""`vocab_parallel_logprobs`: per-token logprobs (and entropy) from tensor-parallel, vocab-sharded logits.

Forward: one pass over each local row computes softmax partials, one all-gather of the `[rows, k]` partials
combines them across ranks (see `partials`). Backward recomputes p from the logits and needs no collective;
only lse (and E[x] with entropy) is kept per row. Padded vocab columns never enter the softmax and get a
gradient of exactly 0.

With `top_k` / `top_p` the distribution is the filtered one the rollout sampler draws from (see `filtering`):
a per-row threshold is found first (a few small collectives), and the kernels count only logits at or above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from .backends import Implementation, Kernels, select_kernels
from .filtering import SamplingFilter, kept_threshold
from .partials import Partials, combine_partials, gather_partials

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's columns sit in the global vocab, and how many of them are real (not padding)."""

    vocab_start: int
    valid_cols: int
    true_vocab_size: int

    @staticmethod
    def resolve(
        local_vocab: int, vocab_start_index: int | None, true_vocab_size: int | None, group: dist.ProcessGroup | None
    ) -> "ShardLayout":
        rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
        vocab_start = rank * local_vocab if vocab_start_index is None else int(vocab_start_index)
        if vocab_start < 0:
            raise ValueError(f"vocab_start_index must be >= 0, got {vocab_start}")
        padded_vocab = world * local_vocab
        if true_vocab_size is None:
            true_vocab_size = max(padded_vocab, vocab_start + local_vocab)
        true_vocab_size = int(true_vocab_size)
        if true_vocab_size <= 0:
            raise ValueError(f"true_vocab_size must be > 0, got {true_vocab_size}")
        if vocab_start_index is None and true_vocab_size > padded_vocab:
            raise ValueError(
                f"true_vocab_size={true_vocab_size} exceeds the sharded vocab of {world} rank(s) x {local_vocab} "
                f"columns = {padded_vocab}: some token ids would belong to no rank"
            )
        valid_cols = min(max(true_vocab_size - vocab_start, 0), local_vocab)
        return ShardLayout(vocab_start=vocab_start, valid_cols=valid_cols, true_vocab_size=true_vocab_size)


class VocabParallelLogprobs(torch.autograd.Function):
    """Autograd wrapper around the kernels; the functional API below validates and reshapes."""

    @staticmethod
    def forward(ctx, logits, targets, layout: ShardLayout, group, with_entropy, inplace_backward, kernels: Kernels,
                threshold: torch.Tensor | None, logit_scale: float = 1.0):
        exp_mode = inplace_backward == "exp"
        if exp_mode:
            # The logits buffer now holds exp(z - m_local): whoever saved the logits fails loudly at unpack.
            partials = kernels.logprob_partials_writing_exps(logits, targets, layout.vocab_start, layout.valid_cols,
                                                             with_entropy, threshold, logit_scale=logit_scale)
            torch.autograd.graph.increment_version(logits)
        else:
            partials = kernels.logprob_partials(logits, targets, layout.vocab_start, layout.valid_cols,
                                                with_entropy, threshold, logit_scale=logit_scale)
        stats = combine_partials(gather_partials(partials, group), targets, with_entropy)
        # A target outside the kept set has logprob -inf, a constant: it passes no gradient back.
        filtered_target = None if threshold is None else stats.logprob == float("-inf")
        prob_scale = _prob_scale(partials, stats.lse) if exp_mode else None
        target_prob = torch.exp(stats.logprob).contiguous() if exp_mode else None
        ctx.save_for_backward(logits, targets, stats.lse, stats.mean_x, threshold, filtered_target, prob_scale,
                              target_prob)
        ctx.layout, ctx.inplace_backward, ctx.kernels = layout, inplace_backward, kernels
        ctx.logit_scale = logit_scale
        ctx.set_materialize_grads(False)  # an entropy that is only logged passes None, and its term is skipped
        return outputs(stats, with_entropy)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        logits, targets, lse, mean_x, threshold, filtered_target, prob_scale, target_prob = ctx.saved_tensors
        rows = logits.shape[0]
        grad_logprob = _row_gradient(grad_logprob, rows, lse)
        if filtered_target is not None:
            grad_logprob = grad_logprob.masked_fill(filtered_target, 0.0)
        mean_x, grad_entropy = entropy_term(mean_x, grad_entropy, rows, lse)
        if prob_scale is not None:  # inplace_backward="exp": `logits` holds exp(z - m_local)
            if grad_entropy is not None:
                raise RuntimeError(
                    "inplace_backward='exp' cannot differentiate the entropy (its gradient needs the logits, which "
                    "forward overwrote); use inplace_backward=True, or detach the entropy"
                )
            ctx.kernels.logprob_backward_from_exps(logits, targets, ctx.layout.vocab_start, ctx.layout.valid_cols,
                                                   prob_scale, target_prob, grad_logprob,
                                                   logit_scale=ctx.logit_scale)
            torch.autograd.graph.increment_version(logits)
            return logits, None, None, None, None, None, None, None, None
        grad_logits = logits if ctx.inplace_backward else empty_with_alignment_of(logits)
        ctx.kernels.logprob_backward(
            logits, targets, ctx.layout.vocab_start, ctx.layout.valid_cols, lse, mean_x, grad_logprob,
            grad_entropy, grad_logits, threshold, logit_scale=ctx.logit_scale,
        )
        if ctx.inplace_backward:
            # Anyone else who saved these logits now fails loudly at unpack instead of reading gradients.
            torch.autograd.graph.increment_version(logits)
        return grad_logits, None, None, None, None, None, None, None, None


def _prob_scale(partials: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(m_local - lse) per row: turns the exps left in the logits buffer into probabilities."""
    m = partials[:, Partials.MAX].to(lse.dtype)
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return torch.exp(shift - lse).contiguous()


VECTOR_BYTES = 16  # the kernels' vector width: a row takes the vector path where grad and logits share it


def empty_with_alignment_of(logits: torch.Tensor) -> torch.Tensor:
    """An uninitialised `[rows, cols]` tensor whose every row has the 16-byte alignment of the logits' row.

    A sliced or offset view of logits would otherwise get a gradient buffer aligned differently, and the
    kernels would fall back to scalar stores for most rows. The row stride is the smallest one `>= cols`
    that is congruent to the logits' modulo 16 bytes, so at most 15 bytes per row are wasted.
    """
    rows, cols = logits.shape
    element = logits.element_size()
    per_vector = VECTOR_BYTES // element
    if rows == 0 or cols == 0 or VECTOR_BYTES % element:
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    row_stride = cols + (logits.stride(0) - cols) % per_vector if rows > 1 else cols
    offset = (logits.data_ptr() % VECTOR_BYTES) // element
    size = offset + (rows - 1) * row_stride + cols + per_vector
    storage = torch.empty(size, dtype=logits.dtype, device=logits.device)
    offset = (offset - (storage.data_ptr() % VECTOR_BYTES) // element) % per_vector
    return storage.as_strided((rows, cols), (row_stride, 1), offset)


def _row_gradient(grad: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The upstream gradient of a per-row output as a contiguous [rows] tensor in the stats' dtype."""
    if grad is None:
        return torch.zeros(rows, dtype=like.dtype, device=like.device)
    return grad.reshape(rows).to(like.dtype).contiguous()

def outputs(stats, with_entropy: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What the autograd Functions return: the logprobs, and the entropies with `with_entropy`."""
    return (stats.logprob, stats.entropy) if with_entropy else stats.logprob


def entropy_term(mean_x: torch.Tensor | None, grad_entropy: torch.Tensor | None, rows: int, lse: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward kernels' `(mean_x, grad_entropy)`: both None without an entropy, or with one that is only
    logged (its upstream gradient is None), so the kernels skip the entropy term."""
    if mean_x is None or grad_entropy is None:
        return None, None
    return mean_x, _row_gradient(grad_entropy, rows, lse)



def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start_index: int | None = None,
    true_vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    inplace_backward: bool | Literal["exp"] = False,
    check_inputs: bool = True,
    implementation: Implementation = "auto",
    top_k: int | None = None,
    top_p: float | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` under softmax(logits) over the whole (sharded, unpadded) vocab.

    With `top_k` / `top_p`, under the filtered distribution the sampler draws from: the softmax over the kept
    tokens only (see `megatron_grpo.ops.filtering` for the exact rule, ties and collectives). A target outside
    the kept set has logprob -inf and no gradient; the entropy is that of the filtered distribution; filtered
    logits get a gradient of exactly 0.

    Args:
        logits: `[..., V_local]` float32/bfloat16/float16 (float64 on the reference path): this rank's shard.
        targets: `[...]` integer global token ids; `< 0` means ignore (logprob, entropy and gradient are 0).
        vocab_start_index: global id of column 0; default `rank(group) * V_local`.
        true_vocab_size: ids `>=` this are padding and take no part; default: no padding.
        group: tensor-parallel process group; None means the vocab is not sharded.
        with_entropy: also return the exact entropy of each row's distribution.
        inplace_backward: False, True or "exp". True: backward writes the gradient into the logits' buffer
            (saves a `[..., V_local]` allocation); the logits must not be needed after backward. "exp": forward
            already overwrites the buffer with exp(z - row max) and backward turns it into the gradient without
            an exponential (faster; fused kernels on CPU only). Then the caller's logits tensor no longer holds
            logits after this call (unless they had to be copied to a contiguous layout), nothing may read them
            between forward and backward, and the entropy cannot be differentiated (returning it for logging is
            fine; a gradient reaching it raises). Either way, whoever saved the logits for its own backward
            fails loudly at unpack (autograd's version counter).
        check_inputs: check target ids against the vocab (a host sync); pass False in hot loops.
        implementation: "auto" (fused kernels where available), "fused" or "reference".
        top_k: keep the logits `>=` the k-th largest of the row; None (or k >= the true vocab) keeps all.
        top_p: then keep the most probable tokens until their mass reaches p; None or 1 keeps all.
        logit_scale: the op's distribution is softmax(logit_scale * logits); pass 1 / temperature for a sampling
            temperature (top-k/top-p then select on the tempered distribution, as the sampler does). Applied
            inside the kernels: no scaled copy of the logits. A finite number > 0.

    Returns:
        float32 logprobs `[...]` (float64 for float64 logits), or `(logprobs, entropy)` with `with_entropy`.
    """
    _check_tensors(logits, targets)
    logit_scale = _checked_logit_scale(logit_scale)
    _check_inplace_backward(inplace_backward)
    sampling = SamplingFilter(top_k=top_k, top_p=top_p)
    layout = ShardLayout.resolve(logits.shape[-1], vocab_start_index, true_vocab_size, group)
    if check_inputs:
        _check_target_ids(targets, layout)
    batch_shape = targets.shape
    rows_logits = logits.reshape(-1, logits.shape[-1])
    if rows_logits.stride(-1) != 1 or (rows_logits.shape[0] > 1 and rows_logits.stride(0) < rows_logits.shape[1]):
        rows_logits = rows_logits.contiguous()
    rows_targets = targets.reshape(-1).to(torch.int64).contiguous()
    kernels = select_kernels(rows_logits, implementation)
    with torch.no_grad():
        threshold = kept_threshold(rows_logits[:, :layout.valid_cols], sampling,
                                   true_vocab_size=layout.true_vocab_size, group=group, logit_scale=logit_scale)
    out = VocabParallelLogprobs.apply(
        rows_logits, rows_targets, layout, group, with_entropy, inplace_backward, kernels, threshold, logit_scale
    )
    if with_entropy:
        logprob, entropy = out
        return logprob.reshape(batch_shape), entropy.reshape(batch_shape)
    return out.reshape(batch_shape)


def _checked_logit_scale(logit_scale: float) -> float:
    """logit_scale as a float: a finite number > 0 (1 / temperature), else a named error."""
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)):
        raise ValueError(f"logit_scale must be a finite number > 0 (1 / temperature), got {logit_scale!r}")
    scale = float(logit_scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"logit_scale must be a finite number > 0 (1 / temperature), got {logit_scale!r}")
    return scale


INPLACE_BACKWARD_MODES = (False, True, "exp")


def _check_inplace_backward(inplace_backward: bool | str) -> None:
    if not any(inplace_backward is mode or (isinstance(mode, str) and inplace_backward == mode)
               for mode in INPLACE_BACKWARD_MODES):
        raise ValueError(f"inplace_backward must be False, True or 'exp', got {inplace_backward!r}")


def _check_tensors(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Shape, dtype and device checks: free, so they always run."""
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ValueError("logits and targets must be torch.Tensors")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal the logits shape without its vocab dim, "
            f"got logits {tuple(logits.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocab dim (V_local = 0)")
    if logits.device != targets.device:
        raise ValueError(f"logits are on {logits.device} but targets on {targets.device}")


def _check_target_ids(targets: torch.Tensor, layout: ShardLayout) -> None:
    """Target ids beyond the true vocab are an error, never a silent -inf."""
    if targets.numel() == 0:
        return
    largest = int(targets.max())
    if largest >= layout.true_vocab_size:
        raise ValueError(
            f"targets contain token id {largest}, which is >= true_vocab_size={layout.true_vocab_size} "
            f"(ids at or beyond it are vocab padding and cannot be targets)"
        )
