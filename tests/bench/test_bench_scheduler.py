"""The scheduler benchmark's pure parts: the baseline config, the summary maths and the launch check."""

from __future__ import annotations

import statistics

import pytest
from _configs import TINY, set_key, tiny

from megatron_grpo.bench.scheduler import (
    first_learned_step,
    main,
    summarise,
    summarise_prev_modes,
    with_all_passes_computed,
    with_prev_modes,
    write_prev_modes_report,
)
from megatron_grpo.runner.config import ConfigError, load_config
from megatron_grpo.runner.plan_inputs import plan_for


def test_baseline_computes_both_passes_and_changes_nothing_else():
    cfg = load_config(TINY)
    baseline = with_all_passes_computed(cfg)
    assert plan_for(baseline).passes_per_step == 2
    assert plan_for(cfg).passes_per_step == 0
    assert baseline.logprob_passes.reference == baseline.logprob_passes.prev == "compute"
    assert (baseline.policy, baseline.loss_fn, baseline.grpo) == (cfg.policy, cfg.loss_fn, cfg.grpo)


def test_summary_medians_and_speedups():
    cfg = load_config(TINY)
    plans = {"auto": plan_for(cfg), "compute": plan_for(with_all_passes_computed(cfg))}
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


def test_prev_modes_are_the_config_under_each_mode_and_an_unknown_one_is_named():
    cfg = load_config(TINY)
    variants = with_prev_modes(cfg, ["auto", "compute"])
    assert list(variants) == ["auto", "compute"]
    assert [v.logprob_passes.prev for v in variants.values()] == ["auto", "compute"]
    assert all(v.logprob_passes.reference == cfg.logprob_passes.reference for v in variants.values())
    for bad in (["auto", "sometimes"], ["auto", "auto"]):
        with pytest.raises(ConfigError, match="--prev-modes"):
            with_prev_modes(cfg, bad)


def test_first_learned_step_is_where_the_trailing_mean_first_reaches_the_threshold():
    assert first_learned_step([0.0] * 5 + [1.0] * 9 + [0.5], window=10) == 14  # steps 5..14: a 0 and nine 1s
    assert first_learned_step([0.0] * 20, window=10) is None
    assert first_learned_step([1.0] * 3, window=10) is None  # fewer steps than the window


def test_prev_mode_summary_shares_and_approximation_errors():
    cfg = load_config(TINY)
    configs = with_prev_modes(cfg, ["auto", "compute"])
    plans = {name: plan_for(variant) for name, variant in configs.items()}
    records = {
        "auto": [{"step_time_s": 0.2, "train_time_s": 0.1, "prev_pass_time_s": 0.0}] * 3,
        "compute": [{"step_time_s": s, "train_time_s": 0.15, "prev_pass_time_s": 0.05, "prox_loglinear_abs_error": e}
                    for s, e in ((0.25, 1e-3), (0.5, 2e-3), (0.25, 4e-3))],
    }
    rewards = {"auto": [0.0, 1.0, 1.0], "compute": [0.0, 1.0, 0.5]}
    summary = summarise_prev_modes(records, rewards, plans, cfg, world_size=2, tp_size=2)
    auto, compute = summary["modes"]["auto"], summary["modes"]["compute"]
    assert (auto["prev_passes_per_step"], compute["prev_passes_per_step"]) == (0, 1)
    assert auto["prev_pass_share"] == 0.0 and compute["prev_pass_share"] == pytest.approx(0.2)  # median of .2 .1 .2
    assert compute["step_time_vs_first"] == pytest.approx(0.25 / 0.2)
    assert compute["approximation_errors"] == {"prox_loglinear_abs_error": 2e-3}
    assert auto["identical_rewards_to_first"] and not compute["identical_rewards_to_first"]


def test_generation_turns_the_is_correction_off_and_every_prev_mode_is_known():
    stale = load_config(TINY.parent / "grpo_tiny_cpu_stale.yaml")
    modes = ["compute_and_compare", "generation", "loglinear", "linear", "auto"]
    variants = with_prev_modes(stale, modes)
    plans = {name: plan_for(variant) for name, variant in variants.items()}  # no ConfigError
    bypass = variants["generation"].loss_fn
    assert not bypass.use_importance_sampling_correction and bypass.truncated_importance_sampling.type is None
    assert variants["loglinear"].loss_fn == stale.loss_fn
    assert plans["generation"].prev_approximation == "generation"
    assert plans["compute_and_compare"].compare_approximations


def test_a_negative_staleness_is_refused(capsys):
    assert main(["--config", str(TINY), "--staleness", "-1"]) == 2
    assert "--staleness: must be >= 0" in capsys.readouterr().err


def test_the_masked_share_is_reported_under_the_sequence_mask(tmp_path):
    cfg = load_config(set_key(tiny(), "grpo.seq_logprob_error_threshold", 1.25))
    plans = {name: plan_for(variant) for name, variant in with_prev_modes(cfg, ["auto", "compute"]).items()}
    row = {"step_time_s": 0.2, "train_time_s": 0.1, "prev_pass_time_s": 0.0}
    records = {name: [{**row, "masked_seqs_by_logprob_error_fraction": fraction} for fraction in (0.1, 0.3)]
               for name in plans}
    summary = summarise_prev_modes(records, {"auto": [0.5, 0.5], "compute": [0.5, 0.5]}, plans, cfg, world_size=2,
                                   tp_size=2)
    assert summary["modes"]["auto"]["masked_fraction"] == pytest.approx(0.2)
    write_prev_modes_report(summary, tmp_path, TINY, ["--config", str(TINY)], threshold=1.25)
    report = (tmp_path / "scheduler_prev_modes_grpo_tiny_cpu_threshold1.25.md").read_text()
    assert "| sequences masked (mean) |" in report and "| 20.0% |" in report
    assert "grpo.seq_logprob_error_threshold 1.25;" in report


def test_a_threshold_goes_through_the_configs_checks(capsys):
    assert main(["--config", str(TINY), "--seq-logprob-error-threshold", "0"]) == 2
    assert "grpo.seq_logprob_error_threshold: must be null or > 0, got 0.0" in capsys.readouterr().err
