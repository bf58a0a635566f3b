"""Deferred normalisation through Megatron's schedule: a tiny GPTModel at TP 1, DP 2 over gloo, four microbatches a
rank, the plan's sequence mask by logprob error in the training forward (prev skipped).

Each microbatch's loss is a sum; `apply_deferred_normalisation` divides the gradients once by the counts the
forwards reported, summed over both ranks. Against the same step on the batch with those sequences dropped
beforehand and global counts known up front, for every aggregation mode and GSPO, the gradients and the loss agree to
fp32 rounding. The mask drops whole microbatches (all of one on each rank), and `train_step` does the same by itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _configs import config_with
from _dist import run_on_ranks
from _tolerances import FP32_U, MODEL_GRAD_RTOL
from test_megatron_dp import DP_MODEL
from test_megatron_hooks import ROWS, SEQ, VOCAB, build, make_batch

THRESHOLD = 1.25
MICROBATCH = 1  # four microbatches per rank
DROPPED = (2, 3, 4)  # rank 0's last two microbatches, rank 1's first: e^0.5 = 1.65 > 1.25; the others e^0.02
MODES = [("token-mean", False), ("seq-mean-token-mean", False), ("seq-mean-token-sum", False),
         ("seq-mean-token-sum-norm", False), ("seq-mean-token-mean", True)]
SGD_LR = 0.1


def loss_config(mode: str, gspo: bool):
    from megatron_grpo.loss import ClippedPGLossConfig

    return ClippedPGLossConfig(loss_agg_mode=mode, sequence_level_importance_ratio=gspo, max_response_length=9,
                               reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True,
                               entropy_coef=0.01)


def masked_rollout(model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole batch with generation logprobs 0.02 nats off the model's own (0.5 off on the rows to drop), and the
    same batch with those rows dropped before the step."""
    from megatron_grpo.megatron import compute_logprobs, vocab_shard_of

    batch = make_batch(seed=23)
    curr = compute_logprobs(model, batch, micro_batch_size=ROWS, vocab=vocab_shard_of(model, VOCAB))
    offset = torch.full((ROWS, 1), 0.02)
    offset[list(DROPPED)] = 0.5
    batch["generation_logprobs"] = curr - offset
    premasked = dict(batch, sample_mask=batch["sample_mask"].clone())
    premasked["sample_mask"][list(DROPPED)] = 0
    return batch, premasked


def run_step(model, loss_fn, plan, microbatches, **counts) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One optimizer step's forward-backward through Megatron's schedule; its metrics and reduced gradients."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_grpo.loss import aggregate_metrics
    from megatron_grpo.megatron import apply_deferred_normalisation, make_forward_step, vocab_shard_of
    from megatron_grpo.megatron.ddp import gradient, zero_grads

    deferred = not counts
    forward_step = make_forward_step(loss_fn, plan, num_microbatches=len(microbatches),
                                     vocab=vocab_shard_of(model, VOCAB), defer_normalisation=deferred, **counts)
    zero_grads(model)
    model.train()
    metrics = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(microbatches),
                                          model=model, num_microbatches=len(microbatches), seq_length=SEQ,
                                          micro_batch_size=MICROBATCH, forward_only=False)
    if deferred:
        step_metrics = apply_deferred_normalisation(model, loss_fn, metrics)
    else:
        step_metrics = aggregate_metrics(metrics, group=dist.group.WORLD, aggregation=loss_fn.metric_aggregation)
    return step_metrics, [gradient(p).detach().clone() for p in model.parameters()]


