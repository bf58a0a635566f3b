"""Reads a NeMo-RL GRPO config for `plan --nemo-rl-config`: our plan for it, and where NeMo-RL would decide otherwise.

The file is loaded as NeMo-RL's `load_config` loads it: its `defaults:` inheritance (`config_files`, with
`_override_` honoured in top-level sections only, as NeMo-RL's `merge_with_override`), and on the keys the plan reads
the interpolations NeMo-RL resolves: `${a.b}` and its registered resolvers `${add:x, y}`, `${mul:...}`, `${div:...}`,
`${max:...}` (anything else, `${oc.env:...}` included, is an error naming the key). Keys the file leaves out take
NeMo-RL's code defaults, at the commit the known-keys list names (`NEMO_RL_COMMIT`).

What it reads:
- the loop the config selects, and its staleness (`nemo_rl_loop`): the SingleController (`grpo.async_grpo: null`),
  whose `async_rl.sampler` bounds the staleness; the legacy async loop (`grpo.async_grpo.enabled`), bounded by
  `grpo.async_grpo.max_trajectory_age_steps`; or a synchronous one;
- every reader of prev before the loss: `grpo.seq_logprob_error_threshold`, the OPD advantage
  (`grpo.adv_estimator.name: opd`, teacher - prev), `loss_fn.use_kl_in_reward` (NeMo-RL's Reinforce++, or this
  runner's outcome form with the other estimators);
- every dropout a NeMo-RL policy applies (`DROPOUT_SOURCES`): any one > 0 makes the plan compute the prev pass;
- `policy.router_replay.enabled` (MoE routing replay), as `PlanInputs.router_replay` (and `moe`).
Keys NeMo-RL does not know at that commit (`nemo_rl_known_keys.txt`, made by `megatron_grpo/runner/nemo_rl_keys.py`) are
reported apart, each with the nearest known key. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Mapping

from megatron_grpo.runner.config_files import read_yaml_with_defaults
from megatron_grpo.scheduler import PlanInputs, PlanKeys
from megatron_grpo.strict_config import ConfigError

KNOWN_KEYS_FILE = Path(__file__).with_name("nemo_rl_known_keys.txt")
# NeMo-RL's code defaults (GRPOConfig, ClippedPGLossConfig, AsyncGRPOConfig, AdvEstimatorConfig, AsyncRLConfig's
# samplers, OnPolicyDistillationConfig, the policy's router replay) for the optional keys the plan reads.
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "grpo.num_prompts_per_step": 32,
    "grpo.num_generations_per_prompt": 16,
    "grpo.skip_reference_policy_logprobs_calculation": False,
    "grpo.seq_logprob_error_threshold": None,
    "grpo.async_grpo.enabled": False,
    "grpo.async_grpo.max_trajectory_age_steps": 1,
    "grpo.adv_estimator.name": "grpo",
    "loss_fn.reference_policy_kl_penalty": 0.01,
    "loss_fn.use_kl_in_reward": False,
    "loss_fn.force_on_policy_ratio": False,
    "loss_fn.use_importance_sampling_correction": False,
    "async_rl.sampler.name": "in_order",
    "async_rl.sampler.max_lookahead_versions": 1,
    "async_rl.sampler.max_staleness_versions": 1,
    "on_policy_distillation.enabled": False,
    "on_policy_distillation.non_colocated_teachers.enabled": False,
    "data_plane.enabled": False,
    "policy.router_replay.enabled": False,
    "policy.generation.backend": None,
    "policy.megatron_cfg.enabled": False,
    "policy.megatron_cfg.virtual_pipeline_model_parallel_size": None,
    "policy.hf_config_overrides": {},
}
REQUIRED_KEYS = ("policy.train_global_batch_size",)  # a required field of NeMo-RL's PolicyConfig
NON_GRPO_SECTIONS = ("sft", "dpo", "distillation", "ppo", "rm")  # NeMo-RL's other algorithms' sections
PLAN_SECTIONS = ("grpo", "loss_fn")  # every leaf key of these is either read or listed as having no say
CHECKED_SECTIONS = ("grpo", "loss_fn", "async_rl", "on_policy_distillation", "reward_penalties", "policy")
ESTIMATORS = ("grpo", "gdpo", "opd", "reinforce_plus_plus")
SAMPLERS = ("in_order", "windowed", "weight_fifo", "ready_first", "custom")

NEMO_RL_KEYS = PlanKeys(
    rollout_batch="grpo.num_prompts_per_step × grpo.num_generations_per_prompt",
    global_batch="policy.train_global_batch_size",
    staleness="the staleness",
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
OPD_READER = ("grpo.adv_estimator.name = opd: the OPD advantage, teacher_logprobs - prev_logprobs, reads prev before "
              "the loss")
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
class NemoRlLoop:
    """The training loop a NeMo-RL config selects, and how stale its rollouts may be."""

    kind: str  # "sync" (grpo_train), "tq_sync" (grpo_train_sync), "async" (async_grpo_train), "single_controller"
    description: str
    staleness: int | None  # None: no known bound (ready_first, a custom sampler)
    staleness_key: str  # what set it, as the plan's sentences name it


@dataclass(frozen=True)
class NemoRlPlanView:
    """A NeMo-RL config seen by our planner: its plan inputs, the files it was merged from, the keys it read and
    did not, and NeMo-RL's own decisions for the same settings."""

    inputs: PlanInputs
    files: tuple[str, ...]  # the merged files, parents first
    loop: NemoRlLoop
    unmapped_keys: tuple[str, ...]  # known to NeMo-RL, no say in the plan
    unknown_keys: tuple[tuple[str, str], ...]  # (key, why: the nearest known key) unknown to NeMo-RL
    not_yet: tuple[str, ...]  # read, with no say in the plan yet (each with its note)
    ignored_sections: tuple[str, ...]  # sections that do not concern the plan, or that NeMo-RL ignores on this path
    nemo_computes_reference: bool
    nemo_computes_prev: bool
    nemo_rejects: tuple[str, ...]  # sentences: what NeMo-RL's setup (or its first step) fails on, in its words
    differences: tuple[str, ...]  # sentences: where NeMo-RL computes something else with the same keys


