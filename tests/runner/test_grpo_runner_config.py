"""The runner rejects bad input before any process group or model exists, naming the offending key."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import yaml
from grpo_workers.launch import REPO, write_config

from megatron_grpo.runner import train_cli
from megatron_grpo.runner.config import load_config
from megatron_grpo.runner.plan_inputs import plan_for

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.fixture
def torchrun_env(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)


def _run_main(argv, capsys) -> tuple[int, str]:
    code = train_cli.main(argv)
    assert not dist.is_initialized(), "no process group may exist after rejected input"
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"policy.model.hidden_size": "sixty-four"}, "policy.model.hidden_size"),
        ({"grpo.num_prompts_per_step": 0}, "grpo.num_prompts_per_step"),
        ({"task.name": "sort"}, "task.name"),
        ({"policy.pipeline_model_parallel_size": 3}, "policy.pipeline_model_parallel_size"),
        ({"policy.model.max_position_embeddings": 8}, "policy.model.max_position_embeddings"),
        ({"grpo.num_generations_per_prompt": 1, "grpo.num_prompts_per_step": 128},
         "grpo.num_generations_per_prompt"),
        ({"policy.sequence_packing.enabled": True, "policy.sequence_packing.train_mb_tokens": 11},
         "policy.sequence_packing.train_mb_tokens: a microbatch must hold the longest sequence"),
        ({"policy.sequence_packing.enabled": True, "policy.sequence_packing.logprob_mb_tokens": 11},
         "policy.sequence_packing.logprob_mb_tokens: a microbatch must hold the longest sequence"),
    ],
)
def test_a_bad_config_is_a_config_error_naming_the_key(tmp_path, capsys, torchrun_env, overrides, key):
    config = write_config(tmp_path, **overrides)
    code, err = _run_main(["--config", str(config)], capsys)
    assert code == train_cli.EXIT_BAD_INPUT
    assert err.startswith(f"error: {config}: ") and key in err


@pytest.mark.parametrize(
    "world_size, overrides, message",
    [
        ("3", {}, "policy.tensor_model_parallel_size: 3 ranks"),
        ("4", {"grpo.num_prompts_per_step": 15, "policy.train_global_batch_size": 120,
               "policy.train_micro_batch_size": 60}, "grpo.num_prompts_per_step (15) must be a multiple of the "
                                                     "data-parallel size (2)"),
        ("2", {"policy.model.num_moe_experts": 4, "policy.model.add_bias_linear": False,
               "policy.sequence_parallel": True, "policy.expert_model_parallel_size": 2},
         "policy.expert_model_parallel_size: 2 must divide the data-parallel size (1 of 2 ranks)"),
        ("2", {"policy.model.num_moe_experts": 4, "policy.model.add_bias_linear": False,
               "policy.sequence_parallel": True, "policy.model.moe_token_dispatcher_type": "flex"},
         "policy.model.moe_token_dispatcher_type: flex (DeepEP / HybridEP) needs CUDA"),
    ],
)
def test_a_config_that_does_not_fit_the_world_size_is_named(tmp_path, capsys, torchrun_env, monkeypatch,
                                                            world_size, overrides, message):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    code, err = _run_main(["--config", str(write_config(tmp_path, **overrides))], capsys)
    assert code == train_cli.EXIT_BAD_INPUT and message in err


def test_an_unknown_key_is_named(tmp_path, capsys, torchrun_env):
    config = write_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["grpo"]["num_epochs"] = 2
    config.write_text(yaml.safe_dump(data))
    code, err = _run_main(["--config", str(config)], capsys)
    assert code == train_cli.EXIT_BAD_INPUT and "grpo.num_epochs: unknown key" in err


def test_resume_without_a_checkpoint_is_a_clear_error_that_creates_nothing(tmp_path, capsys, torchrun_env):
    config = write_config(tmp_path)
    code, err = _run_main(["--config", str(config), "--resume"], capsys)
    assert code == train_cli.EXIT_RUN_DIR
    assert err == (f"error: --resume: checkpoint directory {tmp_path / 'run' / 'checkpoints'} (checkpoint.dir) does "
                   "not exist; run without --resume to start from scratch\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.yaml"]  # no run directory appeared
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    code, err = _run_main(["--config", str(config), "--resume"], capsys)
    assert code == train_cli.EXIT_RUN_DIR
    assert f"--resume: nothing to resume: {tmp_path / 'run' / 'checkpoints'} (checkpoint.dir) holds no" in err
    assert [path.name for path in (tmp_path / "run").rglob("*")] == ["checkpoints"]


def test_a_missing_config_file_is_named_once(tmp_path, capsys, torchrun_env):
    code, err = _run_main(["--config", str(tmp_path / "nowhere.yaml")], capsys)
    assert code == train_cli.EXIT_CONFIG
    assert err == f"error: {tmp_path / 'nowhere.yaml'}: cannot read the config file: No such file or directory\n"


def test_resume_and_fresh_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        train_cli.main(["--config", str(write_config(tmp_path)), "--resume", "--fresh"])
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_an_unwritable_checkpoint_dir_is_named_before_any_process_group(tmp_path, capsys, torchrun_env):
    (tmp_path / "not-a-dir").write_text("")
    config = write_config(tmp_path, **{"checkpoint.dir": str(tmp_path / "not-a-dir" / "checkpoints")})
    code, err = _run_main(["--config", str(config)], capsys)
    assert code == train_cli.EXIT_RUN_DIR
    assert err == (f"error: checkpoint.dir: {tmp_path / 'not-a-dir' / 'checkpoints'} is not usable for this run: "
                   f"[Errno 20] Not a directory: '{tmp_path / 'not-a-dir' / 'checkpoints'}'\n")


def test_a_config_error_is_printed_by_rank_0_only(tmp_path, capsys, torchrun_env, monkeypatch):
    config = write_config(tmp_path, **{"grpo.num_prompts_per_step": 0})
    monkeypatch.setenv("RANK", "1")
    code, err = _run_main(["--config", str(config)], capsys)
    assert code == train_cli.EXIT_CONFIG and err == ""
    monkeypatch.setenv("RANK", "0")
    code, err = _run_main(["--config", str(config)], capsys)
    assert err == f"error: {config}: grpo.num_prompts_per_step: must be > 0, got 0\n"  # one problem, one line


def test_running_outside_torchrun_says_how_to_launch(tmp_path, capsys, monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    code, err = _run_main(["--config", str(write_config(tmp_path))], capsys)
    assert code == train_cli.EXIT_BAD_INPUT and "RANK" in err and "torchrun" in err


@pytest.mark.parametrize("name", ["grpo_tiny_cpu.yaml", "grpo_tiny_cpu_ragged.yaml", "grpo_gpt_gpu.yaml",
                                  "grpo_tiny_cpu_moe.yaml", "grpo_tiny_cpu_moe_ep2.yaml"])
def test_the_shipped_configs_load_plan_and_pass_the_runner_checks(name):
    cfg = load_config(REPO / "configs" / name)
    plan = plan_for(cfg)
    on_cpu = name != "grpo_gpt_gpu.yaml"
    assert train_cli.runner_config_problems(cfg, world_size=2 if on_cpu else 16, cuda_available=not on_cpu) == []
    assert not plan.build_reference_model  # no KL: no reference pass, no reference model
    # on-policy: prev skipped; the ragged config takes two optimizer steps per rollout, so the second needs prev
    assert plan.compute_prev_logprobs == (name == "grpo_tiny_cpu_ragged.yaml")


def test_fp16_is_not_a_precision(tmp_path, capsys, torchrun_env):
    code, err = _run_main(["--config", str(write_config(tmp_path, **{"policy.precision": "fp16"}))], capsys)
    assert code == train_cli.EXIT_BAD_INPUT
    assert "policy.precision" in err and "fp16" in err


def test_bf16_without_cuda_is_rejected_before_any_process_group(tmp_path, capsys, torchrun_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _run_main(["--config", str(write_config(tmp_path, **{"policy.precision": "bf16"}))], capsys)
    assert code == train_cli.EXIT_BAD_INPUT
    assert "policy.precision: bf16 needs CUDA" in err


@pytest.mark.parametrize("precision, cuda_available, rejected", [
    ("fp32", False, False), ("fp32", True, False), ("bf16", False, True), ("bf16", True, False),
])
def test_precision_check_depends_only_on_cuda(tmp_path, precision, cuda_available, rejected):
    cfg = load_config(write_config(tmp_path, **{"policy.precision": precision}))
    problems = train_cli.runner_config_problems(cfg, world_size=2, cuda_available=cuda_available)
    assert [p for p in problems if p.startswith("policy.precision")] == (
        ["policy.precision: bf16 needs CUDA, which is not available here; use fp32 on the CPU"] if rejected else [])


def test_plan_and_runner_problems_are_reported_together(tmp_path, capsys, torchrun_env):
    """The plan's conflict (reference skipped under a KL penalty) and the runner's (a TP × PP layout larger than
    the world) in one error, not one per round."""
    config = write_config(tmp_path, **{"logprob_passes.reference": "skip", "loss_fn.reference_policy_kl_penalty": 0.1,
                                       "policy.pipeline_model_parallel_size": 2})
    code, err = _run_main(["--config", str(config)], capsys)
    assert code == train_cli.EXIT_BAD_INPUT
    assert err.count("invalid configuration") == 1
    assert "logprob_passes.reference = skip is unsafe" in err
    assert ("policy.tensor_model_parallel_size: 2 ranks do not split into groups of tensor × pipeline parallel size 4"
            in err)


def test_checked_plan_returns_the_plan_when_every_check_passes(tmp_path):
    cfg = load_config(write_config(tmp_path))
    assert train_cli.checked_plan(cfg, world_size=2, cuda_available=False) == plan_for(cfg)