def deferred_and_precomputed(rank: int, world_size: int) -> dict:
    from megatron_grpo.loss import ClippedPGLoss, count_valid
    from megatron_grpo.megatron import destroy_parallel, init_parallel, train_step, vocab_shard_of, wrap_in_ddp
    from megatron_grpo.megatron.ddp import gradient
    from megatron_grpo.runner.plugin_params import parallel_params, step_config
    from megatron_grpo.scheduler import PlanInputs, plan_logprob_passes

    cfg = config_with(DP_MODEL)
    layout = init_parallel(parallel_params(cfg))
    try:
        model = wrap_in_ddp(build(cfg))
        batch, premasked = masked_rollout(model)
        rows = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
        mine = [{key: value[rows] for key, value in b.items()} for b in (batch, premasked)]

        def microbatches(rank_batch):
            return [{key: value[i:i + MICROBATCH] for key, value in rank_batch.items()}
                    for i in range(0, ROWS // world_size, MICROBATCH)]

        modes = {}
        for mode, gspo in MODES:
            loss = loss_config(mode, gspo)
            plan_of = lambda **more: plan_logprob_passes(PlanInputs.for_loss(  # noqa: E731
                loss, rollout_batch=ROWS, global_batch=ROWS, dropout=False, **more))
            masking_plan, plain_plan = plan_of(error_threshold=THRESHOLD), plan_of()
            counts = torch.stack([torch.stack(count_valid(mb)) for mb in microbatches(mine[1])]).sum(dim=0)
            dist.all_reduce(counts)
            deferred = run_step(model, ClippedPGLoss(loss), masking_plan, microbatches(mine[0]))
            precomputed = run_step(model, ClippedPGLoss(loss), plain_plan, microbatches(mine[1]),
                                   global_valid_tokens=counts[0], global_valid_seqs=counts[1])
            modes[f"{mode}{'-gspo' if gspo else ''}"] = {"deferred": deferred, "precomputed": precomputed,
                                                        "masking_plan": (masking_plan.compute_prev_logprobs,
                                                                         masking_plan.reasons[1])}
        # train_step by itself: the plan's mask defers the normalisation; SGD's update is linear in the gradient
        loss = loss_config("token-mean", False)
        updates = {}
        for name, rank_batch, threshold in (("masked", mine[0], THRESHOLD), ("premasked", mine[1], None)):
            stepped = wrap_in_ddp(build(cfg))
            before = [p.detach().clone() for p in stepped.parameters()]
            plan = plan_logprob_passes(PlanInputs.for_loss(loss, rollout_batch=ROWS, global_batch=ROWS, dropout=False,
                                                           error_threshold=threshold))
            result = train_step(step_config(cfg), stepped, torch.optim.SGD(stepped.parameters(), lr=SGD_LR),
                                ClippedPGLoss(loss), plan, rank_batch, vocab=vocab_shard_of(stepped, VOCAB))
            updates[name] = {"delta": [p.detach() - b for p, b in zip(stepped.parameters(), before)],
                             "weight_scale": max(b.abs().max().item() for b in before),
                             "metrics": result.step_metrics[0], "passes": result.passes_run,
                             "grads": [gradient(p).detach().clone() for p in stepped.parameters()]}
        no_counts_error = ""
        try:
            run_step(model, ClippedPGLoss(loss), plan_of(error_threshold=THRESHOLD), microbatches(mine[0]),
                     global_valid_tokens=counts[0], global_valid_seqs=counts[1])
        except ValueError as err:
            no_counts_error = str(err)
        return {"modes": modes, "train_step": updates, "no_counts_error": no_counts_error, "dp": layout.dp_size}
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(2, deferred_and_precomputed)


@pytest.mark.parametrize("mode", [f"{m}{'-gspo' if g else ''}" for m, g in MODES])
def test_deferred_normalisation_equals_precomputed_counts_at_dp2(ranks, mode):
    for result in ranks:
        assert result["dp"] == 2
        run = result["modes"][mode]
        (deferred_metrics, deferred_grads), (metrics, grads) = run["deferred"], run["precomputed"]
        computes_prev, reason = run["masking_plan"]
        assert not computes_prev and "masks sequences inside the training forward" in reason
        scale = max(g.abs().max().item() for g in grads)
        assert scale > 1e-3
        for mine, theirs in zip(deferred_grads, grads, strict=True):
            assert (mine - theirs).abs().max().item() <= MODEL_GRAD_RTOL * scale
        assert deferred_metrics["num_masked_seqs_by_logprob_error"] == len(DROPPED)
        assert deferred_metrics["num_valid_samples_before_mask"] == ROWS - 1  # row 5 dropped before the mask
        assert "loss_normaliser" not in deferred_metrics
        # every metric of the precomputed step, the loss included (a mean of O(1) terms, fp32 sums in two orders)
        for name, value in metrics.items():
            assert deferred_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_train_step_defers_by_itself_under_the_plans_mask(ranks):
    for result in ranks:
        masked, premasked = result["train_step"]["masked"], result["train_step"]["premasked"]
        assert masked["passes"] == {} == premasked["passes"]  # no prev pass under the mask
        scale = max(g.abs().max().item() for g in premasked["grads"])
        for mine, theirs in zip(masked["grads"], premasked["grads"], strict=True):
            assert (mine - theirs).abs().max().item() <= MODEL_GRAD_RTOL * scale
        # SGD: lr times the clipped gradient, as well conditioned as the gradient, plus each weight's rounding
        rounding = 2 * FP32_U * premasked["weight_scale"]
        for mine, theirs in zip(masked["delta"], premasked["delta"], strict=True):
            assert (mine - theirs).abs().max().item() <= SGD_LR * MODEL_GRAD_RTOL * scale + rounding
        assert masked["metrics"]["loss"] == pytest.approx(premasked["metrics"]["loss"], rel=1e-5, abs=1e-6)
        assert masked["metrics"]["grad_norm"] == pytest.approx(premasked["metrics"]["grad_norm"], rel=MODEL_GRAD_RTOL)
        assert masked["metrics"]["masked_seqs_by_logprob_error_fraction"] == pytest.approx(len(DROPPED) / (ROWS - 1))


def test_counts_given_with_the_plans_mask_are_an_error_naming_the_fix(ranks):
    for result in ranks:
        assert "pass defer_normalisation=True (no counts), then apply_deferred_normalisation" in \
            result["no_counts_error"]