def load_nemo_rl_config(path: str | os.PathLike) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The merged config of a NeMo-RL YAML file and the files merged into it, parents first (NeMo-RL's `defaults:`
    inheritance, `_override_` in top-level sections only)."""
    return read_yaml_with_defaults(path, nested_override=False)


def nemo_rl_plan_view(path: str | os.PathLike) -> NemoRlPlanView:
    """Maps a NeMo-RL GRPO config onto our plan's inputs; a config of another algorithm, a missing required key or
    an interpolation it cannot resolve is a ConfigError naming it."""
    config, files = load_nemo_rl_config(path)
    if not isinstance(config.get("grpo"), Mapping):
        others = [f"a `{name}:` section" for name in NON_GRPO_SECTIONS if name in config]
        has = f"it has {' and '.join(others)} and no `grpo:` section" if others else "it has no `grpo:` section"
        raise ConfigError(f"not a NeMo-RL GRPO config: {has} (plan --nemo-rl-config reads GRPO configs)")
    value = _Lookup(config)
    problems = [f"{key}: missing key (NeMo-RL has no default for it)" for key in REQUIRED_KEYS if not value.has(key)]
    if problems:
        raise ConfigError(problems)
    loop = nemo_rl_loop(value)
    dropouts = dropout_settings(value)
    estimator = value("grpo.adv_estimator.name")
    threshold = value("grpo.seq_logprob_error_threshold")
    keys = dataclasses.replace(
        NEMO_RL_KEYS, staleness=loop.staleness_key,
        dropout=" / ".join(dropouts) if dropouts else NEMO_RL_KEYS.dropout,
        kl_in_reward=("loss_fn.use_kl_in_reward (NeMo-RL's Reinforce++ advantage: grpo.adv_estimator.name = "
                      "reinforce_plus_plus)" if estimator == "reinforce_plus_plus" else NEMO_RL_KEYS.kl_in_reward))
    inputs = PlanInputs(
        rollout_batch=value.integer("grpo.num_prompts_per_step") * value.integer("grpo.num_generations_per_prompt"),
        global_batch=value.integer("policy.train_global_batch_size"),
        staleness=loop.staleness,
        error_threshold=None if threshold is None else value.number("grpo.seq_logprob_error_threshold"),
        dropout=bool(dropouts),
        kl_penalty=value.number("loss_fn.reference_policy_kl_penalty"),
        kl_in_reward=bool(value("loss_fn.use_kl_in_reward")),
        force_on_policy=bool(value("loss_fn.force_on_policy_ratio")),
        importance_sampling=bool(value("loss_fn.use_importance_sampling_correction")),
        skip_reference=bool(value("grpo.skip_reference_policy_logprobs_calculation")),
        moe=bool(value("policy.router_replay.enabled")),  # the file does not say whether a policy without R3 is MoE
        router_replay=bool(value("policy.router_replay.enabled")),
        prev_readers=(OPD_READER,) if estimator == "opd" else (),
        keys=keys,
    )
    facts = _NemoRlFacts.read(value, loop, estimator)
    if value.problems:
        raise ConfigError(value.problems)
    reference, prev, rejects = nemo_rl_decisions(inputs, facts)
    unknown = unknown_keys(config)
    unknown_names = {key for key, _ in unknown}
    sections = PLAN_SECTIONS + (("async_rl",) if loop.kind == "single_controller" else ())
    unmapped = [key for section in sections for key in _leaf_keys(config.get(section) or {}, section)
                if key not in value.read and not any(_within(key, name) for name in unknown_names)]
    return NemoRlPlanView(
        inputs=inputs, files=files, loop=loop, unmapped_keys=tuple(unmapped),
        unknown_keys=tuple((key, _nearest_note(key, nearest, value)) for key, nearest in unknown),
        not_yet=tuple(_not_yet(value)), ignored_sections=tuple(_ignored(config, value, loop)),
        nemo_computes_reference=reference, nemo_computes_prev=prev, nemo_rejects=tuple(rejects),
        differences=tuple(_differences(inputs, facts)))


def nemo_rl_loop(value: _Lookup) -> NemoRlLoop:
    """The loop NeMo-RL runs for the config and its staleness bound: `grpo.async_grpo: null` selects the
    SingleController (its `async_rl.sampler`), `grpo.async_grpo.enabled` the legacy async loop, `data_plane.enabled`
    the TransferQueue sync loop, else the legacy sync loop."""
    if value.has("grpo.async_grpo") and value.raw("grpo.async_grpo") is None:
        sampler = value("async_rl.sampler.name")
        description = f"SingleController (grpo.async_grpo: null), async_rl.sampler.name = {sampler}"
        if sampler == "in_order":
            key = "async_rl.sampler.max_lookahead_versions"
            return NemoRlLoop("single_controller", description, value.integer(key), _named(value, key))
        if sampler in ("windowed", "weight_fifo"):
            key = "async_rl.sampler.max_staleness_versions"
            return NemoRlLoop("single_controller", description, value.integer(key), _named(value, key))
        why = ("whose late stragglers stay selectable" if sampler == "ready_first" else
               "a user class" if sampler == "custom" else f"not one of NeMo-RL's samplers ({', '.join(SAMPLERS)})")
        return NemoRlLoop("single_controller", description, None, f"async_rl.sampler.name = {sampler}, {why}")
    if value("grpo.async_grpo.enabled"):
        key = "grpo.async_grpo.max_trajectory_age_steps"
        return NemoRlLoop("async", "legacy async (grpo.async_grpo.enabled: async_grpo_train)",
                          value.integer(key), _named(value, key))
    if value("data_plane.enabled"):
        return NemoRlLoop("tq_sync", "TransferQueue sync (data_plane.enabled: grpo_train_sync)", 0,
                          "the staleness of a synchronous loop")
    return NemoRlLoop("sync", "legacy sync (grpo_train)", 0, "the staleness of a synchronous loop")


def dropout_settings(value: _Lookup) -> list[str]:
    """The dotted keys of every dropout > 0 the config sets (`DROPOUT_SOURCES`), in source order."""
    found = []
    for section, switch, keys in DROPOUT_SOURCES:
        if not value.has(section) or not isinstance(value.raw(section), Mapping):
            continue
        if switch is not None and not (value.has(f"{section}.{switch}") and value(f"{section}.{switch}") is True):
            continue
        if keys == "any":
            dotted = [key for key in _leaf_keys(value.raw(section), section)
                      if _DROPOUT_KEY.search(key.rsplit(".", 1)[1])]
        else:
            dotted = [f"{section}.{keys}"] if value.has(f"{section}.{keys}") else []
        found += [key for key in dotted if _positive(value(key))]
    return found


@dataclass(frozen=True)
class _NemoRlFacts:
    """What NeMo-RL's setup and loops read besides the plan's inputs."""

    loop: NemoRlLoop
    estimator: str
    opd_enabled: bool
    non_colocated_teachers: bool
    sampler: str | None
    has_async_rl: bool
    data_plane: bool
    router_replay: bool
    generation_backend: Any
    megatron_policy: bool
    virtual_pipeline: Any

    @classmethod
    def read(cls, value: _Lookup, loop: NemoRlLoop, estimator: str) -> _NemoRlFacts:
        single_controller = loop.kind == "single_controller"
        router_replay = bool(value("policy.router_replay.enabled"))
        return cls(
            loop=loop, estimator=estimator,
            opd_enabled=bool(value("on_policy_distillation.enabled")),
            non_colocated_teachers=bool(value("on_policy_distillation.non_colocated_teachers.enabled"))
            if value.has("on_policy_distillation.non_colocated_teachers") else False,
            sampler=value("async_rl.sampler.name") if single_controller else None,
            has_async_rl=isinstance(value.raw("async_rl"), Mapping) if value.has("async_rl") else False,
            data_plane=bool(value("data_plane.enabled")),
            router_replay=router_replay,
            generation_backend=value("policy.generation.backend") if router_replay else None,
            megatron_policy=bool(value("policy.megatron_cfg.enabled")) if router_replay else False,
            virtual_pipeline=(value("policy.megatron_cfg.virtual_pipeline_model_parallel_size") if router_replay
                              else None),
        )


def nemo_rl_decisions(inputs: PlanInputs, facts: _NemoRlFacts) -> tuple[bool, bool, list[str]]:
    """What NeMo-RL's GRPO setup and loop do with the same settings: (reference pass runs, prev pass runs, what its
    setup or first step fails on, one sentence each).

    Every loop skips the prev pass exactly when `force_on_policy_ratio` is set and no `seq_logprob_error_threshold`
    needs prev, and fills it with zeros then. The legacy and TransferQueue loops load the reference model exactly
    when the KL penalty is > 0 (a zero penalty switches the skip on by itself); the SingleController runs the
    reference pass unless `grpo.skip_reference_policy_logprobs_calculation` is true.
    """
    keys, loop, rejects = inputs.keys, facts.loop, []

    def setup(text: str) -> None:
        rejects.append(f"NeMo-RL's setup rejects this config: {text}.")

    if inputs.skip_reference and inputs.kl_active:
        setup(f"{keys.skip_reference}=True requires {keys.kl_penalty} == 0")
    if inputs.force_on_policy and not inputs.one_step_per_rollout:
        setup(f"{keys.force_on_policy} requires {keys.global_batch} == {keys.rollout_batch}")
    skips_prev = inputs.force_on_policy and inputs.error_threshold is None
    if inputs.kl_in_reward and inputs.kl_active and skips_prev and loop.kind != "single_controller":
        setup(f"{keys.kl_in_reward} with a non-zero KL penalty needs prev logprobs, which {keys.force_on_policy} "
              "zeros (without grpo.seq_logprob_error_threshold)")
    if facts.estimator not in ESTIMATORS:
        setup(f"Invalid adv_estimator name: {facts.estimator} (grpo.adv_estimator.name; one of "
              f"{', '.join(ESTIMATORS)})")
    if facts.estimator == "opd":
        if facts.opd_enabled and skips_prev:
            setup(f"adv_estimator='opd' requires real prev_logprobs, but the config zeros them ({keys.force_on_policy}"
                  "=True with grpo.seq_logprob_error_threshold unset)")
        if not (loop.kind == "async" and facts.opd_enabled and facts.non_colocated_teachers):
            rejects.append("NeMo-RL fails at its first step: its OPD advantage raises 'OPD requires "
                           "teacher_logprobs', which only async_grpo_train with "
                           "on_policy_distillation.non_colocated_teachers.enabled passes.")
    if loop.kind == "async" and not inputs.importance_sampling:
        setup(f"{keys.importance_sampling} must be on for async GRPO (grpo.async_grpo.enabled)")
    if loop.kind == "single_controller":
        rejects.extend(_single_controller_rejects(inputs, facts))
    if facts.router_replay:
        rejects.extend(_router_replay_rejects(facts))
    reference = (not inputs.skip_reference) if loop.kind == "single_controller" else inputs.kl_active
    return reference, not skips_prev, rejects


def _single_controller_rejects(inputs: PlanInputs, facts: _NemoRlFacts) -> list[str]:
    keys, rejects = inputs.keys, []
    prefix = "NeMo-RL's setup rejects this config: "
    if not facts.has_async_rl:
        rejects.append(prefix + "grpo.async_grpo: null selects the SingleController, whose config needs an "
                                "async_rl section.")
    if not facts.data_plane:
        rejects.append(prefix + "run_grpo_single_controller requires data_plane.enabled=true.")
    if not inputs.one_step_per_rollout:
        rejects.append(prefix + f"{keys.rollout_batch} ({inputs.rollout_batch}) must equal {keys.global_batch} "
                                f"({inputs.global_batch}) so that one RL step maps to exactly one optimizer.step.")
    if facts.sampler == "ready_first":
        if not inputs.importance_sampling:
            rejects.append(prefix + "the ready_first sampler requires loss_fn.use_importance_sampling_correction"
                                    "=true.")
        if inputs.force_on_policy:
            rejects.append(prefix + "the ready_first sampler requires loss_fn.force_on_policy_ratio=false so "
                                    "prev_logprobs are used.")
    elif facts.sampler not in SAMPLERS:
        rejects.append(prefix + f"async_rl.sampler.name = {facts.sampler} is not one of {', '.join(SAMPLERS)}.")
    return rejects


def _router_replay_rejects(facts: _NemoRlFacts) -> list[str]:
    prefix, rejects = "NeMo-RL's setup rejects this config: ", []
    if facts.generation_backend != "vllm":
        rejects.append(prefix + "router_replay.enabled requires vLLM generation (policy.generation.backend).")
    if not facts.megatron_policy:
        rejects.append(prefix + "router_replay.enabled requires the Megatron policy backend (policy.megatron_cfg."
                                "enabled).")
    if facts.virtual_pipeline not in (None, 1):
        rejects.append(prefix + "router_replay.enabled does not support virtual pipeline parallelism yet.")
    if facts.loop.kind == "async" and facts.data_plane:
        rejects.append(prefix + "policy.router_replay.enabled=true with async GRPO on this entrypoint is supported "
                                "only when data_plane.enabled=false.")
    return rejects


def _differences(inputs: PlanInputs, facts: _NemoRlFacts) -> list[str]:
    """Where NeMo-RL computes something else from the same keys (beyond which passes run)."""
    lines = []
    if inputs.kl_in_reward and inputs.kl_active and facts.estimator in ("grpo", "gdpo", "opd"):
        lines.append(f"NeMo-RL drops this KL: with loss_fn.use_kl_in_reward its loss zeroes the KL penalty, and its "
                     f"{facts.estimator} advantage adds none; this project's runner subtracts the penalty times "
                     "KL(prev ‖ reference) from each sequence's reward (docs/nemo-rl.md).")
    if facts.estimator == "opd":
        lines.append("The OPD teacher logprobs come from NeMo-RL's teacher workers at rollout time, not from a "
                     "logprob pass of the trained policy: they cost this plan nothing.")
    if inputs.error_threshold is not None and inputs.error_mask_in_training_forward:
        lines.append(f"{inputs.keys.error_threshold}: NeMo-RL masks from its prev pass, before the loss; here the "
                     "mask reads the training forward's detached logprobs, the same numbers, inside the loss.")
    return lines


def _not_yet(value: _Lookup) -> list[str]:
    """Keys read that have no say in this plan yet, each with why: none at present (`policy.router_replay.enabled`
    is `PlanInputs.router_replay`)."""
    return []


def _ignored(config: Mapping[str, Any], value: _Lookup, loop: NemoRlLoop) -> list[str]:
    """Top-level sections the plan read nothing from, and `async_rl` where NeMo-RL ignores it."""
    touched = {key.split(".")[0] for key in value.read}
    lines = []
    for section in config:
        if section == "async_rl" and loop.kind != "single_controller":
            lines.append("async_rl (NeMo-RL ignores it on this path: grpo.async_grpo is not null)")
        elif section not in touched and section not in PLAN_SECTIONS:
            lines.append(section)
    return lines


def comparison_lines(view: NemoRlPlanView, ours_reference: bool | None, ours_prev: bool | None) -> list[str]:
    """Sentences saying where our plan is stricter or looser than NeMo-RL's for this config (None: we reject it)."""
    inputs, keys = view.inputs, view.inputs.keys
    lines = list(view.nemo_rejects)
    if ours_reference is None:
        if inputs.kl_in_reward and not inputs.kl_active and not view.nemo_rejects:
            lines.append(f"stricter: we refuse {keys.kl_in_reward} with a zero KL penalty; NeMo-RL accepts it and "
                         "adds nothing to the reward.")
        return lines or ["we reject this config (above); NeMo-RL's setup accepts it."]
    if ours_reference == view.nemo_computes_reference:
        lines.append("reference pass: same decision as NeMo-RL.")
    elif view.loop.kind == "single_controller":
        lines.append(f"reference pass: NeMo-RL would {'compute' if view.nemo_computes_reference else 'skip'} it: on "
                     f"the SingleController it runs unless {keys.skip_reference} is true, whatever the KL penalty.")
    else:
        lines.append(f"reference pass: NeMo-RL would {'compute' if view.nemo_computes_reference else 'skip'} it.")
    if ours_prev == view.nemo_computes_prev:
        lines.append("prev pass: same decision as NeMo-RL.")
    elif not ours_prev:
        stale = " (stale rollouts included)" if inputs.staleness != 0 else ""
        lines.append(f"looser: we skip the prev pass because the training forward provably is the prev policy: "
                     f"one optimizer step per rollout{stale}, no dropout; NeMo-RL skips it only with "
                     f"{keys.force_on_policy} (and then fills prev with zeros, where we use curr.detach()).")
    else:
        lines.append(f"stricter: we compute the prev pass, which NeMo-RL skips under {keys.force_on_policy}, because "
                     "something reads prev before the loss.")
    return lines + list(view.differences)


