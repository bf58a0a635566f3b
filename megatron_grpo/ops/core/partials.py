"""Per-row softmax partials: their layout, the one all-gather across TP ranks, and the combine.

Each rank reduces its vocab shard to `[rows, k]` partials (m, d, x_y[, s]); one all-gather of that small tensor
gives every rank the full picture, and the combine turns it into log-sum-exp, logprob and entropy:

    M = max_r m_r,  D = sum_r d_r exp(m_r - M),  lse = M + log D,  logprob = x_y(owner) - lse.

The entropy moment is kept relative to the max, s_r = sum exp(x - m_r) (x - m_r), which moves to M as
S = sum_r exp(m_r - M) (s_r + (m_r - M) d_r). Then E[x] = M + S / D and entropy = log D - S / D: no
cancellation between two large numbers, unlike lse - E[x] with absolute moments.

The fused kernels run the combine as one kernel after the all-gather (`combine_partials` in
csrc/logprob_common.h), and with one rank at the end of the forward kernel itself; `combine_partials` here is its
plain-torch twin, operation for operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class Partials:
    """Column indices of the stacked partials (must match PartialsColumn in csrc/logprob_common.h)."""

    MAX = 0
    SUM_EXP = 1
    TARGET = 2
    SUM_EXP_X = 3  # relative to the row max: sum exp(x - m) * (x - m)

    @staticmethod
    def width(with_entropy: bool) -> int:
        return 4 if with_entropy else 3


@dataclass(frozen=True)
class RowStats:
    """What forward returns per row, and what backward needs back (lse, and E[x] with entropy)."""

    logprob: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    mean_x: torch.Tensor | None

    @classmethod
    def of(cls, outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
           with_entropy: bool) -> RowStats:
        """From the kernels' `(logprob, entropy, lse, mean_x)`, whose entropy and E[x] are `[0]` without entropy."""
        logprob, entropy, lse, mean_x = outputs
        return cls(logprob=logprob, lse=lse, entropy=entropy if with_entropy else None,
                   mean_x=mean_x if with_entropy else None)


def gather_partials(partials: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All ranks' partials as [world, rows, k]: the op's single collective."""
    if group is None or dist.get_world_size(group) == 1:
        return partials.unsqueeze(0)
    world = dist.get_world_size(group)
    # gloo wants the output as the ranks' inputs concatenated along dim 0, not stacked in a new dim
    gathered = torch.empty((world * partials.shape[0], *partials.shape[1:]), dtype=partials.dtype,
                           device=partials.device)
    # torch 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single.
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather_single(gathered, partials.contiguous(), group=group)
    return gathered.view(world, *partials.shape)


def combine_partials(gathered: torch.Tensor, targets: torch.Tensor, with_entropy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All ranks' partials `[world, rows, k]` as the kernels' per-row `(logprob, entropy, lse, mean_x)` (entropy and
    E[x] `[0]` without entropy); ignored rows (target < 0) get a logprob and an entropy of exactly 0."""
    m = gathered[..., Partials.MAX]
    global_max = m.amax(dim=0)
    shift = torch.where(global_max == float("-inf"), torch.zeros_like(global_max), global_max)
    scale = torch.exp(m - shift)
    sum_exp = (gathered[..., Partials.SUM_EXP] * scale).sum(dim=0)
    lse = shift + torch.log(sum_exp)
    ignored = targets < 0
    zero = torch.zeros_like(lse)
    logprob = torch.where(ignored, zero, gathered[..., Partials.TARGET].amax(dim=0) - lse)
    if not with_entropy:
        return logprob, lse.new_empty(0), lse, lse.new_empty(0)
    d = gathered[..., Partials.SUM_EXP]
    moved = torch.where(d == 0, torch.zeros_like(d), (m - shift) * d)
    relative_mean = ((gathered[..., Partials.SUM_EXP_X] + moved) * scale).sum(dim=0) / sum_exp
    mean_x = shift + relative_mean
    entropy = torch.where(ignored, zero, torch.log(sum_exp) - relative_mean)
    return logprob, entropy, lse, mean_x
