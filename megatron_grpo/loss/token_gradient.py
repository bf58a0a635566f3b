"""`ClippedPGLoss`'s gradient with respect to each trained token's current logprob, entropy and unfiltered logprob,
in closed form: what the loss-fused head (`loss.fused_head`) feeds the backward kernel chunk by chunk, a few
elementwise kernels on `[rows]` vectors, with no autograd and no host sync.

The loss is linear in its per-token terms: every aggregation is `sum_t w_t x_t` with per-token weights known before
the current logprobs are (`reductions.aggregation_weights`). So, with `c` a token's current logprob (0 where the
filter dropped its target or its prev is -inf: `kept`), `p` its prev, `A` its advantage, `r = exp(c - p)`:

    d loss / d c = a_t w_t d policy_t / dc + beta b_t d kl_t / dc - nu n_t
    d loss / d H = -entropy_coef a_t

- the policy term, as autograd differentiates `_policy_term`: `-A` (REINFORCE), `-A clip(r)` (CISPO, the clipped
  ratio detached), else `max(-A r, -A clip(r))` (ties give each side half, `clip` passes the gradient inside its
  bounds, bounds included), then the dual clip's `min(., -A c)` where `A < 0`;
- `w_t` the importance weights (detached: known up front unless prev is read from curr, then per chunk);
- the KL, `kl_estimate` with the score-function weight `exp(c - sg(c))` (value 1) and the on-policy weight
  `v = sg(exp(c - generation))`: `v (K(lr) - K'(lr))` with `lr = ref - c` inside the input clamp, 0 where it binds or
  where the output clamp binds; under a filter it reads the unfiltered logprob, with the unfiltered mask;
- `a_t`, `b_t`, `n_t`: the policy's, the KL's and VAPO's aggregation weights, each times the bound upstream gradient.

`obstacle` says where this does not hold: where the gradient at a token reads other tokens' current values (GSPO's
sequence ratio, sequence-level weights of a prev read from curr or under a filter, a filter's kept counts in
`seq-mean-token-mean`, NeMo-RL's sequence mask by logprob error read from curr). The head then cuts chunks of whole
sequences and takes the gradient by autograd over the loss itself. The sequence mask read from the batch's prev, and
deferred normalisation (the aggregation's counts then 1), keep the closed form. A new per-token term of the loss adds
its derivative here (`tests/loss/test_linear_loss.py` checks this against autograd in every setting), or an
obstacle.
"""

from __future__ import annotations

import torch

from megatron_grpo.loss.batch import LossBatch
from megatron_grpo.loss.call import LossCall
from megatron_grpo.loss.config import ClippedPGLossConfig
from megatron_grpo.loss.fused_head import Chunk, RowGradients, RowValues, Upstream
from megatron_grpo.loss.importance import finite_or_zero, importance_weights
from megatron_grpo.loss.logprob_error_mask import mask_by_logprob_error
from megatron_grpo.loss.prev_approximation import interpolated_prev
from megatron_grpo.loss.reductions import aggregation_weights


def prev_reads_current(call: LossCall, prev_from_current: bool) -> bool:
    """Whether prev is a function of the current logprobs (`curr.detach()`, or AReaL's interpolation)."""
    approximation = call.prev.approximation
    return prev_from_current or (approximation is not None and approximation.method != "generation")


def obstacle(config: ClippedPGLossConfig, call: LossCall, *, prev_from_current: bool, filter_active: bool,
             prev_in_batch: bool) -> str | None:
    """Why the loss's gradient at a token reads other tokens' current values, or None (the closed form holds).
    `prev_in_batch`: the batch carries `prev_logprobs` (a prev pass), which the sequence mask then reads."""
    if call.seq_logprob_error_threshold is not None and not prev_in_batch:
        return ("the sequence mask by logprob error (seq_logprob_error_threshold) reads each sequence's current "
                "logprobs, without a prev pass")
    if config.sequence_level_importance_ratio:
        return "GSPO's sequence-level ratio (loss_fn.sequence_level_importance_ratio) couples a sequence's tokens"
    sequence_weights = (config.use_importance_sampling_correction
                        and config.truncated_importance_sampling.type == "seq-mask-tis")
    if sequence_weights and (filter_active or prev_reads_current(call, prev_from_current)):
        return ("seq-mask-tis weighs each sequence by the mean of its tokens' weights, which read the current "
                "logprobs here")
    if filter_active and config.loss_agg_mode == "seq-mean-token-mean":
        return ("under a top-k / top-p filter, seq-mean-token-mean divides by each sequence's count of tokens whose "
                "target the filter keeps")
    return None


