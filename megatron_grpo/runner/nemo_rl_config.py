"""Reads a NeMo-RL GRPO config for `plan --nemo-rl-config`: our plan for it, and where NeMo-RL would decide otherwise.

The file is loaded as NeMo-RL's `load_config` loads it, with its `defaults:` inheritance
(`config_files.read_yaml_with_defaults`, which this project's own configs use too). Keys the file leaves out take
NeMo-RL's code defaults. Only the keys the plan reads are
mapped; `${a.b}` references among them are resolved, and any other interpolation is an error naming the key.
Dropout is read from every place a NeMo-RL config sets it (`DROPOUT_SOURCES`); any dropout > 0 makes the plan
compute the prev pass. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from megatron_grpo.runner.config_files import read_yaml_with_defaults
from megatron_grpo.scheduler import PlanInputs, PlanKeys
from megatron_grpo.strict_config import ConfigError

# NeMo-RL's code defaults (GRPOConfig, ClippedPGLossConfig, AsyncGRPOConfig) for the optional keys the plan reads.
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "grpo.skip_reference_policy_logprobs_calculation": False,
    "grpo.seq_logprob_error_threshold": None,
    "grpo.async_grpo.enabled": False,
    "grpo.async_grpo.max_trajectory_age_steps": 1,
    "loss_fn.use_kl_in_reward": False,
    "loss_fn.force_on_policy_ratio": False,
    "policy.hf_config_overrides": {},
    "policy.router_replay.enabled": False,  # R3 (NeMo-RL's router_replay_enabled: false without the section)
}
REQUIRED_KEYS = (
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "policy.train_global_batch_size",
    "loss_fn.reference_policy_kl_penalty",
)
PLAN_SECTIONS = ("grpo", "loss_fn")  # every leaf key of these is either mapped or listed as unmapped

NEMO_RL_KEYS = PlanKeys(
    rollout_batch="grpo.num_prompts_per_step × grpo.num_generations_per_prompt",
    global_batch="policy.train_global_batch_size",
    staleness="grpo.async_grpo age (max_trajectory_age_steps when enabled, else 0)",
    error_threshold="grpo.seq_logprob_error_threshold",
    dropout="every policy dropout",
    kl_penalty="loss_fn.reference_policy_kl_penalty",
    kl_in_reward="loss_fn.use_kl_in_reward",
    force_on_policy="loss_fn.force_on_policy_ratio",
    importance_sampling="loss_fn.use_importance_sampling_correction",
    prev_mode="(prev pass: auto)",
    reference_mode="(reference pass: auto)",
    skip_reference="grpo.skip_reference_policy_logprobs_calculation",
    moe="policy.router_replay.enabled (R3 is for MoE policies)",
    router_replay="policy.router_replay.enabled",
)
_REFERENCE = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")
# Where a NeMo-RL config sets dropout: (the section, its switch or None, the keys read in it). Model overrides go
# to the model's config (Hugging Face's for the DTensor policy, Megatron Bridge's provider for the Megatron
# policy), whose dropout keys are named `*dropout*` (attention_dropout, hidden_dropout, ...) or `*pdrop`
# (GPT-2's resid_pdrop, ...), at any depth; LoRA adapters have one `dropout` each, applied when enabled. The
# pretrained model's own config.json is not part of the file, so it is not read.
DROPOUT_SOURCES = (
    ("policy.hf_config_overrides", None, "any"),
    ("policy.megatron_cfg.model_overrides", None, "any"),
    ("policy.dtensor_cfg.lora_cfg", "enabled", "dropout"),
    ("policy.megatron_cfg.peft", "enabled", "dropout"),
)
_DROPOUT_KEY = re.compile(r"dropout|pdrop$")


@dataclass(frozen=True)
class NemoRlPlanView:
    """A NeMo-RL config seen by our planner: its plan inputs, the files it was merged from, what was not mapped,
    and NeMo-RL's own decisions for the same settings."""

    inputs: PlanInputs
    files: tuple[str, ...]  # the merged files, parents first
    unmapped_keys: tuple[str, ...]
    ignored_sections: tuple[str, ...]
    nemo_computes_reference: bool
    nemo_computes_prev: bool
    nemo_rejects: tuple[str, ...]  # the assertions NeMo-RL's setup would fail, in its words


