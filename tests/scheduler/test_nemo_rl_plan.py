"""`plan --nemo-rl-config`: NeMo-RL-layout configs (written for these tests) get our plan, the unmapped keys and a
comparison with NeMo-RL's own decisions; `defaults:` inheritance follows NeMo-RL's loader."""

from __future__ import annotations

import pathlib

import pytest

from megatron_grpo.runner.config import ConfigError
from megatron_grpo.runner.nemo_rl_config import load_nemo_rl_config, nemo_rl_decisions, nemo_rl_plan_view
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


def test_router_replay_is_read_and_named_in_the_prev_decision(capsys):
    view = nemo_rl_plan_view(NEMO / "moe_router_replay.yaml")
    assert (view.inputs.moe, view.inputs.router_replay) == (True, True)
    assert (nemo_rl_plan_view(NEMO / "grpo_base.yaml").inputs.router_replay) is False  # NeMo-RL's default
    _code, out, _err = run_plan("moe_router_replay.yaml", capsys)
    assert "would replay the rollout's routes, as the training forward does (policy.router_replay.enabled)" in out


def test_the_reference_skip_switch_is_named_as_the_reason(capsys):
    _code, out, _err = run_plan("dapo_reference_skip.yaml", capsys)
    assert f"reference model skipped: {SKIP_SWITCH} = true." in out
    assert "grpo.use_dynamic_sampling" in out.split("not mapped")[1]


def test_async_staleness_maps_to_the_trajectory_age(capsys):
    view = nemo_rl_plan_view(NEMO / "async_reference_skip.yaml")
    assert view.inputs.staleness == 1  # max_trajectory_age_steps: NeMo-RL's default, inherited from grpo_base
    assert ("stale rollouts (grpo.async_grpo age (max_trajectory_age_steps when enabled, else 0) = 1) with one update "
            "per rollout") in plan_logprob_passes(view.inputs).reasons[1]


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
    inputs = nemo_rl_plan_view(NEMO / "force_on_policy.yaml").inputs
    assert nemo_rl_decisions(inputs) == (True, False, [])  # KL on: reference runs; forced ratio: prev skipped
    dapo = nemo_rl_plan_view(NEMO / "dapo_reference_skip.yaml").inputs
    assert nemo_rl_decisions(dapo) == (False, True, [])  # NeMo-RL computes prev unless the ratio is forced


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
    unmapped = lines[lines.index("not mapped (no say in the plan):") + 1:lines.index("read from policy:")]
    assert unmapped == [f"  - {key}" for key in view.unmapped_keys] and len(unmapped) > 3
    ignored = lines[lines.index("sections that do not concern the plan:") + 1:]
    assert ignored == [f"  - {section}" for section in view.ignored_sections]
    assert "  - policy.dtensor_cfg.lora_cfg.dropout (when policy.dtensor_cfg.lora_cfg.enabled is true)" in lines
    assert "  - policy.megatron_cfg.peft.dropout (when policy.megatron_cfg.peft.enabled is true)" in lines


@pytest.mark.parametrize(
    "text, message",
    [
        ("grpo: {num_prompts_per_step: 4}\n", "grpo.num_generations_per_prompt: missing key"),
        ("defaults: loop.yaml\n", "`defaults:` loop"),
        ("defaults: nowhere.yaml\n", "loop.yaml: defaults: nowhere.yaml: no such file"),
        ("defaults: grpo_base.yaml\npolicy: {train_global_batch_size: '${mul:2,3}'}\n",
         "policy.train_global_batch_size: cannot resolve '${mul:2,3}'"),
    ],
    ids=["missing-required-key", "defaults-loop", "missing-parent", "unresolvable-interpolation"],
)
def test_bad_nemo_rl_configs_are_named_errors(tmp_path, text, message, capsys):
    (tmp_path / "grpo_base.yaml").write_text((NEMO / "grpo_base.yaml").read_text())
    path = tmp_path / "loop.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("$", r"\$").replace("{", r"\{").replace("(", r"\(")):
        nemo_rl_plan_view(path)
    assert plan_main(["--nemo-rl-config", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_plan_needs_exactly_one_config_source(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", "a.yaml", "--nemo-rl-config", "b.yaml"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
