"""The GRPO training step on a Megatron-Core model, driven by Megatron's own pipeline schedule.

- `make_forward_step` returns a Megatron-compatible `forward_step(data_iterator, model)` for
  `get_forward_backward_func()` (and for Megatron-LM training scripts). Its loss is normalised over the whole
  optimizer step; the schedule divides each microbatch's loss by the number of microbatches and Megatron's DDP
  averages the gradients over the DP ranks, so the loss handed to it is scaled up by exactly those numbers.
- `compute_logprobs` is a forward-only logprob pass through the same schedule (for prev or reference).
- `train_step` runs the logprob passes the plan asks for, then one optimizer step per global batch of the
  rollout (`optimizer.optimizer_step`), and returns curr logprobs, prev logprobs (backfilled from curr when the
  pass was skipped) and the passes it ran, the same on every rank. The sync and async loops both call it.
- Deferred normalisation (`make_forward_step(..., defer_normalisation=True)`, `StepConfig.defer_normalisation`,
  and always under the plan's sequence mask by logprob error, which changes the counts during the forwards): each
  microbatch's loss is its unnormalised sum, the loss reports the count it divides by, and
  `apply_deferred_normalisation` sums those counts over the microbatches and DP ranks and divides the gradients
  once, before clipping and the optimizer. The loss is linear in its divisor, so this equals global counts known
  beforehand up to rounding, for every aggregation mode.

Batches follow the contract in docs/design.md: dicts of `[B, S]` tensors aligned with `input_ids` (position 0 has no
logprob), or packed (`[1, T]` with `cu_seqlens`, `loss.packing`) where `make_forward_step` and `compute_logprobs`
take them; `train_step` takes the rollout padded and packs each optimizer step's microbatches itself when
`StepConfig.max_tokens_per_microbatch` is set. A batch given to these functions is this data-parallel rank's
share; with DP > 1 the model is wrapped in Megatron's DistributedDataParallel (`ddp.wrap_in_ddp`), which reduces
the gradients.

With context parallelism (CP > 1 in parallel_state) every CP rank is given the same full batch; the forward step
splits each microbatch (`context_parallel.split_for_context_parallel`: targets shifted on the full sequences, then
Megatron's zigzag), the loss reads its share with the CP group (`ops.ContextShard`), and the per-token results
come back whole and token-aligned (`context_parallel.gather_from_context_parallel`). The model must then be in
Megatron's DDP, which reduces over DP × CP. Packed microbatches are split sequence by sequence (each sequence's
length a multiple of 2·CP: packing pads each sequence to one under CP).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from megatron_grpo.loss import (
    aggregate_metrics,
    check_batch_values,
    count_valid,
    trained_token_mask,
)
from megatron_grpo.loss.call import LossCall, PrevSource, StepLoss
from megatron_grpo.loss.kept_set_batch import KEPT_SET_KEYS, as_positions, kept_set_of, with_kept_set
from megatron_grpo.loss.metrics import NORMALISER, Aggregation
from megatron_grpo.loss.packing import (
    CU_SEQLENS,
    POSITION_IDS,
    PackedMicrobatches,
    SequenceLayout,
    next_token_targets_of,
)
from megatron_grpo.loss.prev_approximation import (
    VERSION_KEY,
    PrevApproximation,
    StepVersions,
    check_generation_logprobs,
)
from megatron_grpo.loss.reductions import Count
from megatron_grpo.megatron.context_parallel import (
    context_parallel_size,
    context_shard,
    gather_from_context_parallel,
    padded_for_context_parallel,
    split_for_context_parallel,
)
from megatron_grpo.megatron.ddp import is_ddp, scale_gradients, unwrapped
from megatron_grpo.megatron.forward import (
    Batch,
    ForwardStep,
    batch_forward,
    from_last_stage,
    metrics_from_last_stage,
    run_schedule,
)
from megatron_grpo.megatron.hidden_states import compute_dtype, output_weight
from megatron_grpo.megatron.moe_losses import aux_losses, check_no_deferred_aux_losses, clear_aux_losses
from megatron_grpo.megatron.optimizer import (
    Optimizer,
    grad_norm_after_clipping,
    learning_rate,
    optimizer_step,
    zero_optimizer_grads,
)
from megatron_grpo.megatron.routing_replay import (
    MOE_PADDING_MASK,
    ROUTED_EXPERTS,
    ROUTES_COUNTED,
    RouteChanges,
    check_routes,
    clear_routing,
    moe_layers,
    padding_mask_of,
    routes_counted_of,
)
from megatron_grpo.ops.current import HiddenStates, current_logprobs
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.vocab_shard import VocabShard
from megatron_grpo.scheduler import LogprobPlan
from megatron_grpo.timing import StepTimer

log = logging.getLogger(__name__)

_HAS_TARGET = "has_target"  # compute_logprobs under CP: True on every row with a target, shifted with the tokens


@dataclass(frozen=True)
class StepConfig:
    """What `train_step` needs to know of the run, and nothing else: a Megatron training script builds one
    directly (`StepConfig(global_batch_size=..., micro_batch_size=...)`); the runner adapts its config
    (`megatron_grpo.runner.plugin_params`). The defaults train from logits, on the unfiltered distribution at
    temperature 1, with Megatron's gradient clip of 1.0."""

    global_batch_size: int  # sequences per optimizer step, over all DP ranks
    micro_batch_size: int  # sequences per microbatch on one DP rank
    clip_grad: float = 1.0  # the gradient-norm clip of each optimizer step (0: none); Megatron's default
    distribution: SamplingDistribution = SamplingDistribution()  # the one the rollouts were sampled from (the
    #   policy trained): `SamplingDistribution.of_sampling(temperature, top_k, top_p)`; default softmax(logits)
    fused_linear_logprobs: bool = False  # logprobs from final hidden states (`vocab_parallel_linear_logprobs`)
    fused_linear_loss: bool = False  # the training loss's gradient in forward (`ClippedPGLoss.on_hidden_states`)
    max_tokens_per_microbatch: int | None = None  # pack each optimizer step's sequences into microbatches of at
    #   most this many tokens (`loss.packing.PackedMicrobatches`) instead of micro_batch_size rows; None: padded
    logprob_max_tokens_per_microbatch: int | None = None  # the same for the prev and reference passes (forward
    #   only, so they may take more); None: max_tokens_per_microbatch
    packing_algorithm: str = "first_fit_decreasing"  # how the sequences go into those microbatches
    #   (`loss.packing.PACKING_ALGORITHMS`); "balanced_first_fit_decreasing": as many, evened out
    defer_normalisation: bool = False  # divide the gradients once by the counts the forwards report, not by counts
    #   known before them (`make_forward_step`); the plan's sequence mask by logprob error turns it on by itself
    reference_replays_routes: bool = False  # with `routed_experts` in the batch, the reference pass replays them too;
    #   False (NeMo-RL's): the reference model routes by its own router, as the policy it is
    compare_without_replay: bool = False  # with `routed_experts`: one more forward-only pass, by the router's own
    #   routes, to report how far its logprobs are from the generation logprobs (`TrainStepResult.routing_metrics`)


