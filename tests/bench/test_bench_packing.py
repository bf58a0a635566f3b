"""The packing benchmark: its variants, token counts and summary, its long setting's synthetic rollouts, checks and
report, and one tiny run of the CLI under the launcher (1 rank, 1 step per variant) whose report carries every
column."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch
import yaml
from _configs import CONFIGS, set_key

from megatron_grpo.bench.packing import (
    long_setting_problems,
    main,
    summarise,
    synthetic_rollout,
    tokens_per_pass,
    variants_of,
    write_report,
)
from megatron_grpo.runner.config import load_config
from megatron_grpo.runner.config_files import read_yaml_with_defaults

RAGGED = CONFIGS / "grpo_tiny_cpu_ragged.yaml"
LONG = CONFIGS / "grpo_tiny_cpu_long.yaml"


def test_variants_differ_only_in_packing():
    cfg = load_config(RAGGED)
    variants = variants_of(cfg)
    assert [v.policy.sequence_packing.enabled for v in variants.values()] == [False, True]
    for variant in variants.values():
        assert variant.task == cfg.task and variant.loss_fn == cfg.loss_fn
        assert variant.policy.sequence_packing.train_mb_tokens == cfg.policy.sequence_packing.train_mb_tokens


def test_tokens_per_pass_are_the_padded_width_or_each_rows_trained_length():
    token_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.float32)
    batch = {"input_ids": torch.zeros(3, 6, dtype=torch.int64), "token_mask": token_mask}
    assert tokens_per_pass(batch, packed=False) == 18
    assert tokens_per_pass(batch, packed=True) == 4 + 6 + 2


def test_summary_takes_medians_ratios_and_where_each_curve_learned():
    cfg = load_config(RAGGED)
    records = {name: [{"tokens_through_model": t, "step_time_s": s, "train_time_s": s / 2, "peak_extra_mib": m}
                      for t, s, m in rows]
               for name, rows in {"padded": [(100, 1.0, 4.0), (120, 3.0, 6.0), (110, 2.0, 5.0)],
                                  "packed": [(50, 1.0, 1.0), (60, 1.0, 3.0), (55, 4.0, 2.0)]}.items()}
    rewards = {"padded": [0.5] + [0.95] * 10, "packed": [0.5] * 11}
    summary = summarise(records, rewards, cfg, world_size=2, tp_size=2, live_peaks={"padded": 12.0, "packed": 8.0})
    assert summary["variants"]["padded"]["tokens_through_model"] == 110
    assert summary["padded_over_packed"]["live_peak_mib"] == pytest.approx(1.5)
    assert summary["variants"]["padded"]["peak_extra_mib"] == 6.0
    assert summary["padded_over_packed"]["tokens_through_model"] == pytest.approx(2.0)
    assert summary["padded_over_packed"]["step_s"] == pytest.approx(2.0)
    assert summary["variants"]["padded"]["first_learned_step"] == 10  # (0.5 + 9 × 0.95) / 10 = 0.905
    assert summary["variants"]["packed"]["first_learned_step"] is None
    assert summary["first_rollout_identical"]


def _trainer_stub(cfg, dp_rank: int = 0, dp_size: int = 1):
    from megatron_grpo.runner.tasks import DigitTask, DigitTokenizer

    task = DigitTask(cfg.task.name, cfg.task.num_digits, DigitTokenizer(), min_digits=cfg.task.min_digits)
    return types.SimpleNamespace(cfg=cfg, task=task, layout=types.SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size))


def test_the_long_settings_rollouts_are_the_tasks_prompts_then_long_random_responses():
    cfg = load_config(LONG)
    trainer = _trainer_stub(cfg)
    rollout, rewards = synthetic_rollout(trainer, step=3, response_tokens=(256, 1024))
    again, _ = synthetic_rollout(trainer, step=3, response_tokens=(256, 1024))
    rows = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert rollout.input_ids.shape[0] == rows and torch.equal(rollout.input_ids, again.input_ids)  # per step
    eos = trainer.task.tokenizer.eos_id
    responses = rollout.token_mask.sum(dim=1)
    assert ((responses >= 257) & (responses <= 1025)).all() and responses.unique().numel() > 1  # ragged + <eos>
    for row in range(rows):
        start, length = int(rollout.prompt_lengths[row]), int(responses[row])
        assert rollout.token_mask[row, start:start + length].all() and not rollout.token_mask[row, :start].any()
        assert int(rollout.input_ids[row, start + length - 1]) == eos
        assert (rollout.input_ids[row, start:start + length - 1] < 10).all()  # digits
    assert rollout.input_ids.shape[1] == int((rollout.prompt_lengths + responses).max())
    assert set(rewards.tolist()) <= {0.0, 1.0}
    other, _ = synthetic_rollout(_trainer_stub(cfg, dp_rank=1, dp_size=2), step=3, response_tokens=(256, 1024))
    assert other.input_ids.shape[0] == rows // 2 and not torch.equal(other.token_mask.sum(1),
                                                                       responses[:rows // 2])


def test_the_long_setting_must_fit_the_positions_and_the_budgets():
    assert long_setting_problems(load_config(LONG), (256, 1024)) == []
    assert long_setting_problems(load_config(LONG), None) == []
    assert long_setting_problems(load_config(LONG), (9, 3)) == ["--response-tokens must be MIN MAX with 1 <= MIN <= "
                                                                "MAX, got 9 3"]
    problems = long_setting_problems(load_config(RAGGED), (256, 1024))
    assert [problem.split(", more than ")[1] for problem in problems] == [
        "policy.model.max_position_embeddings (12)", "policy.sequence_packing.train_mb_tokens (384)"]
    assert problems[0].startswith("--response-tokens 256 1024: the longest sequence (a prompt of 7, 1024 tokens and "
                                  "<eos>) is 1032 tokens")


def test_the_long_settings_report_has_no_reward_columns(tmp_path):
    cfg = load_config(LONG)
    records = {name: [{"tokens_through_model": t, "step_time_s": 2.0, "train_time_s": 1.5, "peak_extra_mib": 9.0}
                      for t in (100, 120)] for name in ("padded", "packed")}
    summary = summarise(records, {"padded": [0.5, 0.4], "packed": [0.5, 0.6]}, cfg, world_size=2, tp_size=2,
                        response_tokens=(256, 1024))
    assert summary["config"]["response_tokens"] == [256, 1024]
    assert summary["variants"]["packed"]["train_phase_s_per_step"] == [1.5, 1.5]
    path = write_report(summary, tmp_path, LONG, ["--response-tokens", "256", "1024"])
    assert path.name == "packing_cpu_long.md" and (tmp_path / "packing_cpu_long.png").stat().st_size > 0
    report = path.read_text()
    assert "synthetic rollouts (the long setting)" in report and "256 to 1024 random digits" in report
    assert "reward" not in report.split("| variant")[1].split("\n")[0]


def test_without_torchrun_exits_2_with_the_launch_command(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--config", str(RAGGED)]) == 2
    assert "bench packing" in capsys.readouterr().err


def test_the_cli_runs_both_variants_and_reports_every_column(tmp_path):
    data, _files = read_yaml_with_defaults(RAGGED)
    for key, value in {"policy.tensor_model_parallel_size": 1, "grpo.num_prompts_per_step": 2,
                       "policy.train_global_batch_size": 16, "policy.train_micro_batch_size": 8,
                       "policy.sequence_packing.train_mb_tokens": 48, "logging.progress_bar": False,
                       "logging.tensorboard": False, "run_dir": str(tmp_path / "run"),
                       "checkpoint.dir": str(tmp_path / "run" / "checkpoints")}.items():
        data = set_key(data, key, value)
    config = tmp_path / "tiny_ragged.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "megatron_grpo", "--nproc-per-node", "1", "bench", "packing",
                           "--config", str(config), "--steps", "1", "--warmup", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = (out / "packing_cpu.md").read_text()
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in report.splitlines() if line.startswith("| pad") or line.startswith("| pack")}
    assert set(rows) == {"padded", "packed", "padded / packed"}
    assert all(cell for cell in rows["padded"] + rows["packed"])  # every column filled
    assert "![reward curves](packing_cpu.png)" in report
    assert all(cell.endswith("x") for cell in rows["padded / packed"][:5])  # the live tensors' peak's ratio too
    summary = json.loads((out / "packing_cpu.json").read_text())
    padded, packed = summary["variants"]["padded"], summary["variants"]["packed"]
    assert packed["tokens_through_model"] < padded["tokens_through_model"]  # ragged rows: packing drops padding
    assert padded["live_peak_mib"] > 0 and packed["live_peak_mib"] > 0
    assert summary["first_rollout_identical"] and padded["rewards"] == packed["rewards"]  # one step: one rollout
    assert (out / "packing_cpu.png").stat().st_size > 0
