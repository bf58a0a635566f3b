"""The tiny task still learns off-policy: with rollouts one step stale, and with two optimizer steps per rollout."""

from __future__ import annotations

import pytest

from megatron_grpo.grpo.reporting import read_metrics
from grpo_workers.launch import run, torchrun_command, write_config

STEPS = 120  # the 10-step mean passes 0.9 by step 91 (stale) and 69 (two steps per rollout), and stays
TP1_NO_CHECKPOINTS = {"policy.tensor_model_parallel_size": 1, "grpo.max_num_steps": STEPS,
                      "checkpoint.every_n_steps": 0}
STALE = {
    "grpo.max_rollout_staleness": 1,
    "loss_fn.use_importance_sampling_correction": True,
    "loss_fn.truncated_importance_sampling.type": "tis",
    "loss_fn.truncated_importance_sampling.ratio_min": 0.0,
    "loss_fn.truncated_importance_sampling.ratio_max": 2.0,
}
TWO_STEPS_PER_ROLLOUT = {"policy.train_global_batch_size": 64}  # the rollout is 16 x 8 = 128 sequences


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [STALE, TWO_STEPS_PER_ROLLOUT], ids=["staleness-1", "two-steps-per-rollout"])
def test_off_policy_runs_learn_from_near_zero_to_ninety_percent(tmp_path, overrides):
    config = write_config(tmp_path, **TP1_NO_CHECKPOINTS, **overrides)
    code, output = run(torchrun_command(config, nproc=1), tmp_path / "log.txt", timeout=420)
    assert code == 0, output
    stale = "grpo.max_rollout_staleness" in overrides  # one update per rollout: the prev pass is redundant
    assert ("prev logprobs skipped" if stale else "prev logprobs computed") in output
    records = read_metrics(tmp_path / "run")
    rewards = [record["reward_mean"] for record in records]
    assert len(rewards) == STEPS
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    assert first <= 0.2, f"a random policy should start near 0, got {first:.3f}"
    assert last >= 0.9, f"first 10 steps {first:.3f}, last 10 steps {last:.3f}"
    assert all(record["prev_pass_ran"] != stale for record in records)
    ages = {record["rollout_age"] for record in records[1:]}
    assert ages == ({1} if stale else {0})
