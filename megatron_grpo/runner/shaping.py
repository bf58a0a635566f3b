"""What a GRPO step does with the prev (and reference) logprobs before the loss: the runner's KL in the reward.

`loss_fn.kl_in_sequence_reward` (close to verl's `use_kl_in_reward` with an outcome reward, not NeMo-RL's; its own
name: docs/nemo-rl.md): each sequence's reward becomes `reward - reference_policy_kl_penalty * sum over its trained
tokens of KL_t(prev || reference)`, with the configured estimator and clamps, and the group-relative advantages are
recomputed from it, so they carry the KL. It needs the prev pass: the advantages enter the loss non-linearly and
every backward needs them, so they cannot wait for the training forward (`megatron_grpo.scheduler`). NeMo-RL's
sequence mask by logprob error (`grpo.seq_logprob_error_threshold`) is the plugin's, inside the loss
(`megatron_grpo.loss.logprob_error_mask`).
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

    `rewards` `[N]` are this DP rank's rewards, grouped as the batch. After the call, `metrics` holds
    `reward_kl_penalty` (verl's name: the mean over sequences of the token-mean KL), averaged over the ranks of
    `dp_group`.
    """

    def __init__(self, cfg: Config, rewards: torch.Tensor, dp_group: dist.ProcessGroup | None) -> None:
        self.cfg = cfg
        self.rewards = rewards
        self.dp_group = dp_group
        self.metrics: dict[str, float] = {}

    @staticmethod
    def needed(cfg: Config) -> bool:
        """Whether `cfg` asks for anything this does."""
        return cfg.loss_fn.kl_in_sequence_reward

    def __call__(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {**batch, "advantages": self._kl_shaped_advantages(batch, trained_token_mask(batch))}

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
