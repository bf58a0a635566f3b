"""The standard scalars RL users look for, as pure functions over one step's rollout, optimizer and gradients.

- `rollout_statistics`: mean, std, min and max of the rewards (per sample) and of the advantages (per trained
  token, as verl's `critic/advantages/*`), and the response-length distribution (mean, min, max, and the
  fraction of responses truncated at `generation.max_new_tokens`, i.e. that never emitted `<eos>`). Over all
  data-parallel ranks with one all-gather of a small tensor when a process group is given.

Names. A key that has a peer's name has the peer's meaning:
- `reward_{mean,min,max}`: verl's `critic/rewards/{mean,min,max}`, the per-sample (sequence) reward;
  `reward_std` is the population std over the same samples;
- `advantages_{mean,min,max}`: verl's `critic/advantages/{mean,min,max}`, over trained (response) tokens, so a
  sample weighs by its response length; `advantages_std` is the population std over the same tokens;
- `response_length_{mean,min,max}`: verl's `response_length/{mean,min,max}`, response tokens counted up to and
  including `<eos>`;
- `response_truncated_fraction` is ours: the fraction of responses without `<eos>` (cut by `max_new_tokens`).
  verl's `response_length/clip_ratio` counts length == max, which includes answers whose last allowed token
  was `<eos>`, so it is not reused here;
- the train step adds `lr` (verl's `actor/lr`), `grad_norm` (before clipping, as verl's `actor/grad_norm` and
  NeMo-RL's `grad_norm`) and `grad_norm_after_clip` (ours: verl and NeMo-RL log only the norm before clipping).

std is the population standard deviation (divide by N), so it is defined for a single sample (0).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

# Per rank, per quantity: count, sum, sum of squares, min, max (float64). One all-gather moves them all.
_FIELDS = 5


def _moments(values: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[count, sum, sum of squares, min, max] of `values` (weighted by `weights` >= 0; min/max over weight > 0)."""
    values = values.detach().to(torch.float64).reshape(-1).cpu()
    if weights is None:
        weights = torch.ones_like(values)
    weights = weights.detach().to(torch.float64).reshape(-1).cpu()
    kept = values[weights > 0]
    low = kept.min() if kept.numel() else torch.tensor(math.inf, dtype=torch.float64)
    high = kept.max() if kept.numel() else torch.tensor(-math.inf, dtype=torch.float64)
    return torch.stack([weights.sum(), (weights * values).sum(), (weights * values.square()).sum(), low, high])


def _combine(per_rank: torch.Tensor) -> dict[str, float]:
    """mean, std, min, max from the `[ranks, 5]` moments of one quantity; NaN where nothing was counted."""
    count, total, squares = (per_rank[:, i].sum().item() for i in range(3))
    if count <= 0:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    mean = total / count
    variance = max(squares / count - mean * mean, 0.0)  # rounding can make it a hair negative
    return {"mean": mean, "std": math.sqrt(variance), "min": per_rank[:, 3].min().item(),
            "max": per_rank[:, 4].max().item()}


def rollout_statistics(
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    responses: torch.Tensor,
    eos_id: int,
    *,
    group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
) -> dict[str, float]:
    """Reward, advantage and response-length statistics of one step, over every rank of `group` (data parallel).

    - `rewards` `[B]`: per-sample rewards; `advantages` `[B]` (one per sample, as in GRPO) or `[B, S]` (per token,
      aligned with `token_mask`);
    - `token_mask` `[B, S]`: 1 on trained response tokens (up to and including `<eos>`);
    - `responses` `[B, R]`: the generated tokens (`Rollout.responses`), `eos_id` the end-of-sequence id.

    Every rank of `group` must call it (the TP ranks of one DP rank hold the same rollout: pass the DP group).
    One all-gather of a `[3, 5]` float64 tensor per rank; no collective without a group or with one rank. The
    all-gather runs on `device` (the layout's: a group that is NCCL on GPUs takes CUDA tensors only); None: the
    CPU.
    """
    mask = token_mask.detach().to(torch.float64).cpu()
    lengths = mask.sum(dim=1)
    if advantages.dim() == 1:
        token_advantages, token_weights = advantages, lengths  # each token of a sample carries its advantage
    else:
        token_advantages, token_weights = advantages, mask
    truncated = ~(responses.detach().cpu() == eos_id).any(dim=1)
    moments = torch.stack([
        _moments(rewards),
        _moments(token_advantages, token_weights),
        _moments(lengths),
    ])
    extra = torch.tensor([truncated.sum().item(), truncated.numel()], dtype=torch.float64)
    local = torch.cat([moments.reshape(-1), extra])
    if group is not None and dist.get_world_size(group) > 1:
        local = local if device is None else local.to(device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        per_rank = torch.stack(gathered).cpu()
    else:
        per_rank = local[None]
    moments_per_rank = per_rank[:, : 3 * _FIELDS].reshape(-1, 3, _FIELDS)
    stats = {}
    for index, name in enumerate(("reward", "advantages", "response_length")):
        for stat, value in _combine(moments_per_rank[:, index]).items():
            stats[f"{name}_{stat}"] = value
    del stats["response_length_std"]  # not a standard scalar; the three others are verl's
    truncated_count, samples = per_rank[:, -2].sum().item(), per_rank[:, -1].sum().item()
    stats["response_truncated_fraction"] = truncated_count / samples if samples else math.nan
    return stats
