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

from .backends import Implementation, Kernels, select_kernels
from .filtering import SamplingFilter, kept_threshold
from .partials import Partials, combine_partials, gather_partials
from .shift import aligned_with_tokens, check_shiftable, next_token_targets
from .vocab_shard import VocabShard

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class LogprobCall:
    """Everything a call hands the autograd Function besides the logits and targets."""

    shard: VocabShard  # resolved
    valid_cols: int
    with_entropy: bool
    inplace_backward: bool | Literal["exp"]
    kernels: Kernels
    threshold: torch.Tensor | None  # fp32 [rows]: the top-k / top-p cut, or None
    logit_scale: float  # the kernels see logit_scale * logits


class VocabParallelLogprobs(torch.autograd.Function):
    """Autograd wrapper around the kernels; the functional API below validates and reshapes."""

    @staticmethod
    def forward(ctx, logits, targets, call: LogprobCall):
        start, scale = call.shard.start_index, call.logit_scale
        exp_mode = call.inplace_backward == "exp"
        if exp_mode:
            # The logits buffer now holds exp(z - m_local): whoever saved the logits fails loudly at unpack.
            partials = call.kernels.logprob_partials_writing_exps(logits, targets, start, call.valid_cols,
                                                                  call.with_entropy, call.threshold, logit_scale=scale)
            torch.autograd.graph.increment_version(logits)
        else:
            partials = call.kernels.logprob_partials(logits, targets, start, call.valid_cols, call.with_entropy,
                                                     call.threshold, logit_scale=scale)
        stats = combine_partials(gather_partials(partials, call.shard.group), targets, call.with_entropy)
        # A target outside the kept set has logprob -inf, a constant: it passes no gradient back.
        filtered_target = None if call.threshold is None else stats.logprob == float("-inf")
        prob_scale = _prob_scale(partials, stats.lse) if exp_mode else None
        target_prob = torch.exp(stats.logprob).contiguous() if exp_mode else None
        ctx.save_for_backward(logits, targets, stats.lse, stats.mean_x, call.threshold, filtered_target, prob_scale,
                              target_prob)
        ctx.call = call
        ctx.set_materialize_grads(False)  # an entropy that is only logged passes None, and its term is skipped
        return outputs(stats, call.with_entropy)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        logits, targets, lse, mean_x, threshold, filtered_target, prob_scale, target_prob = ctx.saved_tensors
        call: LogprobCall = ctx.call
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
            call.kernels.logprob_backward_from_exps(logits, targets, call.shard.start_index, call.valid_cols,
                                                    prob_scale, target_prob, grad_logprob,
                                                    logit_scale=call.logit_scale)
            torch.autograd.graph.increment_version(logits)
            return logits, None, None
        grad_logits = logits if call.inplace_backward else empty_with_alignment_of(logits)
        call.kernels.logprob_backward(
            logits, targets, call.shard.start_index, call.valid_cols, lse, mean_x, grad_logprob, grad_entropy,
            grad_logits, threshold, logit_scale=call.logit_scale,
        )
        if call.inplace_backward:
            # Anyone else who saved these logits now fails loudly at unpack instead of reading gradients.
            torch.autograd.graph.increment_version(logits)
        return grad_logits, None, None


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
    shard: VocabShard | None = None,
    shift: bool = False,
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
        shard: where the logits' columns sit in the vocab, its padding and the TP group (`VocabShard`); None
            means an unsharded, unpadded vocab.
        shift: next-token mode (see `megatron_grpo.ops.shift`): `targets` are the sequence's tokens, the logits
            at `t` score `targets[..., t + 1]`, and the outputs are aligned with `targets` (position 0 is 0).
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
    logit_scale = checked_logit_scale(logit_scale)
    _check_inplace_backward(inplace_backward)
    sampling = SamplingFilter(top_k=top_k, top_p=top_p)
    shard = (VocabShard() if shard is None else shard).resolve(logits.shape[-1])
    valid_cols = shard.valid_cols(logits.shape[-1])
    if check_inputs:
        check_target_ids(targets, shard)
    if shift:
        check_shiftable(targets)
        targets = next_token_targets(targets)
    batch_shape = targets.shape
    rows_logits = logits.reshape(-1, logits.shape[-1])
    if rows_logits.stride(-1) != 1 or (rows_logits.shape[0] > 1 and rows_logits.stride(0) < rows_logits.shape[1]):
        rows_logits = rows_logits.contiguous()
    rows_targets = targets.reshape(-1).to(torch.int64).contiguous()
    kernels = select_kernels(rows_logits, implementation)
    with torch.no_grad():
        threshold = kept_threshold(rows_logits[:, :valid_cols], sampling, true_vocab_size=shard.true_vocab_size,
                                   group=shard.group, logit_scale=logit_scale)
    call = LogprobCall(shard=shard, valid_cols=valid_cols, with_entropy=with_entropy,
                       inplace_backward=inplace_backward, kernels=kernels, threshold=threshold,
                       logit_scale=logit_scale)
    out = VocabParallelLogprobs.apply(rows_logits, rows_targets, call)
    return per_token(out, batch_shape, with_entropy, shift)


def per_token(out, batch_shape: torch.Size, with_entropy: bool, shift: bool):
    """The ops' per-row outputs in the targets' shape, moved to the tokens' positions with `shift`."""
    values = out if with_entropy else (out,)
    values = tuple(v.reshape(batch_shape) for v in values)
    if shift:
        values = tuple(aligned_with_tokens(v) for v in values)
    return values if with_entropy else values[0]


def checked_logit_scale(logit_scale: float) -> float:
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


def check_target_ids(targets: torch.Tensor, shard: VocabShard) -> bool:
    """Target ids beyond the true vocab are an error, never a silent -inf (a host sync). Returns whether some
    target is ignored (< 0), read in the same sync."""
    if targets.numel() == 0:
        return False
    smallest, largest = (int(v) for v in torch.stack([targets.min(), targets.max()]).tolist())
    if largest >= shard.true_vocab_size:
        raise ValueError(
            f"targets contain token id {largest}, which is >= true_vocab_size={shard.true_vocab_size} "
            f"(ids at or beyond it are vocab padding and cannot be targets)"
        )
    return smallest < 0
