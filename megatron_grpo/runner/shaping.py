"""What a GRPO step does with the prev (and reference) logprobs before the loss: the two readers the scheduler
plans a prev pass for.

- `grpo.seq_logprob_error_threshold` (NeMo-RL): a sequence whose mean `exp(|generation - prev|)` over its trained
  tokens exceeds the threshold gets `sample_mask = 0`, so the loss ignores it; its reward still counts in its
  group's baseline, as in NeMo-RL, where advantages are computed before the masking.
- `loss_fn.use_kl_in_reward` (verl's `use_kl_in_reward` with an outcome reward): each sequence's reward becomes
  `reward - reference_policy_kl_penalty * sum over its trained tokens of KL_t(prev || reference)`, with the
  configured estimator and clamps, and the group-relative advantages are recomputed from it, so they carry the KL.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_grpo.loss.batch import trained_token_mask
from megatron_grpo.loss.kl import kl_estimate
from megatron_grpo.runner.advantages import group_relative_advantages
from megatron_grpo.runner.config import Config

Batch = Mapping[str, torch.Tensor]


def sequence_mult_prob_error(prev: torch.Tensor, generation: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B]`: NeMo-RL's per-sequence `token_mult_prob_error`, the mean over trained tokens of `exp(|gen - prev|)`
    (1 when they agree; +inf when either logprob is -inf on a trained token; 0 for a sequence without one)."""
    on_mask = mask.bool()
    error = torch.where(on_mask, torch.exp((generation - prev).abs()), torch.zeros((), device=mask.device))
    return error.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def sequence_kl(prev: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, cfg: Config) -> torch.Tensor:
    """`[B, S]` per-token KL(prev || reference) of the trained tokens (0 elsewhere, and where prev is -inf: a token
    outside a filtered distribution's kept set has no defined KL)."""
    loss_cfg = cfg.loss_fn
    kl = kl_estimate(
        prev,
        reference,
        loss_cfg.reference_policy_kl_type,
        input_clamp=loss_cfg.kl_input_clamp_value,
        output_clamp=loss_cfg.kl_output_clamp_value,
    )
    defined = mask.bool() & torch.isfinite(prev) & torch.isfinite(reference)
    return torch.where(defined, kl, torch.zeros((), device=kl.device))


class PrevLogprobShaping:
    """`batch -> batch`, called by `train_step` once the planned logprob passes are in the batch.

    `rewards` `[N]` are this DP rank's rewards, grouped as the batch. After the call, `metrics` holds, summed or
    maxed over the ranks of `dp_group`:
    - with a threshold: `num_masked_seqs_by_logprob_error` and `max_seq_mult_prob_error` (NeMo-RL's names), and
      `masked_seqs_by_logprob_error_fraction` (of the sequences with a trained token);
    - with the KL in the reward: `reward_kl_penalty` (verl's name: the mean over sequences of the token-mean KL).
    """

    def __init__(self, cfg: Config, rewards: torch.Tensor, dp_group: dist.ProcessGroup | None) -> None:
        self.cfg = cfg
        self.rewards = rewards
        self.dp_group = dp_group
        self.metrics: dict[str, float] = {}

    @staticmethod
    def needed(cfg: Config) -> bool:
        """Whether `cfg` asks for anything this does."""
        return cfg.grpo.seq_logprob_error_threshold is not None or cfg.loss_fn.use_kl_in_reward

    def __call__(self, batch: Batch) -> dict[str, torch.Tensor]:
        shaped = dict(batch)
        mask = trained_token_mask(batch)
        if self.cfg.loss_fn.use_kl_in_reward:
            shaped["advantages"] = self._kl_shaped_advantages(batch, mask)
        threshold = self.cfg.grpo.seq_logprob_error_threshold
        if threshold is not None:
            shaped["sample_mask"] = self._masked_by_logprob_error(batch, mask, threshold)
        return shaped

    def _masked_by_logprob_error(self, batch: Batch, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        error = sequence_mult_prob_error(batch["prev_logprobs"], batch["generation_logprobs"], mask)
        has_tokens = mask.sum(dim=-1) > 0
        rejected = has_tokens & ~(error <= threshold)  # NaN is rejected too
        sums = self._reduced(torch.stack([rejected.sum(), has_tokens.sum()]).double(), dist.ReduceOp.SUM)
        largest = self._reduced(torch.where(has_tokens, error, 0.0).amax().reshape(1).double(), dist.ReduceOp.MAX)
        self.metrics.update(
            num_masked_seqs_by_logprob_error=float(sums[0]),
            masked_seqs_by_logprob_error_fraction=float(sums[0] / sums[1].clamp(min=1)),
            max_seq_mult_prob_error=float(largest[0]),
        )
        sample_mask = batch["sample_mask"]
        return torch.where(rejected, torch.zeros((), dtype=sample_mask.dtype, device=sample_mask.device), sample_mask)

    def _kl_shaped_advantages(self, batch: Batch, mask: torch.Tensor) -> torch.Tensor:
        kl = sequence_kl(batch["prev_logprobs"], batch["reference_policy_logprobs"], mask, self.cfg)
        tokens = mask.sum(dim=-1)
        penalty = self.cfg.loss_fn.reference_policy_kl_penalty
        shaped_rewards = self.rewards.to(kl.device, torch.float64) - penalty * kl.double().sum(dim=-1)
        grpo = self.cfg.grpo
        advantages = group_relative_advantages(
            shaped_rewards,
            grpo.num_generations_per_prompt,
            normalize_by_std=grpo.normalize_rewards_by_std,
            leave_one_out=grpo.leave_one_out_baseline,
        ).advantages
        token_mean_kl = kl.double().sum(dim=-1) / tokens.clamp(min=1)
        count = torch.tensor(float(len(tokens)), dtype=torch.float64, device=kl.device)
        sums = self._reduced(torch.stack([token_mean_kl.sum(), count]), dist.ReduceOp.SUM)
        self.metrics["reward_kl_penalty"] = float(sums[0] / sums[1].clamp(min=1))
        return advantages.to(batch["advantages"].device, batch["advantages"].dtype)

    def _reduced(self, values: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(values, op=op, group=self.dp_group)
        return values
