"""Packed (THD) microbatches through the tiny GPTModel equal padded ones: `train_step` with
`StepConfig.max_tokens_per_microbatch` (first-fit-decreasing packing, and its balanced variant at TP 1;
`TorchDotProductAttention`'s THD path, one causal SDPA per sequence on the CPU; positions that restart per
sequence) against the same rollout in padded microbatches, with a prev pass (`compute_logprobs` on packed
microbatches) and a sequence-level loss, on the materialised, fused linear and loss-fused paths, at TP 1 (learned
absolute positions and RoPE), TP 2 and PP 2.

One spawn per world size: world 1 runs TP 1; world 2 runs TP 2, then PP 2 (Megatron's 1F1B schedule over packed
microbatches of one length). Tolerances: fp32 models whose GEMMs and attention softmaxes see other shapes (a packed
row against padded rows, other blocking): logprobs and the loss to 1e-6, the gradient norm to 1e-5 relative.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from test_megatron_hooks import TINY_MODEL, make_batch

LOGPROB_ATOL = 1e-6  # fp32 logprobs of O(1) computed over other GEMM shapes: a few ulps of the logits, summed
LOSS_ATOL = 1e-6  # a token mean of functions of those logprobs with slope O(1)
GRAD_NORM_RTOL = 1e-5  # fp32 gradients accumulated over other microbatch splits and shapes
MAX_TOKENS = 16  # rows of up to 7 tokens: 3 or 4 packed microbatches against 4 padded ones of 2 rows
MODES = {"materialised": (False, False), "fused": (True, False), "loss_fused": (True, True)}
LOSS = {"logprob_passes.prev": "compute", "loss_fn.loss_agg_mode": "seq-mean-token-mean",
        "loss_fn.entropy_coef": 0.01, "generation.temperature": 0.7}


def _train(cfg, max_tokens, batch) -> dict:
    from test_megatron_hooks import VOCAB

    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import build_gpt_model, build_optimizer, train_step, vocab_shard_of
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, model_params, step_config

    torch.manual_seed(cfg.seed)
    model = build_gpt_model(model_params(cfg), VOCAB)
    step = dataclasses.replace(step_config(cfg), max_tokens_per_microbatch=max_tokens)
    result = train_step(step, model, build_optimizer(model, adam_params(cfg)), ClippedPGLoss(cfg.loss_fn),
                        plan_for(cfg), batch, vocab=vocab_shard_of(model, VOCAB))
    return {"curr": result.curr_logprobs, "prev": result.prev_logprobs, "metrics": result.step_metrics[0],
            "passes": result.passes_run}


def _compare(cfg) -> dict:
    from megatron_grpo.loss import trained_token_mask

    batch = make_batch(seed=31)
    mask = trained_token_mask(batch).bool()
    padded, packed = _train(cfg, None, batch), _train(cfg, MAX_TOKENS, batch)
    return {
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
            outcome[name] = {mode: _compare(config_with({**base, "policy.fused_linear_logprobs": linear,
                                                         "policy.fused_linear_loss": loss_fused}))
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
    for rank in ranks:
        for layout, results in rank.items():
            result = results[mode]
            label = f"{layout} {mode}"
            assert result["passes"] == ({"prev": 1}, {"prev": 1}), label
            assert result["counts"][0] == result["counts"][1], label  # tokens and sequences, not rows
            assert result["curr_error"] <= LOGPROB_ATOL, (label, result)
            assert result["prev_error"] <= LOGPROB_ATOL, (label, result)
            assert result["loss_error"] <= LOSS_ATOL, (label, result)
            padded, packed = result["grad_norm"]
            assert padded > 0 and abs(padded - packed) <= GRAD_NORM_RTOL * padded, (label, result)


def test_both_world_sizes_ran_every_layout(ranks):
    assert {layout for rank in ranks for layout in rank} <= {"tp1", "tp1_rope", "tp1_balanced", "tp2", "pp2"}
    assert all(set(rank) in ({"tp1", "tp1_rope", "tp1_balanced"}, {"tp2", "pp2"}) for rank in ranks)
