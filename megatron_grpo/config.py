"""Typed, strict configuration: every key explicit, every error named by its dotted path.

`build_section` turns a plain mapping into a frozen dataclass. It reports every missing key, unknown key and
wrongly typed value of the whole tree in one `ConfigError`, so a user fixes a config in one round trip.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration is incomplete, malformed or self-contradictory. The message names every offending key."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def build_section(cls: type[T], data: Any, path: str = "") -> T:
    """Builds dataclass `cls` from `data`; raises one ConfigError listing every problem under `path`."""
    problems: list[str] = []
    value = _build(cls, data, path, problems)
    if problems:
        raise ConfigError(problems)
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _build(tp: Any, data: Any, path: str, problems: list[str]) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, data, path, problems)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        non_none = [o for o in options if o is not type(None)]
        for option in non_none:
            trial: list[str] = []
            value = _build(option, data, path, trial)
            if not trial:
                return value
        problems.append(f"{path or '<root>'}: expected {_describe(tp)}, got {data!r}")
        return None
    if origin is Literal:
        choices = typing.get_args(tp)
        if data not in choices:
            problems.append(f"{path}: must be one of {', '.join(map(repr, choices))}, got {data!r}")
        return data
    if origin in (dict, Mapping):
        if not isinstance(data, Mapping):
            problems.append(f"{path}: expected a mapping, got {data!r}")
        return dict(data) if isinstance(data, Mapping) else data
    if origin in (tuple, list):
        if not isinstance(data, (list, tuple)):
            problems.append(f"{path}: expected a list, got {data!r}")
            return data
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_build(item_tp, item, f"{path}[{i}]", problems) for i, item in enumerate(data))
    return _build_scalar(tp, data, path, problems)


def _build_scalar(tp: Any, data: Any, path: str, problems: list[str]) -> Any:
    if tp is Any:
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            problems.append(f"{path}: expected a number, got {data!r}")
            return data
        if not math.isfinite(data):  # no key means "unbounded" by inf; a NaN passes every comparison
            problems.append(f"{path}: must be a finite number, got {data!r}")
            return data
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            problems.append(f"{path}: expected an integer, got {data!r}")
        return data
    if tp is bool:
        if not isinstance(data, bool):
            problems.append(f"{path}: expected true or false, got {data!r}")
        return data
    if tp is str:
        if not isinstance(data, str):
            problems.append(f"{path}: expected a string, got {data!r}")
        return data
    raise TypeError(f"unsupported config field type {tp!r} at {path}")


def _build_dataclass(cls: Any, data: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(data, Mapping):
        problems.append(f"{path or '<root>'}: expected a mapping for section {cls.__name__}, got {data!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            problems.append(f"{_join(path, str(key))}: unknown key (allowed: {', '.join(fields)})")
    kwargs = {}
    for name in fields:
        if name not in data:
            problems.append(f"{_join(path, name)}: missing key")
            continue
        kwargs[name] = _build(hints[name], data[name], _join(path, name), problems)
    if len(kwargs) != len(fields) or problems:
        return None
    try:
        return cls(**kwargs)
    except ConfigError as err:
        problems.extend(err.problems)
        return None


def _describe(tp: Any) -> str:
    """Human words for a type: `'a' | 'b' | null`, `number or null`."""
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(repr, typing.get_args(tp)))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    names = {type(None): "null", float: "a number", int: "an integer", bool: "true or false", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", repr(tp)))


# --------------------------------------------------------------------------------------------------------------
# The run configuration: one frozen dataclass per section of configs/grpo_tiny_cpu.yaml, field names as in the YAML.
# --------------------------------------------------------------------------------------------------------------

# megatron_grpo.loss.config imports ConfigError from this module, so this import must come after ConfigError is
# defined and must bind the module (not the class): that works in either import order. The `loss_fn` annotation
# below is a string that build_section resolves only when a config is loaded, by which time both are complete.
import megatron_grpo.loss.config as _loss_config  # noqa: E402

PassMode = Literal["auto", "compute", "skip"]
MAX_SEED = 2**63 - 1  # every seed in [0, MAX_SEED] drives all of the run's random draws
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600.0  # datetime.timedelta and the process groups' clocks overflow far beyond it


@dataclass(frozen=True)
class DistributedConfig:
    """Process-group settings shared by torch.distributed and Megatron's groups."""

    timeout_seconds: float  # a hung peer fails every collective after this long


@dataclass(frozen=True)
class ModelConfig:
    """The Megatron-Core GPTModel architecture."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    position_embedding_type: Literal["learned_absolute", "rope"]
    init_method_std: float
    hidden_dropout: float
    attention_dropout: float
    make_vocab_size_divisible_by: int  # the vocab is padded to a multiple of this times the TP size


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam hyper-parameters and gradient clipping (clip_grad 0 disables clipping)."""

    lr: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    clip_grad: float


