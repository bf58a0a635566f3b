"""ClippedPGLossConfig: strict keys and types on every construction path, and cross-field conflicts."""

from __future__ import annotations

import dataclasses
import re

import pytest
from _loss_inputs import exemplar_loss_section, loss_config

import megatron_grpo
from megatron_grpo.loss import ClippedPGLossConfig, TruncatedImportanceSamplingConfig
from megatron_grpo.runner.config import ConfigError
from megatron_grpo.strict_config import build_section

CONSTRUCTORS = {
    "kwargs": lambda data: ClippedPGLossConfig(**data),
    "from_mapping": ClippedPGLossConfig.from_mapping,
    "build_section": lambda data: build_section(ClippedPGLossConfig, data),
}


@pytest.fixture(params=sorted(CONSTRUCTORS))
def construct(request):
    return CONSTRUCTORS[request.param]


def problems_of(construct, data) -> list[str]:
    with pytest.raises(ConfigError) as err:
        construct(data)
    return err.value.problems


def test_the_exemplar_section_builds_the_same_config_on_every_path():
    section = exemplar_loss_section()
    built = {name: construct(section) for name, construct in CONSTRUCTORS.items()}
    assert built["kwargs"] == built["from_mapping"] == built["build_section"]
    cfg = built["kwargs"]
    assert cfg.truncated_importance_sampling == TruncatedImportanceSamplingConfig(
        type=None, ratio_min=None, ratio_max=None
    )
    assert {f.name for f in dataclasses.fields(cfg)} == set(section)
    assert megatron_grpo.ClippedPGLossConfig is ClippedPGLossConfig


def test_yaml_integers_become_floats_and_built_sections_are_accepted():
    section = dict(exemplar_loss_section(), entropy_coef=0, ratio_clip_c=3)
    section["truncated_importance_sampling"] = TruncatedImportanceSamplingConfig(type=None, ratio_min=None, ratio_max=1)
    cfg = ClippedPGLossConfig(**section)
    assert isinstance(cfg.entropy_coef, float) and isinstance(cfg.ratio_clip_c, float)
    assert cfg.truncated_importance_sampling.ratio_max == 1.0


def test_config_is_frozen_and_replace_keeps_the_checks():
    cfg = loss_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.entropy_coef = 1.0
    assert dataclasses.replace(cfg, entropy_coef=0.5).entropy_coef == 0.5
    with pytest.raises(ConfigError, match=r"loss_fn\.ratio_clip_c"):
        dataclasses.replace(cfg, ratio_clip_c=0.5)


# NeMo-RL's code defaults (its ClippedPGLossConfig in nemo_rl/algorithms/loss/loss_functions.py), under our names:
# sequence_level_importance_ratios -> sequence_level_importance_ratio, token_level_loss: true -> token-mean, the flat
# truncated_importance_sampling_{type, ratio_min, ratio} -> the nested section.
NEMO_RL_DEFAULTS = {
    "ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": None, "disable_ppo_ratio": False,
    "loss_agg_mode": "token-mean", "sequence_level_importance_ratio": False,
    "reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0, "kl_in_sequence_reward": False,
    "use_on_policy_kl_approximation": False, "use_importance_sampling_correction": False,
    "truncated_importance_sampling": TruncatedImportanceSamplingConfig(type=None, ratio_min=None, ratio_max=None),
    "force_on_policy_ratio": False, "use_cispo": False, "positive_example_nll_weight": 0.0,
}
# The keys NeMo-RL does not have: verl's meaning (and default) for max_response_length and entropy_coef (its
# entropy_coeff), and GSPO's weight as both peers compute it.
OTHER_DEFAULTS = {"max_response_length": None, "sequence_level_importance_weight": "product", "entropy_coef": 0.0}


def test_every_key_has_a_default_nemo_rls_where_it_has_the_key():
    defaults = ClippedPGLossConfig()
    assert {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)} == {**NEMO_RL_DEFAULTS,
                                                                                          **OTHER_DEFAULTS}


