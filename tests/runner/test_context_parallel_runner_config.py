"""`policy.context_parallel_size`: read into the plugin's ParallelParams, checked, and refused by this runner with
its reason (the local attention spec has no context parallelism; with TE, the sampler does not split sequences)."""

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


def test_context_parallel_without_transformer_engine_says_why():
    cfg = config_with({"policy.context_parallel_size": 2, "policy.tensor_model_parallel_size": 1})
    problems = runner_config_problems(cfg, world_size=4, cuda_available=False)
    assert any(problem.startswith("policy.context_parallel_size: 2 needs Transformer Engine's attention")
               and "local attention spec has no context parallelism" in problem for problem in problems)
    assert not any("context" in problem for problem in
                   runner_config_problems(config_with({}), world_size=2, cuda_available=False))


def test_world_size_must_split_into_tensor_pipeline_context_groups():
    cfg = config_with({"policy.context_parallel_size": 2})  # TP 2 × CP 2 = 4
    problems = runner_config_problems(cfg, world_size=6, cuda_available=False)
    assert any("tensor × pipeline × context parallel size 4" in problem for problem in problems)
