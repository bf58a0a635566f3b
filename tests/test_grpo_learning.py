"""The tiny config learns by RL alone: a bounded TP=1 run with a fixed seed raises the mean reward, on the fused
linear path with the loss-fused training step (`policy.fused_linear_logprobs`, `policy.fused_linear_loss`); the
materialised-logits path learns in the off-policy learning tests."""

from __future__ import annotations

import pytest

from megatron_grpo.grpo.reporting import read_metrics
from grpo_workers.launch import run, torchrun_command, write_config

STEPS = 60
pytestmark = pytest.mark.slow  # torchrun jobs, end to end


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_reward_rises_within_sixty_steps(tmp_path):
    config = write_config(tmp_path, **{"policy.tensor_model_parallel_size": 1, "grpo.max_num_steps": STEPS,
                                       "checkpoint.every_n_steps": 0, "policy.fused_linear_logprobs": True,
                                       "policy.fused_linear_loss": True})
    code, output = run(torchrun_command(config, nproc=1), tmp_path / "log.txt")
    assert code == 0, output
    rewards = [record["reward_mean"] for record in read_metrics(tmp_path / "run")]
    assert len(rewards) == STEPS
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    assert first <= 0.2, f"a random policy should start near 0, got {first:.3f}"
    assert last >= first + 0.2, f"reward did not rise: first 10 steps {first:.3f}, last 10 steps {last:.3f}"
