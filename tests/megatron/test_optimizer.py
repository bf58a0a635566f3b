"""A train step cannot silently do nothing: under Megatron's DDP the gradients are in `main_grad`, and `train_step`
steps any torch optimizer over them (views, no copy). What cannot work is an error naming the fix: bf16 weights over
DDP's fp32 buffers (Megatron's optimizer keeps fp32 master weights), an optimizer over other parameters."""

from __future__ import annotations

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from test_megatron_hooks import TINY_MODEL, VOCAB, build, make_batch

MODEL = {**TINY_MODEL, "policy.tensor_model_parallel_size": 1}


def step_with(optimizer_of, *, dtype: torch.dtype = torch.float32):
    """One train_step on a DDP-wrapped tiny model with the optimizer `optimizer_of(model)` builds: how many
    parameters moved (of how many), or the error it raised."""
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import train_step, vocab_shard_of, wrap_in_ddp
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import step_config

    cfg = config_with(MODEL)
    model = build(cfg).to(dtype)
    vocab = vocab_shard_of(model, VOCAB)
    model = wrap_in_ddp(model)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        train_step(step_config(cfg), model, optimizer_of(model), ClippedPGLoss(cfg.loss_fn), plan_for(cfg),
                   make_batch(seed=5), vocab=vocab)
    except ValueError as err:
        return str(err)
    moved = sum(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    left = sum(p.grad is not None for p in model.parameters())
    return moved, len(before), left


def clip_norms_with_a_shared_weight() -> tuple[float, float]:
    """clip_grad_norm's norm of two gradients (3 and 4), then with the second weight marked `shared` as Megatron marks
    a pipeline stage's copy of the tied embedding."""
    from megatron_grpo.megatron.optimizer import clip_grad_norm

    model = torch.nn.Linear(1, 1)
    model.weight.grad, model.bias.grad = torch.full((1, 1), 3.0), torch.full((1,), 4.0)
    whole = clip_grad_norm(model, 0.0)
    model.bias.shared = True
    return whole, clip_grad_norm(model, 0.0)


def worker(rank: int, world_size: int) -> dict:
    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.plugin_params import parallel_params

    init_parallel(parallel_params(config_with(MODEL)))
    try:
        return {
            "adam": step_with(lambda model: torch.optim.Adam(model.parameters(), lr=1e-3)),
            "sgd": step_with(lambda model: torch.optim.SGD(model.parameters(), lr=1e-2)),
            "bf16": step_with(lambda model: torch.optim.Adam(model.parameters(), lr=1e-3), dtype=torch.bfloat16),
            "others": step_with(lambda model: torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=1e-3)),
            "shared": clip_norms_with_a_shared_weight(),
        }
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def outcomes() -> dict:
    (outcome,) = run_on_ranks(1, worker)
    return outcome


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_plain_torch_optimizer_after_wrap_in_ddp_trains_every_parameter(outcomes, optimizer):
    moved, total, grads_left = outcomes[optimizer]
    assert moved == total > 0
    assert grads_left == 0  # the main_grad views are gone: the next backward cannot double-count through .grad


def test_bf16_weights_under_a_torch_optimizer_name_megatrons_optimizer(outcomes):
    assert "a torch.bfloat16 parameter's gradient is in DDP's torch.float32 main_grad" in outcomes["bf16"]
    assert "get_megatron_optimizer" in outcomes["bf16"] and "build_optimizer" in outcomes["bf16"]


def test_an_optimizer_over_other_parameters_is_an_error(outcomes):
    assert outcomes["others"].startswith("optimizer: none of its parameters has a gradient after the backward")


def test_clip_grad_norm_counts_a_shared_weight_once(outcomes):
    whole, without_shared = outcomes["shared"]
    assert (whole, without_shared) == (5.0, 3.0)  # exact: small integers in float32
