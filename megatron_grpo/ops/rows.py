"""Per-row outputs of the ops and the gradients that come back to them, shared by every op's backward: the
logprob op, the linear op and the loss-fused path all reduce rows to these and reach the same backward kernel."""

from __future__ import annotations

import torch

from .shift import aligned_with_tokens


def row_gradient(grad: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The upstream gradient of a per-row output as a contiguous `[rows]` tensor in `like`'s dtype (zeros for
    None: an output nothing differentiated)."""
    if grad is None:
        return torch.zeros(rows, dtype=like.dtype, device=like.device)
    return grad.reshape(rows).to(like.dtype).contiguous()


def upstream_gradients(grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None, lse: torch.Tensor,
                       mean_x: torch.Tensor | None, logprob: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward kernel's `(grad_logprob, mean_x, grad_entropy)` for rows with these forward statistics.

    `logprob` is given under a top-k / top-p filter: a target outside the kept set has logprob -inf, a constant,
    and passes no gradient back. `mean_x` and `grad_entropy` are both None without an entropy, or with one that is
    only logged (its upstream gradient is None), so the kernel skips the entropy term.
    """
    rows = lse.shape[0]
    grad_logprob = row_gradient(grad_logprob, rows, lse)
    if logprob is not None:
        grad_logprob = grad_logprob.masked_fill(logprob == float("-inf"), 0.0)
    if mean_x is None or grad_entropy is None:
        return grad_logprob, None, None
    return grad_logprob, mean_x, row_gradient(grad_entropy, rows, lse)


def per_token(values: tuple[torch.Tensor, ...], batch_shape: torch.Size, shift: bool) -> tuple[torch.Tensor, ...]:
    """Per-row outputs in the targets' shape, moved to the tokens' positions with `shift`."""
    values = tuple(v.reshape(batch_shape) for v in values)
    return tuple(aligned_with_tokens(v) for v in values) if shift else values
