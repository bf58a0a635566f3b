"""load_config: the exemplar configs load into typed sections; every bad key or value is named by its dotted path."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import typing

import pytest
import yaml
from _configs import CONFIGS, TINY, config_with, drop_key, set_key, tiny

from megatron_grpo.loss.config import ClippedPGLossConfig
from megatron_grpo.runner.config import (
    Config,
    ConfigError,
    GenerationConfig,
    PolicyConfig,
    load_config,
    write_resolved_config,
)
from megatron_grpo.runner.config_files import read_yaml, read_yaml_with_defaults
from megatron_grpo.strict_config import StrictSection


def problems_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(data)
    return err.value.problems


def test_tiny_config_loads_with_yaml_names_and_types():
    cfg = load_config(TINY)
    assert isinstance(cfg, Config)
    assert cfg.policy.model.hidden_size == 64
    assert cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt == 128
    assert cfg.generation.temperature == 1.0 and cfg.generation.top_k is None
    assert cfg.task.name == "reverse"
    assert cfg.checkpoint.every_n_steps == 50
    assert isinstance(cfg.distributed.timeout_seconds, float)  # YAML's int 60 becomes a float
    assert isinstance(cfg.loss_fn, ClippedPGLossConfig)
    assert cfg.logprob_passes.prev == "auto"


def test_file_and_mapping_give_the_same_config():
    assert load_config(TINY) == load_config(tiny()) == load_config(str(TINY))


def test_config_is_frozen():
    cfg = load_config(TINY)
    with pytest.raises(AttributeError):
        cfg.policy.model.hidden_size = 128  # type: ignore[misc]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_resolves_to_the_base_key_set(path):
    load_config(path)
    merged, files = read_yaml_with_defaults(path)
    assert _key_paths(merged) == _key_paths(tiny())
    assert files[0] == str(TINY) and files[-1] == str(path)  # the base first, the file itself on top


def test_the_base_config_names_every_key_defaults_included():
    assert _key_paths(tiny()) == _key_paths(load_config(TINY).to_mapping())


@pytest.mark.parametrize("path", sorted(set(CONFIGS.glob("*.yaml")) - {TINY}), ids=lambda p: p.name)
def test_every_other_shipped_config_lists_only_what_differs_from_the_base(path):
    own = read_yaml(path)
    assert own.pop("defaults") == TINY.name
    base = tiny()
    for dotted in _leaf_paths(own):
        assert _value_at(own, dotted) != _value_at(base, dotted), f"{path.name}: {dotted} repeats the base's value"


def _write_child(directory: pathlib.Path, text: str, name: str = "child.yaml") -> pathlib.Path:
    """A child config of a copy of the base config in `directory`."""
    (directory / "base.yaml").write_text(TINY.read_text())
    path = directory / name
    path.write_text(text)
    return path


def test_a_child_config_overrides_one_key_and_inherits_the_rest(tmp_path):
    child = load_config(_write_child(tmp_path, "defaults: base.yaml\ngrpo:\n  max_num_steps: 7\n"))
    base = load_config(TINY)
    assert child.grpo.max_num_steps == 7
    assert child == dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, max_num_steps=7))


def test_an_unknown_key_in_a_child_config_is_named(tmp_path):
    path = _write_child(tmp_path, "defaults: base.yaml\ngrpo:\n  max_num_step: 7\nloss_fn:\n  ratio_clip: 0.2\n")
    problems = problems_of_file(path)
    assert [p.split(":")[0] for p in problems] == ["grpo.max_num_step", "loss_fn.ratio_clip"]
    assert all("unknown key" in p for p in problems)


def test_a_defaults_cycle_is_an_error_naming_the_files(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\nseed: 1\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"`defaults:` loop through .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")


def test_a_missing_parent_config_is_an_error_naming_it(tmp_path):
    path = _write_child(tmp_path, "defaults: [base.yaml, nowhere.yaml]\n")
    with pytest.raises(ConfigError, match=r"child\.yaml: defaults: nowhere\.yaml: no such file"):
        load_config(path)


def test_the_resolved_config_names_every_key_and_loads_back_equal(tmp_path):
    cfg = load_config(CONFIGS / "grpo_tiny_cpu_stale.yaml")
    path = tmp_path / "config.yaml"
    write_resolved_config(cfg, path)
    assert "defaults" not in read_yaml(path)
    assert _key_paths(read_yaml(path)) == _key_paths(tiny())
    assert load_config(path) == cfg


def problems_of_file(path: pathlib.Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return err.value.problems


def test_gpu_example_is_tensor_parallel_bf16():
    cfg = load_config(CONFIGS / "grpo_gpt_gpu.yaml")
    assert cfg.policy.tensor_model_parallel_size >= 2
    assert cfg.policy.precision == "bf16"
    assert cfg.policy.model.hidden_size > load_config(TINY).policy.model.hidden_size


def test_missing_and_unknown_keys_are_all_named_at_once():
    data = drop_key(tiny(), "policy.model.hidden_dropout")
    data = drop_key(data, "checkpoint")
    data = set_key(data, "grpo.epochs", 2)
    data = set_key(data, "loss_fn.truncated_importance_sampling.ratio", 1.0)
    problems = problems_of(data)
    assert any(p.startswith("policy.model.hidden_dropout: missing key") for p in problems)
    assert any(p.startswith("checkpoint: missing key") for p in problems)
    assert any(p.startswith("grpo.epochs: unknown key") for p in problems)
    assert any(p.startswith("loss_fn.truncated_importance_sampling.ratio: unknown key") for p in problems)


@pytest.mark.parametrize(
    "key, value",
    [
        ("policy.precision", "fp64"),
        ("task.name", "sort"),
        ("logprob_passes.prev", "maybe"),
        ("policy.model.position_embedding_type", "alibi"),
        ("generation.top_k", 2.5),
        ("grpo.seq_logprob_error_threshold", "high"),
        ("logging.progress_bar", "yes"),
        ("policy.sequence_packing.algorithm", "modified_first_fit_decreasing"),
        ("policy.sequence_packing.enabled", "on"),
        ("task.min_digits", 2.5),
    ],
)
def test_wrong_type_or_choice_names_the_key(key, value):
    assert any(p.startswith(f"{key}:") for p in problems_of(set_key(tiny(), key, value)))


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("distributed.timeout_seconds", 0, "must be > 0"),
        ("policy.train_micro_batch_size", 0, "must be > 0"),
        ("policy.model.num_layers", -1, "must be > 0"),
        ("policy.optimizer.lr", 0.0, "must be > 0"),
        ("generation.temperature", 0.0, "must be a finite number > 0"),
        ("grpo.num_generations_per_prompt", 0, "must be > 0"),
        ("grpo.max_rollout_staleness", -1, "must be >= 0"),
        ("checkpoint.every_n_steps", -5, "must be >= 0"),
        ("policy.optimizer.clip_grad", -1.0, "must be >= 0"),
        ("policy.model.hidden_dropout", 1.0, "must be in [0, 1)"),
        ("policy.optimizer.adam_beta2", 1.5, "must be in [0, 1)"),
        ("generation.top_k", 0, "must be null or an int >= 1"),
        ("generation.top_p", 1.5, "must be null or a number in (0, 1]"),
        ("grpo.seq_logprob_error_threshold", 0.0, "must be null or > 0"),
        ("policy.sequence_packing.train_mb_tokens", 0, "must be > 0"),
        ("policy.sequence_packing.logprob_mb_tokens", 0, "must be null or > 0"),
        ("task.min_digits", 0, "must be null or in [1, task.num_digits = 4]"),
        ("task.min_digits", 5, "must be null or in [1, task.num_digits = 4]"),
        ("generation.replay_kept_set", True, "true needs generation.top_k or generation.top_p < 1"),
    ],
)
def test_out_of_range_value_names_the_key(key, value, expected):
    problems = problems_of(set_key(tiny(), key, value))
    assert any(p.startswith(f"{key}:") and expected in p for p in problems), problems


@pytest.mark.parametrize(
    "key, value, divisor_key, dividend_key",
    [
        ("policy.tensor_model_parallel_size", 3, "policy.tensor_model_parallel_size",
         "policy.model.num_attention_heads"),
        ("policy.model.ffn_hidden_size", 255, "policy.tensor_model_parallel_size", "policy.model.ffn_hidden_size"),
        ("policy.model.hidden_size", 66, "policy.model.num_attention_heads", "policy.model.hidden_size"),
        ("policy.pipeline_model_parallel_size", 3, "policy.pipeline_model_parallel_size", "policy.model.num_layers"),
        ("policy.train_micro_batch_size", 48, "policy.train_micro_batch_size", "policy.train_global_batch_size"),
    ],
)
def test_divisibility_conflicts_name_both_keys(key, value, divisor_key, dividend_key):
    problems = problems_of(set_key(tiny(), key, value))
    assert any(p.startswith(divisor_key) and f"must divide {dividend_key}" in p for p in problems), problems


@pytest.mark.parametrize(
    "key, value",
    [
        ("distributed.timeout_seconds", float("inf")),
        ("policy.optimizer.lr", float("inf")),
        ("generation.temperature", float("inf")),
        ("loss_fn.ratio_clip_max", float("nan")),
        ("policy.optimizer.clip_grad", float("-inf")),
    ],
)
def test_non_finite_numbers_are_rejected_by_key(key, value):
    problems = problems_of(set_key(tiny(), key, value))
    assert any(p.startswith(f"{key}: must be a finite number") for p in problems), problems


def test_non_finite_number_in_a_yaml_file_is_rejected(tmp_path):
    path = tmp_path / "inf.yaml"
    path.write_text(TINY.read_text().replace("timeout_seconds: 60", "timeout_seconds: .inf"))
    with pytest.raises(ConfigError, match=r"distributed.timeout_seconds: must be a finite number, got inf"):
        load_config(path)


@pytest.mark.parametrize(("written", "value"), [
    ("1e-3", 1e-3), ("5e-7", 5e-7), ("1E+3", 1e3), ("2.5e-4", 2.5e-4), ("1.e-3", 1e-3), ("0.001", 1e-3),
])
def test_numbers_load_as_omegaconf_reads_them(tmp_path, written, value):
    """`lr: 1e-3` is a float, as in OmegaConf (NeMo-RL) and YAML 1.2; PyYAML alone reads it as a string."""
    text = TINY.read_text()
    assert "    lr: 1.0e-3\n" in text
    path = tmp_path / "lr.yaml"
    path.write_text(text.replace("    lr: 1.0e-3\n", f"    lr: {written}\n"))
    assert load_config(path).policy.optimizer.lr == value
    assert isinstance(yaml.safe_load(f"lr: {written}")["lr"], str if "." not in written else float)


@pytest.mark.parametrize("written", ["1e999", "-1e999", ".nan"])
def test_a_number_that_overflows_or_is_nan_is_still_rejected_by_key(tmp_path, written):
    path = tmp_path / "big.yaml"
    path.write_text(TINY.read_text().replace("    lr: 1.0e-3\n", f"    lr: {written}\n"))
    with pytest.raises(ConfigError, match=r"policy.optimizer.lr: must be a finite number"):
        load_config(path)


def test_the_float_rule_leaves_pyyaml_alone_and_strings_strings():
    from megatron_grpo.runner.config import ConfigLoader

    assert yaml.safe_load("x: 1e-3")["x"] == "1e-3"  # the global SafeLoader is untouched
    loaded = yaml.load("a: 1e3\nb: e3\nc: 1e\nd: v1e3\ne: '1e-3'\nf: 10\n", Loader=ConfigLoader)
    assert loaded == {"a": 1000.0, "b": "e3", "c": "1e", "d": "v1e3", "e": "1e-3", "f": 10}
    assert isinstance(loaded["f"], int)


@pytest.mark.parametrize("seed", [0, 1, 123456789, 2**31 - 1, 2**46, 2**63 - 1])
def test_every_seed_up_to_2_63_minus_1_is_accepted(seed):
    assert load_config(set_key(tiny(), "seed", seed)).seed == seed


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_seed_outside_the_int64_range_names_the_key(seed):
    assert any(p.startswith("seed: must be in [0, 2**63 - 1]") for p in problems_of(set_key(tiny(), "seed", seed)))


def test_timeout_beyond_a_year_names_the_key():
    problems = problems_of(set_key(tiny(), "distributed.timeout_seconds", 1e20))
    assert any(p.startswith("distributed.timeout_seconds: must be at most") for p in problems), problems


def test_duplicate_yaml_keys_are_named_with_their_lines(tmp_path):
    text = TINY.read_text()
    text = text.replace("  temperature: 1.0\n", "  temperature: 1.0\n  temperature: 0.5\n", 1)
    text = text.replace("seed: 1234\n", "seed: 1234\nseed: 99\n", 1)
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    problems = err.value.problems
    assert len(problems) == 2, problems
    lines = text.splitlines()
    seed_lines = [i + 1 for i, line in enumerate(lines) if line.startswith("seed:")]
    assert any("seed: key given twice" in p and f"lines {seed_lines[0]} and {seed_lines[1]}" in p for p in problems)
    assert any("generation.temperature: key given twice" in p for p in problems)
    assert all(p.startswith(f"{path}: ") for p in problems)


def test_missing_config_file_is_a_config_error_naming_it(tmp_path):
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError, match=r"nowhere.yaml: cannot read the config file: No such file"):
        load_config(path)


def test_range_problems_are_reported_together():
    data = set_key(tiny(), "generation.temperature", -1.0)
    data = set_key(data, "policy.model.num_attention_heads", 3)
    data = set_key(data, "checkpoint.every_n_steps", -1)
    problems = problems_of(data)
    assert len(problems) == 4, problems  # temperature, every_n_steps, TP ∤ heads, heads ∤ hidden


def test_the_logprob_error_mask_with_two_loss_divisors_is_a_conflict_naming_the_keys():
    data = set_key(tiny(), "grpo.seq_logprob_error_threshold", 1.5)
    data = set_key(data, "loss_fn.positive_example_nll_weight", 0.1)
    load_config(data)  # token-mean: one divisor
    problems = problems_of(set_key(data, "loss_fn.loss_agg_mode", "seq-mean-token-sum"))
    assert len(problems) == 1 and problems[0].startswith(
        "grpo.seq_logprob_error_threshold with loss_fn.positive_example_nll_weight > 0 and loss_fn.loss_agg_mode = "
        "seq-mean-token-sum"), problems


def test_loss_fn_conflicts_surface_through_load_config():
    problems = problems_of(set_key(tiny(), "loss_fn.ratio_clip_c", 0.5))
    assert any("loss_fn.ratio_clip_c" in p for p in problems)


def test_range_conflict_and_type_problems_of_different_sections_come_in_one_error():
    data = set_key(tiny(), "task.name", "sort")  # mistyped: task's own checks cannot run
    data = set_key(data, "generation.temperature", -1.0)
    data = set_key(data, "loss_fn.ratio_clip_c", 0.5)
    data = set_key(data, "policy.model.hidden_dropout", 1.5)
    problems = problems_of(data)
    assert [p.split(":")[0] for p in problems] == [
        "policy.model.hidden_dropout", "task.name", "generation.temperature", "loss_fn.ratio_clip_c"], problems


MOE = {"policy.model.num_moe_experts": 4, "policy.model.add_bias_linear": False, "policy.sequence_parallel": True}


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"policy.router_replay.enabled": True},
     ["policy.router_replay.enabled: needs an MoE model (policy.model.num_moe_experts), got a dense one"]),
    ({"policy.expert_model_parallel_size": 2},
     ["policy.expert_model_parallel_size: needs an MoE model (policy.model.num_moe_experts), got a dense one"]),
    ({**MOE, "policy.sequence_parallel": False},
     ["policy.sequence_parallel: an MoE model at policy.tensor_model_parallel_size 2 needs true"]),
    ({**MOE, "policy.model.add_bias_linear": True},
     ["policy.model.add_bias_linear: true with policy.model.num_moe_experts: an MoE model's experts take no bias"]),
    ({**MOE, "policy.model.moe_router_topk": 5},
     ["policy.model.moe_router_topk (5) must be at most policy.model.num_moe_experts (4)"]),
    ({**MOE, "policy.expert_model_parallel_size": 3},
     ["policy.expert_model_parallel_size (3) must divide policy.model.num_moe_experts (4)"]),
    ({**MOE, "policy.router_replay.compare_without_replay": True, "policy.router_replay.replay_in_reference": True},
     ["policy.router_replay.replay_in_reference: true needs policy.router_replay.enabled: true",
      "policy.router_replay.compare_without_replay: true needs policy.router_replay.enabled: true"]),
    ({**MOE, "policy.model.moe_z_loss_coeff": 0.001, "grpo.seq_logprob_error_threshold": 2.0},
     ["grpo.seq_logprob_error_threshold with policy.model.moe_aux_loss_coeff / moe_z_loss_coeff: the mask defers"]),
    ({**MOE, "policy.model.num_moe_experts": 0, "policy.model.moe_z_loss_coeff": -1.0},
     ["policy.model.num_moe_experts: must be null or > 0, got 0",
      "policy.model.moe_z_loss_coeff: must be null or >= 0, got -1.0"]),
])
def test_moe_settings_the_runner_cannot_build_are_named(overrides, expected):
    problems = problems_of(_with(overrides))
    for fragment in expected:
        assert any(fragment in problem for problem in problems), (fragment, problems)


def test_an_moe_policy_with_routing_replay_loads():
    cfg = config_with({**MOE, "policy.router_replay.enabled": True, "policy.expert_model_parallel_size": 2})
    assert cfg.policy.model.num_moe_experts == 4 and cfg.policy.router_replay.enabled


def _with(overrides: dict) -> dict:
    data = tiny()
    for key, value in overrides.items():
        data = set_key(data, key, value)
    return data


def test_keyword_construction_of_a_section_runs_the_yaml_checks():
    section = tiny()["generation"]
    assert GenerationConfig(**section) == load_config(TINY).generation
    with pytest.raises(ConfigError) as err:
        GenerationConfig(**dict(section, temperature=0, top_k="all"))
    assert [p.split(":")[0] for p in err.value.problems] == ["generation.top_k"]  # no range check on a bad type
    with pytest.raises(ConfigError, match=r"generation\.temperature: must be a finite number > 0, got 0\.0"):
        GenerationConfig(**dict(section, temperature=0))
    with pytest.raises(ConfigError, match=r"policy\.fused_linear_loss: true needs policy\.fused_linear_logprobs"):
        dataclasses.replace(load_config(TINY).policy, fused_linear_logprobs=False, fused_linear_loss=True)
    with pytest.raises(TypeError):
        GenerationConfig(1.0, None, None, 4)


def _nested_sections(cls: type[StrictSection]):
    for name, field_type in typing.get_type_hints(cls).items():
        if isinstance(field_type, type) and issubclass(field_type, StrictSection):
            yield cls, name, field_type
            yield from _nested_sections(field_type)


def test_every_section_path_is_where_the_yaml_holds_it():
    nested = list(_nested_sections(Config))
    assert {child for _, _, child in nested} >= {PolicyConfig, ClippedPGLossConfig}
    for parent, name, child in nested:
        assert child.SECTION == (f"{parent.SECTION}.{name}" if parent.SECTION else name), child


def test_reading_a_config_imports_neither_torch_nor_more_than_the_bottom_module():
    """strict_config imports no project module (so no section module can form a cycle through it); the loss's and
    the run's config modules, and loading a config, never import torch."""
    code = (
        "import sys\n"
        "import megatron_grpo.strict_config\n"
        "assert {m for m in sys.modules if m.startswith('megatron_grpo')} == "
        "{'megatron_grpo', 'megatron_grpo._lazy', 'megatron_grpo.strict_config'}, sorted(sys.modules)\n"
        "import megatron_grpo.loss.config, megatron_grpo.runner.config\n"
        "megatron_grpo.runner.config.load_config(sys.argv[1])\n"
        "assert 'torch' not in sys.modules\n"
    )
    repo = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code, str(TINY)], cwd=repo, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_invalid_yaml_file_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("policy: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(path)


def test_non_mapping_top_level_is_a_config_error(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- seed\n- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(path)


def _key_paths(data: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        paths.add(path)
        if isinstance(value, dict):
            paths |= _key_paths(value, path)
    return paths


def _leaf_paths(data: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        paths += _leaf_paths(value, path) if isinstance(value, dict) else [path]
    return paths


def _value_at(data: dict, dotted: str):
    for key in dotted.split("."):
        data = data[key]
    return data
