"""The packing benchmark: its variants, token counts and summary, and one tiny run of the CLI under the launcher
(1 rank, 1 step per variant) whose report carries every column."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from _configs import CONFIGS, set_key

from megatron_grpo.bench.packing import main, summarise, tokens_per_pass, variants_of
from megatron_grpo.runner.config import load_config
from megatron_grpo.runner.config_files import read_yaml_with_defaults

RAGGED = CONFIGS / "grpo_tiny_cpu_ragged.yaml"


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
    summary = summarise(records, rewards, cfg, world_size=2, tp_size=2)
    assert summary["variants"]["padded"]["tokens_through_model"] == 110
    assert summary["variants"]["padded"]["peak_extra_mib"] == 6.0
    assert summary["padded_over_packed"]["tokens_through_model"] == pytest.approx(2.0)
    assert summary["padded_over_packed"]["step_s"] == pytest.approx(2.0)
    assert summary["variants"]["padded"]["first_learned_step"] == 10  # (0.5 + 9 × 0.95) / 10 = 0.905
    assert summary["variants"]["packed"]["first_learned_step"] is None
    assert summary["first_rollout_identical"]


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
    assert all(cell.endswith("x") for cell in rows["padded / packed"][:4])
    summary = json.loads((out / "packing_cpu.json").read_text())
    padded, packed = summary["variants"]["padded"], summary["variants"]["packed"]
    assert packed["tokens_through_model"] < padded["tokens_through_model"]  # ragged rows: packing drops padding
    assert summary["first_rollout_identical"] and padded["rewards"] == packed["rewards"]  # one step: one rollout
    assert (out / "packing_cpu.png").stat().st_size > 0
