"""plan_logprob_passes: a table of configs with the expected plan or the expected ConfigError, plus the CLI."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import yaml
from _configs import TINY, config_with, set_key, tiny

from megatron_grpo.runner.config import ConfigError, load_config
from megatron_grpo.runner.plan_cli import main as plan_main
from megatron_grpo.runner.plan_inputs import plan_for
from megatron_grpo.scheduler import LogprobPlan

ROLLOUT_X2 = {"grpo.num_prompts_per_step": 32}  # 32 × 8 = 256 = 2 × train_global_batch_size (128)
KL = {"loss_fn.reference_policy_kl_penalty": 0.05}
KL_IN_REWARD = {**KL, "loss_fn.kl_in_sequence_reward": True}
STALE = {"grpo.max_rollout_staleness": 1}
THRESHOLD = {"grpo.seq_logprob_error_threshold": 2.0}
MASK_IN_FORWARD = ("nothing reads prev before the loss: grpo.seq_logprob_error_threshold = 2.0 masks sequences inside "
                   "the training forward, by its detached logprobs, and the loss is normalised once the step's "
                   "masked counts are known.")
DROPOUT = {"policy.model.hidden_dropout": 0.1}
FORCE = {"loss_fn.force_on_policy_ratio": True}
SKIP_REFERENCE = {"grpo.skip_reference_policy_logprobs_calculation": True}
IS_CORRECTION = {"loss_fn.use_importance_sampling_correction": True}
MOE = {"policy.model.num_moe_experts": 4, "policy.model.add_bias_linear": False, "policy.sequence_parallel": True}
R3 = {**MOE, "policy.router_replay.enabled": True}


def prev(mode: str) -> dict:
    return {"logprob_passes.prev": mode}


# (id, overrides, compute_reference_logprobs, compute_prev_logprobs, words the prev reason must contain)
PLANS = [
    ("tiny-default", {}, False, False, ["on-policy"]),
    ("kl-in-loss", KL, True, False, ["on-policy"]),
    ("kl-in-reward-needs-prev", KL_IN_REWARD, True, True,
     ["loss_fn.kl_in_sequence_reward", "advantages that the first backward needs", "non-linearly"]),
    ("two-steps-per-rollout", ROLLOUT_X2, False, True, ["policy.train_global_batch_size"]),
    ("stale-rollouts-one-update", STALE, False, False,
     ["stale rollouts (grpo.max_rollout_staleness = 1) with one update per rollout",
      "the prev policy is the training forward's; the IS weights use curr against generation"]),
    ("stale-rollouts-two-updates", {**STALE, **ROLLOUT_X2}, False, True, ["policy.train_global_batch_size"]),
    ("stale-rollouts-dropout", {**STALE, **DROPOUT}, False, True, ["policy.model.hidden_dropout"]),
    ("stale-rollouts-threshold", {**STALE, **THRESHOLD}, False, False,
     ["stale rollouts (grpo.max_rollout_staleness = 1)", MASK_IN_FORWARD]),
    ("threshold-two-steps", {**THRESHOLD, **ROLLOUT_X2}, False, True,
     ["grpo.seq_logprob_error_threshold = 2.0 masks sequences by prev logprobs", "policy.train_global_batch_size"]),
    ("threshold-dropout", {**THRESHOLD, **DROPOUT}, False, True,
     ["grpo.seq_logprob_error_threshold = 2.0 masks sequences by prev logprobs", "policy.model.hidden_dropout"]),
    ("stale-rollouts-compute", {**STALE, "logprob_passes.prev": "compute"}, False, True,
     ["logprob_passes.prev = compute"]),
    ("prev-skip-stale-one-update", {"logprob_passes.prev": "skip", **STALE}, False, False,
     ["logprob_passes.prev = skip"]),
    ("force-on-policy-stale", {**FORCE, **STALE}, False, False, ["stale rollouts"]),
    ("hidden-dropout", DROPOUT, False, True, ["policy.model.hidden_dropout"]),
    ("attention-dropout", {"policy.model.attention_dropout": 0.1}, False, True, ["policy.model.attention_dropout"]),
    ("error-threshold-in-the-training-forward", THRESHOLD, False, False, ["on-policy", MASK_IN_FORWARD]),
    ("force-on-policy-with-dropout", {**FORCE, **DROPOUT}, False, False, ["loss_fn.force_on_policy_ratio"]),
    ("force-on-policy-with-threshold", {**FORCE, **THRESHOLD}, False, False, ["on-policy", MASK_IN_FORWARD]),
    ("force-on-policy-with-threshold-and-dropout", {**FORCE, **THRESHOLD, **DROPOUT}, False, True,
     ["grpo.seq_logprob_error_threshold = 2.0 masks sequences by prev logprobs"]),
    ("prev-compute-override", {"logprob_passes.prev": "compute"}, False, True, ["logprob_passes.prev = compute"]),
    ("prev-skip-when-safe", {"logprob_passes.prev": "skip"}, False, False, ["logprob_passes.prev = skip"]),
    ("prev-skip-forced-on-policy-with-dropout", {"logprob_passes.prev": "skip", **FORCE, **DROPOUT}, False, False,
     ["logprob_passes.prev = skip"]),
    ("reference-compute-override", {"logprob_passes.reference": "compute"}, True, False, ["on-policy"]),
    ("reference-skip-when-safe", {"logprob_passes.reference": "skip"}, False, False, ["on-policy"]),
    ("nemo-rl-skip-reference-switch", SKIP_REFERENCE, False, False, ["on-policy"]),
    ("nemo-rl-switch-agrees-with-skip", {**SKIP_REFERENCE, "logprob_passes.reference": "skip"}, False, False,
     ["on-policy"]),
    ("moe-replayed-routes", R3, False, False,
     ["on-policy", "The prev pass would replay the rollout's routes, as the training forward does "
                   "(policy.router_replay.enabled): curr.detach() is what it computes"]),
    ("moe-stale-replayed-routes", {**R3, **STALE}, False, False,
     ["stale rollouts", "would replay the rollout's routes"]),
    ("moe-replayed-routes-two-steps", {**R3, **ROLLOUT_X2}, False, True,
     ["policy.train_global_batch_size", "The prev pass replays the rollout's routes"]),
    ("moe-own-routes", MOE, False, False,
     ["on-policy", "MoE model without replayed routes (policy.model.num_moe_experts, policy.router_replay.enabled "
                   "off): the skip assumes the prev pass would route every token as the training forward does"]),
    ("moe-own-routes-skip-override", {**MOE, "logprob_passes.prev": "skip"}, False, False,
     ["logprob_passes.prev = skip", "the skip assumes the prev pass would route every token"]),
]


@pytest.mark.parametrize("overrides, reference, prev, prev_words", [row[1:] for row in PLANS],
                         ids=[row[0] for row in PLANS])
def test_plan_table(overrides, reference, prev, prev_words):
    plan = plan_for(config_with(overrides))
    assert (plan.compute_reference_logprobs, plan.compute_prev_logprobs) == (reference, prev)
    assert plan.build_reference_model == reference
    forced = overrides.get("loss_fn.force_on_policy_ratio", False)
    assert plan.prev_from_current == (not prev or forced)
    reference_reason, prev_reason = plan.reasons
    if prev and forced:
        assert "The loss's ratio still uses curr.detach()" in prev_reason, prev_reason
    assert reference_reason.startswith("reference logprobs " + ("computed" if reference else "and reference model"))
    assert prev_reason.startswith("prev logprobs " + ("computed" if prev else "skipped"))
    for word in prev_words:
        assert word in prev_reason, prev_reason


def test_nemo_rl_switch_is_named_as_the_reason_for_skipping_the_reference_pass():
    plan = plan_for(config_with(SKIP_REFERENCE))
    assert "grpo.skip_reference_policy_logprobs_calculation = true" in plan.reasons[0]
    unset = plan_for(config_with({"logprob_passes.reference": "compute"}))
    assert unset.compute_reference_logprobs  # false leaves the choice to logprob_passes.reference


def test_reference_reason_names_the_kl_key():
    on, off = plan_for(config_with(KL)), plan_for(config_with({}))
    assert "loss_fn.reference_policy_kl_penalty = 0.05" in on.reasons[0]
    assert "loss_fn.reference_policy_kl_penalty = 0" in off.reasons[0]


# (id, overrides, fragments: each problem must be matched by one listed line holding all of a fragment's words)
CONFLICTS = [
    ("force-on-policy-two-steps", {**FORCE, **ROLLOUT_X2},
     [["loss_fn.force_on_policy_ratio", "policy.train_global_batch_size", "grpo.num_prompts_per_step"]]),
    ("force-on-policy-stale-two-steps", {**FORCE, **STALE, **ROLLOUT_X2},
     [["loss_fn.force_on_policy_ratio", "policy.train_global_batch_size", "grpo.num_prompts_per_step"]]),
    ("prev-skip-stale-two-steps", {"logprob_passes.prev": "skip", **STALE, **ROLLOUT_X2},
     [["logprob_passes.prev", "policy.train_global_batch_size", "grpo.num_prompts_per_step"]]),
    ("prev-skip-threshold-two-steps", {"logprob_passes.prev": "skip", **THRESHOLD, **ROLLOUT_X2},
     [["logprob_passes.prev", "grpo.seq_logprob_error_threshold"],
      ["logprob_passes.prev", "grpo.num_prompts_per_step", "policy.train_global_batch_size"]]),
    ("prev-skip-kl-in-reward", {"logprob_passes.prev": "skip", **KL_IN_REWARD},
     [["logprob_passes.prev", "loss_fn.kl_in_sequence_reward", "loss_fn.reference_policy_kl_penalty"]]),
    ("prev-skip-dropout", {"logprob_passes.prev": "skip", **DROPOUT},
     [["logprob_passes.prev", "policy.model.hidden_dropout"]]),
    ("prev-skip-two-steps", {"logprob_passes.prev": "skip", **ROLLOUT_X2},
     [["logprob_passes.prev", "grpo.num_prompts_per_step", "policy.train_global_batch_size"]]),
    ("reference-skip-with-kl", {"logprob_passes.reference": "skip", **KL},
     [["logprob_passes.reference", "loss_fn.reference_policy_kl_penalty"]]),
    ("nemo-rl-skip-reference-with-kl", {**SKIP_REFERENCE, **KL},
     [["grpo.skip_reference_policy_logprobs_calculation", "loss_fn.reference_policy_kl_penalty", "unsafe"]]),
    ("nemo-rl-skip-reference-disagrees-with-compute", {**SKIP_REFERENCE, "logprob_passes.reference": "compute"},
     [["grpo.skip_reference_policy_logprobs_calculation", "logprob_passes.reference = compute", "disagree"]]),
    ("kl-in-reward-without-kl", {"loss_fn.kl_in_sequence_reward": True},
     [["loss_fn.kl_in_sequence_reward", "loss_fn.reference_policy_kl_penalty"]]),
    ("rollout-not-a-multiple", {"grpo.num_prompts_per_step": 12},
     [["multiple", "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt",
       "policy.train_global_batch_size"]]),
    ("every-conflict-at-once",
     {"logprob_passes.prev": "skip", "logprob_passes.reference": "skip", **STALE, **THRESHOLD, **DROPOUT,
      **KL, "grpo.num_prompts_per_step": 12},
     [["multiple", "grpo.num_prompts_per_step"],
      ["logprob_passes.reference", "loss_fn.reference_policy_kl_penalty"],
      ["logprob_passes.prev", "!=", "policy.train_global_batch_size"],
      ["logprob_passes.prev", "policy.model.hidden_dropout"],
      ["logprob_passes.prev", "grpo.seq_logprob_error_threshold"]]),
    # force_on_policy_ratio: the loss never reads prev, so only its own conflicts and prev's pre-loss readers remain
    ("every-conflict-at-once-forced-on-policy",
     {"logprob_passes.prev": "skip", **FORCE, **STALE, **THRESHOLD, **DROPOUT, "grpo.num_prompts_per_step": 12},
     [["multiple", "grpo.num_prompts_per_step"],
      ["loss_fn.force_on_policy_ratio", "one optimizer step"],
      ["logprob_passes.prev", "grpo.seq_logprob_error_threshold"]]),
]


# A prev without a pass, or the pass compared with the approximations: each unsafe combination names both keys.
CONFLICTS += [
    ("generation-with-is-correction", {**prev("generation"), **IS_CORRECTION},
     [["logprob_passes.prev = generation", "loss_fn.use_importance_sampling_correction", "are 1"]]),
    ("generation-with-forced-ratio", {**prev("generation"), **FORCE},
     [["logprob_passes.prev = generation", "loss_fn.force_on_policy_ratio"]]),
    ("generation-with-error-threshold", {**prev("generation"), **THRESHOLD},
     [["logprob_passes.prev = generation", "grpo.seq_logprob_error_threshold", "never masks"]]),
    ("loglinear-with-error-threshold", {**prev("loglinear"), **THRESHOLD},
     [["logprob_passes.prev = loglinear", "grpo.seq_logprob_error_threshold", "before the loss"]]),
    ("linear-with-kl-in-reward", {**prev("linear"), **KL_IN_REWARD},
     [["logprob_passes.prev = linear", "loss_fn.kl_in_sequence_reward", "before the loss"]]),
    ("loglinear-with-dropout", {**prev("loglinear"), **DROPOUT},
     [["logprob_passes.prev = loglinear", "policy.model.hidden_dropout"]]),
    ("linear-with-forced-ratio", {**prev("linear"), **FORCE}, [["logprob_passes.prev = linear",
                                                                 "loss_fn.force_on_policy_ratio"]]),
    ("compare-with-forced-ratio", {**prev("compute_and_compare"), **FORCE},
     [["logprob_passes.prev = compute_and_compare", "loss_fn.force_on_policy_ratio"]]),
    ("every-generation-conflict-at-once", {**prev("generation"), **IS_CORRECTION, **FORCE, **THRESHOLD},
     [["logprob_passes.prev = generation", "loss_fn.force_on_policy_ratio"],
      ["logprob_passes.prev = generation", "loss_fn.use_importance_sampling_correction"],
      ["logprob_passes.prev = generation", "grpo.seq_logprob_error_threshold"]]),
    ("every-interpolation-conflict-at-once",
     {**prev("loglinear"), **FORCE, **THRESHOLD, **KL_IN_REWARD, **DROPOUT, "grpo.num_prompts_per_step": 12},
     [["multiple", "grpo.num_prompts_per_step"],
      ["loss_fn.force_on_policy_ratio", "one optimizer step"],
      ["logprob_passes.prev = loglinear", "loss_fn.force_on_policy_ratio"],
      ["logprob_passes.prev = loglinear", "grpo.seq_logprob_error_threshold"],
      ["logprob_passes.prev = loglinear", "loss_fn.kl_in_sequence_reward"],
      ["logprob_passes.prev = loglinear", "policy.model.hidden_dropout"]]),
]


@pytest.mark.parametrize("overrides, fragments", [row[1:] for row in CONFLICTS], ids=[row[0] for row in CONFLICTS])
def test_conflict_table(overrides, fragments):
    cfg = config_with(overrides)  # the config itself is valid: these are the scheduler's conflicts
    with pytest.raises(ConfigError) as err:
        plan_for(cfg)
    problems = err.value.problems
    assert len(problems) == len(fragments), problems
    for words in fragments:
        assert any(all(word in problem for word in words) for problem in problems), (words, problems)
    assert str(err.value).count("\n  - ") == len(fragments)


GRID = {
    "grpo.num_prompts_per_step": [16, 32],
    "grpo.max_rollout_staleness": [0, 2],
    "grpo.seq_logprob_error_threshold": [None, 1.5],
    "policy.model.attention_dropout": [0.0, 0.1],
    "loss_fn.reference_policy_kl_penalty": [0.0, 0.1],
    "loss_fn.kl_in_sequence_reward": [False, True],
}
# kl_in_sequence_reward with a zero KL is a global conflict (tested above), not an auto decision: left out.
AUTO_SETTINGS = [
    setting for setting in (dict(zip(GRID, values)) for values in itertools.product(*GRID.values()))
    if setting["loss_fn.reference_policy_kl_penalty"] > 0 or not setting["loss_fn.kl_in_sequence_reward"]
]


@pytest.mark.parametrize("setting", AUTO_SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_auto_never_errors_and_skips_exactly_the_redundant_passes(setting):
    plan = plan_for(config_with(setting))
    kl_on = setting["loss_fn.reference_policy_kl_penalty"] > 0
    # staleness has no say: with one update per rollout the training forward is the prev policy
    forward_is_prev = (setting["grpo.num_prompts_per_step"] == 16
                           and setting["policy.model.attention_dropout"] == 0)
    # the mask by logprob error reads the training forward where that is the prev policy; the KL in the reward never
    threshold = setting["grpo.seq_logprob_error_threshold"] is not None
    read_before_loss = (threshold and not forward_is_prev) or setting["loss_fn.kl_in_sequence_reward"]
    assert plan.compute_reference_logprobs == plan.build_reference_model == kl_on
    assert plan.compute_prev_logprobs == (not forward_is_prev or read_before_loss)
    assert plan.prev_from_current == (not plan.compute_prev_logprobs)
    assert plan.seq_logprob_error_threshold == setting["grpo.seq_logprob_error_threshold"]
    assert len(plan.reasons) == 2


# (id, overrides, pass runs, approximation, compared, words of the prev reason)
PREV_MODES = [
    ("generation-on-policy", prev("generation"), False, "generation", False,
     ["verl's rollout_correction.bypass_mode", "slime's --use-rollout-logprobs",
      "token_mult_prob_error, gen_kl_error, sampling_importance_ratio, is_oob_ratio, gen_ratio_outside_band are "
      "not reported"]),
    ("generation-stale-two-steps", {**prev("generation"), **STALE, **ROLLOUT_X2}, False, "generation", False,
     ["PPO clips against the behaviour policy"]),
    ("generation-with-kl-in-reward", {**prev("generation"), **KL_IN_REWARD}, False, "generation", False,
     ["logprob_passes.prev = generation"]),
    ("loglinear-stale-two-steps", {**prev("loglinear"), **STALE, **ROLLOUT_X2}, False, "loglinear", False,
     ["AReaL's prox_logp_method: loglinear", "prev = gen + alpha (curr - gen)",
      "alpha = (v_prox - v_behave) / (v_theta - v_behave)", "curr.detach() exactly"]),
    ("linear-stale", {**prev("linear"), **STALE}, False, "linear", False,
     ["prev = log((1 - alpha) exp(gen) + alpha exp(curr))"]),
    ("compute-and-compare", {**prev("compute_and_compare"), **STALE, **ROLLOUT_X2}, True, None, True,
     ["AReaL's prox_logp_method: metrics", "prox_<method>_abs_error"]),
]


@pytest.mark.parametrize("overrides, computed, approximation, compared, words", [row[1:] for row in PREV_MODES],
                         ids=[row[0] for row in PREV_MODES])
def test_prev_modes_without_a_pass_or_compared_with_one(overrides, computed, approximation, compared, words):
    plan = plan_for(config_with(overrides))
    assert plan.compute_prev_logprobs == computed and plan.passes_per_step == int(computed) + int(
        plan.compute_reference_logprobs)
    assert plan.prev_approximation == approximation and plan.compare_approximations == compared
    assert not plan.prev_from_current
    assert plan.needs_versions == (approximation in ("loglinear", "linear") or compared)
    for word in words:
        assert word in plan.reasons[1], plan.reasons[1]


@pytest.mark.parametrize("setting", AUTO_SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_auto_never_picks_an_approximation(setting):
    plan = plan_for(config_with(setting))
    assert plan.prev_approximation is None and not plan.compare_approximations


def test_a_plan_with_contradictory_prev_sources_is_rejected():
    with pytest.raises(ValueError, match="needs no pass and is not curr.detach"):
        LogprobPlan(compute_reference_logprobs=False, compute_prev_logprobs=True, prev_from_current=False,
                    reasons=(), prev_approximation="loglinear")
    with pytest.raises(ValueError, match="compare_approximations compares with the prev pass"):
        LogprobPlan(compute_reference_logprobs=False, compute_prev_logprobs=False, prev_from_current=True,
                    reasons=(), compare_approximations=True)
    with pytest.raises(ValueError, match="mask by logprob error reads a computed prev"):
        LogprobPlan(compute_reference_logprobs=False, compute_prev_logprobs=False, prev_from_current=False,
                    reasons=(), prev_approximation="generation", seq_logprob_error_threshold=1.5)


@pytest.mark.parametrize("mode, prev_line, peers", [
    ("generation", "skip (loss uses the generation logprobs)", "verl's algorithm.rollout_correction.bypass_mode: true"),
    ("loglinear", "skip (loss interpolates prev: loglinear)", "AReaL's actor.prox_logp_method: loglinear"),
    ("compute_and_compare", "compute (and the approximations compared with it)", "AReaL's prox_logp_method: metrics"),
    ("compute", "compute", "NeMo-RL's prev_logprobs, verl's recomputed old_log_prob"),
])
def test_cli_names_the_prev_source_and_the_peers_key(tmp_path, capsys, mode, prev_line, peers):
    path = tmp_path / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(set_key(tiny(), "logprob_passes.prev", mode)))
    assert plan_main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"prev logprobs:      {prev_line}\n" in out
    assert f"prev in peers' terms: {peers}" in out


def test_forced_on_policy_ratio_takes_prev_from_current_even_when_the_pass_runs_for_a_reader():
    # The prev pass runs for the sequence mask (dropout: the training forward is not the prev policy); the loss's
    # ratio still uses curr.detach(), and the plan alone says so (the loss does not re-derive it from its config).
    plan = plan_for(config_with({**FORCE, **DROPOUT, "grpo.seq_logprob_error_threshold": 1.5}))
    assert plan.compute_prev_logprobs and plan.prev_from_current and plan.seq_logprob_error_threshold == 1.5


def test_a_plan_that_skips_prev_but_needs_it_is_rejected():
    with pytest.raises(ValueError, match="prev_from_current=True"):
        LogprobPlan(compute_reference_logprobs=False, compute_prev_logprobs=False, prev_from_current=False,
                    reasons=())


@pytest.mark.parametrize("reference, prev, saved", [(False, False, 2), (True, False, 1), (True, True, 0)])
def test_passes_saved_per_step(reference, prev, saved):
    plan = LogprobPlan(compute_reference_logprobs=reference, compute_prev_logprobs=prev, prev_from_current=not prev,
                       reasons=())
    assert plan.passes_per_step == 2 - saved
    assert plan.passes_saved_per_step == saved


def test_plan_is_frozen():
    plan = plan_for(load_config(TINY))
    with pytest.raises(AttributeError):
        plan.compute_prev_logprobs = True  # type: ignore[misc]


def test_cli_prints_plan_reasons_and_savings(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's run_dir is relative: the resolved config lands under tmp_path
    assert plan_main(["--config", str(TINY)]) == 0
    out = capsys.readouterr().out
    assert "reference logprobs: skip (reference model not built)" in out
    assert "prev logprobs:      skip (loss uses curr.detach())" in out
    for reason in plan_for(load_config(TINY)).reasons:
        assert reason in out
    assert "forward passes saved per step: 2 of 2 (256 sequence forwards of the 128-sequence rollout batch)" in out


def test_cli_skips_the_prev_pass_of_the_stale_demo_and_says_why(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plan_main(["--config", str(TINY.parent / "grpo_tiny_cpu_stale.yaml")]) == 0
    out = capsys.readouterr().out
    assert "prev logprobs:      skip (loss uses curr.detach())" in out
    assert ("stale rollouts (grpo.max_rollout_staleness = 1) with one update per rollout" in out
            and "the prev policy is the training forward's; the IS weights use curr against generation" in out)


def test_cli_reports_a_bad_config_cleanly_with_exit_2(tmp_path, capsys):
    data = set_key(set_key(tiny(), "logprob_passes.prev", "skip"), "policy.model.hidden_dropout", 0.1)
    path = tmp_path / "dropout.yaml"
    path.write_text(yaml.safe_dump(data))
    assert plan_main(["--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "logprob_passes.prev = skip is unsafe" in captured.err and "policy.model.hidden_dropout" in captured.err
    assert "Traceback" not in captured.err


def test_cli_reports_a_loader_error_with_exit_2(tmp_path, capsys):
    path = tmp_path / "missing.yaml"
    data = tiny()
    del data["logprob_passes"]
    path.write_text(yaml.safe_dump(data))
    assert plan_main(["--config", str(path)]) == 2
    assert "logprob_passes: missing key" in capsys.readouterr().err


def test_cli_reports_a_missing_config_file_with_exit_2(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    assert plan_main(["--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "typo.yaml: cannot read the config file: No such file or directory" in captured.err
    assert "Traceback" not in captured.err


def test_cli_writes_the_resolved_config_into_an_empty_run_directory_only(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stale = TINY.parent / "grpo_tiny_cpu_stale.yaml"
    cfg = load_config(stale)
    written = tmp_path / cfg.run_dir / "config.yaml"
    assert plan_main(["--config", str(stale)]) == 0
    assert f"resolved config: {cfg.run_dir}/config.yaml" in capsys.readouterr().out
    assert load_config(written) == cfg  # every key, the base's and the defaults included
    (written.parent / "metrics.jsonl").write_text("")  # the directory now holds a run: its config stays
    written.write_text("seed: 1\n")
    assert plan_main(["--config", str(stale)]) == 0
    assert f"resolved config: not written, {cfg.run_dir} holds a run" in capsys.readouterr().out
    assert written.read_text() == "seed: 1\n"


def test_plan_inputs_for_a_loss_read_its_kl_forced_ratio_and_is_correction():
    from megatron_grpo.loss import ClippedPGLossConfig
    from megatron_grpo.scheduler import PlanInputs, plan_logprob_passes

    loss = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True)
    inputs = PlanInputs.for_loss(loss, rollout_batch=8, global_batch=8, dropout=False, staleness=1)
    assert (inputs.kl_penalty, inputs.kl_in_reward, inputs.force_on_policy, inputs.importance_sampling) == (
        0.0, False, False, True)
    plan = plan_logprob_passes(inputs)
    assert not plan.compute_reference_logprobs and not plan.compute_prev_logprobs
    # The loss's default KL penalty (NeMo-RL's 0.01) needs the reference pass.
    defaults = plan_logprob_passes(PlanInputs.for_loss(ClippedPGLossConfig(), rollout_batch=8, global_batch=8,
                                                       dropout=False))
    assert defaults.compute_reference_logprobs


RUNNER_KEY = re.compile(r"\b(grpo|policy|logprob_passes)\.[a-z_]")  # a key of the runner's config


@pytest.mark.parametrize("settings", [
    dict(rollout_batch=8, global_batch=8, dropout=False),
    dict(rollout_batch=8, global_batch=8, dropout=False, moe=True, router_replay=True),
    dict(rollout_batch=8, global_batch=8, dropout=False, moe=True),
    dict(rollout_batch=8, global_batch=8, dropout=False, staleness=2),
    dict(rollout_batch=16, global_batch=8, dropout=False),
    dict(rollout_batch=8, global_batch=8, dropout=True, error_threshold=1.5),
    dict(rollout_batch=8, global_batch=8, dropout=False, prev_mode="generation"),
])
def test_a_plan_for_a_loss_explains_itself_in_the_callers_names(settings):
    """A script that calls `PlanInputs.for_loss` reads its own argument names and the loss config's keys, never the
    runner's `grpo.` / `policy.` keys; conflicts too."""
    from megatron_grpo.loss import ClippedPGLossConfig
    from megatron_grpo.scheduler import PlanInputs, plan_logprob_passes

    plan = plan_logprob_passes(PlanInputs.for_loss(ClippedPGLossConfig(), **settings))
    words = " ".join(plan.reasons)
    assert RUNNER_KEY.search(words) is None, words
    assert "rollout_batch" in words or "ClippedPGLossConfig." in words or "prev_mode" in words
    with pytest.raises(ConfigError) as err:
        plan_logprob_passes(PlanInputs.for_loss(ClippedPGLossConfig(), rollout_batch=12, global_batch=8,
                                                dropout=False, prev_mode="skip"))
    assert "rollout_batch (12) must be a multiple of global_batch (8)" in str(err.value)
    assert RUNNER_KEY.search(str(err.value)) is None, str(err.value)


