"""Plain-torch kernels with the exact contract of the fused ones (csrc/logprob_common.h).

Used when `megatron_grpo._C` cannot be loaded, for float64 logits, and as the anchor of the kernel tests. Rows
are processed in pieces (`chunking.piece_rows`) so the temporaries stay bounded whatever the number of tokens.

`logit_scale` (> 0): the kernels see z = logit_scale * logits (rounded in the compute dtype, as the fused
kernels do); the threshold, lse and mean_x are in units of z, and the gradient is logit_scale * d/dz.
"""

from __future__ import annotations

import torch

from megatron_grpo.ops.core.alignment import empty_with_alignment_of
from megatron_grpo.ops.core.chunking import piece_rows, pieces
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.core.partials import Partials, combine_partials
from megatron_grpo.ops.core.rows import upstream_gradients


def _local_target_column(targets: torch.Tensor, vocab_start: int, valid_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each target in this shard, and whether this shard owns it (see local_target_column)."""
    col = targets - vocab_start
    owned = (targets >= 0) & (col >= 0) & (col < valid_cols)
    return col.clamp(0, max(valid_cols - 1, 0)), owned


def _scaled(x: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """z = logit_scale * x (x itself at scale 1)."""
    return x if logit_scale == 1.0 else x * logit_scale


def _filtered(x: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """x with the logits below the row's threshold set to -inf (NaN stays NaN, so it still poisons its row)."""
    if threshold is None:
        return x
    return x.masked_fill(x < threshold.to(x.dtype)[:, None], float("-inf"))


def logprob_partials(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
    threshold: torch.Tensor | None = None, logit_scale: float = 1.0,
) -> torch.Tensor:
    """Stacked partials [rows, k]: max m, sum exp(z - m), target logit, (sum exp(z - m) * (z - m)). See `Partials`.

    With a per-row `threshold` ([rows]), only logits `>=` it take part; a target below it has logit -inf.
    """
    dtype = compute_dtype(logits.dtype)
    rows = logits.shape[0]
    out = torch.empty(rows, Partials.width(with_entropy), dtype=dtype, device=logits.device)
    for sl in pieces(rows, piece_rows(logits.shape[1])):
        out[sl] = _chunk_partials(logits[sl], targets[sl], vocab_start, valid_cols, with_entropy, dtype,
                                  None if threshold is None else threshold[sl], logit_scale)
    return out


def _chunk_partials(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
    dtype: torch.dtype, threshold: torch.Tensor | None, logit_scale: float,
) -> torch.Tensor:
    rows = logits.shape[0]
    out = torch.empty(rows, Partials.width(with_entropy), dtype=dtype, device=logits.device)
    x = _filtered(_scaled(logits[:, :valid_cols].to(dtype), logit_scale), threshold)
    if valid_cols == 0:
        out[:, Partials.MAX] = float("-inf")
        out[:, Partials.SUM_EXP] = 0.0
        if with_entropy:
            out[:, Partials.SUM_EXP_X] = 0.0
    else:
        m = x.amax(dim=-1)
        shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        z = x - shift[:, None]
        e = torch.exp(z)
        out[:, Partials.MAX] = m
        out[:, Partials.SUM_EXP] = e.sum(dim=-1)
        if with_entropy:
            out[:, Partials.SUM_EXP_X] = torch.where(e == 0, torch.zeros_like(e), e * z).sum(dim=-1)
    col, owned = _local_target_column(targets, vocab_start, valid_cols)
    target_logit = (x.gather(1, col[:, None]).squeeze(1) if valid_cols
                    else torch.zeros(rows, dtype=dtype, device=logits.device))
    out[:, Partials.TARGET] = torch.where(owned, target_logit, torch.full_like(target_logit, float("-inf")))
    ignored = targets < 0
    out[ignored, Partials.MAX] = 0.0
    out[ignored, Partials.SUM_EXP] = 1.0
    if with_entropy:
        out[ignored, Partials.SUM_EXP_X] = 0.0
    return out


def logprob_stats(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
    threshold: torch.Tensor | None = None, logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's `(logprob, entropy, lse, mean_x)` (TP 1): the combine of its own partials."""
    partials = logprob_partials(logits, targets, vocab_start, valid_cols, with_entropy, threshold, logit_scale)
    return combine(partials.unsqueeze(0), targets, with_entropy)


def combine(gathered: torch.Tensor, targets: torch.Tensor, with_entropy: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logprob, entropy, lse, mean_x)` from the all-gathered partials `[world, rows, k]`."""
    return combine_partials(gathered, targets, with_entropy)


def logprob_gradient(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, lse: torch.Tensor,
    mean_x: torch.Tensor | None, logprob: torch.Tensor | None, grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None, threshold: torch.Tensor | None = None, logit_scale: float = 1.0,
) -> torch.Tensor:
    """The out-of-place backward: `logprob_backward` into a new buffer with the logits' row alignment, from the
    upstream gradients as autograd hands them (`upstream_gradients`); `logprob` is given with the threshold."""
    grad_logprob, mean_x, grad_entropy = upstream_gradients(grad_logprob, grad_entropy, lse, mean_x, logprob)
    grad_logits = empty_with_alignment_of(logits)
    logprob_backward(logits, targets, vocab_start, valid_cols, lse, mean_x, grad_logprob, grad_entropy, grad_logits,
                     threshold, logit_scale)
    return grad_logits


def logprob_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    valid_cols: int,
    lse: torch.Tensor,
    mean_x: torch.Tensor | None,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    grad_logits: torch.Tensor,
    threshold: torch.Tensor | None = None,
    logit_scale: float = 1.0,
) -> None:
    """Writes dx = s * (g_lp * (1[v = y] - p) + g_H * p * (E[z] - z)), z = s * x, into grad_logits (which may
    alias logits), s = logit_scale.

    With a per-row `threshold`, logits below it (the target included) get exactly 0.
    """
    for sl in pieces(logits.shape[0], piece_rows(logits.shape[1])):
        grad = _chunk_backward(
            logits[sl], targets[sl], vocab_start, valid_cols, lse[sl],
            None if mean_x is None else mean_x[sl], grad_logprob[sl],
            None if grad_entropy is None else grad_entropy[sl],
            None if threshold is None else threshold[sl], logit_scale,
        )
        grad_logits[sl] = grad.to(grad_logits.dtype)


def _chunk_backward(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, lse: torch.Tensor,
    mean_x: torch.Tensor | None, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None,
    threshold: torch.Tensor | None, logit_scale: float,
) -> torch.Tensor:
    dtype = compute_dtype(logits.dtype)
    grad = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
    x = _scaled(logits[:, :valid_cols].to(dtype), logit_scale)
    kept = None if threshold is None else ~(x < threshold.to(dtype)[:, None])
    p = torch.exp(x - lse[:, None].to(dtype))
    g_lp = grad_logprob.to(dtype)[:, None] * logit_scale
    valid = -g_lp * p
    if grad_entropy is not None:
        entropy_term = grad_entropy.to(dtype)[:, None] * logit_scale * p * (mean_x.to(dtype)[:, None] - x)
        valid = valid + torch.where(p == 0, torch.zeros_like(p), entropy_term)
    col, owned = _local_target_column(targets, vocab_start, valid_cols)
    if valid_cols:
        valid.scatter_add_(1, col[:, None], torch.where(owned, g_lp.squeeze(1), 0.0)[:, None])
    if kept is not None:
        valid = torch.where(kept, valid, torch.zeros_like(valid))
    grad[:, :valid_cols] = valid
    grad[targets < 0] = 0.0
    return grad


def logprob_partials_writing_exps(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
    threshold: torch.Tensor | None = None, logit_scale: float = 1.0,
) -> torch.Tensor:
    """`logprob_partials`, and e = exp(z - m) (m = the row's MAX partial; 0 where filtered) written over the
    valid columns of the non-ignored rows: the in-place exp mode's forward."""
    partials = logprob_partials(logits, targets, vocab_start, valid_cols, with_entropy, threshold, logit_scale)
    dtype = compute_dtype(logits.dtype)
    for sl in pieces(logits.shape[0], piece_rows(logits.shape[1])):
        rows = (targets[sl] >= 0).nonzero().squeeze(1) + sl.start
        if rows.numel() == 0 or valid_cols == 0:
            continue
        z = _filtered(_scaled(logits[rows, :valid_cols].to(dtype), logit_scale),
                      None if threshold is None else threshold[rows])
        m = partials[rows, Partials.MAX]
        shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        logits[rows, :valid_cols] = torch.exp(z - shift[:, None]).to(logits.dtype)
    return partials


def logprob_backward_from_exps(
    exps: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, prob_scale: torch.Tensor,
    target_prob: torch.Tensor, grad_logprob: torch.Tensor, logit_scale: float = 1.0,
) -> None:
    """Overwrites the exps of `logprob_partials_writing_exps` with dx = s * g_lp * (1[v = y] - p), p = e *
    prob_scale except at the target, where p = target_prob; padding columns and ignored rows get 0. No entropy
    term."""
    dtype = compute_dtype(exps.dtype)
    for sl in pieces(exps.shape[0], piece_rows(exps.shape[1])):
        grad = torch.zeros(exps[sl].shape, dtype=dtype, device=exps.device)
        p = exps[sl, :valid_cols].to(dtype) * prob_scale[sl].to(dtype)[:, None]
        g = grad_logprob[sl].to(dtype) * logit_scale
        valid = -g[:, None] * p
        col, owned = _local_target_column(targets[sl], vocab_start, valid_cols)
        if valid_cols:
            kept = valid.gather(1, col[:, None]).squeeze(1)
            target_grad = torch.where(owned, g * (1 - target_prob[sl].to(dtype)), kept)
            valid.scatter_(1, col[:, None], target_grad[:, None])
        grad[:, :valid_cols] = valid
        grad[targets[sl] < 0] = 0.0
        exps[sl] = grad.to(exps.dtype)