def test_a_script_passes_only_what_it_changes(construct):
    changed = construct({"ratio_clip_max": 0.28, "truncated_importance_sampling": {"type": "tis", "ratio_max": 2.0},
                         "use_importance_sampling_correction": True})
    assert changed == dataclasses.replace(
        ClippedPGLossConfig(), ratio_clip_max=0.28, use_importance_sampling_correction=True,
        truncated_importance_sampling=TruncatedImportanceSamplingConfig(type="tis", ratio_max=2.0))
    assert changed.truncated_importance_sampling.ratio_min is None  # the nested section's own default


@pytest.mark.parametrize("key", sorted(exemplar_loss_section()))
def test_every_missing_key_takes_its_default(construct, key):
    section = exemplar_loss_section()
    del section[key]
    assert getattr(construct(section), key) == getattr(ClippedPGLossConfig(), key)


def test_unknown_keys_are_named_at_both_levels(construct):
    section = exemplar_loss_section()
    section["ratio_clip"] = 0.2
    section["truncated_importance_sampling"]["ratio"] = 2.0
    problems = problems_of(construct, section)
    assert len(problems) == 2
    assert problems[0].startswith("loss_fn.ratio_clip: unknown key")
    assert problems[1].startswith("loss_fn.truncated_importance_sampling.ratio: unknown key")


def test_a_missing_nested_key_takes_its_default_and_its_conflicts_still_count(construct):
    section = exemplar_loss_section()
    section["truncated_importance_sampling"] = {"type": "tis"}
    section["use_importance_sampling_correction"] = True
    assert problems_of(construct, section) == ["loss_fn.truncated_importance_sampling.ratio_max: 'tis' needs it, got "
                                               "null"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("ratio_clip_min", "0.2"),
        ("ratio_clip_c", True),
        ("disable_ppo_ratio", 1),
        ("loss_agg_mode", "token_mean"),
        ("max_response_length", 8.5),
        ("reference_policy_kl_type", "k4"),
        ("truncated_importance_sampling", "tis"),
    ],
)
def test_wrongly_typed_values_are_named(construct, key, value):
    problems = problems_of(construct, dict(exemplar_loss_section(), **{key: value}))
    assert len(problems) == 1 and problems[0].startswith(f"loss_fn.{key}:")


def test_a_wrong_nested_value_is_named(construct):
    section = exemplar_loss_section()
    section["truncated_importance_sampling"]["type"] = "clip"
    (problem,) = problems_of(construct, section)
    assert problem.startswith("loss_fn.truncated_importance_sampling.type:") and "'clip'" in problem


def test_all_key_and_type_problems_come_in_one_error(construct):
    section = exemplar_loss_section()
    section["bogus"] = 1
    section["ratio_clip_max"] = None
    section["truncated_importance_sampling"]["ratio"] = 2.0
    problems = problems_of(construct, section)
    assert sorted(p.split(":")[0] for p in problems) == [
        "loss_fn.bogus",
        "loss_fn.ratio_clip_max",
        "loss_fn.truncated_importance_sampling.ratio",
    ]


def test_range_problems_come_with_the_key_and_type_problems(construct):
    """A misspelt key, a wrong value and an out-of-range one are all named at once (the ranges are checked on the
    well-typed keys even while others are malformed), the misspelt key with its nearest known one."""
    section = {**exemplar_loss_section(), "ratio_clip_hi": 0.3, "loss_agg_mode": "token_mean",
               "reference_policy_kl_penalty": -1.0}
    problems = problems_of(construct, section)
    assert sorted(p.split(":")[0] for p in problems) == [
        "loss_fn.loss_agg_mode", "loss_fn.ratio_clip_hi", "loss_fn.reference_policy_kl_penalty"]
    assert any("did you mean ratio_clip_min?" in p or "did you mean ratio_clip_max?" in p for p in problems)