# --- Keys NeMo-RL knows -------------------------------------------------------------------------------------------


@cache
def known_keys() -> tuple[frozenset[str], frozenset[str], str]:
    """(known dotted keys, free-form prefixes `p` of `p.*` lines, the NeMo-RL commit) of `KNOWN_KEYS_FILE`."""
    keys, free, commit = set(), set(), ""
    for line in KNOWN_KEYS_FILE.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            found = re.search(r"NVIDIA-NeMo/RL commit ([0-9a-f]{40})", line)
            commit = found.group(1) if found else commit
            continue
        key, _, source = line.partition("\t")
        if key.endswith(".*") and source.startswith("free"):
            free.add(key[:-2])
        else:
            keys.add(key)
    return frozenset(keys), frozenset(free), commit


NEMO_RL_COMMIT = known_keys()[2]


def is_known(key: str) -> bool:
    """Whether NeMo-RL knows `key`: listed, under a free-form prefix, or matching a `x.*.y` line (a map's entries)."""
    keys, free, _ = known_keys()
    if key in keys:
        return True
    parts = key.split(".")
    for i in range(1, len(parts)):
        if ".".join(parts[:i]) in free or ".".join([*parts[:i], "*", *parts[i + 1:]]) in keys:
            return True
    return False


def unknown_keys(config: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """The shallowest key of each sub-tree of the checked sections that NeMo-RL does not know, with the nearest
    known key (None: none is near)."""
    unknown = []
    for section in CHECKED_SECTIONS:
        if isinstance(config.get(section), Mapping):
            unknown += _unknown_in(config[section], section)
    return [(key, nearest_known(key)) for key in unknown]


def _unknown_in(node: Mapping[str, Any], prefix: str) -> list[str]:
    found = []
    for key, child in node.items():
        dotted = f"{prefix}.{key}"
        if not is_known(dotted):
            found.append(dotted)
        elif isinstance(child, Mapping):
            found += _unknown_in(child, dotted)
    return found


def nearest_known(key: str) -> str | None:
    """The known key an unknown one most likely meant: a sibling with the same words in another order, else a close
    sibling (a misspelling), else a key anywhere with a close last part, same section first (a key in the wrong
    section), else the closest dotted key."""
    parent, _, leaf = key.rpartition(".")
    concrete = sorted(k for k in known_keys()[0] if "*" not in k)
    siblings = {k.rpartition(".")[2]: k for k in concrete if k.rpartition(".")[0] == parent}
    shuffled = [k for name, k in siblings.items() if sorted(name.split("_")) == sorted(leaf.split("_"))]
    if shuffled:
        return shuffled[0]
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    if match:
        return siblings[match[0]]
    scored = [(-(k.split(".")[0] == key.split(".")[0]), -ratio, len(k), k) for k in concrete
              if (ratio := difflib.SequenceMatcher(None, leaf, k.rpartition(".")[2]).ratio()) >= 0.8]
    if scored:
        return min(scored)[3]
    match = difflib.get_close_matches(key, concrete, n=1, cutoff=0.6)
    return match[0] if match else None


def _nearest_note(key: str, nearest: str | None, value: _Lookup) -> str:
    if nearest is None:
        return "no known key is near it"
    note = f"did you mean {nearest}?"
    if nearest in value.read:
        note += f" {nearest} = {_shown(value(nearest))} applies"
    return note


# --- Values: NeMo-RL's defaults and interpolations -----------------------------------------------------------------

_RESOLVERS = {"add": operator.add, "mul": operator.mul, "div": operator.truediv, "max": max}
_KEY = re.compile(r"^[A-Za-z0-9_.]+$")


class _Unresolvable(Exception):
    pass


class _Lookup:
    """Dotted-key access to the merged config with NeMo-RL's code defaults and interpolations resolved; it records
    every key it was asked about (`read`) and every value it could not resolve (`problems`)."""

    def __init__(self, config: Mapping[str, Any]):
        self.config = config
        self.problems: list[str] = []
        self.read: set[str] = set()

    def has(self, dotted: str) -> bool:
        self.read.add(dotted)
        return _get(self.config, dotted) is not _MISSING

    def raw(self, dotted: str) -> Any:
        """The value as written (interpolations unresolved), or None when absent."""
        self.read.add(dotted)
        found = _get(self.config, dotted)
        return None if found is _MISSING else found

    def __call__(self, dotted: str) -> Any:
        self.read.add(dotted)
        found = _get(self.config, dotted)
        if found is _MISSING:
            return OPTIONAL_DEFAULTS[dotted]
        if not (isinstance(found, str) and "${" in found):
            return found
        try:
            return self._resolve(found, {dotted})
        except _Unresolvable as why:
            self.problems.append(f"{dotted}: cannot resolve {found!r} ({why})")
            return OPTIONAL_DEFAULTS.get(dotted, 0)

    def integer(self, dotted: str) -> int:
        """The value as an integer; anything else is a problem naming the key (and 0)."""
        found = self(dotted)
        if isinstance(found, bool) or not isinstance(found, int):
            if not (isinstance(found, float) and found.is_integer()):
                self.problems.append(f"{dotted}: expected an integer, got {found!r}")
                return 0
        return int(found)

    def number(self, dotted: str) -> float:
        """The value as a float; anything else is a problem naming the key (and 0)."""
        found = self(dotted)
        if isinstance(found, bool) or not isinstance(found, (int, float)):
            self.problems.append(f"{dotted}: expected a number, got {found!r}")
            return 0.0
        return float(found)

    def _resolve(self, text: str, seen: set[str]) -> Any:
        """One interpolation that is the whole value: a reference `${a.b}` or a resolver `${name:x, y}`."""
        text = text.strip()
        if not (text.startswith("${") and _closing(text, 1) == len(text) - 1):
            raise _Unresolvable("an interpolation inside a longer string is not resolved here")
        inner = text[2:-1]
        name, colon, arguments = inner.partition(":")
        if not colon:
            if not _KEY.match(inner):
                raise _Unresolvable(f"{inner!r} is not a key")
            if inner in seen:
                raise _Unresolvable(f"{inner} refers back to itself")
            target = _get(self.config, inner)
            if target is _MISSING:
                raise _Unresolvable(f"{inner} is not in the file")
            return self._resolve(target, seen | {inner}) if isinstance(target, str) and "${" in target else target
        if name not in _RESOLVERS:
            raise _Unresolvable(f"NeMo-RL registers the resolvers {', '.join(_RESOLVERS)}; {name!r} (an environment "
                                "variable, or another library's) is not read here" if name == "oc.env" else
                                f"NeMo-RL registers the resolvers {', '.join(_RESOLVERS)}, not {name!r}")
        values = [self._argument(part, seen) for part in _split_arguments(arguments)]
        if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise _Unresolvable(f"{name} takes two numbers, got {values!r}")
        return _RESOLVERS[name](*values)

    def _argument(self, text: str, seen: set[str]) -> Any:
        text = text.strip()
        if text.startswith("${"):
            return self._resolve(text, seen)
        for parse in (int, float):
            try:
                return parse(text)
            except ValueError:
                pass
        raise _Unresolvable(f"{text!r} is not a number")


def _closing(text: str, opening: int) -> int:
    """The index of the brace that closes the one at `opening` (-1: none)."""
    depth = 0
    for index in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return index
    return -1


def _split_arguments(text: str) -> list[str]:
    """A resolver's arguments, split at the commas outside nested interpolations."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return parts + [text[start:]]


_MISSING = object()


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _named(value: _Lookup, key: str) -> str:
    """A key as the plan names it, saying so when NeMo-RL's default supplies its value."""
    return key if value.has(key) else f"NeMo-RL's default {key}"


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _within(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _leaf_keys(section: Mapping[str, Any], prefix: str) -> list[str]:
    keys = []
    for key, value in section.items():
        path = f"{prefix}.{key}"
        keys += _leaf_keys(value, path) if isinstance(value, Mapping) and value else [path]
    return keys