@dataclass(frozen=True)
class TrainStepResult:
    """What one call of `train_step` did. Per-token tensors are `[B, S]` in the order of the batch given."""

    curr_logprobs: torch.Tensor  # from the training forward, detached
    prev_logprobs: torch.Tensor  # what the loss's ratio used: curr_logprobs when plan.prev_from_current, the
    #   generation logprobs or the interpolation when prev is approximated, else the prev pass's
    reference_policy_logprobs: torch.Tensor | None  # None when the plan skipped the reference pass
    step_metrics: list[dict[str, float]]  # per optimizer step, the same on every rank: the loss's metrics
    #   aggregated over microbatches and DP ranks, `grad_norm` (before clipping), `grad_norm_after_clip`, `lr`
    passes_run: dict[str, int]  # logprob passes that ran this call, by name ("reference", "prev"); none = {}
    routing_metrics: dict[str, float] = field(default_factory=dict)  # with replayed routes and generation logprobs:
    #   `router_replay_token_mult_prob_error` (mean exp|generation - curr| of the trained tokens, curr replayed) and,
    #   with `StepConfig.compare_without_replay`, `router_replay_off_token_mult_prob_error` (the same of the logprobs
    #   under the router's own routes, at the weights the step started from); the same on every rank


def make_forward_step(
    loss_fn: StepLoss,
    plan: LogprobPlan,
    *,
    num_microbatches: int,
    vocab: VocabShard,
    global_valid_tokens: Count | None = None,
    global_valid_seqs: Count | None = None,
    distribution: SamplingDistribution | None = None,
    fused_linear: bool = False,
    fused_loss: bool = False,
    versions: StepVersions | None = None,
    check_inputs: bool | None = None,
    defer_normalisation: bool = False,
    route_changes: RouteChanges | None = None,
) -> ForwardStep:
    """A `forward_step(data_iterator, model) -> (output_tensor, loss_func)` for one optimizer step.

    `loss_fn` follows `megatron_grpo.loss.StepLoss` (`ClippedPGLoss` does): each microbatch's loss is
    `loss_fn.step_loss(output, batch, call)`, where `call` is one `LossCall` that says everything else:
    - the counts: `global_valid_*` count the whole optimizer step (all microbatches, all DP ranks); the loss is
      normalised by them, so the per-microbatch losses sum to the step's loss. With `defer_normalisation=True`
      there are none: each microbatch's loss is a sum, and after the schedule `apply_deferred_normalisation(model,
      loss_fn, metrics)` divides the gradients (and the loss metrics) once by the counts the loss reported, before
      the optimizer step. The plan's sequence mask by logprob error (`plan.seq_logprob_error_threshold`, applied
      in the loss from the batch's prev or curr.detach()) changes the counts during the forwards, so it needs it;
    - `vocab` (this rank's `VocabShard`) and `distribution` (`SamplingDistribution`, the policy trained: pass the
      sampling settings', `SamplingDistribution.of_sampling`, so that it is the one the rollouts came from; None:
      softmax(logits));
    - where prev comes from, as the plan decided (`prev_source`); `versions` (this optimizer step's prev and current
      weight versions) are needed when the plan interpolates prev or compares with the interpolations, together with
      the batch's per-sample `rollout_weight_version`;
    - `inplace_backward=True`: the logits are the loss's alone (GPTModel's forward returns a fresh `[b, s, V_local]`
      tensor that no other autograd node saves, and Megatron's schedule hands it only to the loss function), so
      backward may write their gradient into their buffer instead of a second one; autograd's version counter makes
      any other reader fail loudly;
    - `check_inputs=False`: the loss and the ops skip their checks of values that cost a host sync per microbatch
      (target ids, finite advantages, the counts against the batch); pass it only for batches checked once already
      (`train_step` does, with `loss.check_batch_values`). None: `LossCall`'s default (check);
    - under context parallelism, this rank's `ContextShard`.

    `fused_linear` (`StepConfig.fused_linear_logprobs`): the model runs without its output layer
    (`hidden_states.without_output_layer`), and the loss reads the final hidden states and the output weight shard
    (`ops.HiddenStates`, in the model's compute dtype: bf16 under bf16 autocast): no logits are materialised.
    `fused_loss` (`StepConfig.fused_linear_loss`, with `fused_linear`): the loss-fused head, which computes the loss's
    gradient chunk by chunk in forward, for every loss setting and distribution (top-k / top-p included); the
    gradient the schedule will bring to the loss is bound up front (`schedule_upstream_gradient`), so the weight's
    gradient goes straight into Megatron DDP's `main_grad` during forward. Otherwise `vocab_parallel_linear_logprobs`
    recomputes each chunk in backward.

    The loss handed to the schedule is scaled by `num_microbatches` × the DP size, undoing the schedule's division by
    the number of microbatches and the average over DP ranks of Megatron's DDP (`megatron.ddp`): with DP > 1 the
    model must be wrapped in it, and its gradients are then in DDP's `main_grad`, which only Megatron's optimizer, or
    `optimizer_step` over any torch optimizer, reads (a plain `optimizer.step()` sees no `.grad`). With pipeline
    parallelism the schedule calls `loss_func` on the last stage only.

    Context parallelism (CP > 1 in parallel_state): each microbatch is the full batch, the same on every CP rank;
    the forward step splits it (`split_for_context_parallel`) and the loss takes this rank's `ContextShard`, so its
    per-token metrics (`curr_logprobs`) are this rank's row-aligned share (`gather_from_context_parallel` makes them
    whole). `global_valid_*` still count the whole sequences. The loss of each CP rank is its share; Megatron's DDP
    averages over DP × CP and its schedule multiplies the loss by the CP size (Megatron-Core 0.16 and 0.19, for a
    `loss_func` returning two values), so the scale above is unchanged. A packed microbatch is split sequence by
    sequence (each sequence's length a multiple of 2·CP); its per-token metrics are then this rank's share of the
    packed row (`gather_from_context_parallel(..., cu_seqlens)`).

    A Mixture-of-Experts model: Megatron's routers add their auxiliary losses (load balancing, z-loss) to the
    gradient in backward, scaled by the schedule per microbatch as Megatron scales them (the loss's normalisation
    above leaves that scale Megatron's; docs/moe.md); each microbatch's positions after its sequences' last scored
    token are left out of them (Megatron's `padding_mask`). A microbatch carrying `routed_experts` (`[B, S, L, k]`,
    `routing_replay`) is routed so: checked against the model (ids against the experts when `check_inputs`),
    replayed, and `route_changes` (a `RouteChanges`) collects which tokens the replay changed.
    """
    if not callable(getattr(loss_fn, "step_loss", None)):
        raise TypeError(f"loss_fn: {type(loss_fn).__name__} has no step_loss(output, batch, call); the step takes a "
                        "loss that follows megatron_grpo.loss.StepLoss, as ClippedPGLoss does")
    if fused_loss and not fused_linear:
        raise ValueError("fused_loss: needs fused_linear=True")
    threshold = plan.seq_logprob_error_threshold
    if threshold is not None and not defer_normalisation:
        raise ValueError(f"defer_normalisation: the plan masks sequences by logprob error in the forward "
                         f"(seq_logprob_error_threshold = {threshold}), so the step's counts are known only after its "
                         "last forward; pass defer_normalisation=True (no counts), then "
                         "apply_deferred_normalisation(model, loss_fn, metrics) before the optimizer step")
    call = LossCall.of(global_valid_tokens, global_valid_seqs, shard=vocab, distribution=distribution,
                       prev=prev_source(plan, versions), seq_logprob_error_threshold=threshold,
                       defer_normalisation=defer_normalisation, context=context_shard(), inplace_backward=True,
                       check_inputs=check_inputs, loss_fused=fused_loss)
    # Megatron divides the returned loss in place by num_microbatches, and DDP averages over the DP ranks: hand
    # it a scaled copy (a new tensor, so `metrics["loss"]`, the loss's own detached value, stays unscaled).
    loss_scale = num_microbatches * parallel_state.get_data_parallel_world_size()

    def loss_func(batch: Batch, model: torch.nn.Module,
                  output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        output = HiddenStates(*_in_compute_dtype(model, output_tensor)) if fused_linear else output_tensor
        bound = call
        if fused_loss:  # the loss-fused head writes dW (into main_grad) and dH final in forward
            bound = replace(call, upstream_gradient=schedule_upstream_gradient(model, loss_scale, num_microbatches,
                                                                               output_tensor.device))
        loss, metrics = loss_fn.step_loss(output, batch, bound)
        return loss * loss_scale, metrics

    def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
        batch = next(data_iterator)
        if moe_layers(model) is not None:
            if defer_normalisation:
                check_no_deferred_aux_losses(model)
            batch = {**batch, MOE_PADDING_MASK: padding_mask_of(batch)}
            if ROUTED_EXPERTS in batch:
                check_routes(model, batch[ROUTED_EXPERTS], batch["input_ids"], check_values=call.check_inputs)
                batch[ROUTES_COUNTED] = routes_counted_of(batch)
        elif ROUTED_EXPERTS in batch:
            check_routes(model, batch[ROUTED_EXPERTS], batch["input_ids"])  # names the dense model
        if call.context is not None:
            batch = split_for_context_parallel(batch)
        output = batch_forward(model, batch, hidden_states=fused_linear, changes=route_changes)
        return output, partial(loss_func, batch, model)

    return forward_step


def schedule_upstream_gradient(model: torch.nn.Module, loss_scale: float, num_microbatches: int,
                               device: torch.device) -> float | torch.Tensor:
    """d(what Megatron's schedule differentiates)/d(the loss `step_loss` returns): `make_forward_step` multiplies the
    loss by `loss_scale`; the schedule (`forward_step_calc_loss`, Megatron-Core 0.16 and 0.19, for a `loss_func`
    returning two values) multiplies it in place by the CP size and divides it by `num_microbatches`, and its
    `backward_step` differentiates `config.grad_scale_func(loss)` where the model config has one (the optimizer's loss
    scale: Megatron's own reads it the same way, `grad_scale_func(torch.ones(1))`, a device tensor, no host sync).
    So `loss_scale * CP / num_microbatches * scale` = DP × CP × the optimizer's loss scale."""
    upstream = loss_scale * context_parallel_size() / num_microbatches
    grad_scale_func = getattr(get_model_config(model), "grad_scale_func", None)
    if grad_scale_func is None:
        return float(upstream)
    return grad_scale_func(torch.ones(1, device=device)).detach().reshape(()) * upstream


def apply_deferred_normalisation(model: torch.nn.Module, loss_fn: StepLoss,
                                 microbatch_metrics: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Finishes an optimizer step run with `make_forward_step(..., defer_normalisation=True)`, after Megatron's
    schedule and before clipping and the optimizer: the counts the loss reported (`loss_normaliser`, after any
    sequence mask) summed over the microbatches and the DP × CP ranks, the gradients divided by them (DDP's
    `main_grad`, or `.grad`), and the step's metrics returned aggregated as `train_step` reports them, the loss and
    the other normalised sums divided too. `microbatch_metrics`: what the schedule returned (none on a pipeline
    stage other than the last, whose counts are broadcast to it). The same on every rank."""
    return _normalised(model, metrics_from_last_stage(_aggregate(microbatch_metrics, loss_fn)),
                       loss_fn.metric_aggregation)


def _normalised(model: torch.nn.Module, metrics: dict[str, float],
                aggregation: Mapping[str, Aggregation]) -> dict[str, float]:
    """The gradients and the normalised-sum metrics of a deferred step divided by its summed normaliser (0: an
    empty step, whose sums are 0, divided by 1 as the loss divides a global count of 0)."""
    if NORMALISER not in metrics:
        raise ValueError(f"metrics: no {NORMALISER!r}: the loss reports it only when the forward step was made with "
                         "defer_normalisation=True")
    metrics = dict(metrics)
    normaliser = max(metrics.pop(NORMALISER), 1.0)
    scale_gradients(model, 1.0 / normaliser)
    return {name: value / normaliser if aggregation.get(name) is Aggregation.NORMALISED_SUM else value
            for name, value in metrics.items()}


def prev_source(plan: LogprobPlan, versions: StepVersions | None = None) -> PrevSource:
    """Where the loss's prev comes from, as the plan decided: from current, approximated, or the batch's pass,
    possibly compared with the approximations (which, like the interpolations, need the step's `versions`)."""
    if plan.needs_versions and versions is None:
        raise ValueError(f"versions: the plan's prev ({plan.prev_source}"
                         f"{', compared with its approximations' if plan.compare_approximations else ''}) needs this "
                         "optimizer step's weight versions (StepVersions)")
    approximation = None
    if plan.prev_approximation is not None:
        approximation = PrevApproximation(plan.prev_approximation,
                                          versions if plan.prev_approximation != "generation" else None)
    return PrevSource(from_current=plan.prev_from_current, approximation=approximation,
                      compare_with=versions if plan.compare_approximations else None)


def compute_logprobs(model: torch.nn.Module, batch: Batch, *, micro_batch_size: int, vocab: VocabShard,
                     distribution: SamplingDistribution | None = None, fused_linear: bool = False,
                     check_inputs: bool = True, max_tokens_per_microbatch: int | None = None,
                     packing_algorithm: str = "first_fit_decreasing") -> torch.Tensor:
    """float32 `[B, S]` logprobs (float64 from a float64 model) of `batch["input_ids"]` under `distribution`
    (`SamplingDistribution`; None: softmax(logits); -inf outside a top-k / top-p kept set) of `model`, in eval mode;
    position 0 is 0.

    A packed batch (`batch['cu_seqlens']`, `loss.packing`) is one microbatch and gives `[1, T]` logprobs, 0 at
    each sequence's first token. `max_tokens_per_microbatch`: the padded batch's rows are packed into microbatches
    of at most that many tokens (`loss.packing.PackedMicrobatches`, by `packing_algorithm`), and the logprobs come
    back `[B, S]` (0 past each row's last trained token).

    `fused_linear`: from the final hidden states and the output weight (`vocab_parallel_linear_logprobs`),
    without materialising the logits.

    `vocab`: this rank's vocab shard, e.g. `vocab_shard_of(model, true_vocab_size)`.
    `check_inputs=False`: the token ids are not checked against the vocab in each microbatch (a host sync each);
    for a batch checked once already (`loss.check_batch_values`).

    A forward-only pass through Megatron's schedule; with pipeline parallelism the last stage broadcasts the
    result to the other stages. With context parallelism every CP rank is given the full batch, computes the
    logprobs of its share of each sequence, and returns the whole `[B, S]` (one all-gather over the CP group per
    padded pass, or per packed microbatch). Padded rows are extended to a multiple of 2·CP for the pass
    (`padded_for_context_parallel`); a packed batch's sequences must each be a multiple of 2·CP long, and
    `max_tokens_per_microbatch` pads them so.

    A batch with `routed_experts` (`[B, S, L, k]`, `routing_replay`) is computed under those routes, replayed in each
    microbatch (checked against the model first, the ids only with `check_inputs`); without them an MoE model routes
    by its own router.
    """
    width = batch["input_ids"].shape[1]
    batch = padded_for_context_parallel(batch)
    input_ids = batch["input_ids"]
    if ROUTED_EXPERTS in batch:
        check_routes(model, batch[ROUTED_EXPERTS], input_ids, check_values=check_inputs)
    context = context_shard()
    packing = None
    if max_tokens_per_microbatch is not None and CU_SEQLENS not in batch:
        packing = _packed_microbatches(batch, max_tokens_per_microbatch, packing_algorithm)
        microbatches = packing.microbatches
    else:
        microbatches = _split(batch, micro_batch_size)
    if context is not None:  # the split shifts every per-token tensor of a microbatch: hand it the tokens alone,
        # and a mark shifted with them that is False on each sequence's last row (it has no target)
        microbatches = [{**{key: mb[key] for key in ("input_ids", CU_SEQLENS, POSITION_IDS, ROUTED_EXPERTS,
                                                              *KEPT_SET_KEYS)
                            if key in mb},
                         _HAS_TARGET: torch.ones_like(mb["input_ids"], dtype=torch.bool)} for mb in microbatches]

    replay = distribution is not None and distribution.replay_kept_set

    def logprob_func(targets: torch.Tensor, kept, output_tensor: torch.Tensor,
                     non_loss_data: bool = True) -> torch.Tensor:
        output = HiddenStates(*_in_compute_dtype(model, output_tensor)) if fused_linear else output_tensor
        return current_logprobs(output, targets, shard=vocab, distribution=distribution, with_entropy=False,
                                check_inputs=check_inputs, shift=context is None, kept_set=kept).logprobs

    def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
        microbatch = next(data_iterator)
        if context is None:
            # No logprob crosses into a sequence: each sequence's first token (a padded row's position 0) scores
            # nothing.
            targets = next_token_targets_of(microbatch["input_ids"], SequenceLayout.of_batch(microbatch))
        else:  # row-aligned: each row scores its label; the last row of a sequence has none
            microbatch = split_for_context_parallel(microbatch)
            targets = microbatch["labels"].masked_fill(~microbatch[_HAS_TARGET], -1)
        kept = kept_set_of(microbatch) if replay else None
        if kept is not None:  # replayed: only the sampled tokens, which carry a kept set, are scored
            targets = targets.masked_fill(kept.lengths().view(targets.shape) == 0, -1)
        elif replay:
            raise ValueError(f"batch[{KEPT_SET_KEYS[0]!r}] is missing: required by distribution.replay_kept_set")
        return batch_forward(model, microbatch, hidden_states=fused_linear), partial(logprob_func, targets, kept)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = run_schedule(forward_step, model, microbatches, forward_only=True)
    finally:
        model.train(was_training)
        clear_routing(model)
    if not outputs:  # a pipeline stage that is not the last
        logprobs = torch.empty(input_ids.shape, dtype=_logprob_dtype(model), device=input_ids.device)
    else:
        logprobs = _whole_per_token(outputs, microbatches, packing)
    return from_last_stage(logprobs)[:, :width]


def _logprob_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the logprobs the last pipeline stage computes, which the other stages receive them in: the ops'
    float32, float64 from a float64 model."""
    return torch.promote_types(compute_dtype(model), torch.float32)


def _whole_per_token(per_microbatch: list[torch.Tensor], microbatches: list[Batch],
                     packing: PackedMicrobatches | None) -> torch.Tensor:
    """One per-token result of every microbatch (under CP this rank's row-aligned share) as the batch's whole
    token-aligned tensor: the CP shares gathered (padded at once, packed microbatch by microbatch), the packed
    microbatches unpacked to the rows when the pass packed them."""
    if CU_SEQLENS not in microbatches[0]:
        return gather_from_context_parallel(torch.cat(per_microbatch))
    whole = [gather_from_context_parallel(values, mb[CU_SEQLENS]) for values, mb in zip(per_microbatch,
                                                                                       microbatches, strict=True)]
    return packing.unpack(whole) if packing is not None else torch.cat(whole)


def _packed_microbatches(batch: Batch, max_tokens: int, algorithm: str) -> PackedMicrobatches:
    """`batch`'s rows packed into microbatches of at most `max_tokens` tokens by `algorithm` (a name of
    `loss.packing.PACKING_ALGORITHMS`); under pipeline parallelism all of one length, as the stages exchange
    activations of one shape; under context parallelism each sequence padded to a multiple of 2·CP (the split's
    chunks, as Megatron's `cu_seqlens_padded`)."""
    same_length = parallel_state.get_pipeline_model_parallel_world_size() > 1
    size = context_parallel_size()
    return PackedMicrobatches(batch, max_tokens, pad_multiple=2 * size if size > 1 else 1, same_length=same_length,
                              algorithm=algorithm)


def _in_compute_dtype(model: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden states and the output weight shard in the model's compute dtype (`compute_dtype`)."""
    dtype = compute_dtype(model)
    return hidden.to(dtype), output_weight(model).to(dtype)


def train_step(
    step: StepConfig,
    model: torch.nn.Module,
    optimizer: Optimizer,
    loss_fn: StepLoss,
    plan: LogprobPlan,
    batch: Batch,
    *,
    vocab: VocabShard,
    reference_model: torch.nn.Module | None = None,
    prepare_batch: Callable[[Batch], Batch] | None = None,
    timer: StepTimer | None = None,
    prev_version: float | None = None,
) -> TrainStepResult:
    """Trains on one rollout batch (this DP rank's share): the planned logprob passes, then the optimizer steps.

    The rollout holds rollout / `step.global_batch_size` optimizer steps, each of `step.global_batch_size` / DP
    sequences on this rank, in microbatches of `step.micro_batch_size`. `model` is any Megatron-Core GPTModel
    (wrapped in Megatron's DDP when DP > 1) and `vocab` its shard, `vocab_shard_of(model, true_vocab_size)`; the
    reference model shares it. `reference_model` is needed only when `plan.compute_reference_logprobs`.
    `prepare_batch`, when given, maps the batch once the logprob passes are in it and before any optimizer step:
    a reader of prev logprobs before the loss (the runner's KL in the reward) works there. The plan's sequence mask
    by logprob error runs inside the loss instead, with the normalisation deferred (`StepConfig.defer_normalisation`
    is then on whatever it says).

    With prev from the generation logprobs (the plan's `prev_approximation`), they are the batch's prev from the
    start. An interpolated prev (or the comparison with it) needs `prev_version`, the weight version of the
    model as given (in the unit of the batch's per-sample `rollout_weight_version`); optimizer step k of the K
    that train the rollout then has current version `prev_version + k / K` (`StepVersions`).

    The batch's values (token ids within the model's vocab, finite advantages and rewards) are checked once here,
    in one host sync (`loss.check_batch_values`); the passes and the loss then skip their own checks of values in
    every microbatch (`check_inputs=False`). A bad value is a `ValueError` naming its batch key.

    Under context parallelism the rows are extended to a multiple of 2·CP for the step
    (`padded_for_context_parallel`: untrained positions after every row's end), and the results cut back to `S`.
    A Mixture-of-Experts model: each optimizer step's metrics add Megatron's auxiliary losses (`load_balancing_loss`,
    `z_loss`, ...: `moe_losses.aux_losses`). With `routed_experts` in the batch (`[B, S, L, k]`, the rollout's routes,
    `routing_replay`; checked once, here) the prev pass and every training forward replay them (the reference pass
    too with `step.reference_replays_routes`), and each optimizer step reports `router_replay_changed_fraction`: of
    the training forwards' tokens (their padding left out), the fraction to which the router would have given other
    experts in some MoE layer (given the replayed layers before it).
    """
    if plan.compute_reference_logprobs and reference_model is None:
        raise ValueError("reference_model: the plan computes reference logprobs, but none was given")
    if plan.needs_versions and (prev_version is None or VERSION_KEY not in batch):
        missing = " and ".join(name for name, absent in (("prev_version", prev_version is None),
                                                         (f"batch[{VERSION_KEY!r}]", VERSION_KEY not in batch))
                               if absent)
        raise ValueError(f"{missing}: required by the plan's prev ({plan.prev_source}"
                         f"{', compared with its approximations' if plan.compare_approximations else ''}): the "
                         "weight versions of the prev policy and of each sample's generating policy")
    if vocab.true_vocab_size is not None:
        check_batch_values(batch, vocab.true_vocab_size)
    routes = batch.get(ROUTED_EXPERTS)
    if routes is not None:
        check_routes(model, routes, batch["input_ids"])
    timer = timer if timer is not None else StepTimer()
    clip = step.clip_grad
    micro_batch_size = step.micro_batch_size
    distribution = step.distribution  # train the policy the rollouts sampled from
    fused = step.fused_linear_logprobs
    packed_tokens = step.max_tokens_per_microbatch
    logprob_tokens = (None if packed_tokens is None else
                      step.logprob_max_tokens_per_microbatch or packed_tokens)
    packed_passes = {"max_tokens_per_microbatch": logprob_tokens, "packing_algorithm": step.packing_algorithm}
    if CU_SEQLENS in batch:
        raise ValueError("batch['cu_seqlens']: train_step takes the rollout padded, [B, S], and packs each optimizer "
                         "step itself with StepConfig.max_tokens_per_microbatch")
    step_rows = _rows_per_optimizer_step(step, batch["input_ids"].shape[0])
    width = batch["input_ids"].shape[1]
    deferred = step.defer_normalisation or plan.seq_logprob_error_threshold is not None
    if deferred:
        check_no_deferred_aux_losses(model)
    batch = dict(padded_for_context_parallel(batch))
    passes_run: dict[str, int] = {}
    if plan.compute_reference_logprobs:
        # Unfiltered, as NeMo-RL's reference pass: the KL compares the current and reference full distributions.
        reference_batch = batch if step.reference_replays_routes else _without_routes(batch)
        with timer.section("reference_pass"):
            batch["reference_policy_logprobs"] = compute_logprobs(reference_model, reference_batch,
                                                                  micro_batch_size=micro_batch_size, vocab=vocab,
                                                                  distribution=distribution.unfiltered(),
                                                                  fused_linear=fused, check_inputs=False,
                                                                  **packed_passes)
        passes_run["reference"] = 1
    if plan.compute_prev_logprobs:
        with timer.section("prev_pass"):
            batch["prev_logprobs"] = compute_logprobs(model, batch, micro_batch_size=micro_batch_size, vocab=vocab,
                                                      distribution=distribution, fused_linear=fused,
                                                      check_inputs=False, **packed_passes)
        passes_run["prev"] = 1
    natural_logprobs = None
    if step.compare_without_replay and routes is not None:
        with timer.section("natural_routing_pass"):
            natural_logprobs = compute_logprobs(model, _without_routes(batch), micro_batch_size=micro_batch_size,
                                                vocab=vocab, distribution=distribution, fused_linear=fused,
                                                check_inputs=False, **packed_passes)
    if plan.prev_approximation == "generation":  # verl's bypass: the rollout's logprobs are prev from the start
        check_generation_logprobs(batch.get("generation_logprobs"), trained_token_mask(batch),
                                  "the plan's prev from generation (logprob_passes.prev: generation)")
        batch["prev_logprobs"] = batch["generation_logprobs"]
    if passes_run:
        log.info("logprob passes run: %s", ", ".join(f"{name} x{count}" for name, count in passes_run.items()))
    if prepare_batch is not None:
        batch = dict(prepare_batch(batch))
        if vocab.true_vocab_size is not None:  # the shaped advantages are new values
            check_batch_values(batch, vocab.true_vocab_size)

    step_metrics, step_logprobs = [], []
    rows = batch["input_ids"].shape[0]
    by_position, kept = as_positions(batch)  # the kept sets (if any) follow their tokens into the microbatches
    for start in range(0, rows, step_rows):
        step_batch = with_kept_set({key: value[start:start + step_rows] for key, value in by_position.items()}, kept)
        versions = (StepVersions.of_optimizer_step(prev_version, start // step_rows, rows // step_rows)
                    if plan.needs_versions else None)
        with timer.section("forward_backward"):
            packing = (None if packed_tokens is None else
                       _packed_microbatches(step_batch, packed_tokens, step.packing_algorithm))
            microbatches = _split(step_batch, micro_batch_size) if packing is None else packing.microbatches
            outcome = _forward_backward(model, optimizer, loss_fn, plan, microbatches, vocab, distribution,
                                        fused_linear=fused, fused_loss=step.fused_linear_loss, versions=versions,
                                        deferred=deferred)
        metrics = outcome.loss
        aggregated = metrics_from_last_stage(_aggregate(metrics, loss_fn))
        with timer.section("optimizer"):
            if deferred:  # the gradients divided once, before clipping
                aggregated = _normalised(model, aggregated, loss_fn.metric_aggregation)
            lr = learning_rate(optimizer)  # the rate this step uses
            grad_norm = optimizer_step(model, optimizer, clip)
        step_metrics.append({**aggregated, **outcome.moe, "grad_norm": grad_norm,
                             "grad_norm_after_clip": grad_norm_after_clipping(grad_norm, clip), "lr": lr})
        if metrics:  # the per-token metrics whole (CP), back at the rollout's rows (packing)
            step_logprobs.append({key: _whole_per_token([m[key] for m in metrics], microbatches, packing)
                                  for key in ("curr_logprobs", "prev_logprobs") if key in metrics[0]})

    curr_logprobs = from_last_stage(
        torch.cat([m["curr_logprobs"] for m in step_logprobs]) if step_logprobs
        else torch.empty(batch["input_ids"].shape, dtype=_logprob_dtype(model), device=batch["input_ids"].device))
    if plan.prev_approximation in ("loglinear", "linear"):  # interpolated in the loss, microbatch by microbatch
        prev_logprobs = from_last_stage(torch.cat([m["prev_logprobs"] for m in step_logprobs]) if step_logprobs
                                        else torch.empty_like(curr_logprobs))
    else:
        prev_logprobs = curr_logprobs if plan.prev_from_current else batch["prev_logprobs"]
    routing_metrics = {}
    if routes is not None and "generation_logprobs" in batch:
        routing_metrics["router_replay_token_mult_prob_error"] = _token_mult_prob_error(batch, curr_logprobs)
        if natural_logprobs is not None:
            routing_metrics["router_replay_off_token_mult_prob_error"] = _token_mult_prob_error(batch, natural_logprobs)
    reference_logprobs = batch.get("reference_policy_logprobs")
    return TrainStepResult(
        curr_logprobs=curr_logprobs[:, :width],
        prev_logprobs=prev_logprobs[:, :width],
        reference_policy_logprobs=None if reference_logprobs is None else reference_logprobs[:, :width],
        step_metrics=step_metrics,
        passes_run=passes_run,
        routing_metrics=routing_metrics,
    )


def _without_routes(batch: Batch) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if key != ROUTED_EXPERTS}


def _token_mult_prob_error(batch: Batch, logprobs: torch.Tensor) -> float:
    """NeMo-RL's `token_mult_prob_error` of `logprobs` against the batch's generation logprobs: the mean of
    exp(|generation - logprobs|) over the trained tokens with a finite generation logprob, over all DP ranks."""
    generation = batch["generation_logprobs"]
    mask = trained_token_mask(batch).bool() & torch.isfinite(generation)
    error = torch.exp((generation - logprobs).abs()).masked_fill(~mask, 0)
    totals = _sum_over_data_parallel(torch.stack([error.sum(), mask.sum()]).to(torch.float64))
    total, count = totals.tolist()
    return total / count if count else 0.0


@dataclass(frozen=True)
class _StepOutcome:
    loss: list[dict[str, torch.Tensor]]  # the loss's metrics of each microbatch (none on stages but the last)
    moe: dict[str, float]  # an MoE model's auxiliary losses and replayed routes' changes; the same on every rank


def _forward_backward(
    model: torch.nn.Module,
    optimizer: Optimizer,
    loss_fn: StepLoss,
    plan: LogprobPlan,
    microbatches: list[Batch],
    vocab: VocabShard,
    distribution: SamplingDistribution,
    fused_linear: bool = False,
    fused_loss: bool = False,
    versions: StepVersions | None = None,
    deferred: bool = False,
) -> _StepOutcome:
    """Fresh gradients of one optimizer step: Megatron's schedule over the microbatches, which ends in DDP's
    reduction over the DP ranks (`megatron.ddp`); `deferred`: unnormalised, for `_normalised`."""
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1 and not is_ddp(model):
        raise ValueError("model: data parallelism needs the model wrapped in Megatron-Core's DistributedDataParallel "
                         "(megatron_grpo.megatron.wrap_in_ddp), which reduces the gradients over the DP ranks (and "
                         "the context-parallel ranks, with CP)")
    if _sequence_parallel(model) and not is_ddp(model):
        raise ValueError("model: sequence parallelism needs the model wrapped in Megatron-Core's "
                         "DistributedDataParallel (megatron_grpo.megatron.wrap_in_ddp), whose finalize_model_grads "
                         "sums the gradients that each TP rank computes from its slice of the sequence (norms, "
                         "routers)")
    layers = moe_layers(model)
    tokens, seqs = (None, None) if deferred else _global_valid_counts(microbatches)
    replayed = ROUTED_EXPERTS in microbatches[0]
    changes = RouteChanges() if replayed else None
    forward_step = make_forward_step(loss_fn, plan, num_microbatches=len(microbatches), global_valid_tokens=tokens,
                                     global_valid_seqs=seqs, vocab=vocab, distribution=distribution,
                                     fused_linear=fused_linear, fused_loss=fused_loss, versions=versions,
                                     check_inputs=False,  # train_step checked the batch's values once
                                     defer_normalisation=deferred, route_changes=changes)
    zero_optimizer_grads(model, optimizer)
    model.train()
    if layers is not None:
        clear_aux_losses()
    try:
        loss_metrics = run_schedule(forward_step, model, microbatches, forward_only=False)
    finally:
        clear_routing(model)
    moe = {}
    if layers is not None:
        moe = aux_losses(len(microbatches), layers.num_layers)
        if changes is not None:
            moe["router_replay_changed_fraction"] = changes.fraction(layers.sequence_parallel)
    return _StepOutcome(loss_metrics, moe)


def _sequence_parallel(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(unwrapped(model), "config", None), "sequence_parallel", False)) and \
        parallel_state.get_tensor_model_parallel_world_size() > 1


def _aggregate(microbatch_metrics: list[dict[str, torch.Tensor]], loss_fn: StepLoss) -> dict[str, float]:
    """The loss's scalar metrics of one optimizer step, over its microbatches and the DP × CP ranks (each CP rank's
    metrics are its share's), aggregated as the loss says (`metric_aggregation`, e.g. ClippedPGLoss's `is_oob_ratio`
    is per sequence for seq-mask-tis)."""
    if not microbatch_metrics:  # a pipeline stage that is not the last
        return {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    aggregation = loss_fn.metric_aggregation
    return aggregate_metrics(microbatch_metrics, group=group if group.size() > 1 else None, aggregation=aggregation)


def _split(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Microbatches of `micro_batch_size` rows; a packed batch is one microbatch."""
    if CU_SEQLENS in batch:
        return [batch]
    rows = batch["input_ids"].shape[0]
    if rows == 0 or rows % micro_batch_size:
        raise ValueError(f"batch['input_ids']: {rows} sequences are not a positive multiple of "
                         f"micro_batch_size ({micro_batch_size})")
    batch, kept = as_positions(batch)  # the kept sets (if any) follow their tokens
    return [with_kept_set({key: value[start:start + micro_batch_size] for key, value in batch.items()}, kept)
            for start in range(0, rows, micro_batch_size)]


def _rows_per_optimizer_step(step: StepConfig, rollout_rows: int) -> int:
    """This DP rank's sequences per optimizer step; the rollout must hold a whole number of steps."""
    dp_size = parallel_state.get_data_parallel_world_size()
    global_batch = step.global_batch_size
    if global_batch % (dp_size * step.micro_batch_size):
        raise ValueError(f"global_batch_size ({global_batch}) is not a multiple of the data-parallel size "
                         f"({dp_size}) × micro_batch_size ({step.micro_batch_size})")
    step_rows = global_batch // dp_size
    if rollout_rows % step_rows:
        raise ValueError(f"batch['input_ids']: {rollout_rows} sequences on this rank are not a multiple of "
                         f"global_batch_size / DP = {step_rows}")
    return step_rows


def _global_valid_counts(microbatches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """Trained tokens and sequences of the whole optimizer step: all microbatches, all DP ranks (the full sequences,
    the same on every CP rank)."""
    counts = torch.stack([torch.stack(count_valid(mb)) for mb in microbatches]).sum(dim=0)
    counts = _sum_over_data_parallel(counts)
    return counts[0], counts[1]


def _sum_over_data_parallel(tensor: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_data_parallel_group()
    if group.size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
    return tensor