def load_nemo_rl_config(path: str | os.PathLike) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The merged config of a NeMo-RL YAML file and the files merged into it, parents first (NeMo-RL's `defaults:`
    inheritance, the one this project's configs use: `config_files.read_yaml_with_defaults`)."""
    return read_yaml_with_defaults(path)


def nemo_rl_plan_view(path: str | os.PathLike) -> NemoRlPlanView:
    """Maps a NeMo-RL GRPO config onto our plan's inputs; a missing required key is a ConfigError naming it."""
    config, files = load_nemo_rl_config(path)
    value = _Lookup(config)
    problems = [f"{key}: missing key (NeMo-RL has no default for it)" for key in REQUIRED_KEYS if not value.has(key)]
    if problems:
        raise ConfigError(problems)
    async_enabled = bool(value("grpo.async_grpo.enabled"))
    dropouts = dropout_settings(value)
    inputs = PlanInputs(
        rollout_batch=int(value("grpo.num_prompts_per_step")) * int(value("grpo.num_generations_per_prompt")),
        global_batch=int(value("policy.train_global_batch_size")),
        staleness=int(value("grpo.async_grpo.max_trajectory_age_steps")) if async_enabled else 0,
        error_threshold=_optional_float(value("grpo.seq_logprob_error_threshold")),
        dropout=bool(dropouts),
        kl_penalty=float(value("loss_fn.reference_policy_kl_penalty")),
        kl_in_reward=bool(value("loss_fn.use_kl_in_reward")),
        force_on_policy=bool(value("loss_fn.force_on_policy_ratio")),
        reference_mode="auto",
        prev_mode="auto",
        skip_reference=bool(value("grpo.skip_reference_policy_logprobs_calculation")),
        moe=bool(value("policy.router_replay.enabled")),  # the file does not say whether a policy without R3 is MoE
        router_replay=bool(value("policy.router_replay.enabled")),
        keys=dataclasses.replace(NEMO_RL_KEYS, dropout=" / ".join(dropouts) if dropouts else NEMO_RL_KEYS.dropout),
    )
    if value.problems:
        raise ConfigError(value.problems)
    mapped = set(REQUIRED_KEYS) | set(OPTIONAL_DEFAULTS)
    unmapped = [key for section in PLAN_SECTIONS for key in _leaf_keys(config.get(section) or {}, section)
                if key not in mapped and not key.startswith("grpo.async_grpo.")]
    if async_enabled:
        unmapped += [key for key in _leaf_keys(value("grpo.async_grpo") or {}, "grpo.async_grpo") if key not in mapped]
    ignored = tuple(section for section in config if section not in (*PLAN_SECTIONS, "policy"))
    reference, prev, rejects = nemo_rl_decisions(inputs)
    return NemoRlPlanView(inputs, files, tuple(unmapped), ignored, reference, prev, tuple(rejects))


def dropout_settings(value: _Lookup) -> list[str]:
    """The dotted keys of every dropout > 0 the config sets (`DROPOUT_SOURCES`), in source order."""
    found = []
    for section, switch, keys in DROPOUT_SOURCES:
        if not value.has(section) or not isinstance(value(section), Mapping):
            continue
        if switch is not None and not (value.has(f"{section}.{switch}") and value(f"{section}.{switch}") is True):
            continue
        if keys == "any":
            dotted = [key for key in _leaf_keys(value(section), section) if _DROPOUT_KEY.search(key.rsplit(".", 1)[1])]
        else:
            dotted = [f"{section}.{keys}"] if value.has(f"{section}.{keys}") else []
        found += [key for key in dotted if _positive(value(key))]
    return found


def nemo_rl_decisions(inputs: PlanInputs) -> tuple[bool, bool, list[str]]:
    """What NeMo-RL's GRPO setup and train loop do with the same settings: (reference pass runs, prev pass runs,
    the assertions its setup fails).

    NeMo-RL loads the reference model exactly when the KL penalty is > 0 (a zero penalty turns the skip switch
    on by itself), and skips the prev pass exactly when `force_on_policy_ratio` is on and no
    `seq_logprob_error_threshold` needs prev; a skipped pass is filled with zeros there.
    """
    keys, rejects = inputs.keys, []
    if inputs.skip_reference and inputs.kl_active:
        rejects.append(f"{keys.skip_reference}=True requires {keys.kl_penalty} == 0")
    if inputs.force_on_policy and not inputs.one_step_per_rollout:
        rejects.append(f"{keys.force_on_policy} requires {keys.global_batch} == {keys.rollout_batch}")
    skips_prev = inputs.force_on_policy and inputs.error_threshold is None
    if inputs.kl_in_reward and inputs.kl_active and skips_prev:
        rejects.append(f"{keys.kl_in_reward} with a non-zero KL penalty needs prev logprobs, which "
                       f"{keys.force_on_policy} skips")
    return inputs.kl_active, not skips_prev, rejects


def comparison_lines(view: NemoRlPlanView, ours_reference: bool | None, ours_prev: bool | None) -> list[str]:
    """Sentences saying where our plan is stricter or looser than NeMo-RL's for this config (None: we reject it)."""
    inputs, keys = view.inputs, view.inputs.keys
    lines = [f"NeMo-RL's setup rejects this config: {reject}." for reject in view.nemo_rejects]
    if ours_reference is None:
        if inputs.kl_in_reward and not inputs.kl_active and not view.nemo_rejects:
            lines.append(f"stricter: we refuse {keys.kl_in_reward} with a zero KL penalty; NeMo-RL accepts it and "
                         "adds nothing to the reward.")
        return lines or ["we reject this config (above); NeMo-RL's setup accepts it."]
    if ours_reference == view.nemo_computes_reference:
        lines.append("reference pass: same decision as NeMo-RL.")
    else:
        lines.append(f"reference pass: NeMo-RL would {'compute' if view.nemo_computes_reference else 'skip'} it.")
    if ours_prev == view.nemo_computes_prev:
        lines.append("prev pass: same decision as NeMo-RL.")
    elif not ours_prev:
        stale = " (stale rollouts included)" if inputs.staleness > 0 else ""
        lines.append(f"looser: we skip the prev pass because the training forward provably is the prev policy: "
                     f"one optimizer step per rollout{stale}, no dropout; NeMo-RL skips it only with "
                     f"{keys.force_on_policy} (and then fills prev with zeros, where we use curr.detach()).")
    else:
        lines.append(f"stricter: we compute the prev pass, which NeMo-RL skips under {keys.force_on_policy}, because "
                     "something reads prev before the loss.")
    return lines


class _Lookup:
    """Dotted-key access to the merged config with NeMo-RL's code defaults and `${a.b}` references resolved."""

    def __init__(self, config: Mapping[str, Any]):
        self.config = config
        self.problems: list[str] = []

    def has(self, dotted: str) -> bool:
        return _get(self.config, dotted) is not _MISSING

    def __call__(self, dotted: str) -> Any:
        found = _get(self.config, dotted)
        if found is _MISSING:
            return OPTIONAL_DEFAULTS[dotted]
        seen = {dotted}
        while isinstance(found, str) and "${" in found:
            match = _REFERENCE.match(found)
            target = match.group(1) if match else None
            if target is None or target in seen or _get(self.config, target) is _MISSING:
                self.problems.append(f"{dotted}: cannot resolve {found!r} (only ${{a.b}} references to keys of the "
                                     "file are resolved here)")
                return OPTIONAL_DEFAULTS.get(dotted, 0)
            seen.add(target)
            found = _get(self.config, target)
        return found


_MISSING = object()


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _leaf_keys(section: Mapping[str, Any], prefix: str) -> list[str]:
    keys = []
    for key, value in section.items():
        path = f"{prefix}.{key}"
        keys += _leaf_keys(value, path) if isinstance(value, Mapping) and value else [path]
    return keys
