"""`ClippedPGLoss`: the clipped policy-gradient loss on vocab-sharded logits.

Per trained token `t` (ratio `r = exp(curr - prev)`, advantage `A`):

    loss_t = w_t * max(-A r, -A clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max))     (PPO / GRPO / DAPO)
             ... then min(., -A ratio_clip_c) where A < 0                            (dual clip)
           + reference_policy_kl_penalty * v_t * exp(curr - sg(curr)) * KL_t         (KL to the reference)
           - entropy_coef * H_t                                                      (entropy bonus)

`disable_ppo_ratio` replaces the clipped term by `-A curr` (REINFORCE / RLOO). With
`sequence_level_importance_ratio` (GSPO) `r` is the sequence's `exp(mean over its trained tokens of
(curr - prev))`, differentiable through every token. `w_t` are the detached importance-sampling weights
(see `importance.py`; 1 without the correction), `v_t = sg(exp(curr - generation))` with the on-policy KL
approximation (else 1), and `exp(curr - sg(curr))` (value 1) keeps the KL's score-function gradient.
The per-token losses are reduced by `loss_agg_mode` with global normalisation (`reductions.aggregate_loss`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_grpo.loss.batch import BatchRequirements, LossBatch, validate_batch
from megatron_grpo.loss.config import ClippedPGLossConfig
from megatron_grpo.loss.importance import ImportanceWeights, importance_weights
from megatron_grpo.loss.kl import kl_estimate
from megatron_grpo.loss.next_token import next_token_logprobs
from megatron_grpo.loss.reductions import (
    Count,
    aggregate_loss,
    token_max,
    token_mean,
    token_mean_per_sequence,
    token_min,
)


@dataclasses.dataclass(frozen=True)
class _PolicyTerm:
    per_token_loss: torch.Tensor  # before importance weighting
    ratio: torch.Tensor
    clamped_ratio: torch.Tensor


class ClippedPGLoss:
    """Callable loss: `loss, metrics = loss_fn(logits, batch, global_valid_tokens=..., global_valid_seqs=...)`.

    `loss` is this microbatch's share of the step's globally normalised loss. `metrics` maps the names in
    `metrics.METRIC_AGGREGATION` to detached tensors:
    - `loss`, `num_valid_tokens`, `num_valid_samples` (sequences with a trained token);
    - `probs_ratio` (token mean), `probs_ratio_min`, `probs_ratio_max`, `probs_ratio_clamped`;
    - `clip_fraction_lower` / `clip_fraction_upper`: fraction of trained tokens whose ratio was raised to
      `1 - ratio_clip_min` / lowered to `1 + ratio_clip_max` (0 with `disable_ppo_ratio`: nothing is clipped);
    - `kl_penalty`: token mean of the KL estimate (weighted as in the loss, before the penalty factor), only
      when the loss carries a KL term;
    - `entropy`: token mean of the exact entropy from the op, only when `entropy_coef != 0` (0 skips computing it);
    - with `generation_logprobs`: `token_mult_prob_error` (mean `exp(|generation - prev|)`), `gen_kl_error`
      (KL(generation || prev) with the configured estimator), `sampling_importance_ratio` (mean weight after
      truncation) and, with truncation, `is_oob_ratio` (fraction of trained tokens out of bounds; for
      `seq-mask-tis`, in a rejected sequence);
    - `curr_logprobs` `[B, S]`: the current logprobs (0 where a token is not trained).
    The mismatch metrics always use the prev logprobs the ratio used, `curr.detach()` when the pass was skipped.
    """

    def __init__(self, config: ClippedPGLossConfig) -> None:
        self.config = config

    def __call__(
        self,
        logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        *,
        global_valid_tokens: Count,
        global_valid_seqs: Count,
        vocab_start_index: int | None = None,
        true_vocab_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        prev_logprobs_from_current: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This microbatch's globally normalised loss and its detached metrics (see the class docstring)."""
        cfg = self.config
        prev_from_current = prev_logprobs_from_current or cfg.force_on_policy_ratio
        inputs = validate_batch(batch, logits, self._requirements(prev_from_current))
        curr, entropy = self._current_logprobs(
            logits, inputs, vocab_start_index=vocab_start_index, true_vocab_size=true_vocab_size, group=group
        )
        prev = curr.detach() if prev_from_current else inputs.prev_logprobs
        policy = self._policy_term(curr, prev, inputs)
        weights = self._importance_weights(prev, inputs)
        per_token_loss = policy.per_token_loss
        if cfg.use_importance_sampling_correction:
            per_token_loss = weights.weights * per_token_loss
        kl = self._kl(curr, inputs) if cfg.kl_in_loss else None
        if kl is not None:
            per_token_loss = per_token_loss + cfg.reference_policy_kl_penalty * kl
        if entropy is not None:
            per_token_loss = per_token_loss - cfg.entropy_coef * entropy
        loss = aggregate_loss(
            per_token_loss,
            inputs.mask,
            cfg.loss_agg_mode,
            global_valid_tokens=global_valid_tokens,
            global_valid_seqs=global_valid_seqs,
            max_response_length=cfg.max_response_length,
        )
        with torch.no_grad():
            metrics = self._metrics(loss, curr, prev, inputs, policy, weights, kl, entropy)
        return loss, metrics

    def _requirements(self, prev_from_current: bool) -> BatchRequirements:
        """Which optional batch keys this call needs, each with the reason a missing one's error gives."""
        cfg = self.config
        generation_users = []
        if cfg.use_importance_sampling_correction:
            generation_users.append("loss_fn.use_importance_sampling_correction")
        if cfg.kl_in_loss and cfg.use_on_policy_kl_approximation:
            generation_users.append("loss_fn.use_on_policy_kl_approximation")
        prev_reason = "unless prev_logprobs_from_current=True or loss_fn.force_on_policy_ratio is true"
        reference_reason = "because loss_fn.reference_policy_kl_penalty > 0 and loss_fn.use_kl_in_reward is false"
        return BatchRequirements(
            prev_logprobs=None if prev_from_current else prev_reason,
            generation_logprobs=f"by {' and '.join(generation_users)}" if generation_users else None,
            reference_policy_logprobs=reference_reason if cfg.kl_in_loss else None,
        )

    def _current_logprobs(
        self,
        logits: torch.Tensor,
        inputs: LossBatch,
        *,
        vocab_start_index: int | None,
        true_vocab_size: int | None,
        group: dist.ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[B, S]` logprobs (and entropies) of the trained tokens, from the logits one position earlier."""
        return next_token_logprobs(
            logits,
            inputs.input_ids,
            trained=inputs.mask,
            vocab_start_index=vocab_start_index,
            true_vocab_size=true_vocab_size,
            group=group,
            with_entropy=self.config.entropy_coef != 0,
        )

    def _policy_term(self, curr: torch.Tensor, prev: torch.Tensor, inputs: LossBatch) -> _PolicyTerm:
        cfg = self.config
        log_ratio = curr - prev
        if cfg.sequence_level_importance_ratio:
            log_ratio = token_mean_per_sequence(log_ratio, inputs.mask)[:, None].expand_as(log_ratio)
        ratio = torch.exp(log_ratio)
        advantages = inputs.advantages
        if cfg.disable_ppo_ratio:
            return _PolicyTerm(per_token_loss=-advantages * curr, ratio=ratio, clamped_ratio=ratio)
        clamped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        clipped_loss = torch.maximum(-advantages * ratio, -advantages * clamped)
        if cfg.ratio_clip_c is not None:
            dual_clipped = torch.minimum(clipped_loss, -advantages * cfg.ratio_clip_c)
            clipped_loss = torch.where(advantages < 0, dual_clipped, clipped_loss)
        return _PolicyTerm(per_token_loss=clipped_loss, ratio=ratio, clamped_ratio=clamped)

    def _importance_weights(self, prev: torch.Tensor, inputs: LossBatch) -> ImportanceWeights | None:
        if inputs.generation_logprobs is None:
            return None
        return importance_weights(
            prev,
            inputs.generation_logprobs,
            inputs.mask,
            self.config.truncated_importance_sampling,
            sequence_level=self.config.sequence_level_importance_ratio,
        )

    def _kl(self, curr: torch.Tensor, inputs: LossBatch) -> torch.Tensor:
        """Per-token KL(pi || pi_ref) estimate with the score-function weight (and on-policy weight)."""
        cfg = self.config
        kl = kl_estimate(
            curr,
            inputs.reference_policy_logprobs,
            cfg.reference_policy_kl_type,
            input_clamp=cfg.kl_input_clamp_value,
            output_clamp=cfg.kl_output_clamp_value,
        )
        weight = torch.exp(curr - curr.detach())
        if cfg.use_on_policy_kl_approximation:
            weight = weight * torch.exp(curr - inputs.generation_logprobs).detach()
        return weight * kl

    def _metrics(
        self,
        loss: torch.Tensor,
        curr: torch.Tensor,
        prev: torch.Tensor,
        inputs: LossBatch,
        policy: _PolicyTerm,
        weights: ImportanceWeights | None,
        kl: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        mask = inputs.mask
        ratio, clamped = policy.ratio.detach(), policy.clamped_ratio.detach()
        metrics = {
            "loss": loss.detach().clone(),  # Megatron divides the returned loss in place
            "num_valid_tokens": mask.sum(),
            "num_valid_samples": (mask.sum(dim=-1) > 0).sum().to(torch.float32),
            "probs_ratio": token_mean(ratio, mask),
            "probs_ratio_min": token_min(ratio, mask),
            "probs_ratio_max": token_max(ratio, mask),
            "probs_ratio_clamped": token_mean(clamped, mask),
            "clip_fraction_lower": token_mean((clamped > ratio).to(torch.float32), mask),
            "clip_fraction_upper": token_mean((clamped < ratio).to(torch.float32), mask),
            "curr_logprobs": curr.detach(),
        }
        if kl is not None:
            metrics["kl_penalty"] = token_mean(kl.detach(), mask)
        if entropy is not None:
            metrics["entropy"] = token_mean(entropy.detach(), mask)
        if inputs.generation_logprobs is not None:
            metrics.update(self._mismatch_metrics(prev.detach(), inputs.generation_logprobs, mask, weights))
        return metrics

    def _mismatch_metrics(
        self, prev: torch.Tensor, generation: torch.Tensor, mask: torch.Tensor, weights: ImportanceWeights
    ) -> dict[str, torch.Tensor]:
        """How far the rollout engine's logprobs are from the trainer's prev logprobs."""
        metrics = {
            "token_mult_prob_error": token_mean(torch.exp((generation - prev).abs()), mask),
            "gen_kl_error": token_mean(kl_estimate(generation, prev, self.config.reference_policy_kl_type), mask),
            "sampling_importance_ratio": token_mean(weights.weights, mask),
        }
        if weights.out_of_bounds is not None:
            metrics["is_oob_ratio"] = token_mean(weights.out_of_bounds.to(torch.float32), mask)
        return metrics

