"""The scheduler benchmark's pure parts: the baseline config, the summary maths and the launch check."""

from __future__ import annotations

import statistics

import pytest
from _configs import TINY

from megatron_grpo.bench.scheduler import main, summarise, with_all_passes_computed
from megatron_grpo.config import load_config
from megatron_grpo.scheduler import plan_logprob_passes


def test_baseline_computes_both_passes_and_changes_nothing_else():
    cfg = load_config(TINY)
    baseline = with_all_passes_computed(cfg)
    assert plan_logprob_passes(baseline).passes_per_step == 2
    assert plan_logprob_passes(cfg).passes_per_step == 0
    assert baseline.logprob_passes.reference == baseline.logprob_passes.prev == "compute"
    assert (baseline.policy, baseline.loss_fn, baseline.grpo) == (cfg.policy, cfg.loss_fn, cfg.grpo)


def test_summary_medians_and_speedups():
    cfg = load_config(TINY)
    plans = {"auto": plan_logprob_passes(cfg), "compute": plan_logprob_passes(with_all_passes_computed(cfg))}
    train = {"auto": [0.11, 0.09, 0.5], "compute": [0.2, 0.25, 0.3]}
    step = {"auto": [0.3, 0.2, 0.7], "compute": [0.4, 0.45, 0.5]}
    records = {name: [{"train_time_s": t, "step_time_s": s, "reward_mean": 0.25 * i, "peak_extra_mib": 2.0 * i}
                      for i, (t, s) in enumerate(zip(train[name], step[name]))] for name in train}
    summary = summarise(records, plans, cfg, world_size=2, tp_size=2)
    assert summary["medians"]["auto"] == {"train_phase_s": 0.11, "step_s": 0.3, "peak_extra_mib": 4.0}
    assert summary["train_phase_speedup"] == pytest.approx(statistics.median(train["compute"]) / 0.11)
    assert summary["step_speedup"] == pytest.approx(0.45 / 0.3)
    assert summary["identical_rewards"] and summary["passes_per_step"] == {"auto": 0, "compute": 2}
    records["compute"][1]["reward_mean"] = 0.3
    assert not summarise(records, plans, cfg, world_size=2, tp_size=2)["identical_rewards"]


def test_without_torchrun_exits_2_with_the_launch_command(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--config", str(TINY)]) == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err
