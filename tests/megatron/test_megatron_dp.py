"""Data parallelism in train_step: TP=1, DP=2 over gloo, each rank half the batch, against DP=1 on the full batch.

The model is wrapped in Megatron-Core's DistributedDataParallel. The loss is normalised over the whole global
batch, so the reduced gradient must be the full-batch gradient to fp32 rounding (the DP all-reduce sums the halves
in another order), and the AdamW update must agree as far as Adam's conditioning carries that rounding.
DDP's reduction must be one collective per step; an unwrapped model under DP is an error naming the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _configs import config_with
from _dist import run_on_ranks
from _tolerances import MODEL_GRAD_RTOL, MODEL_LOGPROB_ATOL, adam_first_step_bound
from test_megatron_hooks import ROWS, TINY_MODEL, VOCAB, build, make_batch

DP_MODEL = {**TINY_MODEL, "policy.tensor_model_parallel_size": 1}


def one_train_step(rank: int, world_size: int) -> dict:
    """One train_step on this rank's contiguous share of the batch; what it did to the weights and gradients."""
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import (
        build_optimizer,
        destroy_parallel,
        init_parallel,
        train_step,
        vocab_shard_of,
        wrap_in_ddp,
    )
    from megatron_grpo.megatron.ddp import gradient
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, parallel_params, step_config

    cfg = config_with(DP_MODEL)
    layout = init_parallel(parallel_params(cfg))
    try:
        rows = ROWS // layout.dp_size
        batch = {key: value[layout.dp_rank * rows:(layout.dp_rank + 1) * rows] for key, value in
                 make_batch(seed=21).items()}
        unwrapped_error = ""
        if layout.dp_size > 1:  # first, the same step on a model without DDP
            plain = build(cfg)
            try:
                train_step(step_config(cfg), plain, build_optimizer(plain, adam_params(cfg)),
                           ClippedPGLoss(cfg.loss_fn), plan_for(cfg), batch, vocab=vocab_shard_of(plain, VOCAB))
            except ValueError as err:
                unwrapped_error = str(err)
        model = wrap_in_ddp(build(cfg))
        initial = [p.detach().clone() for p in model.parameters()]
        all_reduce_sizes = []
        all_reduce = dist.all_reduce

        def counted_all_reduce(tensor, *args, **kwargs):
            all_reduce_sizes.append(tensor.numel())
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counted_all_reduce
        try:
            result = train_step(step_config(cfg), model, build_optimizer(model, adam_params(cfg)),
                                ClippedPGLoss(cfg.loss_fn), plan_for(cfg), batch, vocab=vocab_shard_of(model, VOCAB))
        finally:
            dist.all_reduce = all_reduce
        return {
            "dp": (layout.dp_rank, layout.dp_size, layout.tp_size),
            "initial": initial,
            "params": [p.detach().clone() for p in model.parameters()],
            "names": [name for name, _ in model.named_parameters()],
            "grads": [gradient(p).detach().clone() for p in model.parameters()],  # clipped, as stepped
            "step_metrics": result.step_metrics,
            "curr_logprobs": result.curr_logprobs,
            "all_reduce_sizes": all_reduce_sizes,
            "unwrapped_error": unwrapped_error,
            **(two_backwards_around_a_step(cfg) if layout.dp_size == 1 else {}),
            "float64_grads": float64_gradients(cfg, batch),
        }
    finally:
        destroy_parallel()