IS_ON = dict(use_importance_sampling_correction=True)
CONFLICTS = {
    "dual_clip_at_most_one": (dict(ratio_clip_c=1.0), ["loss_fn.ratio_clip_c"]),
    "negative_clip_min": (dict(ratio_clip_min=-0.1), ["loss_fn.ratio_clip_min"]),
    "clip_min_at_least_one": (dict(ratio_clip_min=1.5), ["loss_fn.ratio_clip_min"]),
    "negative_clip_max": (dict(ratio_clip_max=-0.1), ["loss_fn.ratio_clip_max"]),
    "truncation_without_is": (
        dict(truncated_importance_sampling=dict(type="tis", ratio_max=2.0)),
        ["loss_fn.truncated_importance_sampling.type", "loss_fn.use_importance_sampling_correction"],
    ),
    "ratio_min_above_ratio_max": (
        dict(IS_ON, truncated_importance_sampling=dict(type="icepop", ratio_min=3.0, ratio_max=2.0)),
        ["loss_fn.truncated_importance_sampling.ratio_min", "loss_fn.truncated_importance_sampling.ratio_max"],
    ),
    "gspo_with_token_mean": (
        dict(sequence_level_importance_ratio=True),
        ["loss_fn.sequence_level_importance_ratio", "loss_fn.loss_agg_mode"],
    ),
    "icepop_without_ratio_min": (
        dict(IS_ON, truncated_importance_sampling=dict(type="icepop", ratio_max=2.0)),
        ["loss_fn.truncated_importance_sampling.ratio_min"],
    ),
    "seq_mask_tis_without_ratio_min": (
        dict(IS_ON, truncated_importance_sampling=dict(type="seq-mask-tis", ratio_max=2.0)),
        ["loss_fn.truncated_importance_sampling.ratio_min"],
    ),
    "truncation_without_ratio_max": (
        dict(IS_ON, truncated_importance_sampling=dict(type="tis")),
        ["loss_fn.truncated_importance_sampling.ratio_max"],
    ),
    "non_positive_ratio_max": (
        dict(IS_ON, truncated_importance_sampling=dict(type="tis", ratio_max=0.0)),
        ["loss_fn.truncated_importance_sampling.ratio_max"],
    ),
    "negative_ratio_min": (
        dict(IS_ON, truncated_importance_sampling=dict(type="icepop", ratio_min=-1.0, ratio_max=2.0)),
        ["loss_fn.truncated_importance_sampling.ratio_min"],
    ),
    "force_on_policy_with_reinforce": (
        dict(force_on_policy_ratio=True, disable_ppo_ratio=True),
        ["loss_fn.force_on_policy_ratio", "loss_fn.disable_ppo_ratio"],
    ),
    "gspo_with_reinforce": (
        dict(sequence_level_importance_ratio=True, loss_agg_mode="seq-mean-token-mean", disable_ppo_ratio=True),
        ["loss_fn.sequence_level_importance_ratio", "loss_fn.disable_ppo_ratio"],
    ),
    "dr_grpo_without_length": (
        dict(loss_agg_mode="seq-mean-token-sum-norm"),
        ["loss_fn.max_response_length", "loss_fn.loss_agg_mode"],
    ),
    "non_positive_length": (dict(max_response_length=0), ["loss_fn.max_response_length"]),
    "negative_kl_penalty": (dict(reference_policy_kl_penalty=-0.1), ["loss_fn.reference_policy_kl_penalty"]),
    "non_positive_kl_input_clamp": (dict(kl_input_clamp_value=0.0), ["loss_fn.kl_input_clamp_value"]),
    "negative_kl_output_clamp": (dict(kl_output_clamp_value=-1.0), ["loss_fn.kl_output_clamp_value"]),
    "on_policy_kl_approximation_with_kl_in_reward": (
        dict(use_on_policy_kl_approximation=True, kl_in_sequence_reward=True),
        ["loss_fn.use_on_policy_kl_approximation", "loss_fn.kl_in_sequence_reward"],
    ),
    "seq_mask_tis_with_gspo": (
        dict(
            IS_ON,
            sequence_level_importance_ratio=True,
            loss_agg_mode="seq-mean-token-mean",
            truncated_importance_sampling=dict(type="seq-mask-tis", ratio_min=0.5, ratio_max=2.0),
        ),
        ["loss_fn.truncated_importance_sampling.type", "loss_fn.sequence_level_importance_ratio"],
    ),
    "geometric_mean_weight_without_gspo": (
        dict(sequence_level_importance_weight="geometric_mean"),
        ["loss_fn.sequence_level_importance_weight", "loss_fn.sequence_level_importance_ratio"],
    ),
    "negative_nll_weight": (dict(positive_example_nll_weight=-0.1), ["loss_fn.positive_example_nll_weight"]),
    # NeMo-RL's ClippedPGLossFn rejects the same four combinations with CISPO, and needs a token-level loss
    "cispo_with_reinforce": (
        dict(use_cispo=True, disable_ppo_ratio=True), ["loss_fn.use_cispo", "loss_fn.disable_ppo_ratio"]
    ),
    "cispo_with_forced_ratio": (
        dict(use_cispo=True, force_on_policy_ratio=True), ["loss_fn.use_cispo", "loss_fn.force_on_policy_ratio"]
    ),
    "cispo_with_dual_clip": (dict(use_cispo=True, ratio_clip_c=3.0), ["loss_fn.use_cispo", "loss_fn.ratio_clip_c"]),
    "cispo_with_sequence_mean": (
        dict(use_cispo=True, loss_agg_mode="seq-mean-token-mean"), ["loss_fn.use_cispo", "loss_fn.loss_agg_mode"]
    ),
}