@dataclass(frozen=True)
class PolicyConfig:
    """The trained policy: parallel layout, batch sizes, precision, model and optimizer."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    train_global_batch_size: int  # sequences per optimizer step, all DP ranks
    train_micro_batch_size: int  # sequences per microbatch per DP rank
    precision: Literal["fp32", "bf16"]  # no fp16: the train step does no loss scaling
    fused_linear_logprobs: bool  # logprobs from the final hidden states, no [tokens, vocab] logits
    fused_linear_loss: bool  # with fused_linear_logprobs: the training loss's gradient in forward (3 GEMMs, not 4)
    model: ModelConfig
    optimizer: OptimizerConfig


@dataclass(frozen=True)
class TaskConfig:
    """The toy task whose rewards drive training."""

    name: Literal["copy", "reverse"]
    num_digits: int


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings of the rollouts."""

    temperature: float
    top_k: int | None  # None = the full distribution
    top_p: float | None  # None or 1.0 = the full distribution; else the nucleus of mass top_p, after top_k
    max_new_tokens: int


@dataclass(frozen=True)
class GrpoConfig:
    """The GRPO loop: rollout batch shape, length of the run, staleness and advantage estimation."""

    num_prompts_per_step: int
    num_generations_per_prompt: int
    max_num_steps: int
    max_rollout_staleness: int  # 0 = rollouts always come from the current weights
    seq_logprob_error_threshold: float | None  # None = no masking of sequences by logprob mismatch
    normalize_rewards_by_std: bool  # False = Dr. GRPO
    leave_one_out_baseline: bool
    # NeMo-RL's switch, with its meaning: true = logprob_passes.reference: skip (needs a zero KL penalty)
    skip_reference_policy_logprobs_calculation: bool


