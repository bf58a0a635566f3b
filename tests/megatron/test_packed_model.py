"""Packed (THD) microbatches through the tiny GPTModel equal padded ones: `train_step` with
`StepConfig.max_tokens_per_microbatch` (first-fit-decreasing packing, and its balanced variant at TP 1;
`TorchDotProductAttention`'s THD path, one causal SDPA per sequence on the CPU; positions that restart per
sequence) against the same rollout in padded microbatches, with a prev pass (`compute_logprobs` on packed
microbatches) and a sequence-level loss, on the materialised, fused linear and loss-fused paths, at TP 1 (learned
absolute positions and RoPE), TP 2 and PP 2: the curr and prev logprobs, the loss, the gradient norm and every
parameter's gradient (after the step's clip, which scales both alike).

One spawn per world size: world 1 runs TP 1; world 2 runs TP 2, then PP 2 (Megatron's 1F1B schedule over packed
microbatches of one length). The models are float64 (`GPTModelParams.precision="fp64"`), which runs the ops'
plain-torch kernels; TP 1 runs once more in fp32, through the C++ CPU kernels that float64 does not take.

Tolerances. float64: the packed and padded steps do the same maths over other GEMM shapes, blockings and summation
orders (a packed row against padded rows, other microbatch splits), so each result is a few roundings (2.2e-16
relative) of quantities of order 1 away from the other, through two layers; gradients are compared relative to their
tensor's largest element, so one that cancels to about 0 is held to its terms' rounding. 1e-12 leaves thousands of
ulps of headroom, while a packing error (a token attending across sequences, a position that does not restart, a
wrongly unpacked row) moves them far more (positions capped at 3 moved the logprobs by 0.7, the loss by 3e-4).
fp32: the same at 6e-8 per rounding: logprobs and the loss to 1e-6, gradients to 1e-5 relative.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from test_megatron_hooks import TINY_MODEL, make_batch

TOLERANCES = {  # logprob and loss absolute, gradient relative to its tensor's largest element (module docstring)
    "fp64": {"logprob": 1e-12, "loss": 1e-12, "grad": 1e-12},
    "fp32": {"logprob": 1e-6, "loss": 1e-6, "grad": 1e-5},
}
MAX_TOKENS = 16  # rows of up to 7 tokens: 3 or 4 packed microbatches against 4 padded ones of 2 rows
MODES = {"materialised": (False, False), "fused": (True, False), "loss_fused": (True, True)}
LOSS = {"logprob_passes.prev": "compute", "loss_fn.loss_agg_mode": "seq-mean-token-mean",
        "loss_fn.entropy_coef": 0.01, "generation.temperature": 0.7}


def _train(cfg, precision: str, max_tokens: int | None, batch) -> dict:
    from test_megatron_hooks import VOCAB

    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import build_gpt_model, build_optimizer, train_step, vocab_shard_of
    from megatron_grpo.megatron.ddp import gradient
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, model_params, step_config

    torch.manual_seed(cfg.seed)
    model = build_gpt_model(dataclasses.replace(model_params(cfg), precision=precision), VOCAB)
    step = dataclasses.replace(step_config(cfg), max_tokens_per_microbatch=max_tokens)
    result = train_step(step, model, build_optimizer(model, adam_params(cfg)), ClippedPGLoss(cfg.loss_fn),
                        plan_for(cfg), batch, vocab=vocab_shard_of(model, VOCAB))
    grads = {name: gradient(param).clone() for name, param in model.named_parameters()}  # the step's, clipped
    return {"curr": result.curr_logprobs, "prev": result.prev_logprobs, "metrics": result.step_metrics[0],
            "passes": result.passes_run, "grads": grads,
            "dtypes": {param.dtype for param in model.parameters()}}


def _worst_grad_error(grads: dict, expected: dict) -> float:
    """The largest gradient difference, relative to its tensor's largest element, over the parameters."""
    return max(((grads[name] - want).abs().max() / want.abs().max().clamp(min=torch.finfo(want.dtype).tiny)).item()
               for name, want in expected.items())


