"""End to end: a run with NeMo-RL's reference-skip switch, and the largest seed, trains and reports the skips."""

from __future__ import annotations

import math

import pytest
from grpo_workers.launch import run, torchrun_command, write_config

from megatron_grpo.runner.config import MAX_SEED
from megatron_grpo.runner.reporting import read_metrics

STEPS = 2


@pytest.mark.slow
def test_skip_reference_switch_and_the_largest_seed_train_and_report_the_skipped_passes(tmp_path):
    config = write_config(tmp_path, **{
        "seed": MAX_SEED,
        "grpo.skip_reference_policy_logprobs_calculation": True,
        "grpo.max_num_steps": STEPS,
        "checkpoint.every_n_steps": 0,
        "policy.tensor_model_parallel_size": 1,
    })
    code, output = run(torchrun_command(config, nproc=1), tmp_path / "log.txt")
    assert code == 0, output
    assert "reference logprobs and reference model skipped: grpo.skip_reference_policy_logprobs_calculation = true" \
        in output
    assert f"reference logprob passes skipped  {STEPS} of {STEPS}" in output
    records = read_metrics(tmp_path / "run")
    assert [record["step"] for record in records] == list(range(STEPS))
    assert all(math.isfinite(record["loss"]) and not record["reference_pass_ran"] for record in records)
