"""The fused paths run their GEMMs in the model's compute dtype, not in the hidden states' dtype.

A bf16 run keeps fp32 master weights and autocasts the forward (`policy.precision: bf16`). Without Transformer Engine
the local spec's final LayerNorm returns fp32 hidden states (and on the CPU Megatron's CUDA autocast does nothing), and
the loss function runs outside autocast: casting the weight to the hidden states' dtype would make the fused GEMMs
fp32. Here, on the CPU with a bf16-configured tiny GPTModel, the train step's fused op and loss-fused path see fp32
hidden states and compute bf16 chunk logits; an fp32 model computes fp32 ones.

The same Megatron process also checks that the train step, whose loss and passes skip their checks of values in every
microbatch, names a bad batch value once, up front.
"""

from __future__ import annotations

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from test_megatron_hooks import TINY_MODEL, make_batch

ONE_RANK = {**TINY_MODEL, "policy.tensor_model_parallel_size": 1}
MODES = {"fused": {"policy.fused_linear_logprobs": True},
         "loss_fused": {"policy.fused_linear_logprobs": True, "policy.fused_linear_loss": True}}


def _train_step_dtypes(cfg) -> dict:
    """One train step; the dtypes of the hidden states the loss got and of every chunk of logits the GEMMs wrote."""
    from test_megatron_hooks import VOCAB

    from megatron_grpo.loss import ClippedPGLoss, fused_head
    from megatron_grpo.megatron import build_gpt_model, build_optimizer, train_step, vocab_shard_of
    from megatron_grpo.megatron.hidden_states import compute_dtype
    from megatron_grpo.ops import linear_logprobs
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, model_params, step_config

    torch.manual_seed(cfg.seed)
    model = build_gpt_model(model_params(cfg), VOCAB)
    seen = {"chunk_logits": set(), "hidden": set()}
    chunk_logits = linear_logprobs.chunk_logits  # the one chunk GEMM (ops.core.gemm), as both fused paths import it

    def recording(hidden_chunk, weight_valid, scale, out):
        seen["chunk_logits"].add(out.dtype)
        return chunk_logits(hidden_chunk, weight_valid, scale, out)

    original_forward = type(model).forward

    def forward_recording_output(self, *args, **kwargs):
        output = original_forward(self, *args, **kwargs)
        seen["hidden"].add(output.dtype)
        return output

    linear_logprobs.chunk_logits = fused_head.chunk_logits = recording
    type(model).forward = forward_recording_output
    try:
        result = train_step(step_config(cfg), model, build_optimizer(model, adam_params(cfg)),
                            ClippedPGLoss(cfg.loss_fn), plan_for(cfg), make_batch(seed=3),
                            vocab=vocab_shard_of(model, VOCAB))
    finally:
        linear_logprobs.chunk_logits = fused_head.chunk_logits = chunk_logits
        type(model).forward = original_forward
    weight = model.output_layer.weight
    return {"chunk_logits": seen["chunk_logits"], "hidden": seen["hidden"], "compute_dtype": compute_dtype(model),
            "weight_dtype": weight.dtype, "weight_grad_norm": float(weight.grad.norm()) if weight.grad is not None
            else 0.0, "loss": result.step_metrics[0]["loss"]}


def _bad_batch_error(cfg) -> str:
    """The train step's error for a token id beyond the true vocab (13 real ids, padded to 16)."""
    from test_megatron_hooks import VOCAB

    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import build_gpt_model, build_optimizer, train_step, vocab_shard_of
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, model_params, step_config

    model = build_gpt_model(model_params(cfg), VOCAB)
    batch = make_batch(seed=4)
    batch["input_ids"][2, 5] = VOCAB  # a padding id: the embedding would take it silently
    try:
        train_step(step_config(cfg), model, build_optimizer(model, adam_params(cfg)), ClippedPGLoss(cfg.loss_fn),
                   plan_for(cfg), batch, vocab=vocab_shard_of(model, VOCAB))
    except ValueError as error:
        return str(error)
    return "no error"


def worker(rank: int, world_size: int) -> dict:
    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.plugin_params import parallel_params

    init_parallel(parallel_params(config_with(ONE_RANK)))
    try:
        results = {(precision, mode): _train_step_dtypes(config_with({**ONE_RANK, **overrides,
                                                                      "policy.precision": precision}))
                   for precision in ("bf16", "fp32") for mode, overrides in MODES.items()}
        results["bad_batch_error"] = _bad_batch_error(config_with({**ONE_RANK, **MODES["fused"]}))
        return results
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def results() -> dict:
    (only_rank,) = run_on_ranks(1, worker)
    return only_rank


@pytest.mark.parametrize("mode", MODES)
def test_a_bf16_model_computes_bf16_chunk_logits_from_fp32_hidden_states(results, mode):
    got = results[("bf16", mode)]
    assert got["weight_dtype"] == torch.float32 and got["hidden"] == {torch.float32}  # fp32 master weights, hidden
    assert got["compute_dtype"] == torch.bfloat16
    assert got["chunk_logits"] == {torch.bfloat16}
    assert got["weight_grad_norm"] > 0 and got["loss"] == got["loss"]  # a gradient reached the fp32 weight; no NaN


@pytest.mark.parametrize("mode", MODES)
def test_an_fp32_model_computes_fp32_chunk_logits(results, mode):
    got = results[("fp32", mode)]
    assert got["compute_dtype"] == torch.float32 and got["chunk_logits"] == {torch.float32}


def test_the_train_step_names_a_bad_token_id_once_up_front(results):
    assert results["bad_batch_error"] == "batch['input_ids']: contains token id 13, outside the vocab [0, 13)"