def test_routes_replayed_for_a_dense_policy_are_a_conflict_in_the_callers_names():
    from megatron_grpo.loss import ClippedPGLossConfig
    from megatron_grpo.scheduler import PlanInputs, plan_logprob_passes

    with pytest.raises(ConfigError, match=r"router_replay replays the routes of a Mixture-of-Experts policy, "
                                          r"but moe is false"):
        plan_logprob_passes(PlanInputs.for_loss(ClippedPGLossConfig(), rollout_batch=8, global_batch=8,
                                                dropout=False, router_replay=True))


def test_a_dense_plan_says_nothing_of_routes():
    words = " ".join(plan_for(config_with({})).reasons)
    assert "route" not in words and "MoE" not in words


def test_the_runner_config_is_adapted_outside_the_scheduler():
    from megatron_grpo.scheduler import plan_logprob_passes

    with pytest.raises(TypeError, match="expected PlanInputs"):
        plan_logprob_passes(load_config(TINY))


def test_other_readers_of_prev_make_the_plan_compute_it_naming_them():
    """A reader the plan knows only by its words (a NeMo-RL config's OPD advantage) computes the pass, is unsafe
    under `skip` and conflicts with an interpolated prev, each time in its own words."""
    from megatron_grpo.loss import ClippedPGLossConfig
    from megatron_grpo.scheduler import PlanInputs, plan_logprob_passes

    reader = "opd_advantage: teacher - prev, read before the loss"
    inputs = PlanInputs.for_loss(ClippedPGLossConfig(reference_policy_kl_penalty=0.0), rollout_batch=8,
                                 global_batch=8, dropout=False, prev_readers=(reader,))
    plan = plan_logprob_passes(inputs)
    assert plan.compute_prev_logprobs and not plan.prev_from_current
    assert plan.reasons[1] == f"prev logprobs computed: {reader}."
    for mode, words in (("skip", f"prev_mode = skip is unsafe: {reader}"),
                        ("loglinear", f"prev_mode = loglinear and {reader}: the interpolation needs curr")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            plan_logprob_passes(dataclasses.replace(inputs, prev_mode=mode))


def test_staleness_without_a_known_bound_still_skips_prev_with_one_update_per_rollout():
    from megatron_grpo.loss import ClippedPGLossConfig
    from megatron_grpo.scheduler import PlanInputs, PlanKeys, plan_logprob_passes

    keys = PlanKeys(staleness="async_rl.sampler.name = ready_first")
    inputs = PlanInputs.for_loss(ClippedPGLossConfig(), rollout_batch=8, global_batch=8, dropout=False,
                                 staleness=None, keys=keys)
    plan = plan_logprob_passes(inputs)
    assert not plan.compute_prev_logprobs
    assert "stale rollouts (async_rl.sampler.name = ready_first: no known bound) with one update" in plan.reasons[1]
    with pytest.raises(ConfigError, match="staleness: must be >= 0, got -1"):
        plan_logprob_passes(dataclasses.replace(inputs, staleness=-1, keys=PlanKeys()))