def _compare(cfg, precision: str) -> dict:
    from megatron_grpo.loss import trained_token_mask

    batch = make_batch(seed=31)
    mask = trained_token_mask(batch).bool()
    padded, packed = _train(cfg, precision, None, batch), _train(cfg, precision, MAX_TOKENS, batch)
    return {
        "dtypes": (padded["dtypes"], packed["dtypes"], {padded["curr"].dtype, packed["curr"].dtype}),
        "grad_error": _worst_grad_error(packed["grads"], padded["grads"]),
        "curr_error": (padded["curr"] - packed["curr"])[mask].abs().max().item(),
        "prev_error": (padded["prev"] - packed["prev"])[mask].abs().max().item(),
        "loss_error": abs(padded["metrics"]["loss"] - packed["metrics"]["loss"]),
        "grad_norm": (padded["metrics"]["grad_norm"], packed["metrics"]["grad_norm"]),
        "counts": [(m["num_valid_tokens"], m["num_valid_samples"]) for m in (padded["metrics"], packed["metrics"])],
        "passes": (padded["passes"], packed["passes"]),
    }


def run_layouts(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.plugin_params import parallel_params

    layouts = {"tp1": {"policy.tensor_model_parallel_size": 1},
               "tp1_rope": {"policy.tensor_model_parallel_size": 1,
                            "policy.model.position_embedding_type": "rope"},
               "tp1_balanced": {"policy.tensor_model_parallel_size": 1,
                                "policy.sequence_packing.algorithm": "balanced_first_fit_decreasing"},
               } if world_size == 1 else {
        "tp2": {"policy.tensor_model_parallel_size": 2},
        "pp2": {"policy.tensor_model_parallel_size": 1, "policy.pipeline_model_parallel_size": 2}}
    outcome = {}
    try:
        for name, layout in layouts.items():  # one process group, Megatron's groups rebuilt per layout
            base = {**TINY_MODEL, **LOSS, **layout}
            init_parallel(parallel_params(config_with(base)))
            for precision in ("fp64", "fp32") if name == "tp1" else ("fp64",):
                outcome[name, precision] = {
                    mode: _compare(config_with({**base, "policy.fused_linear_logprobs": linear,
                                                "policy.fused_linear_loss": loss_fused}), precision)
                    for mode, (linear, loss_fused) in MODES.items()}
            parallel_state.destroy_model_parallel()
    finally:
        destroy_parallel()
    return outcome


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def ranks(request) -> list[dict]:
    return run_on_ranks(request.param, run_layouts)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_packed_train_step_equals_padded(ranks, mode):
    dtypes = {"fp64": torch.float64, "fp32": torch.float32}
    for rank in ranks:
        for (layout, precision), results in rank.items():
            result, tolerance = results[mode], TOLERANCES[precision]
            label = f"{layout} {precision} {mode}"
            assert result["dtypes"] == ({dtypes[precision]},) * 3, label  # every parameter, and the logprobs
            assert result["passes"] == ({"prev": 1}, {"prev": 1}), label
            assert result["counts"][0] == result["counts"][1], label  # tokens and sequences, not rows
            assert result["curr_error"] <= tolerance["logprob"], (label, result)
            assert result["prev_error"] <= tolerance["logprob"], (label, result)
            assert result["loss_error"] <= tolerance["loss"], (label, result)
            assert result["grad_error"] <= tolerance["grad"], (label, result)
            padded, packed = result["grad_norm"]
            assert padded > 0 and abs(padded - packed) <= tolerance["grad"] * padded, (label, result)


def test_both_world_sizes_ran_every_layout(ranks):
    world1 = {("tp1", "fp64"), ("tp1", "fp32"), ("tp1_rope", "fp64"), ("tp1_balanced", "fp64")}
    world2 = {("tp2", "fp64"), ("pp2", "fp64")}
    assert all(set(rank) in (world1, world2) for rank in ranks)