class ClosedFormGradient:
    """The gradient of `upstream` times `ClippedPGLoss`'s loss with respect to each trained row's values (see the
    module docstring), its per-token constants gathered once at the trained rows' `positions`; called per chunk."""

    def __init__(self, config: ClippedPGLossConfig, inputs: LossBatch, call: LossCall, *, prev_from_current: bool,
                 alpha: torch.Tensor | None, positions: torch.Tensor, upstream: Upstream, dtype: torch.dtype) -> None:
        self.config, self.dtype = config, dtype
        cfg, layout = config, inputs.layout
        approximation = call.prev.approximation
        self.method = None if approximation is None else approximation.method
        self.prev_from_current = prev_from_current
        self.filtered = call.distribution.filtered  # the KL then reads the unfiltered logprobs, with the whole mask

        def at(values: torch.Tensor) -> torch.Tensor:
            return values.reshape(-1).index_select(0, positions)

        mask = inputs.mask
        if call.seq_logprob_error_threshold is not None:  # from the batch's prev (else an obstacle): known up front
            mask = mask_by_logprob_error(inputs.prev_logprobs, inputs.generation_logprobs, mask,
                                         call.seq_logprob_error_threshold, layout, context=call.context).mask
        unmasked_by_filter = mask  # what the KL reads under a filter: every token's unfiltered logprob
        prev = None  # known up front: the batch's (a pass), or the generation logprobs
        if self.method == "generation":
            prev = torch.where(mask.bool(), inputs.generation_logprobs, 0.0)
        elif not prev_reads_current(call, prev_from_current):
            prev = inputs.prev_logprobs
        if prev is not None:  # a prev of -inf drops its token, known now
            kept = ~torch.isneginf(prev)
            prev, mask = torch.where(kept, prev, 0.0), mask * kept
        self.prev = None if prev is None else at(prev)
        self.generation = None if inputs.generation_logprobs is None else at(inputs.generation_logprobs)
        self.alpha = None if self.method in (None, "generation") else at(layout.broadcast(alpha))
        self.negative_advantage = -at(inputs.advantages)
        self.advantage = at(inputs.advantages)
        # Deferred normalisation: the loss is a sum, divided once by the step (counts of 1 here).
        tokens, sequences = (1, 1) if call.defer_normalisation else (call.global_valid_tokens, call.global_valid_seqs)
        weigh = dict(mode=cfg.loss_agg_mode, global_valid_tokens=tokens, global_valid_seqs=sequences,
                     max_response_length=cfg.max_response_length, layout=layout, context=call.context, dtype=dtype)
        self.policy_weight = at(aggregation_weights(mask, **weigh)) * upstream
        self.importance = None
        if cfg.use_importance_sampling_correction and prev is not None:  # else per chunk, from curr
            self.importance = at(self._importance_weights(prev, inputs.generation_logprobs, mask, layout, call))
        self.kl_weight = self.reference = None
        if cfg.kl_in_loss:
            kl_mask = unmasked_by_filter if self.filtered else mask
            self.kl_weight = at(aggregation_weights(kl_mask, **weigh)) * (cfg.reference_policy_kl_penalty * upstream)
            self.reference = at(inputs.reference_policy_logprobs)
        self.nll_weight = None
        if cfg.positive_example_nll_weight > 0:
            positive = mask * layout.broadcast((inputs.rewards > 0).to(mask.dtype))
            count = torch.as_tensor(tokens, device=mask.device).to(dtype).clamp(min=1)
            self.nll_weight = at(positive.to(dtype)) / count * (cfg.positive_example_nll_weight * upstream)

    def _importance_weights(self, prev, generation, mask, layout, call: LossCall | None = None) -> torch.Tensor:
        cfg = self.config
        return importance_weights(prev, generation, mask, cfg.truncated_importance_sampling,
                                  sequence_level=cfg.sequence_level_importance_ratio,
                                  sequence_weight=cfg.sequence_level_importance_weight, layout=layout,
                                  context=None if call is None else call.context).weights

    def __call__(self, chunk: Chunk, values: RowValues) -> RowGradients:
        cfg, sl = self.config, chunk.rows
        curr = values.logprob.to(self.dtype)
        if self.prev is not None:
            prev = self.prev[sl]
        elif self.method is not None:
            prev = interpolated_prev(self.method, curr, self.generation[sl], self.alpha[sl])
        else:
            prev = curr.detach()
        kept = ~(torch.isneginf(curr) | torch.isneginf(prev))
        curr, prev = torch.where(kept, curr, 0.0), torch.where(kept, prev, 0.0)
        grad = self._policy_derivative(curr, prev, sl)
        if cfg.use_importance_sampling_correction:
            grad = grad * (self.importance[sl] if self.importance is not None else
                           self._importance_weights(prev[None], self.generation[sl][None], kept[None].to(curr.dtype),
                                                    None)[0])
        grad = grad * self.policy_weight[sl]
        grad_unfiltered = None
        if self.kl_weight is not None:
            if self.filtered:
                unfiltered = values.unfiltered.to(self.dtype)
                grad_unfiltered = self.kl_weight[sl] * self._kl_derivative(unfiltered, sl)
            else:
                grad = grad + self.kl_weight[sl] * self._kl_derivative(curr, sl)
        if self.nll_weight is not None:
            grad = grad - self.nll_weight[sl]
        kept = kept.to(grad.dtype)
        grad_entropy = None
        if cfg.entropy_coef != 0:
            grad_entropy = (-cfg.entropy_coef) * self.policy_weight[sl] * kept
        return RowGradients(grad * kept, grad_entropy, grad_unfiltered)

    def _policy_derivative(self, curr: torch.Tensor, prev: torch.Tensor, sl: slice) -> torch.Tensor:
        """d(the per-token policy term)/d(curr), as autograd differentiates `ClippedPGLoss._policy_term`."""
        cfg, negative = self.config, self.negative_advantage[sl]
        if cfg.disable_ppo_ratio:
            return negative.to(curr.dtype).expand_as(curr)
        ratio = torch.exp(curr - prev)
        low, high = 1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max
        clamped = ratio.clamp(low, high)
        if cfg.use_cispo:
            return negative * clamped
        unclipped, clipped = negative * ratio, negative * clamped
        # max(unclipped, clipped) passes -A r where the unclipped side wins, or where the ratio lies within the clip
        # bounds (bounds included: the sides tie there, each carrying half of the same slope); a clipped side that
        # wins outside them is flat. A tie outside the bounds has A = 0, a slope of 0. NaN stays NaN (times 0 or 1).
        passes = (unclipped > clipped) | ((ratio >= low) & (ratio <= high))
        grad = unclipped * passes.to(ratio.dtype)
        if cfg.ratio_clip_c is not None:
            loss = torch.maximum(unclipped, clipped)
            dual = negative * cfg.ratio_clip_c
            below = (loss < dual).to(ratio.dtype) + (loss == dual).to(ratio.dtype) * 0.5
            grad = torch.where(self.advantage[sl] < 0, grad * below, grad)
        return grad

    def _kl_derivative(self, curr: torch.Tensor, sl: slice) -> torch.Tensor:
        """d(the weighted, clamped per-token KL)/d(curr), as autograd differentiates `ClippedPGLoss._kl`."""
        cfg = self.config
        log_ratio = self.reference[sl] - curr
        inside = None
        if cfg.kl_input_clamp_value is not None:
            bound = cfg.kl_input_clamp_value
            inside = (log_ratio >= -bound) & (log_ratio <= bound)
            log_ratio = log_ratio.clamp(-bound, bound)
        if cfg.reference_policy_kl_type == "k1":
            estimate, slope = -log_ratio, -torch.ones_like(log_ratio)
        elif cfg.reference_policy_kl_type == "k2":
            estimate, slope = 0.5 * log_ratio.square(), log_ratio
        else:  # k3
            ratio = torch.exp(log_ratio)
            estimate, slope = ratio - 1 - log_ratio, ratio - 1
        grad, value = estimate - slope, estimate  # the score-function term and the path through log_ratio
        if cfg.use_on_policy_kl_approximation:
            weight = finite_or_zero(torch.exp(curr - self.generation[sl]))
            grad, value = weight * grad, weight * estimate
        if inside is not None:
            grad = grad * inside.to(grad.dtype)
        if cfg.kl_output_clamp_value is not None:
            bound = cfg.kl_output_clamp_value
            grad = grad * ((value >= -bound) & (value <= bound)).to(grad.dtype)
        return grad