def test_cispo_with_gspo_names_both_keys(construct):
    section = dict(
        exemplar_loss_section(),
        use_cispo=True,
        sequence_level_importance_ratio=True,
        loss_agg_mode="seq-mean-token-mean",
    )
    problems = problems_of(construct, section)
    assert any(
        "loss_fn.use_cispo" in p and "loss_fn.sequence_level_importance_ratio" in p for p in problems
    ), problems


@pytest.mark.parametrize("name", sorted(CONFLICTS))
def test_each_conflict_names_its_keys(construct, name):
    overrides, keys = dict(CONFLICTS[name][0]), CONFLICTS[name][1]
    section = exemplar_loss_section()
    section["truncated_importance_sampling"].update(overrides.pop("truncated_importance_sampling", {}))
    section.update(overrides)
    (problem,) = problems_of(construct, section)
    named = re.findall(r"loss_fn\.[a-z_.]+[a-z_]", problem)
    assert named[: len(keys)] == keys


def test_all_conflicts_come_in_one_error(construct):
    section = dict(
        exemplar_loss_section(),
        ratio_clip_c=0.5,
        ratio_clip_min=-1.0,
        sequence_level_importance_ratio=True,
        force_on_policy_ratio=True,
        disable_ppo_ratio=True,
    )
    section["truncated_importance_sampling"] = dict(type="icepop", ratio_min=None, ratio_max=1.0)
    problems = problems_of(construct, section)
    assert len(problems) == 7
    for key in (
        "ratio_clip_c",
        "ratio_clip_min",
        "loss_agg_mode",
        "force_on_policy_ratio",
        "use_importance_sampling_correction",
    ):
        assert any(f"loss_fn.{key}" in p for p in problems), key


def test_config_error_is_a_value_error_listing_every_problem():
    section = dict(exemplar_loss_section(), ratio_clip_c=0.5, ratio_clip_max=-1.0)
    with pytest.raises(ValueError) as err:
        ClippedPGLossConfig(**section)
    assert "loss_fn.ratio_clip_c" in str(err.value) and "loss_fn.ratio_clip_max" in str(err.value)


def test_the_truncation_section_checks_its_own_bounds_when_built_alone():
    with pytest.raises(ConfigError) as err:
        TruncatedImportanceSamplingConfig(type=None, ratio_min=-1.0, ratio_max=0)
    assert err.value.problems == [
        "loss_fn.truncated_importance_sampling.ratio_min: must be >= 0, got -1.0",
        "loss_fn.truncated_importance_sampling.ratio_max: must be > 0, got 0.0",
    ]


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        ClippedPGLossConfig(0.2)
