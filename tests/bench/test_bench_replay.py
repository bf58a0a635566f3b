"""The kept-set replay report's pure parts: the two variants, the summary and its report, and the launch check."""

from __future__ import annotations

import pytest
from _configs import TINY

from megatron_grpo.bench.replay import METRICS, main, summarise, variants, write_report
from megatron_grpo.runner.config import ConfigError, load_config


def test_the_variants_differ_in_replay_alone():
    cfg = load_config(TINY)
    configs = variants(cfg, top_p=0.8, top_k=None, staleness=1)
    assert [c.generation.replay_kept_set for c in configs.values()] == [False, True]
    for variant in configs.values():
        assert (variant.generation.top_p, variant.grpo.max_rollout_staleness) == (0.8, 1)
        assert (variant.policy, variant.loss_fn) == (cfg.policy, cfg.loss_fn)
    with pytest.raises(ConfigError, match="generation.replay_kept_set: true needs generation.top_k or"):
        variants(cfg, top_p=None, top_k=None, staleness=None)


def test_the_summary_means_skip_the_first_step_and_the_report_has_one_row_per_run(tmp_path, capsys):
    configs = variants(load_config(TINY), top_p=0.8, top_k=None, staleness=1)
    records = {name: [{**{key: float(step + shift) for key in METRICS}, "step_time_s": 0.5 + shift}
                      for step in range(3)] for shift, name in enumerate(configs)}
    summary = summarise(records, configs, world_size=2, tp_size=2)
    assert summary["variants"]["recompute"]["means"]["gen_ratio_outside_band"] == 1.5  # steps 1 and 2
    assert summary["replay_step_time_vs_recompute"] == pytest.approx(1.5 / 0.5)
    write_report(summary, tmp_path, TINY, ["--steps", "3"])
    report = (tmp_path / "replay_grpo_tiny_cpu_top_p0.8.md").read_text()
    assert "| recompute | 150.0% |" in report and "| replay | 250.0% |" in report
    assert (tmp_path / "replay_grpo_tiny_cpu_top_p0.8.png").stat().st_size > 0
    capsys.readouterr()


def test_without_torchrun_exits_2_with_the_launch_command(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--config", str(TINY)]) == 2
    assert "megatron-grpo --nproc-per-node N bench replay" in capsys.readouterr().err
