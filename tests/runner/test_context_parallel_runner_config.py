"""`policy.context_parallel_size`: read into the plugin's ParallelParams and checked: the world must split into
TP × PP × CP groups, and the longest sequence, padded to a multiple of 2·CP for the zigzag split, must fit the
position embeddings and the packing budgets. The runner trains under it (tests/runner/test_grpo_layouts.py)."""

from __future__ import annotations

import pytest
from _configs import config_with

from megatron_grpo.runner.config import ConfigError
from megatron_grpo.runner.plugin_params import parallel_params
from megatron_grpo.runner.train_cli import runner_config_problems


def test_context_parallel_size_reaches_parallel_params():
    assert parallel_params(config_with({"policy.context_parallel_size": 1})).context_parallel_size == 1
    assert parallel_params(config_with({"policy.context_parallel_size": 2})).context_parallel_size == 2


def test_context_parallel_size_below_one_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"policy\.context_parallel_size: must be > 0"):
        config_with({"policy.context_parallel_size": 0})


def test_context_parallel_is_accepted_without_transformer_engine():
    cfg = config_with({"policy.context_parallel_size": 2, "policy.tensor_model_parallel_size": 1})
    assert runner_config_problems(cfg, world_size=2, cuda_available=False) == []


def test_the_longest_sequence_padded_to_2cp_must_fit_the_positions_and_the_packing_budget():
    """The demo's longest sequence is 12 tokens (a prompt of 7 and 5 new tokens): 12 under CP 2, 16 under CP 4."""
    base = {"policy.tensor_model_parallel_size": 1, "policy.model.max_position_embeddings": 12,
            "policy.sequence_packing.enabled": True, "policy.sequence_packing.train_mb_tokens": 12}
    assert runner_config_problems(config_with({**base, "policy.context_parallel_size": 2}), world_size=2,
                                  cuda_available=False) == []
    problems = runner_config_problems(config_with({**base, "policy.context_parallel_size": 4}), world_size=4,
                                      cuda_available=False)
    padded = ("a prompt (7 tokens) plus generation.max_new_tokens (5) padded to a multiple of 2 × "
              "policy.context_parallel_size (8)")
    assert f"policy.model.max_position_embeddings: {padded} needs 16, got 12" in problems, problems
    assert (f"policy.sequence_packing.train_mb_tokens: a microbatch must hold the longest sequence, {padded}: 16 "
            "tokens, got 12") in problems, problems


def test_world_size_must_split_into_tensor_pipeline_context_groups():
    cfg = config_with({"policy.context_parallel_size": 2})  # TP 2 × CP 2 = 4
    problems = runner_config_problems(cfg, world_size=6, cuda_available=False)
    assert any("tensor × pipeline × context parallel size 4" in problem for problem in problems)


def test_router_replay_under_context_parallelism_is_a_config_error_naming_both_keys():
    """The sampler records an MoE model's routes on whole sequences; under CP each rank's forward sees its share."""
    moe = {"policy.tensor_model_parallel_size": 1, "policy.model.num_moe_experts": 4,
           "policy.model.moe_ffn_hidden_size": 64, "policy.model.add_bias_linear": False,
           "policy.router_replay.enabled": True}
    assert config_with(moe).policy.router_replay.enabled
    with pytest.raises(ConfigError, match=r"policy\.router_replay\.enabled: true with policy\.context_parallel_size 2"):
        config_with({**moe, "policy.context_parallel_size": 2})