@dataclass(frozen=True)
class LogprobPassesConfig:
    """Per-pass overrides of the scheduler: auto decides, compute always runs, skip is validated."""

    reference: PassMode
    prev: PassMode


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to save (every_n_steps 0 = never)."""

    dir: str
    every_n_steps: int
    verify_checksums: bool  # hash every file of a checkpoint on load against its COMPLETE marker


@dataclass(frozen=True)
class LoggingConfig:
    """Console output, and the scalar logs of the run directory (rank 0 writes; see grpo/tensorboard_log.py)."""

    progress_bar: bool
    tensorboard: bool  # TensorBoard event files in run_dir, every scalar of metrics.jsonl
    wandb: bool  # W&B in offline mode under run_dir/wandb; needs the wandb package

    def __post_init__(self) -> None:
        import importlib.util

        problems = [f"logging.{key}: true needs the {key} package, which is not installed (pip install {key}, "
                    f"or set logging.{key}: false)"
                    for key in ("tensorboard", "wandb") if getattr(self, key) and importlib.util.find_spec(key) is None]
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True)
class Config:
    """A whole run. Built by `load_config`; range and cross-field checks name the dotted keys they concern."""

    seed: int
    run_dir: str
    distributed: DistributedConfig
    policy: PolicyConfig
    task: TaskConfig
    generation: GenerationConfig
    grpo: GrpoConfig
    loss_fn: _loss_config.ClippedPGLossConfig
    logprob_passes: LogprobPassesConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig

    def __post_init__(self) -> None:
        problems = _range_problems(self)
        if problems:
            raise ConfigError(problems)


def load_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> Config:
    """Reads a YAML file (or takes an already parsed mapping) into a `Config`; every problem is a ConfigError."""
    if isinstance(path_or_dict, Mapping):
        return build_section(Config, path_or_dict)
    return build_section(Config, read_yaml(path_or_dict))


def read_yaml(path: str | os.PathLike) -> Any:
    """The parsed YAML file; an unreadable file, invalid YAML or a key given twice is a ConfigError naming it.

    PyYAML silently keeps the last of two equal keys, so a duplicated key would hide the value the user reads
    first; the node tree is checked for duplicates before anything is built from it.
    """
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as stream:
            text = stream.read()
    except OSError as err:
        raise ConfigError(f"{name}: cannot read the config file: {err.strerror or err}") from err
    try:
        duplicates = list(_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), ""))
        if duplicates:
            raise ConfigError([f"{name}: {problem}" for problem in duplicates])
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{name}: not valid YAML: {err}") from err


def _duplicate_keys(node: yaml.Node | None, path: str) -> Iterator[str]:
    """Yields one line per key that a mapping of the YAML node tree gives more than once."""
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in first_line:
                yield f"{_join(path, key)}: key given twice (lines {first_line[key]} and {line})"
            else:
                first_line[key] = line
            yield from _duplicate_keys(value_node, _join(path, key))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _duplicate_keys(item, f"{path}[{index}]")


def _range_problems(cfg: Config) -> list[str]:
    """Every value outside its allowed range, and every cross-field conflict that is not the scheduler's."""
    policy, model, optim = cfg.policy, cfg.policy.model, cfg.policy.optimizer
    positive = {
        "distributed.timeout_seconds": cfg.distributed.timeout_seconds,
        "policy.tensor_model_parallel_size": policy.tensor_model_parallel_size,
        "policy.pipeline_model_parallel_size": policy.pipeline_model_parallel_size,
        "policy.train_global_batch_size": policy.train_global_batch_size,
        "policy.train_micro_batch_size": policy.train_micro_batch_size,
        "policy.model.num_layers": model.num_layers,
        "policy.model.hidden_size": model.hidden_size,
        "policy.model.num_attention_heads": model.num_attention_heads,
        "policy.model.ffn_hidden_size": model.ffn_hidden_size,
        "policy.model.max_position_embeddings": model.max_position_embeddings,
        "policy.model.init_method_std": model.init_method_std,
        "policy.model.make_vocab_size_divisible_by": model.make_vocab_size_divisible_by,
        "policy.optimizer.lr": optim.lr,
        "policy.optimizer.adam_eps": optim.adam_eps,
        "task.num_digits": cfg.task.num_digits,
        "generation.temperature": cfg.generation.temperature,
        "generation.max_new_tokens": cfg.generation.max_new_tokens,
        "grpo.num_prompts_per_step": cfg.grpo.num_prompts_per_step,
        "grpo.num_generations_per_prompt": cfg.grpo.num_generations_per_prompt,
        "grpo.max_num_steps": cfg.grpo.max_num_steps,
    }
    non_negative = {
        "policy.optimizer.weight_decay": optim.weight_decay,
        "policy.optimizer.clip_grad": optim.clip_grad,
        "grpo.max_rollout_staleness": cfg.grpo.max_rollout_staleness,
        "checkpoint.every_n_steps": cfg.checkpoint.every_n_steps,
    }
    unit_interval = {  # [0, 1)
        "policy.model.hidden_dropout": model.hidden_dropout,
        "policy.model.attention_dropout": model.attention_dropout,
        "policy.optimizer.adam_beta1": optim.adam_beta1,
        "policy.optimizer.adam_beta2": optim.adam_beta2,
    }
    problems = [f"{key}: must be > 0, got {value!r}" for key, value in positive.items() if not value > 0]
    if not 0 <= cfg.seed <= MAX_SEED:
        problems.append(f"seed: must be in [0, 2**63 - 1], got {cfg.seed!r}")
    if cfg.distributed.timeout_seconds > MAX_TIMEOUT_SECONDS:
        problems.append(f"distributed.timeout_seconds: must be at most {MAX_TIMEOUT_SECONDS:.0f} (one year), got "
                        f"{cfg.distributed.timeout_seconds!r}")
    problems += [f"{key}: must be >= 0, got {value!r}" for key, value in non_negative.items() if not value >= 0]
    problems += [f"{key}: must be in [0, 1), got {value!r}" for key, value in unit_interval.items()
                 if not 0 <= value < 1]
    if cfg.generation.top_k is not None and cfg.generation.top_k < 1:
        problems.append(f"generation.top_k: must be null or >= 1, got {cfg.generation.top_k!r}")
    if cfg.generation.top_p is not None and not 0.0 < cfg.generation.top_p <= 1.0:
        problems.append(f"generation.top_p: must be null or in (0, 1], got {cfg.generation.top_p!r}")
    if policy.fused_linear_loss and not policy.fused_linear_logprobs:
        problems.append("policy.fused_linear_loss: true needs policy.fused_linear_logprobs: true")
    if policy.fused_linear_loss and (cfg.generation.top_k is not None or cfg.generation.top_p is not None):
        problems.append(f"policy.fused_linear_loss: true does not support generation.top_k / generation.top_p (got "
                        f"top_k {cfg.generation.top_k!r}, top_p {cfg.generation.top_p!r}): set "
                        f"policy.fused_linear_loss: false (the fused op then applies the filter)")
    threshold = cfg.grpo.seq_logprob_error_threshold
    if threshold is not None and not threshold > 0:
        problems.append(f"grpo.seq_logprob_error_threshold: must be null or > 0, got {threshold!r}")
    tp = "policy.tensor_model_parallel_size"
    divisibility = [  # (divisor key, dividend key)
        (tp, "policy.model.num_attention_heads"),
        (tp, "policy.model.ffn_hidden_size"),
        ("policy.model.num_attention_heads", "policy.model.hidden_size"),
        ("policy.pipeline_model_parallel_size", "policy.model.num_layers"),
        ("policy.train_micro_batch_size", "policy.train_global_batch_size"),
    ]
    for divisor_key, dividend_key in divisibility:
        divisor, dividend = positive[divisor_key], positive[dividend_key]
        if divisor > 0 and dividend > 0 and dividend % divisor:
            problems.append(f"{divisor_key} ({divisor}) must divide {dividend_key} ({dividend})")
    return problems
