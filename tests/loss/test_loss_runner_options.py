"""The loss options that need the runner, end to end under torchrun (TP=2 over gloo, 2 steps, about 20 s).

`grpo.seq_logprob_error_threshold` and `loss_fn.kl_in_sequence_reward` read prev (and reference) logprobs before the
loss; CISPO and VAPO's positive-example NLL read the rollout's rewards in the loss.
"""

from __future__ import annotations

import math

import pytest
from grpo_workers.launch import run, torchrun_command, write_config

from megatron_grpo.runner.reporting import read_metrics


@pytest.mark.slow
def test_kl_in_reward_logprob_error_masking_cispo_and_nll_run_end_to_end(tmp_path):
    config = write_config(tmp_path, **{
        "grpo.max_num_steps": 2,
        "checkpoint.every_n_steps": 0,
        "grpo.seq_logprob_error_threshold": 2.0,
        "loss_fn.kl_in_sequence_reward": True,
        "loss_fn.reference_policy_kl_penalty": 0.05,
        "loss_fn.use_cispo": True,
        "loss_fn.positive_example_nll_weight": 0.1,
    })
    code, output = run(torchrun_command(config, nproc=2), tmp_path / "log.txt")
    assert code == 0, output
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert record["reference_pass_ran"] and record["prev_pass_ran"]  # both read before the loss
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
        # on-policy rollouts: generation and prev agree, so no sequence is near the threshold
        assert record["num_masked_seqs_by_logprob_error"] == 0 == record["masked_seqs_by_logprob_error_fraction"]
        assert 1.0 <= record["max_seq_mult_prob_error"] < 1.0 + 1e-4
        assert record["positive_nll_loss"] > 0 and record["filtered_out_tokens"] == 0
        assert "kl_penalty" not in record  # the KL is in the reward, not the loss
    # the reference is the initial policy: no KL at step 0, some once the policy has moved
    assert records[0]["reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert records[1]["reward_kl_penalty"] > 0
