"""Off-policy GRPO in the loop: stale rollouts really come from older weights, and several optimizer steps per
rollout move the ratio away from 1, and a resume with rollouts in flight repeats the uninterrupted run. One
process (TP=1, gloo) drives the real Trainer for a few steps."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from _tolerances import MODEL_LOGPROB_ATOL

STEPS = 4
OFF_POLICY = {
    "policy.tensor_model_parallel_size": 1,
    "grpo.max_rollout_staleness": 1,
    "policy.train_global_batch_size": 64,  # half of the 16 x 8 rollout: two optimizer steps per rollout
    "policy.train_micro_batch_size": 32,
    "grpo.max_num_steps": STEPS,
    "loss_fn.use_importance_sampling_correction": True,
    "loss_fn.truncated_importance_sampling.type": "tis",
    "loss_fn.truncated_importance_sampling.ratio_min": 0.0,
    "loss_fn.truncated_importance_sampling.ratio_max": 2.0,
}


def sampling_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """[B, S] log-probabilities of the rollout's tokens under `model`'s sampling distribution (TP=1)."""
    from megatron_grpo.megatron import model_forward

    with torch.no_grad():
        logits = model_forward(model, rollout.input_ids)[..., : model.true_vocab_size].double() / temperature
    picked = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, rollout.input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0)) * rollout.token_mask


def drive_trainer(rank: int, world_size: int, overrides: dict) -> dict:
    from megatron_grpo.grpo.loop import Trainer
    from megatron_grpo.megatron import build_gpt_model, destroy_parallel, init_parallel
    from megatron_grpo.scheduler import plan_logprob_passes

    cfg = config_with(overrides)
    plan = plan_logprob_passes(cfg)
    trainer = Trainer.build(cfg, plan, init_parallel(cfg))
    snapshots, taken, records = {}, [], []
    take = trainer.rollouts.take

    def recording_take(step):
        entry = take(step)
        taken.append(entry)
        return entry

    trainer.rollouts.take = recording_take
    for step in range(STEPS):
        snapshots[step] = copy.deepcopy(trainer.model.state_dict())  # the weights that have done `step` steps
        records.append(trainer.step(step))
        # prev comes from the weights at the start of the step: PPO's old policy, recomputed by the plan's pass
    checks = []
    probe = build_gpt_model(cfg, trainer.task.tokenizer.vocab_size)
    temperature = cfg.generation.temperature
    for entry in taken:
        probe.load_state_dict(snapshots[entry.weight_version])
        under_generating = sampling_logprobs(probe, entry.rollout, temperature)
        probe.load_state_dict(snapshots[entry.step])
        under_current = sampling_logprobs(probe, entry.rollout, temperature)
        generation = entry.rollout.generation_logprobs.double()
        checks.append({
            "step": entry.step,
            "weight_version": entry.weight_version,
            "gen_vs_generating_weights": (generation - under_generating).abs().max().item(),
            "gen_vs_current_weights": (generation - under_current).abs().max().item(),
        })
    destroy_parallel()
    return {"plan": (plan.compute_reference_logprobs, plan.compute_prev_logprobs), "checks": checks,
            "records": records}


def test_stale_rollouts_come_from_older_weights_and_the_ratio_moves():
    (result,) = run_on_ranks(1, drive_trainer, OFF_POLICY)
    assert result["plan"] == (False, True)  # staleness and two steps per rollout: prev is computed
    checks, records = result["checks"], result["records"]
    assert [c["weight_version"] for c in checks] == [0, 0, 1, 2]  # step s trains on weights of step max(0, s-1)
    for check in checks:
        # generation logprobs: the generating weights' (one fp32 forward per decoding step against a float64 head on
        # one full-sequence forward: rounding only)
        assert check["gen_vs_generating_weights"] <= MODEL_LOGPROB_ATOL, check
    for check in checks[1:]:
        assert check["gen_vs_current_weights"] > 1e-4, check  # ... not the current ones once the weights moved
    assert [r["rollout_age"] for r in records] == [0, 1, 1, 1]
    for record in records:
        assert record["prev_pass_ran"]
        assert record["probs_ratio"] != 1.0  # the second optimizer step of each rollout trains on moved weights
        assert torch.isfinite(torch.tensor(record["loss"]))
    for record in records[1:]:
        assert record["token_mult_prob_error"] > 1.0 + 1e-6  # prev (current weights) vs generation (older ones)
        assert record["gen_kl_error"] != 0.0


def train_and_resume(rank: int, world_size: int, overrides: dict, root: str) -> dict:
    """An uninterrupted run that checkpoints after 2 of 4 steps, then a resume of that checkpoint in another run
    directory, then a resume of it with another staleness (an error)."""
    from megatron_grpo.grpo.checkpoint_dir import CheckpointError, step_dir_name
    from megatron_grpo.grpo.loop import train
    from megatron_grpo.grpo.reporting import read_metrics, without_timings
    from megatron.core import parallel_state

    from megatron_grpo.megatron import init_parallel
    from megatron_grpo.scheduler import plan_logprob_passes

    def run(run_dir: str, resume_from, **more) -> list[dict]:
        cfg = config_with({**overrides, "checkpoint.every_n_steps": 2, "run_dir": f"{root}/{run_dir}",
                           "checkpoint.dir": f"{root}/{run_dir}/checkpoints", **more})
        layout = init_parallel(cfg)
        try:
            train(cfg, plan_logprob_passes(cfg), layout, resume_from=resume_from)
        finally:
            parallel_state.destroy_model_parallel()  # the default group stays for the next run
        return [without_timings(record) for record in read_metrics(Path(cfg.run_dir))]

    uninterrupted = run("uninterrupted", None)
    middle = Path(root) / "uninterrupted" / "checkpoints" / step_dir_name(2)
    resumed = run("resumed", middle)
    try:
        run("other_staleness", middle, **{"grpo.max_rollout_staleness": overrides["grpo.max_rollout_staleness"] + 1})
        staleness_error = ""
    except CheckpointError as err:
        staleness_error = str(err)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "staleness_error": staleness_error}


@pytest.mark.slow  # three torchrun jobs per case
@pytest.mark.parametrize("staleness", [1, 2])
def test_a_resume_with_rollouts_in_flight_repeats_the_uninterrupted_run(tmp_path, staleness):
    (result,) = run_on_ranks(1, train_and_resume, {**OFF_POLICY, "grpo.max_rollout_staleness": staleness},
                             str(tmp_path))
    uninterrupted, resumed = result["uninterrupted"], result["resumed"]
    assert [r["step"] for r in resumed] == [2, 3]
    assert [r["rollout_weight_version"] for r in resumed] == [2 - staleness, 3 - staleness]  # from the queue
    assert resumed == uninterrupted[2:]  # every metric, bit for bit (fp32 on the CPU)
    expected = f"saved with grpo.max_rollout_staleness = {staleness}, this run has {staleness + 1}"
    assert expected in result["staleness_error"]