def float64_gradients(cfg, batch) -> list[torch.Tensor]:
    """The same step's clipped gradients from a float64 model in Megatron's DDP (float64 gradient buffers)."""
    import dataclasses

    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import build_gpt_model, build_optimizer, train_step, vocab_shard_of, wrap_in_ddp
    from megatron_grpo.megatron.ddp import gradient
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, model_params, step_config

    torch.manual_seed(cfg.seed)
    model = wrap_in_ddp(build_gpt_model(dataclasses.replace(model_params(cfg), precision="fp64"), VOCAB))
    train_step(step_config(cfg), model, build_optimizer(model, adam_params(cfg)), ClippedPGLoss(cfg.loss_fn),
               plan_for(cfg), batch, vocab=vocab_shard_of(model, VOCAB))
    return [gradient(p).detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {"dp1": run_on_ranks(1, one_train_step), "dp2": run_on_ranks(2, one_train_step)}


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_layouts_are_tp1_with_dp1_and_dp2(runs):
    assert [r["dp"] for r in runs["dp1"]] == [(0, 1, 1)]
    assert [r["dp"] for r in runs["dp2"]] == [(0, 2, 1), (1, 2, 1)]


def test_dp2_halves_give_the_full_batch_gradient_and_update(runs):
    (full,) = runs["dp1"]
    optimizer = config_with(DP_MODEL).policy.optimizer
    assert optimizer.weight_decay == 0  # adam_first_step_bound's premise
    grad_scale = max(g.abs().max().item() for g in full["grads"])
    assert max_difference(full["params"], full["initial"]) > 1e-4  # the step really moved the weights
    assert grad_scale > 1e-3  # a real gradient, not zeros
    for half in runs["dp2"]:
        assert max_difference(half["initial"], full["initial"]) == 0  # same starting weights
        assert max_difference(half["grads"], full["grads"]) <= MODEL_GRAD_RTOL * grad_scale
        # Adam's update, elementwise within what its conditioning allows for these two gradients
        for name, a, b, g_a, g_b in zip(half["names"], half["params"], full["params"], half["grads"], full["grads"]):
            excess = (a.double() - b.double()).abs() - adam_first_step_bound(g_a, g_b, b, optimizer.lr,
                                                                             optimizer.adam_eps)
            assert excess.max().item() <= 0, name


def test_dp2_metrics_and_logprobs_match_the_full_batch(runs):
    (full,) = runs["dp1"]
    (full_step,) = full["step_metrics"]
    for rank, half in enumerate(runs["dp2"]):
        (half_step,) = half["step_metrics"]
        assert half_step["num_valid_tokens"] == full_step["num_valid_tokens"]  # a count: exact
        # the on-policy loss is -sum(A * mask) / tokens (ratio exactly 1): an fp32 sum of <= 56 terms of |A| < 3,
        # each rounded once and summed in another order, so within 56 * 2 u * 3 = 2e-5
        assert half_step["loss"] == pytest.approx(full_step["loss"], rel=0, abs=2e-5)
        # the token mean of exp(curr - curr.detach()), exactly 1 per token: a sum of per-microbatch fractions of the
        # global count, a few u from 1
        assert half_step["probs_ratio"] == pytest.approx(1.0, rel=0, abs=1e-6)
        # the norm is dominated by the largest elements, which MODEL_GRAD_RTOL bounds relative to the largest
        assert half_step["grad_norm"] == pytest.approx(full_step["grad_norm"], rel=MODEL_GRAD_RTOL)
        rows = ROWS // 2
        own_rows = full["curr_logprobs"][rank * rows:(rank + 1) * rows]
        assert (half["curr_logprobs"] - own_rows).abs().max() <= MODEL_LOGPROB_ATOL  # 4 rows per forward, not 8


def test_dp_gradient_reduction_is_one_all_reduce_of_all_gradients(runs):
    for half in runs["dp2"]:
        gradient_elements = sum(g.numel() for g in half["grads"])
        large = [size for size in half["all_reduce_sizes"] if size >= gradient_elements]
        assert len(large) == 1, half["all_reduce_sizes"]  # DDP's one buffer, not one collective per parameter


def test_an_unwrapped_model_under_data_parallelism_is_an_error_naming_ddp(runs):
    for half in runs["dp2"]:
        assert ("model: data parallelism needs the model wrapped in Megatron-Core's DistributedDataParallel"
                in half["unwrapped_error"])


def two_backwards_around_a_step(cfg) -> dict:
    """The gradient of one backward, after an AdamOverMainGrad step, with only DDP's buffer zeroed between."""
    from megatron_grpo.megatron import build_optimizer, model_forward, wrap_in_ddp
    from megatron_grpo.runner.plugin_params import adam_params

    model = wrap_in_ddp(build(cfg))
    optimizer = build_optimizer(model, adam_params(cfg))
    input_ids = make_batch(seed=3)["input_ids"]
    grads, left_behind = [], 0
    for _ in range(2):
        model.zero_grad_buffer()
        model_forward(model, input_ids).square().mean().backward()
        model.finish_grad_sync()
        grads.append([p.main_grad.clone() for p in model.parameters()])
        optimizer.step()
        left_behind += sum(p.grad is not None for p in model.parameters())
    return {"grads_around_a_step": grads, "grads_left_behind": left_behind}


def test_adam_over_main_grad_leaves_no_grad_alias_that_would_double_the_next_gradient(runs):
    (result,) = runs["dp1"]
    assert result["grads_left_behind"] == 0
    first, second = result["grads_around_a_step"]
    # the second backward runs on updated weights, so its gradient differs a little, but it is not doubled
    ratios = [(b.norm() / a.norm()).item() for a, b in zip(first, second) if a.norm() > 0]
    assert all(0.5 < ratio < 1.5 for ratio in ratios), ratios


def test_dp2_halves_of_a_float64_model_give_the_full_batch_gradient(runs):
    """Under DDP a float64 model's gradients stay float64 (Megatron's buffers in the parameters' dtype), so the halves'
    reduced gradient is the full batch's to float64 rounding: sums of a few hundred terms, 1e-12 of the largest."""
    (full,) = runs["dp1"]
    scale = max(g.abs().max().item() for g in full["float64_grads"])
    assert scale > 1e-3 and all(g.dtype == torch.float64 for g in full["float64_grads"])
    for half in runs["dp2"]:
        assert all(g.dtype == torch.float64 for g in half["float64_grads"])
        assert max_difference(half["float64_grads"], full["float64_grads"]) <= 1e-12 * scale
