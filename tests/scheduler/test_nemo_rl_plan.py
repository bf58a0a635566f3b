"""`plan --nemo-rl-config`: NeMo-RL-layout configs (written for these tests) get our plan, the unmapped keys and a
comparison with NeMo-RL's own decisions; `defaults:` inheritance follows NeMo-RL's loader."""

from __future__ import annotations

import pathlib
import re

import pytest

from megatron_grpo.runner.config import ConfigError
from megatron_grpo.runner.config_files import read_yaml_with_defaults
from megatron_grpo.runner.nemo_rl_config import NEMO_RL_COMMIT, load_nemo_rl_config, nemo_rl_plan_view
from megatron_grpo.runner.plan_cli import main as plan_main
from megatron_grpo.scheduler import plan_logprob_passes

NEMO = pathlib.Path(__file__).resolve().parents[1] / "nemo_rl_configs"
SKIP_SWITCH = "grpo.skip_reference_policy_logprobs_calculation"


def run_plan(name: str, capsys) -> tuple[int, str, str]:
    code = plan_main(["--nemo-rl-config", str(NEMO / name)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# (file, reference computed, prev computed, words in the comparison with NeMo-RL)
RECIPES = [
    ("dapo_reference_skip.yaml", False, False,
     ["reference pass: same decision", "looser", "the training forward provably is the prev policy"]),
    ("async_reference_skip.yaml", False, False,
     ["reference pass: same decision", "looser", "(stale rollouts included)"]),
    ("async_force_on_policy.yaml", False, False, ["reference pass: same decision", "prev pass: same decision"]),
    ("force_on_policy.yaml", True, False, ["reference pass: same decision", "prev pass: same decision"]),
]


@pytest.mark.parametrize("name, reference, prev, comparison", RECIPES, ids=[r[0] for r in RECIPES])
def test_recipe_situations_get_our_plan_and_the_comparison(name, reference, prev, comparison, capsys):
    code, out, err = run_plan(name, capsys)
    assert code == 0 and err == ""
    plan = plan_logprob_passes(nemo_rl_plan_view(NEMO / name).inputs)
    assert (plan.compute_reference_logprobs, plan.compute_prev_logprobs) == (reference, prev)
    assert f"reference logprobs: {'compute' if reference else 'skip'}" in out
    assert f"prev logprobs:      {'compute' if prev else 'skip'}" in out
    for reason in plan.reasons:
        assert reason in out
    comparison_part = out.split("compared with NeMo-RL:")[1]
    for words in comparison:
        assert words in comparison_part, out
    assert "not mapped (no say in the plan):\n  - grpo.max_num_steps\n" in out
    assert "sections that do not concern the plan:\n  - cluster\n  - data\n  - logger\n" in out


def test_the_reference_skip_switch_is_named_as_the_reason(capsys):
    _code, out, _err = run_plan("dapo_reference_skip.yaml", capsys)
    assert f"reference model skipped: {SKIP_SWITCH} = true." in out
    assert "grpo.use_dynamic_sampling" in out.split("not mapped")[1]


def test_async_staleness_maps_to_the_trajectory_age(capsys):
    view = nemo_rl_plan_view(NEMO / "async_reference_skip.yaml")
    assert view.inputs.staleness == 1  # max_trajectory_age_steps: NeMo-RL's default, inherited from grpo_base
    assert view.loop.kind == "async"
    assert ("stale rollouts (grpo.async_grpo.max_trajectory_age_steps = 1) with one update per rollout"
            in plan_logprob_passes(view.inputs).reasons[1])


def test_force_on_policy_ratio_with_async_rollouts_is_accepted_as_nemo_rl_accepts_it():
    view = nemo_rl_plan_view(NEMO / "async_force_on_policy.yaml")
    assert view.inputs.staleness == 1 and view.inputs.force_on_policy
    assert view.nemo_rejects == ()
    plan = plan_logprob_passes(view.inputs)  # no ConfigError
    assert not plan.compute_prev_logprobs and plan.prev_from_current


def test_reference_skip_with_a_kl_penalty_is_an_error_naming_both_keys(capsys):
    code, out, err = run_plan("conflict_reference_skip_with_kl.yaml", capsys)
    assert code == 2 and out == ""
    assert f"{SKIP_SWITCH} = true is unsafe: loss_fn.reference_policy_kl_penalty = 0.01 > 0" in err
    assert f"NeMo-RL's setup rejects this config: {SKIP_SWITCH}=True requires" in err
    assert "Traceback" not in err


def test_kl_in_reward_without_kl_says_we_are_stricter(capsys):
    code, _out, err = run_plan("kl_in_reward_without_kl.yaml", capsys)
    assert code == 2
    assert "loss_fn.use_kl_in_reward is true but loss_fn.reference_policy_kl_penalty is 0" in err
    assert "stricter: we refuse loss_fn.use_kl_in_reward with a zero KL penalty; NeMo-RL accepts it" in err


def test_defaults_inheritance_merges_parents_in_order_then_the_file(capsys):
    config, files = load_nemo_rl_config(NEMO / "recipes" / "two_parents.yaml")
    assert [pathlib.Path(f).name for f in files] == ["grpo_base.yaml", "grpo_base.yaml", "force_on_policy.yaml",
                                                      "two_parents.yaml"]
    assert config["grpo"]["num_prompts_per_step"] == 8  # the file's own value wins
    assert config["grpo"]["num_generations_per_prompt"] == 16  # inherited
    assert config["grpo"]["async_grpo"] == {"enabled": False, "max_trajectory_age_steps": 1}  # nested merge
    assert config["loss_fn"] == {"reference_policy_kl_penalty": 0.0, "force_on_policy_ratio": False}  # _override_
    assert "defaults" not in config
    view = nemo_rl_plan_view(NEMO / "recipes" / "two_parents.yaml")
    assert view.inputs.global_batch == 128  # ${policy.rollout_batch} resolved
    assert view.inputs.rollout_batch == 8 * 16
    assert not view.inputs.force_on_policy and view.inputs.kl_penalty == 0.0
    code, out, _err = run_plan("recipes/two_parents.yaml", capsys)
    assert code == 0 and "looser: we skip the prev pass" in out


def test_nemo_rl_decisions_follow_its_setup_rules():
    view = nemo_rl_plan_view(NEMO / "force_on_policy.yaml")
    # KL on: reference runs; forced ratio: prev skipped
    assert (view.nemo_computes_reference, view.nemo_computes_prev, view.nemo_rejects) == (True, False, ())
    dapo = nemo_rl_plan_view(NEMO / "dapo_reference_skip.yaml")
    # NeMo-RL computes prev unless the ratio is forced
    assert (dapo.nemo_computes_reference, dapo.nemo_computes_prev, dapo.nemo_rejects) == (False, True, ())


# Each place a NeMo-RL config sets dropout: (YAML on top of grpo_base.yaml, the key the plan must name).
DROPOUT_SOURCES = [
    ("policy: {hf_config_overrides: {attention_dropout: 0.1}}", "policy.hf_config_overrides.attention_dropout"),
    ("policy: {hf_config_overrides: {text_config: {resid_pdrop: 0.1}}}",
     "policy.hf_config_overrides.text_config.resid_pdrop"),
    ("policy: {megatron_cfg: {enabled: true, model_overrides: {hidden_dropout: 0.1}}}",
     "policy.megatron_cfg.model_overrides.hidden_dropout"),
    ("policy: {dtensor_cfg: {enabled: true, lora_cfg: {enabled: true, dim: 8, dropout: 0.1}}}",
     "policy.dtensor_cfg.lora_cfg.dropout"),
    ("policy: {megatron_cfg: {enabled: true, peft: {enabled: true, dim: 8, dropout: 5e-2}}}",
     "policy.megatron_cfg.peft.dropout"),
]


@pytest.mark.parametrize("text, key", DROPOUT_SOURCES, ids=[key for _, key in DROPOUT_SOURCES])
def test_any_dropout_of_a_nemo_rl_config_computes_the_prev_pass(tmp_path, text, key, capsys):
    (tmp_path / "grpo_base.yaml").write_text((NEMO / "grpo_base.yaml").read_text())
    path = tmp_path / "dropout.yaml"
    path.write_text(f"defaults: grpo_base.yaml\n{text}\n")
    plan = plan_logprob_passes(nemo_rl_plan_view(path).inputs)
    assert plan.compute_prev_logprobs
    assert f"{key} > 0 makes the train-mode forward differ" in plan.reasons[1]
    assert plan_main(["--nemo-rl-config", str(path)]) == 0
    assert "prev logprobs:      compute" in capsys.readouterr().out


@pytest.mark.parametrize("text", [
    "policy: {hf_config_overrides: {attention_dropout: 0.0, dropout_position: post}}",
    "policy: {dtensor_cfg: {enabled: true, lora_cfg: {enabled: false, dim: 8, dropout: 0.1}}}",  # LoRA off
    "policy: {megatron_cfg: {enabled: true, peft: {enabled: false, dim: 8, dropout: 0.1}}}",
], ids=["zero", "dtensor-lora-off", "megatron-peft-off"])
def test_a_dropout_that_does_not_apply_leaves_the_step_on_policy(tmp_path, text):
    (tmp_path / "grpo_base.yaml").write_text((NEMO / "grpo_base.yaml").read_text())
    path = tmp_path / "no_dropout.yaml"
    path.write_text(f"defaults: grpo_base.yaml\n{text}\n")
    assert not plan_logprob_passes(nemo_rl_plan_view(path).inputs).compute_prev_logprobs


def test_lists_print_one_key_per_line(capsys):
    _code, out, _err = run_plan("dapo_reference_skip.yaml", capsys)
    view = nemo_rl_plan_view(NEMO / "dapo_reference_skip.yaml")
    lines = out.splitlines()
    unknown_header = f"unknown to NeMo-RL at commit {NEMO_RL_COMMIT[:8]} (no effect there):"
    unmapped = lines[lines.index("not mapped (no say in the plan):") + 1:lines.index(unknown_header)]
    assert unmapped == [f"  - {key}" for key in view.unmapped_keys] and len(unmapped) > 3
    ignored = lines[lines.index("sections that do not concern the plan:") + 1:]
    assert ignored == [f"  - {section}" for section in view.ignored_sections]
    assert "  - policy.dtensor_cfg.lora_cfg.dropout (when policy.dtensor_cfg.lora_cfg.enabled is true)" in lines
    assert "  - policy.megatron_cfg.peft.dropout (when policy.megatron_cfg.peft.enabled is true)" in lines


@pytest.mark.parametrize(
    "text, message",
    [
        ("grpo: {num_prompts_per_step: 4}\n", "policy.train_global_batch_size: missing key"),
        ("defaults: loop.yaml\n", "`defaults:` loop"),
        ("defaults: nowhere.yaml\n", "loop.yaml: defaults: nowhere.yaml: no such file"),
        ("defaults: grpo_base.yaml\npolicy: {train_global_batch_size: '${oc.env:GBS}'}\n",
         "policy.train_global_batch_size: cannot resolve '${oc.env:GBS}' (NeMo-RL registers the resolvers add, mul, "
         "div, max; 'oc.env' (an environment variable, or another library's) is not read here)"),
        ("defaults: grpo_base.yaml\npolicy: {train_global_batch_size: '${mul:${grpo.missing}, 2}'}\n",
         "policy.train_global_batch_size: cannot resolve '${mul:${grpo.missing}, 2}' (grpo.missing is not in the "
         "file)"),
        ("defaults: grpo_base.yaml\npolicy: {train_global_batch_size: 'size_${grpo.num_prompts_per_step}'}\n",
         "an interpolation inside a longer string is not resolved here"),
        ("defaults: grpo_base.yaml\ngrpo: {num_prompts_per_step: many}\n",
         "grpo.num_prompts_per_step: expected an integer, got 'many'"),
    ],
    ids=["missing-required-key", "defaults-loop", "missing-parent", "environment-variable", "missing-reference",
         "inside-a-string", "not-a-number"],
)
def test_bad_nemo_rl_configs_are_named_errors(tmp_path, text, message, capsys):
    (tmp_path / "grpo_base.yaml").write_text((NEMO / "grpo_base.yaml").read_text())
    path = tmp_path / "loop.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        nemo_rl_plan_view(path)
    assert plan_main(["--nemo-rl-config", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_plan_needs_exactly_one_config_source(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", "a.yaml", "--nemo-rl-config", "b.yaml"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# --- Readers of prev, staleness, unknown keys: each case in its own config ----------------------------------------


def plan_and_view(name: str):
    view = nemo_rl_plan_view(NEMO / name)
    return view, plan_logprob_passes(view.inputs)


def test_the_opd_advantage_reads_prev_and_the_plan_computes_it_naming_the_key(capsys):
    view, plan = plan_and_view("opd_reads_prev.yaml")
    assert plan.compute_prev_logprobs and not plan.prev_from_current and not plan.compute_reference_logprobs
    assert plan.reasons[1] == ("prev logprobs computed: grpo.adv_estimator.name = opd: the OPD advantage, "
                               "teacher_logprobs - prev_logprobs, reads prev before the loss.")
    assert "grpo.adv_estimator.name" not in view.unmapped_keys
    assert "on_policy_distillation" not in view.ignored_sections
    assert view.nemo_rejects == () and view.nemo_computes_prev and not view.nemo_computes_reference
    code, out, _ = run_plan("opd_reads_prev.yaml", capsys)
    assert code == 0 and "prev pass: same decision as NeMo-RL." in out
    assert "NeMo-RL loop: legacy async (grpo.async_grpo.enabled: async_grpo_train)" in out


def test_opd_without_non_colocated_teachers_fails_nemo_rls_first_step(tmp_path):
    (tmp_path / "grpo_base.yaml").write_text((NEMO / "grpo_base.yaml").read_text())
    (tmp_path / "opd_reads_prev.yaml").write_text((NEMO / "opd_reads_prev.yaml").read_text())
    path = tmp_path / "colocated.yaml"
    path.write_text("defaults: opd_reads_prev.yaml\n"
                    "on_policy_distillation: {non_colocated_teachers: {enabled: false}}\n")
    view = nemo_rl_plan_view(path)
    assert plan_logprob_passes(view.inputs).compute_prev_logprobs  # still read before the loss
    assert any("'OPD requires teacher_logprobs'" in line for line in view.nemo_rejects)


def test_opd_with_the_forced_ratio_computes_prev_for_the_advantage_where_nemo_rl_refuses(capsys):
    view, plan = plan_and_view("opd_force_on_policy.yaml")
    assert plan.compute_prev_logprobs and plan.prev_from_current  # the pass for the advantage; the ratio is forced
    assert view.nemo_rejects == (
        "NeMo-RL's setup rejects this config: adv_estimator='opd' requires real prev_logprobs, but the config zeros "
        "them (loss_fn.force_on_policy_ratio=True with grpo.seq_logprob_error_threshold unset).",)
    code, out, _ = run_plan("opd_force_on_policy.yaml", capsys)
    assert code == 0 and "prev logprobs:      compute (loss uses curr.detach())" in out


def test_reinforce_plus_plus_with_the_kl_in_the_reward_reads_prev_and_the_reference():
    view, plan = plan_and_view("reinforce_kl_in_reward.yaml")
    assert plan.compute_prev_logprobs and plan.compute_reference_logprobs
    assert ("loss_fn.use_kl_in_reward (NeMo-RL's Reinforce++ advantage: grpo.adv_estimator.name = "
            "reinforce_plus_plus) with loss_fn.reference_policy_kl_penalty > 0 puts a KL of prev logprobs in the "
            "reward") in plan.reasons[1]
    assert "puts a KL in the reward" in plan.reasons[0]
    assert "grpo.adv_estimator.name" not in view.unmapped_keys and view.differences == ()


def test_the_kl_in_the_reward_with_the_grpo_estimator_says_nemo_rl_drops_it(capsys):
    view, plan = plan_and_view("grpo_kl_in_reward.yaml")
    assert plan.compute_prev_logprobs  # this runner's KL in the reward reads prev
    code, out, _ = run_plan("grpo_kl_in_reward.yaml", capsys)
    assert code == 0
    assert ("NeMo-RL drops this KL: with loss_fn.use_kl_in_reward its loss zeroes the KL penalty, and its grpo "
            "advantage adds none") in " ".join(out.split())


# (file, loop kind, staleness, words of the prev reason)
STALENESS = [
    ("sc_windowed.yaml", "single_controller", 2, "stale rollouts (async_rl.sampler.max_staleness_versions = 2)"),
    ("sc_default_sampler.yaml", "single_controller", 1,
     "stale rollouts (NeMo-RL's default async_rl.sampler.max_lookahead_versions = 1)"),
    ("sc_in_order_sync.yaml", "single_controller", 0, "async_rl.sampler.max_lookahead_versions = 0, every policy "
                                                      "dropout = 0) and nothing reads prev before the loss"),
    ("sc_ready_first.yaml", "single_controller", None,
     "stale rollouts (async_rl.sampler.name = ready_first, whose late stragglers stay selectable: no known bound)"),
    ("async_reference_skip.yaml", "async", 1, "stale rollouts (grpo.async_grpo.max_trajectory_age_steps = 1)"),
    ("dapo_reference_skip.yaml", "sync", 0, "the staleness of a synchronous loop = 0"),
]


@pytest.mark.parametrize("name, kind, staleness, words", STALENESS, ids=[row[0] for row in STALENESS])
def test_the_staleness_comes_from_the_key_nemo_rls_loop_reads(name, kind, staleness, words):
    view, plan = plan_and_view(name)
    assert (view.loop.kind, view.inputs.staleness) == (kind, staleness)
    assert not plan.compute_prev_logprobs  # one update per rollout, stale or not
    assert words in plan.reasons[1], plan.reasons[1]
    if kind == "single_controller":
        assert not any(section.startswith("async_rl") for section in view.ignored_sections)
        assert view.nemo_rejects == ()


def test_the_single_controller_without_async_rl_or_the_data_plane_is_what_nemo_rl_rejects():
    view, _ = plan_and_view("sc_without_async_rl.yaml")
    assert view.nemo_rejects == (
        "NeMo-RL's setup rejects this config: grpo.async_grpo: null selects the SingleController, whose config needs "
        "an async_rl section.",
        "NeMo-RL's setup rejects this config: run_grpo_single_controller requires data_plane.enabled=true.")


def test_async_rl_on_another_path_is_listed_as_ignored_by_nemo_rl(tmp_path):
    (tmp_path / "grpo_base.yaml").write_text((NEMO / "grpo_base.yaml").read_text())
    path = tmp_path / "legacy_with_async_rl.yaml"
    path.write_text("defaults: grpo_base.yaml\nasync_rl: {sampler: {name: windowed, max_staleness_versions: 3}}\n")
    view = nemo_rl_plan_view(path)
    assert view.loop.kind == "sync" and view.inputs.staleness == 0
    assert "async_rl (NeMo-RL ignores it on this path: grpo.async_grpo is not null)" in view.ignored_sections


def test_keys_unknown_to_nemo_rl_are_listed_apart_with_the_nearest_known_key(capsys):
    view, plan = plan_and_view("misspelt_keys.yaml")
    assert plan.compute_reference_logprobs  # the misspelt penalty has no effect: the inherited 0.01 applies
    assert view.unknown_keys == (
        ("grpo.async_grpo.max_staleness_versions", "did you mean async_rl.sampler.max_staleness_versions?"),
        ("loss_fn.refrence_policy_kl_penalty",
         "did you mean loss_fn.reference_policy_kl_penalty? loss_fn.reference_policy_kl_penalty = 0.01 applies"))
    assert not set(view.unmapped_keys) & {key for key, _ in view.unknown_keys}
    code, out, _ = run_plan("misspelt_keys.yaml", capsys)
    listed = out.split(f"unknown to NeMo-RL at commit {NEMO_RL_COMMIT[:8]} (no effect there):\n")[1]
    assert listed.startswith("  - grpo.async_grpo.max_staleness_versions: did you mean async_rl.sampler.")
    assert "refrence" not in out.split("not mapped (no say in the plan):")[1].split("unknown to NeMo-RL")[0]


def test_the_nearest_known_key_of_each_kind_of_typo():
    view, _ = plan_and_view("typos_many.yaml")
    nearest = {key: note.split("did you mean ")[1].split("?")[0] for key, note in view.unknown_keys}
    assert nearest == {
        "grpo.seq_logprob_error_treshold": "grpo.seq_logprob_error_threshold",
        "grpo.adv_estimator.nmae": "grpo.adv_estimator.name",
        "grpo.async_grpo.max_staleness_versions": "async_rl.sampler.max_staleness_versions",
        "grpo.max_trajectory_age_steps": "grpo.async_grpo.max_trajectory_age_steps",
        "loss_fn.refrence_policy_kl_penalty": "loss_fn.reference_policy_kl_penalty",
        "loss_fn.use_kl_in_rewards": "loss_fn.use_kl_in_reward",
        "async_rl.sampler.max_stalenes_versions": "async_rl.sampler.max_staleness_versions",
        "policy.router_replay.enable": "policy.router_replay.enabled",
        "policy.activation_checkpointing_enabled": "policy.dtensor_cfg.activation_checkpointing",
    }


def test_the_known_keys_list_names_its_nemo_rl_commit():
    assert NEMO_RL_COMMIT == "7ea279abfbeb698b092856d0dab61e7cf39bc909"  # megatron_grpo/runner/nemo_rl_keys.py's header


def test_router_replay_is_read_into_the_plan_and_named_in_the_prev_decision(capsys):
    view, plan = plan_and_view("router_replay.yaml")
    base_view, base = plan_and_view("grpo_base.yaml")
    assert (plan.compute_reference_logprobs, plan.compute_prev_logprobs) == (base.compute_reference_logprobs,
                                                                             base.compute_prev_logprobs)
    assert (view.inputs.moe, view.inputs.router_replay) == (True, True)
    assert (base_view.inputs.moe, base_view.inputs.router_replay) == (False, False)  # NeMo-RL's default
    assert view.not_yet == ()
    code, out, _ = run_plan("router_replay.yaml", capsys)
    assert "would replay the rollout's routes, as the training forward does (policy.router_replay.enabled)" in out
    assert "read, no say in the plan yet:\n  - none" in out


def test_nemo_rls_resolvers_are_evaluated_on_numbers():
    view, _ = plan_and_view("resolver_mul.yaml")
    assert view.inputs.global_batch == 32 * 16 == view.inputs.rollout_batch


def test_a_config_of_another_nemo_rl_algorithm_is_one_clear_error(capsys):
    code, out, err = run_plan("not_grpo.yaml", capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == ("  - not a NeMo-RL GRPO config: it has a `sft:` section and no `grpo:` "
                                            "section (plan --nemo-rl-config reads GRPO configs)")


def test_a_nested_override_is_honoured_as_nemo_rl_honours_it():
    """NeMo-RL reads `_override_` in top-level sections only: the nested one keeps the parent's dropout, which this
    project's own loader would drop."""
    nemo_rl, _ = load_nemo_rl_config(NEMO / "nested_override_child.yaml")
    ours, _ = read_yaml_with_defaults(NEMO / "nested_override_child.yaml")
    assert nemo_rl["policy"]["megatron_cfg"]["model_overrides"] == {"hidden_dropout": 0.1}
    assert nemo_rl["policy"]["megatron_cfg"]["_override_"] is True
    assert "model_overrides" not in ours["policy"]["megatron_cfg"]
    view, plan = plan_and_view("nested_override_child.yaml")
    assert plan.compute_prev_logprobs and "policy.megatron_cfg.model_overrides.hidden_dropout" in plan.reasons[1]


def test_the_sequence_mask_reads_the_training_forward_where_it_is_the_prev_policy(capsys):
    view, plan = plan_and_view("threshold_in_forward.yaml")
    assert not plan.compute_prev_logprobs and plan.seq_logprob_error_threshold == 1.25
    assert ("grpo.seq_logprob_error_threshold = 1.25 masks sequences inside the training forward, by its detached "
            "logprobs, and the loss is normalised once the step's masked counts are known.") in plan.reasons[1]
    assert view.nemo_computes_prev  # NeMo-RL computes prev for its mask
    code, out, _ = run_plan("threshold_in_forward.yaml", capsys)
    assert code == 0 and "looser: we skip the prev pass" in out
    assert "NeMo-RL masks from its prev pass, before the loss" in " ".join(out.split())
