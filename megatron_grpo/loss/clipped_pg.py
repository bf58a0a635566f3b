"""`ClippedPGLoss`: the clipped policy-gradient loss on vocab-sharded logits.

Per trained token `t` (ratio `r = exp(curr - prev)`, advantage `A`):

    loss_t = w_t * max(-A r, -A clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max))     (PPO / GRPO / DAPO)
             ... then min(., -A ratio_clip_c) where A < 0                            (dual clip)
           + reference_policy_kl_penalty * clamp_out(v_t * exp(curr - sg(curr)) * KL_t)   (KL to the reference)
           + positive_example_nll_weight * (-curr) on samples with reward > 0        (VAPO)
           - entropy_coef * H_t                                                      (entropy bonus)

`disable_ppo_ratio` replaces the clipped term by `-A curr` (REINFORCE / RLOO); `use_cispo` by
`-A sg(clip(r)) curr` (CISPO). With `sequence_level_importance_ratio` (GSPO) `r` is the sequence's
`exp(mean over its trained tokens of (curr - prev))`, differentiable through every token. `w_t` are the detached
importance-sampling weights (see `importance.py`; 1 without the correction), `v_t = sg(exp(curr - generation))`
with the on-policy KL approximation (else 1), and `exp(curr - sg(curr))` (value 1) keeps the KL's score-function
gradient; the KL follows NeMo-RL's `calculate_kl` (see `kl.py`). A trained token whose current (or prev) logprob
is -inf, a target outside the kept set of a top-k / top-p filtered distribution, is dropped from every term but
the KL, which reads unfiltered current logprobs, and is counted in `filtered_out_tokens`; the global counts that
normalise the loss still include it.
The per-token losses are reduced by `loss_agg_mode` with global normalisation (`reductions.aggregate_loss`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import partial

import torch

from megatron_grpo.loss.batch import BatchRequirements, LossBatch, validate_batch
from megatron_grpo.loss.call import LossCall, PrevSource
from megatron_grpo.loss.config import ClippedPGLossConfig
from megatron_grpo.loss.fused_head import RowGradient, SequenceAutograd, Upstream, loss_fused_linear
from megatron_grpo.loss.importance import ImportanceWeights, finite_or_zero, importance_weights
from megatron_grpo.loss.kept_set_batch import KEPT_SET_OFFSETS, kept_set_of, without_kept_set
from megatron_grpo.loss.kl import kl_estimate
from megatron_grpo.loss.logprob_error_mask import mask_by_logprob_error
from megatron_grpo.loss.metrics import METRIC_AGGREGATION, NORMALISER, Aggregation
from megatron_grpo.loss.packing import SequenceLayout
from megatron_grpo.loss.prev_approximation import (
    VERSION_KEY,
    PrevApproximation,
    StepVersions,
    approximate_prev,
    approximation_errors,
    check_generation_logprobs,
    interpolation_weights,
)
from megatron_grpo.loss.reductions import (
    Count,
    aggregate_loss,
    sequences_with_tokens,
    token_max,
    token_mean,
    token_mean_per_sequence,
    token_min,
)
from megatron_grpo.loss.token_gradient import ClosedFormGradient, obstacle
from megatron_grpo.ops.context_shard import ContextShard
from megatron_grpo.ops.core.backends import Implementation
from megatron_grpo.ops.core.dtypes import compute_dtype, in_compute_dtype
from megatron_grpo.ops.current import (
    CurrentLogprobs,
    HiddenStates,
    KeptSetMetrics,
    ModelOutput,
    current_logprobs,
    kept_set_metrics,
)
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet
from megatron_grpo.ops.vocab_shard import VocabShard

RATIO_BAND = (0.9, 1.1)  # gen_ratio_outside_band: the band of exp(prev - generation) TRL's and vLLM's reports use


@dataclasses.dataclass(frozen=True)
class _PolicyTerm:
    per_token_loss: torch.Tensor  # before importance weighting
    ratio: torch.Tensor
    clamped_ratio: torch.Tensor


class ClippedPGLoss:
    """Callable loss: `loss, metrics = loss_fn(logits, batch, global_valid_tokens=..., global_valid_seqs=...)`;
    `loss_fn.on_hidden_states(hidden, weight, batch, ...)` from final hidden states without logits; or
    `loss_fn(None, batch, curr_logprobs=..., curr_entropy=..., ...)` with precomputed current logprobs. Every entry
    takes its current tensors from `megatron_grpo.ops.current_logprobs` (or the loss-fused path's chunks) and then
    runs the same per-token code.

    The batch is padded (`[B, S]` per-token tensors) or packed (`[1, T]` with `cu_seqlens`, `[N]` per-sequence
    tensors; `loss.packing`): every term and metric is the same on the same sequences either way, per-token metrics
    (`curr_logprobs`, `prev_logprobs`) come back in the batch's own layout.

    `loss` is this microbatch's share of the step's globally normalised loss. `metrics` maps the names in
    `metrics.METRIC_AGGREGATION` to detached tensors (`self.metric_aggregation` says how each aggregates):
    - `loss`, `num_valid_tokens`, `num_valid_samples` (sequences with a trained token);
    - `filtered_out_tokens`: trained tokens dropped because their current or prev logprob is -inf (top-k / top-p);
      every token mean below is over the remaining tokens, except `kl_penalty`, over the tokens the KL reads;
    - `probs_ratio` (token mean), `probs_ratio_min`, `probs_ratio_max`, `probs_ratio_clamped` and its
      `probs_ratio_clamped_min` / `_max` (NeMo-RL's names);
    - `clip_fraction_lower` / `clip_fraction_upper`: fraction of trained tokens whose ratio was raised to
      `1 - ratio_clip_min` / lowered to `1 + ratio_clip_max` (0 with `disable_ppo_ratio`: nothing is clipped);
    - `kl_penalty`: token mean of the weighted, clamped KL estimate (before the penalty factor), only when the loss
      carries a KL term;
    - `entropy`: token mean of the policy's exact entropy from the op, always (one more partial per row; it
      carries gradient only when `entropy_coef != 0`); with `generation_logprobs` also `approx_entropy`,
      NeMo-RL's `mean(-exp(curr - generation) * curr)`;
    - `positive_nll_loss`: the VAPO term before its weight, only when `positive_example_nll_weight > 0`;
    - with `generation_logprobs`: `token_mult_prob_error` (mean `exp(|generation - prev|)`), `gen_kl_error`
      (KL(generation || prev) with the configured estimator), both over tokens with a finite generation logprob
      (`nonfinite_generation_logprobs` counts the others), `sampling_importance_ratio` (mean weight after
      truncation) and, with truncation, `is_oob_ratio`: the fraction of trained tokens out of bounds, or for
      `seq-mask-tis` the fraction of sequences rejected (then `is_oob_token_ratio` is the token fraction);
      `gen_ratio_outside_band`: the fraction of those tokens whose ratio `exp(prev - generation)` lies outside
      [0.9, 1.1] (`RATIO_BAND`);
    - with the rollout engine's kept sets in the batch (`kept_set_offsets`, `kept_set_ids`; `LossCall.kept_set_metrics`,
      on by default): `kept_set_mass`, the token mean of the engine's set's probability under this forward's
      unfiltered distribution (at the sampling temperature), and `kept_set_differs`, the fraction of trained tokens
      whose set recomputed from this forward's logits (top-k / top-p) differs from the engine's
      (`ops.kept_set_metrics`: forward-only op calls, two when the loss trains on one of the sets); with
      `generation_logprobs` also `kept_set_replayed_ratio_outside_band` and `kept_set_recomputed_ratio_outside_band`,
      the fraction of those tokens whose `exp(curr - generation)` lies outside [0.9, 1.1] with curr over the engine's
      set and over the recomputed one (ratio 0, outside, for a token the recomputed set drops): both ways on the
      same tokens and weights, whichever the loss trains;
    - `curr_logprobs` `[B, S]`: the current logprobs (0 where a token is not trained or was filtered out);
      `prev_logprobs` `[B, S]` too when prev is approximated (`prev_approximation`);
    - with `compare_approximations`: `prox_<method>_<kind>` for each approximation of `loss.prev_approximation`
      against the batch's computed prev (AReaL's `metrics` mode): `abs_error`, `rel_error`, `is_weight_abs_error`,
      `ratio_abs_error`, token means.
    - with `seq_logprob_error_threshold`: NeMo-RL's `num_masked_seqs_by_logprob_error`, `{max,mean,min}_seq_mult_
      prob_error` and their `_after_mask` twins, `masked_correct_pct` (with the batch's `rewards`), and this project's
      `masked_seqs_by_logprob_error_fraction` and `num_valid_samples_before_mask` (`loss.logprob_error_mask`); every
      other metric is over the sequences the mask kept;
    - with `defer_normalisation`: `loss_normaliser`, the count the step divides the summed loss by.
    The mismatch metrics always use the prev logprobs the ratio used, `curr.detach()` when the pass was skipped.
    With prev from the generation logprobs they would compare prev with itself, so they are absent.
    """

    def __init__(self, config: ClippedPGLossConfig) -> None:
        self.config = config

    @property
    def metric_aggregation(self) -> Mapping[str, Aggregation]:
        """How each metric aggregates over microbatches and DP ranks: `METRIC_AGGREGATION`, except that
        `is_oob_ratio` is a mean over sequences for `seq-mask-tis`."""
        if self.config.truncated_importance_sampling.type != "seq-mask-tis":
            return METRIC_AGGREGATION
        return {**METRIC_AGGREGATION, "is_oob_ratio": Aggregation.SEQUENCE_MEAN}

    def __call__(
        self,
        logits: torch.Tensor | None,
        batch: Mapping[str, torch.Tensor],
        *,
        global_valid_tokens: Count | None = None,
        global_valid_seqs: Count | None = None,
        shard: VocabShard | None = None,
        distribution: SamplingDistribution | None = None,
        prev_logprobs_from_current: bool | None = None,
        prev_approximation: PrevApproximation | None = None,
        compare_approximations: StepVersions | None = None,
        seq_logprob_error_threshold: float | None = None,
        defer_normalisation: bool | None = None,
        curr_logprobs: torch.Tensor | None = None,
        curr_entropy: torch.Tensor | None = None,
        curr_unfiltered_logprobs: torch.Tensor | None = None,
        inplace_backward: bool | None = None,
        check_inputs: bool | None = None,
        context: ContextShard | None = None,
        kept_set_metrics: bool | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This microbatch's globally normalised loss and its detached metrics (see the class docstring), from the
        model's logits `[B, S, V_local]` (the output tensor a Megatron `forward_step` hands its loss function).

        The keywords are the fields of `LossCall`, each None for its default there:
        `shard`: where the logits' vocab columns sit (`megatron_grpo.ops.VocabShard`); default unsharded.
        `distribution`: the policy trained, the distribution the rollouts were sampled from
        (`megatron_grpo.ops.SamplingDistribution`: 1 / temperature applied inside the kernels, the top-k / top-p
        filter); default softmax(logits). The policy term trains the filtered distribution; the KL to the
        (unfiltered) reference reads unfiltered current logprobs, as NeMo-RL does.
        Where prev comes from (`PrevSource`): `batch['prev_logprobs']` (a prev pass); `curr.detach()` when
        `prev_logprobs_from_current` is true, and by default (None) exactly when `loss_fn.force_on_policy_ratio` is
        set, as in NeMo-RL (an explicit False with that key set is a contradiction, a ValueError); or, with
        `prev_approximation`, the generation logprobs or AReaL's interpolation (`loss.prev_approximation`), which
        needs `batch['rollout_weight_version']` `[B]` for the interpolations. `compare_approximations` (the step's
        versions), with prev from the batch, adds the approximations' errors against it to the metrics.
        `seq_logprob_error_threshold` (NeMo-RL's key, default None: off): the sequences whose mean
        `exp(|generation - prev|)` over their trained tokens exceeds it leave the loss, its metrics and the counts
        (`loss.logprob_error_mask`, with NeMo-RL's metrics); prev is `batch['prev_logprobs']` when given, else
        curr.detach(). It needs `defer_normalisation=True`: the counts over the step are known only once every
        microbatch's forward has masked its sequences.
        `defer_normalisation` (default False): the global counts are None, and the loss and its normalised-sum
        metrics are sums; `metrics['loss_normaliser']` is the count of this microbatch they are to be divided by
        (trained tokens for `token-mean`, sequences with a trained token for the `seq-mean-*` modes), and the step
        divides once by its sum over the step (`megatron.apply_deferred_normalisation`). With VAPO's NLL and a
        `seq-mean-*` mode the loss has two divisors: a ValueError.
        `inplace_backward` (default False): the logits are this loss's alone (nothing reads them after it, as in a
        Megatron forward step): backward writes their gradient into their buffer (`vocab_parallel_logprobs`), guarded
        by autograd's version counter; taken where one op reads the logits (not with a KL under a filter, which
        reads them twice).

        `logits=None` with `curr_logprobs` and `curr_entropy` (`[B, S]`, differentiable, aligned with `input_ids`
        as the ops' `shift=True` aligns them, e.g. from `megatron_grpo.ops.current_logprobs`): the current logprobs
        and entropies are taken as given (and zeroed off the trained-token mask) instead of computed; everything
        after is the same code. `distribution` then says which one they are of: with a filter and a KL in the loss,
        `curr_unfiltered_logprobs` are required (the KL to the unfiltered reference reads them).
        `check_inputs=False` (default True) skips the checks of values that cost a host sync (target ids within the
        vocab, finite advantages and rewards, the counts against the batch), for a caller that checked its batch
        once (the Megatron train step); keys, shapes, dtypes and the counts' signs are always checked. A negative or
        non-finite count is a ValueError naming it; so is a count of 0 for a microbatch that has something to train.

        `context` (`ops.ContextShard`, context parallelism): the batch is this CP rank's row-aligned share of every
        sequence (targets shifted before the split: `batch['labels']`, Megatron's convention; `logits` and the
        per-token tensors belong to the labels' rows). The loss is this rank's share, normalised by the same global
        counts; sequence sums (GSPO, sequence-level IS, `seq-mask-tis`, sequence token counts) are over the CP
        group, and `num_valid_samples` is counted by one rank of it. The Megatron step splits with
        `megatron_grpo.megatron.split_for_context_parallel`, padded or packed (a packed share carries its own
        `cu_seqlens`, each sequence `1 / CP` of its tokens).
        """
        call = LossCall.of(global_valid_tokens, global_valid_seqs, shard=shard, distribution=distribution,
                           prev=PrevSource(prev_logprobs_from_current, prev_approximation, compare_approximations),
                           seq_logprob_error_threshold=seq_logprob_error_threshold,
                           defer_normalisation=defer_normalisation, inplace_backward=inplace_backward,
                           check_inputs=check_inputs, context=context, kept_set_metrics=kept_set_metrics)
        precomputed = self._check_precomputed(logits, curr_logprobs, curr_entropy, curr_unfiltered_logprobs,
                                              filtered=call.distribution.filtered)
        return self._evaluate(logits, batch, call, precomputed=precomputed)

    def on_hidden_states(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        *,
        global_valid_tokens: Count | None = None,
        global_valid_seqs: Count | None = None,
        shard: VocabShard | None = None,
        distribution: SamplingDistribution | None = None,
        prev_logprobs_from_current: bool | None = None,
        prev_approximation: PrevApproximation | None = None,
        compare_approximations: StepVersions | None = None,
        seq_logprob_error_threshold: float | None = None,
        defer_normalisation: bool | None = None,
        loss_fused: bool | None = None,
        chunk_rows: int | None = None,
        implementation: Implementation | None = None,
        check_inputs: bool | None = None,
        context: ContextShard | None = None,
        upstream_gradient: float | torch.Tensor | None = None,
        kept_set_metrics: bool | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The same loss and metrics from final hidden states `[B, S, H]` and this rank's `[V_local, H]` output
        weight shard (logits `hidden @ weight.T`, under `distribution`), without materialising the logits. `hidden`'s
        gradient is this rank's partial sum over its vocab shard (the caller reduces it over TP).

        `loss_fused` (default True): the loss-fused head (`megatron_grpo.loss.fused_head`), the loss's gradient
        computed chunk by chunk in forward, 3 GEMMs instead of 4, exact for every setting of this loss and any
        distribution (top-k / top-p, or the rollout engine's kept sets replayed): chunks of trained rows with the
        gradient in closed form (`loss.token_gradient`), or chunks of whole sequences where a setting couples a
        sequence's tokens. `upstream_gradient`: d(objective)/d(loss), bound up front (`LossCall.upstream_gradient`):
        dH and dW are final after forward, dW in Megatron DDP's `main_grad` where the weight has one.
        `loss_fused=False`: the current logprobs from `vocab_parallel_linear_logprobs` (backward recomputes each
        chunk's logits). The other keywords as for `__call__` (the fields of `LossCall`); the batch's values are
        checked once here, never per chunk."""
        call = LossCall.of(global_valid_tokens, global_valid_seqs, shard=shard, distribution=distribution,
                           prev=PrevSource(prev_logprobs_from_current, prev_approximation, compare_approximations),
                           seq_logprob_error_threshold=seq_logprob_error_threshold,
                           defer_normalisation=defer_normalisation, loss_fused=loss_fused, chunk_rows=chunk_rows,
                           implementation=implementation, check_inputs=check_inputs, context=context,
                           upstream_gradient=upstream_gradient, kept_set_metrics=kept_set_metrics)
        return self.step_loss(HiddenStates(hidden, weight), batch, call)

    def step_loss(self, output: ModelOutput, batch: Mapping[str, torch.Tensor],
                  call: LossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The `StepLoss` entry the Megatron step calls: the loss of the model's `output` (its logits, or
        `HiddenStates`) on `batch`, as `call` says."""
        if isinstance(output, HiddenStates) and call.loss_fused:
            return self._loss_fused(output, batch, call)
        return self._evaluate(output, batch, call)

    def _loss_fused(self, output: HiddenStates, batch: Mapping[str, torch.Tensor],
                    call: LossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss-fused head: the batch checked once, then its chunks' gradients (`_HeadOfClippedPG`)."""
        prev_from_current = self._prev_from_current(call.prev)
        self._check_deferral(call)
        inputs = validate_batch(batch, output, self._requirements(prev_from_current, call),
                                check_values=call.check_inputs, row_aligned=call.context is not None)
        self._check_counts(call, inputs)
        unchecked = dataclasses.replace(call, check_inputs=False)
        kept = self._kept_set(batch, call)
        alpha = self._interpolation_weights(batch, inputs, call.prev.approximation, None)
        true_vocab_size = call.shard.resolve(output.weight.shape[0]).true_vocab_size
        head = _HeadOfClippedPG(self, without_kept_set(batch), inputs, unchecked, prev_from_current, alpha,
                                dtype=compute_dtype(output.hidden.dtype),
                                filter_active=call.distribution.restricts(true_vocab_size))
        loss, metrics = loss_fused_linear(
            head, output.hidden, output.weight, inputs.targets, inputs.layout, shard=call.shard,
            distribution=call.distribution, chunk_rows=call.chunk_rows, check_inputs=call.check_inputs,
            implementation=call.implementation, shift=call.context is None, context=call.context,
            upstream_gradient=call.upstream_gradient, kept_set=kept if call.distribution.replay_kept_set else None)
        if kept is not None and call.kept_set_metrics:
            metrics.update(_kept_set_metric_means(kept_set_metrics(
                output, inputs.targets, kept, shard=call.shard, distribution=call.distribution,
                check_inputs=call.check_inputs, chunk_rows=call.chunk_rows, implementation=call.implementation,
                shift=call.context is None), inputs.mask, inputs.generation_logprobs))
        return loss, metrics

    @staticmethod
    def _kept_set(batch: Mapping[str, torch.Tensor], call: LossCall) -> KeptSet | None:
        """The batch's kept sets (`loss.kept_set_batch`), which a replaying distribution requires."""
        kept = kept_set_of(batch)
        if kept is None and call.distribution.replay_kept_set:
            raise ValueError(f"batch[{KEPT_SET_OFFSETS!r}] is missing: required by distribution.replay_kept_set (the "
                             "rollout engine's kept set of every token, docs/design.md's batch contract)")
        return kept

    def _evaluate(
        self,
        output: ModelOutput | None,
        batch: Mapping[str, torch.Tensor],
        call: LossCall,
        precomputed: CurrentLogprobs | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of every entry: the current tensors of the model's `output` (`ops.current_logprobs`) or the
        `precomputed` ones, then the per-token terms, the reduction and the metrics."""
        cfg, prev_source, context = self.config, call.prev, call.context
        prev_from_current = self._prev_from_current(prev_source)
        self._check_deferral(call)
        given = None if precomputed is None else {"curr_logprobs": precomputed.logprobs,
                                                  "curr_entropy": precomputed.entropy}
        inputs = validate_batch(batch, output, self._requirements(prev_from_current, call), current=given,
                                check_values=call.check_inputs, row_aligned=context is not None)
        self._check_counts(call, inputs)
        kept = self._kept_set(batch, call) if precomputed is None else None
        current = precomputed if precomputed is not None else current_logprobs(
            output, inputs.targets, shard=call.shard, distribution=call.distribution, shift=context is None,
            with_unfiltered=cfg.kl_in_loss, inplace_backward=call.inplace_backward, check_inputs=call.check_inputs,
            chunk_rows=call.chunk_rows, implementation=call.implementation, kept_set=kept,
            with_kept_set_metrics=call.kept_set_metrics)
        trained = inputs.mask.bool()
        zero = torch.zeros((), dtype=torch.float32, device=trained.device)
        curr, entropy = (torch.where(trained, in_compute_dtype(values), zero)
                         for values in (current.logprobs, current.entropy))
        curr_unfiltered = None  # the KL's current logprobs, where a sampling filter makes them differ
        if cfg.kl_in_loss and current.unfiltered_logprobs is not None:
            curr_unfiltered = torch.where(trained, in_compute_dtype(current.unfiltered_logprobs), zero)
        masking = None
        if call.seq_logprob_error_threshold is not None:  # before anything reads the mask or the counts
            masking = mask_by_logprob_error(
                curr.detach() if inputs.prev_logprobs is None else inputs.prev_logprobs, inputs.generation_logprobs,
                inputs.mask, call.seq_logprob_error_threshold, inputs.layout, context=context,
                rewards=_optional_rewards(batch, inputs))
            inputs = dataclasses.replace(inputs, mask=masking.mask)
        approximation, compare = prev_source.approximation, prev_source.compare_with
        alpha = self._interpolation_weights(batch, inputs, approximation, compare)
        if approximation is not None:
            prev = approximate_prev(approximation.method, curr, inputs.generation_logprobs, inputs.mask, alpha,
                                    inputs.layout)
        else:
            prev = curr.detach() if prev_from_current else inputs.prev_logprobs
        errors = None
        if compare is not None:
            errors = approximation_errors(prev, curr, inputs.generation_logprobs, inputs.mask, alpha, inputs.layout)
        kept = ~(torch.isneginf(curr) | torch.isneginf(prev))  # -inf: target outside a top-k / top-p kept set
        zero = torch.zeros((), dtype=curr.dtype, device=curr.device)
        curr, prev = torch.where(kept, curr, zero), torch.where(kept, prev, zero)
        mask = inputs.mask * kept
        policy = self._policy_term(curr, prev, inputs.advantages, mask, inputs.layout, context)
        weights = self._importance_weights(prev, inputs, mask, context)
        per_token_loss = policy.per_token_loss
        if cfg.use_importance_sampling_correction:
            per_token_loss = weights.weights * per_token_loss
        if cfg.entropy_coef != 0:
            per_token_loss = per_token_loss - cfg.entropy_coef * entropy
        deferred = call.defer_normalisation  # sums now, divided once by the step (counts of 1 here)
        valid_tokens, valid_seqs = (1, 1) if deferred else (call.global_valid_tokens, call.global_valid_seqs)
        aggregate = partial(
            aggregate_loss,
            mode=cfg.loss_agg_mode,
            global_valid_tokens=valid_tokens,
            global_valid_seqs=valid_seqs,
            max_response_length=cfg.max_response_length,
            layout=inputs.layout,
            context=context,
        )
        loss = aggregate(per_token_loss, mask)
        kl = kl_mask = None
        if cfg.kl_in_loss:
            # The unfiltered current logprobs are finite at filtered-out tokens, so the KL keeps them (NeMo-RL);
            # without a filter the KL reduces over the same tokens as the policy term.
            kl_mask = mask if curr_unfiltered is None else inputs.mask
            kl = self._kl(curr if curr_unfiltered is None else curr_unfiltered, inputs)
            loss = loss + cfg.reference_policy_kl_penalty * aggregate(kl, kl_mask)
        nll = None
        if cfg.positive_example_nll_weight > 0:
            nll = self._positive_example_nll(curr, inputs.rewards, mask, valid_tokens, inputs.layout)
            loss = loss + cfg.positive_example_nll_weight * nll
        with torch.no_grad():
            metrics = self._metrics(loss, curr, prev, inputs, mask, policy, weights, kl, kl_mask, entropy, nll, context,
                                    prev_is_generation=approximation is not None
                                    and approximation.method == "generation")
            if approximation is not None:
                metrics["prev_logprobs"] = prev.detach()
            if masking is not None:
                metrics.update(masking.metrics)
            if deferred:
                metrics[NORMALISER] = self._normaliser(inputs, context)
            if errors is not None:
                metrics.update({name: token_mean(value.to(torch.float32), mask) for name, value in errors.items()})
            if current.kept_set is not None:
                metrics.update(_kept_set_metric_means(current.kept_set, inputs.mask, inputs.generation_logprobs))
        return loss, metrics

    def _check_deferral(self, call: LossCall) -> None:
        """What the sequence mask and deferred normalisation cannot serve, each a ValueError naming the keys."""
        cfg = self.config
        if call.defer_normalisation and cfg.positive_example_nll_weight > 0 and cfg.loss_agg_mode != "token-mean":
            raise ValueError(f"defer_normalisation with loss_fn.positive_example_nll_weight > 0 and "
                             f"loss_fn.loss_agg_mode = {cfg.loss_agg_mode}: the step divides its loss by one count "
                             "after the last forward, but VAPO's NLL divides by the trained tokens and the seq-mean "
                             "modes by the sequences")
        if call.seq_logprob_error_threshold is not None and call.prev.approximation is not None:
            raise ValueError(f"seq_logprob_error_threshold and prev_approximation={call.prev.approximation.method!r}: "
                             "the mask compares the generation logprobs with a computed prev (a pass, or curr.detach() "
                             "where it is exact); set at most one")

    def _normaliser(self, inputs: LossBatch, context: ContextShard | None) -> torch.Tensor:
        """Deferred normalisation: the count of this microbatch (after the sequence mask) that `loss_agg_mode`
        divides by, its trained tokens or its sequences with one (reported by one rank of a CP group)."""
        if self.config.loss_agg_mode == "token-mean":
            return inputs.mask.sum()
        sequences = sequences_with_tokens(inputs.mask, inputs.layout, context=context).sum()
        return sequences if context is None or context.counts_sequences else torch.zeros_like(sequences)

    @staticmethod
    def _check_counts(call: LossCall, inputs: LossBatch) -> None:
        """With `check_inputs` (one host sync): each global count is finite, and at least what this microbatch alone
        holds (0 is an empty step, where this microbatch has nothing to train either). Deferred: no counts."""
        if not call.check_inputs or call.defer_normalisation:
            return
        mask = inputs.mask
        here = (mask.sum(), (inputs.layout.sum(mask) > 0).sum())
        given = (call.global_valid_tokens, call.global_valid_seqs)
        values = torch.stack([torch.as_tensor(v, device=mask.device).to(torch.float64).reshape(())
                              for v in (*given, *here)]).tolist()
        for name, what, count, local in (("global_valid_tokens", "trained tokens", values[0], values[2]),
                                         ("global_valid_seqs", "sequences with a trained token", values[1], values[3])):
            if not math.isfinite(count) or count < 0:
                raise ValueError(f"{name}: must be a finite count >= 0 over the whole optimizer step, got {count:g}")
            if count < local:
                raise ValueError(f"{name}: {count:g} is less than this microbatch's own {local:.0f} {what}; pass "
                                 "the count over every microbatch and data-parallel rank of the optimizer step")

    def _check_precomputed(
        self, logits: torch.Tensor | None, curr_logprobs: torch.Tensor | None, curr_entropy: torch.Tensor | None,
        curr_unfiltered_logprobs: torch.Tensor | None, *, filtered: bool,
    ) -> CurrentLogprobs | None:
        """The precomputed current tensors, or None when the loss computes them from logits."""
        given = {"curr_logprobs": curr_logprobs, "curr_entropy": curr_entropy}
        if logits is not None:
            extra = [name for name, value in {**given, "curr_unfiltered_logprobs": curr_unfiltered_logprobs}.items()
                     if value is not None]
            if extra:
                raise ValueError(f"{' and '.join(extra)}: give either logits or precomputed current logprobs, "
                                 "not both")
            return None
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"{' and '.join(missing)}: required when logits is None")
        if curr_unfiltered_logprobs is not None and not filtered:
            raise ValueError("curr_unfiltered_logprobs: only with a top-k / top-p distribution (without a filter "
                             "curr_logprobs are the unfiltered ones)")
        if filtered and self.config.kl_in_loss and curr_unfiltered_logprobs is None:
            raise ValueError("curr_unfiltered_logprobs: required with a top-k / top-p distribution and a KL penalty "
                             "in the loss (the KL to the unfiltered reference reads unfiltered current logprobs)")
        return CurrentLogprobs(logprobs=curr_logprobs, entropy=curr_entropy,
                               unfiltered_logprobs=curr_unfiltered_logprobs)

    def _prev_from_current(self, prev: PrevSource) -> bool:
        """Whether prev is curr.detach(): as `prev.from_current` says, or by default as `loss_fn.force_on_policy_ratio`
        says (NeMo-RL's meaning of the key). Contradictory requests are a ValueError naming both."""
        given, approximation, compare = prev.from_current, prev.approximation, prev.compare_with
        forced = self.config.force_on_policy_ratio
        if forced and given is False:
            raise ValueError("loss_fn.force_on_policy_ratio is true but prev_logprobs_from_current=False: the key "
                             "makes the loss take prev = curr.detach(); leave prev_logprobs_from_current unset "
                             "(None) or pass the plan's prev_from_current")
        from_current = forced if given is None else given
        if approximation is not None and (from_current or forced):
            which = "loss_fn.force_on_policy_ratio" if forced else "prev_logprobs_from_current=True"
            raise ValueError(f"prev_approximation={approximation.method!r} and {which}: prev comes from one place; "
                             "set at most one")
        if approximation is not None and approximation.method == "generation" and \
                self.config.use_importance_sampling_correction:
            raise ValueError("prev_approximation='generation' and loss_fn.use_importance_sampling_correction: with "
                             "prev = the generation logprobs the IS weights exp(prev - generation) are 1; set at "
                             "most one")
        if compare is not None and (from_current or approximation is not None):
            raise ValueError("compare_approximations: compares the approximations with a computed prev pass "
                             "(batch['prev_logprobs']), but prev comes from "
                             + ("curr.detach()" if from_current else f"prev_approximation={approximation.method!r}"))
        return from_current

    def _interpolation_weights(self, batch: Mapping[str, torch.Tensor], inputs: LossBatch,
                               approximation: PrevApproximation | None,
                               compare: StepVersions | None) -> torch.Tensor | None:
        """`[B]` float64 alpha of each sample when an interpolation (or a comparison with them) needs it."""
        versions = compare if compare is not None else (approximation.versions if approximation else None)
        if versions is None:
            return None
        user = ("compare_approximations" if compare is not None
                else f"prev_approximation={approximation.method!r}")
        if VERSION_KEY not in batch:
            raise ValueError(f"batch[{VERSION_KEY!r}] is missing: it is required by {user} (the weight version "
                             "that generated each sample)")
        behave = batch[VERSION_KEY]
        if not isinstance(behave, torch.Tensor):
            raise ValueError(f"batch[{VERSION_KEY!r}]: expected a tensor of shape [{inputs.layout.num_sequences}], "
                             f"got {type(behave).__name__}")
        inputs.layout.check_per_sequence(VERSION_KEY, behave)
        if compare is not None:
            check_generation_logprobs(inputs.generation_logprobs, inputs.mask, user)
        return interpolation_weights(behave, versions)

    def _requirements(self, prev_from_current: bool, call: LossCall) -> BatchRequirements:
        """Which optional batch keys this call needs, each with the reason a missing one's error gives."""
        cfg, approximation, compare = self.config, call.prev.approximation, call.prev.compare_with
        generation_users = []
        if call.seq_logprob_error_threshold is not None:
            generation_users.append("seq_logprob_error_threshold")
        if cfg.use_importance_sampling_correction:
            generation_users.append("loss_fn.use_importance_sampling_correction")
        if cfg.kl_in_loss and cfg.use_on_policy_kl_approximation:
            generation_users.append("loss_fn.use_on_policy_kl_approximation")
        if approximation is not None:
            generation_users.append(f"prev_approximation={approximation.method!r}")
        if compare is not None:
            generation_users.append("compare_approximations")
        prev_reason = ("unless prev_logprobs_from_current=True (or loss_fn.force_on_policy_ratio, or a "
                       "prev_approximation)")
        reference_reason = "because loss_fn.reference_policy_kl_penalty > 0 and loss_fn.kl_in_sequence_reward is false"
        return BatchRequirements(
            prev_logprobs=None if prev_from_current or approximation is not None else prev_reason,
            generation_logprobs=f"by {' and '.join(generation_users)}" if generation_users else None,
            reference_policy_logprobs=reference_reason if cfg.kl_in_loss else None,
            rewards="because loss_fn.positive_example_nll_weight > 0" if cfg.positive_example_nll_weight > 0 else None,
        )

    def _policy_term(
        self, curr: torch.Tensor, prev: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
        layout: SequenceLayout, context: ContextShard | None = None,
    ) -> _PolicyTerm:
        cfg = self.config
        log_ratio = curr - prev
        if cfg.sequence_level_importance_ratio:
            log_ratio = layout.broadcast(token_mean_per_sequence(log_ratio, mask, layout, context=context))
        ratio = torch.exp(log_ratio)
        if cfg.disable_ppo_ratio:
            return _PolicyTerm(per_token_loss=-advantages * curr, ratio=ratio, clamped_ratio=ratio)
        clamped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        if cfg.use_cispo:  # the clipped ratio is a detached weight of the REINFORCE term
            return _PolicyTerm(per_token_loss=-advantages * clamped.detach() * curr, ratio=ratio, clamped_ratio=clamped)
        clipped_loss = torch.maximum(-advantages * ratio, -advantages * clamped)
        if cfg.ratio_clip_c is not None:
            dual_clipped = torch.minimum(clipped_loss, -advantages * cfg.ratio_clip_c)
            clipped_loss = torch.where(advantages < 0, dual_clipped, clipped_loss)
        return _PolicyTerm(per_token_loss=clipped_loss, ratio=ratio, clamped_ratio=clamped)

    def _importance_weights(
        self, prev: torch.Tensor, inputs: LossBatch, mask: torch.Tensor, context: ContextShard | None = None
    ) -> ImportanceWeights | None:
        if inputs.generation_logprobs is None:
            return None
        return importance_weights(
            prev,
            inputs.generation_logprobs,
            mask,
            self.config.truncated_importance_sampling,
            sequence_level=self.config.sequence_level_importance_ratio,
            sequence_weight=self.config.sequence_level_importance_weight,
            layout=inputs.layout,
            context=context,
        )

    def _kl(self, curr: torch.Tensor, inputs: LossBatch) -> torch.Tensor:
        """Per-token KL(pi || pi_ref) estimate, weighted by the score-function (and on-policy) weight, clamped."""
        cfg = self.config
        weight = torch.exp(curr - curr.detach())
        if cfg.use_on_policy_kl_approximation:
            weight = weight * finite_or_zero(torch.exp(curr - inputs.generation_logprobs).detach())
        return kl_estimate(
            curr,
            inputs.reference_policy_logprobs,
            cfg.reference_policy_kl_type,
            input_clamp=cfg.kl_input_clamp_value,
            output_clamp=cfg.kl_output_clamp_value,
            weights=weight,
        )

    @staticmethod
    def _positive_example_nll(
        curr: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, global_valid_tokens: Count,
        layout: SequenceLayout,
    ) -> torch.Tensor:
        """VAPO's NLL of the samples with reward > 0, summed over their trained tokens / `global_valid_tokens`."""
        positive = mask * layout.broadcast((rewards > 0).to(mask.dtype))
        return aggregate_loss(
            -curr, positive, "token-mean", global_valid_tokens=global_valid_tokens, global_valid_seqs=1,
            max_response_length=None,
        )

    def _metrics(
        self,
        loss: torch.Tensor,
        curr: torch.Tensor,
        prev: torch.Tensor,
        inputs: LossBatch,
        mask: torch.Tensor,
        policy: _PolicyTerm,
        weights: ImportanceWeights | None,
        kl: torch.Tensor | None,
        kl_mask: torch.Tensor | None,
        entropy: torch.Tensor,
        nll: torch.Tensor | None,
        context: ContextShard | None = None,
        *,
        prev_is_generation: bool = False,
    ) -> dict[str, torch.Tensor]:
        ratio, clamped = policy.ratio.detach(), policy.clamped_ratio.detach()
        has_tokens = sequences_with_tokens(inputs.mask, inputs.layout, context=context)
        counted = context is None or context.counts_sequences  # one CP rank counts the sequences
        metrics = {
            "loss": loss.detach().clone(),  # Megatron divides the returned loss in place
            "num_valid_tokens": inputs.mask.sum(),
            "num_valid_samples": has_tokens.sum() if counted else torch.zeros_like(has_tokens.sum()),
            "filtered_out_tokens": inputs.mask.sum() - mask.sum(),
            "probs_ratio": token_mean(ratio, mask),
            "probs_ratio_min": token_min(ratio, mask),
            "probs_ratio_max": token_max(ratio, mask),
            "probs_ratio_clamped": token_mean(clamped, mask),
            "probs_ratio_clamped_min": token_min(clamped, mask),
            "probs_ratio_clamped_max": token_max(clamped, mask),
            "clip_fraction_lower": token_mean((clamped > ratio).to(torch.float32), mask),
            "clip_fraction_upper": token_mean((clamped < ratio).to(torch.float32), mask),
            "curr_logprobs": curr.detach(),
        }
        if kl is not None:
            metrics["kl_penalty"] = token_mean(kl.detach(), kl_mask)
        metrics["entropy"] = token_mean(entropy.detach(), mask)
        if inputs.generation_logprobs is not None:
            approx = finite_or_zero(-torch.exp(curr - inputs.generation_logprobs) * curr)
            metrics["approx_entropy"] = token_mean(approx.detach(), mask)
        if nll is not None:
            metrics["positive_nll_loss"] = nll.detach()
        if inputs.generation_logprobs is not None and not prev_is_generation:  # else prev vs itself: left out
            metrics.update(self._mismatch_metrics(prev.detach(), inputs.generation_logprobs, mask, weights,
                                                  inputs.layout, context))
        return metrics

    def _mismatch_metrics(
        self, prev: torch.Tensor, generation: torch.Tensor, mask: torch.Tensor, weights: ImportanceWeights,
        layout: SequenceLayout, context: ContextShard | None = None,
    ) -> dict[str, torch.Tensor]:
        """How far the rollout engine's logprobs are from the trainer's prev logprobs."""
        finite = mask * torch.isfinite(generation)
        safe_generation = torch.where(finite.bool(), generation, torch.zeros((), device=generation.device))
        metrics = {
            "nonfinite_generation_logprobs": mask.sum() - finite.sum(),
            "token_mult_prob_error": token_mean(torch.exp((safe_generation - prev).abs()), finite),
            "gen_kl_error": token_mean(
                kl_estimate(safe_generation, prev, self.config.reference_policy_kl_type), finite
            ),
            "sampling_importance_ratio": token_mean(weights.weights, mask),
            "gen_ratio_outside_band": token_mean(_outside_band(torch.exp(prev - safe_generation)), finite),
        }
        oob = weights.out_of_bounds
        if oob is None:
            return metrics
        if oob.dim() == 1:  # seq-mask-tis: one flag per sequence
            has_tokens = sequences_with_tokens(mask, layout, context=context)
            metrics["is_oob_ratio"] = (oob.to(torch.float32) * has_tokens).sum() / has_tokens.sum().clamp(min=1)
            metrics["is_oob_token_ratio"] = token_mean(layout.broadcast(oob.to(torch.float32)), mask)
        else:
            metrics["is_oob_ratio"] = token_mean(oob.to(torch.float32), mask)
        return metrics



def _optional_rewards(batch: Mapping[str, torch.Tensor], inputs: LossBatch) -> torch.Tensor | None:
    """The batch's per-sequence `rewards` when it carries them (the mask's `masked_correct_pct` reads them)."""
    if inputs.rewards is not None:
        return inputs.rewards
    rewards = batch.get("rewards")
    if not isinstance(rewards, torch.Tensor):
        return None
    inputs.layout.check_per_sequence("rewards", rewards)
    return rewards


class _HeadOfClippedPG:
    """`ClippedPGLoss` as the loss-fused head takes a loss (`fused_head.HeadLoss`) for one microbatch: its rows'
    gradients in closed form (`token_gradient`), or by autograd over whole sequences where its gradient couples a
    sequence's tokens, and its value and metrics from the same per-token code as every other entry."""

    def __init__(self, loss: ClippedPGLoss, batch: Mapping[str, torch.Tensor], inputs: LossBatch, call: LossCall,
                 prev_from_current: bool, alpha: torch.Tensor | None, *, dtype: torch.dtype,
                 filter_active: bool) -> None:
        self.loss, self.batch, self.inputs, self.call = loss, batch, inputs, call
        self.prev_from_current, self.alpha, self.dtype = prev_from_current, alpha, dtype
        self.coupling = obstacle(loss.config, call, prev_from_current=prev_from_current, filter_active=filter_active,
                                 prev_in_batch=inputs.prev_logprobs is not None)

    @property
    def whole_sequences(self) -> bool:
        return self.coupling is not None

    @property
    def reads_unfiltered(self) -> bool:
        return self.loss.config.kl_in_loss and self.call.distribution.filtered

    def row_gradients(self, positions: torch.Tensor, upstream: Upstream) -> RowGradient:
        if self.whole_sequences:
            return SequenceAutograd(self._sequence_loss, self.batch, self.inputs.layout, positions, upstream,
                                    self.reads_unfiltered)
        return ClosedFormGradient(self.loss.config, self.inputs, self.call, prev_from_current=self.prev_from_current,
                                  alpha=self.alpha, positions=positions, upstream=upstream, dtype=self.dtype)

    def value(self, logprobs: torch.Tensor, entropy: torch.Tensor, unfiltered: torch.Tensor | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self._value_of(self.batch, logprobs, entropy, unfiltered)

    def _sequence_loss(self, sequences: Mapping[str, torch.Tensor], logprobs: torch.Tensor, entropy: torch.Tensor,
                       unfiltered: torch.Tensor | None) -> torch.Tensor:
        return self._value_of(sequences, logprobs, entropy, unfiltered)[0]

    def _value_of(self, batch: Mapping[str, torch.Tensor], logprobs: torch.Tensor, entropy: torch.Tensor,
                  unfiltered: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics of `batch` (the microbatch, or some of its sequences) on given per-token values."""
        return self.loss._evaluate(None, batch, self.call, precomputed=CurrentLogprobs(
            logprobs=logprobs, entropy=entropy, unfiltered_logprobs=unfiltered))


def _outside_band(ratio: torch.Tensor) -> torch.Tensor:
    """1.0 where `ratio` lies outside `RATIO_BAND`, else 0.0."""
    return ((ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])).to(torch.float32)


def _kept_set_metric_means(kept: KeptSetMetrics, mask: torch.Tensor,
                           generation: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`kept_set_mass` and `kept_set_differs`, token means over the trained tokens (the mass over those whose
    target is in its set: with unchecked inputs one may not be); with generation logprobs, the fraction of the tokens
    (with a finite one) whose ratio `exp(curr - generation)` lies outside `RATIO_BAND` when curr replays the engine's
    set, and when it recomputes the filter (a target outside the recomputed set has ratio 0: outside)."""
    finite = mask * torch.isfinite(kept.mass)
    zero = torch.zeros((), dtype=kept.mass.dtype, device=kept.mass.device)
    metrics = {"kept_set_mass": token_mean(torch.where(finite.bool(), kept.mass, zero).to(torch.float32), finite),
               "kept_set_differs": token_mean(kept.differs.to(torch.float32), mask)}
    if generation is not None:
        scored = mask * torch.isfinite(generation)
        safe = torch.where(scored.bool(), generation.to(kept.replayed.dtype), zero)
        for name, curr in (("replayed", kept.replayed), ("recomputed", kept.recomputed)):
            ratio = torch.exp(torch.where(scored.bool(), curr, zero) - safe)
            metrics[f"kept_set_{name}_ratio_outside_band"] = token_mean(_outside_band(ratio), scored)
    return metrics
