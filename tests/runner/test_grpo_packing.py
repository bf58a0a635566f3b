"""Sequence packing in the runner: on the ragged task, a packed run's first step is the padded run's, over two DP
ranks, in another number of microbatches, with a prev pass and the sequence masking that reads it (inside the loss,
microbatch by microbatch, padded or packed, the normalisation deferred to the step's end). One launch of two gloo
ranks (TP 1, DP 2) drives the real Trainer."""

from __future__ import annotations

import torch
from _configs import CONFIGS, set_key
from _dist import run_on_ranks
from _tolerances import MODEL_GRAD_RTOL, MODEL_LOGPROB_ATOL

from megatron_grpo.runner.config import load_config
from megatron_grpo.runner.config_files import read_yaml_with_defaults

RAGGED = {
    "policy.tensor_model_parallel_size": 1,  # two ranks: DP 2
    "grpo.num_prompts_per_step": 4,  # 4 x 8 sequences, 16 per rank
    "policy.train_global_batch_size": 32,
    "policy.train_micro_batch_size": 8,  # padded: 2 microbatches of 8 rows per rank
    "policy.sequence_packing.train_mb_tokens": 40,  # packed: as many microbatches as the rank's lengths need
    "policy.sequence_packing.logprob_mb_tokens": 60,
    "logprob_passes.prev": "compute",  # a packed prev pass, read by the masking below in the loss
    "grpo.seq_logprob_error_threshold": 1.0 + 1e-6,  # masks the sequences whose prev strays from generation
}


def _ragged_config(packed: bool):
    data, _files = read_yaml_with_defaults(CONFIGS / "grpo_tiny_cpu_ragged.yaml")
    for key, value in {**RAGGED, "policy.sequence_packing.enabled": packed}.items():
        data = set_key(data, key, value)
    return load_config(data)


def first_steps(rank: int, world_size: int) -> dict:
    import importlib

    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.loop import Trainer
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import parallel_params, step_config

    # the package exports the function under the module's name
    train_step_module = importlib.import_module("megatron_grpo.megatron.step")

    configs = {name: _ragged_config(name == "packed") for name in ("padded", "packed")}
    layout = init_parallel(parallel_params(configs["padded"]))
    microbatches, shaped, out = {}, {}, {}
    run_schedule = train_step_module.run_schedule

    def counting_schedule(forward_step, model, batches, *, forward_only):
        if not forward_only:
            microbatches[current] = len(batches)
        return run_schedule(forward_step, model, batches, forward_only=forward_only)

    train_step_module.run_schedule = counting_schedule
    train_step = train_step_module.train_step

    def recording_train_step(step, model, optimizer, loss_fn, plan, batch, **kwargs):
        result = train_step(step, model, optimizer, loss_fn, plan, batch, **kwargs)
        shaped[current] = {"input_ids": batch["input_ids"].clone(), "token_mask": batch["token_mask"].clone(),
                           "prev_logprobs": result.prev_logprobs.clone()}  # the pass's, unpacked to [B, S]
        return result

    from megatron_grpo.runner import loop
    loop.train_step = recording_train_step
    try:
        for current, cfg in configs.items():
            torch.manual_seed(cfg.seed)  # both start from the same weights
            trainer = Trainer.build(cfg, plan_for(cfg), layout)
            out[current] = trainer.step(0)
            out[current]["max_tokens"] = step_config(cfg).max_tokens_per_microbatch
    finally:
        loop.train_step = train_step
        train_step_module.run_schedule = run_schedule
        destroy_parallel()
    return {"records": out, "microbatches": microbatches, "shaped": shaped}


def test_a_packed_first_step_is_the_padded_one_over_two_data_parallel_ranks():
    ranks = run_on_ranks(2, first_steps)
    for result in ranks:
        padded, packed = result["records"]["padded"], result["records"]["packed"]
        assert padded["max_tokens"] is None and packed["max_tokens"] == 40  # the config reaches StepConfig
        assert result["microbatches"]["padded"] == 2
        # the same rollout and, to rounding, the same prev ([B, S], the packed pass's unpacked)
        shaped_padded, shaped_packed = result["shaped"]["padded"], result["shaped"]["packed"]
        assert torch.equal(shaped_padded["input_ids"], shaped_packed["input_ids"])
        trained = shaped_padded["token_mask"] != 0  # the packed pass scores nothing past a row's last trained token
        torch.testing.assert_close(shaped_packed["prev_logprobs"][trained], shaped_padded["prev_logprobs"][trained],
                                   rtol=0, atol=MODEL_LOGPROB_ATOL)
        assert padded["reward_mean"] == packed["reward_mean"] and padded["prev_pass_ran"] and packed["prev_pass_ran"]
        assert padded["num_masked_seqs_by_logprob_error"] == packed["num_masked_seqs_by_logprob_error"]
        # The loss is normalised by the step's token and sequence counts over all microbatches and both ranks:
        # exact whatever the microbatches. Loss: a token mean of |values| < 10 whose terms differ by the logprobs'
        # rounding (MODEL_LOGPROB_ATOL) times |advantage| <= sqrt(group size) = 2.9. Grad norm: |‖a‖ - ‖b‖| <=
        # ‖a - b‖, rounding of the gradient relative to its size (MODEL_GRAD_RTOL).
        assert abs(packed["loss"] - padded["loss"]) <= 3 * MODEL_LOGPROB_ATOL
        assert abs(packed["grad_norm"] - padded["grad_norm"]) <= MODEL_GRAD_RTOL * padded["grad_norm"]
        assert packed["loss"] != 0 and padded["grad_norm"] > 0
    # the packed steps ran another number of microbatches than the padded ones (as many as the lengths need)
    counts = [result["microbatches"]["packed"] for result in ranks]
    assert all(count not in (0, 2) for count in counts), counts
