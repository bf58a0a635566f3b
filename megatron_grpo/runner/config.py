"""The run configuration: one strict section per section of configs/grpo_tiny_cpu.yaml, field names as in the YAML.

Every section is a `StrictSection` (see `megatron_grpo.strict_config`): `load_config` reports every missing key,
unknown key, wrongly typed value, out-of-range value and conflict of the whole file in one `ConfigError`, each
named by its dotted key, so a user fixes a config in one round trip. A section checks its own keys in its
`conflicts()`; the rules that span sections are `Config.conflicts()`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Mapping

import yaml

from megatron_grpo.loss.config import ClippedPGLossConfig
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.runner.config_files import ConfigLoader, read_yaml, read_yaml_with_defaults
from megatron_grpo.scheduler import PassMode, PrevMode
from megatron_grpo.strict_config import ConfigError, StrictSection, build_section

__all__ = [
    "MAX_SEED",
    "MAX_TIMEOUT_SECONDS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DistributedConfig",
    "GenerationConfig",
    "GrpoConfig",
    "LoggingConfig",
    "LogprobPassesConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PassMode",
    "PolicyConfig",
    "PrevMode",
    "RouterReplayConfig",
    "SequencePackingConfig",
    "TaskConfig",
    "ConfigLoader",
    "load_config",
    "read_yaml",
    "write_resolved_config",
]

MAX_SEED = 2**63 - 1  # every seed in [0, MAX_SEED] drives all of the run's random draws
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600.0  # datetime.timedelta and the process groups' clocks overflow far beyond it
RESOLVED_CONFIG = "config.yaml"  # the resolved config `train` and `plan` write into the run directory
RESOLVED_HEADER = ("# The resolved config of this run: every key, inherited (`defaults:`) and default values\n"
                   "# included. Written by megatron-grpo; `train --config` reads it as it is.\n")


def _failing(cfg: StrictSection, names: tuple[str, ...], allowed: Callable[[Any], bool], rule: str) -> list[str]:
    """`<key>: <rule>, got <value>` for each field of `names` whose value `allowed(value)` refuses."""
    return [f"{cfg.key(name)}: {rule}, got {getattr(cfg, name)!r}" for name in names if not allowed(getattr(cfg, name))]


def _positive(value: Any) -> bool:
    return value > 0


def _non_negative(value: Any) -> bool:
    return value >= 0


def _in_unit_interval(value: float) -> bool:  # [0, 1)
    return 0 <= value < 1


def _divisibility(pairs: list[tuple[str, int, str, int]]) -> list[str]:
    """`<divisor key> (d) must divide <dividend key> (n)` for each (key, d, key, n) that fails; a non-positive
    value is left to its own range check."""
    return [f"{divisor_key} ({divisor}) must divide {dividend_key} ({dividend})"
            for divisor_key, divisor, dividend_key, dividend in pairs
            if divisor > 0 and dividend > 0 and dividend % divisor]


@dataclass(frozen=True, init=False)
class DistributedConfig(StrictSection):
    """Process-group settings shared by torch.distributed and Megatron's groups."""

    SECTION: ClassVar[str] = "distributed"

    timeout_seconds: float  # a hung peer fails every collective after this long

    def conflicts(self) -> list[str]:
        problems = _failing(self, ("timeout_seconds",), _positive, "must be > 0")
        if self.timeout_seconds > MAX_TIMEOUT_SECONDS:
            problems.append(f"{self.key('timeout_seconds')}: must be at most {MAX_TIMEOUT_SECONDS:.0f} (one year), "
                            f"got {self.timeout_seconds!r}")
        return problems


@dataclass(frozen=True, init=False)
class ModelConfig(StrictSection):
    """The Megatron-Core GPTModel architecture."""

    SECTION: ClassVar[str] = "policy.model"

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
    add_bias_linear: bool  # biases in the linear layers (an MoE model's experts take none: false)
    # Mixture of Experts, Megatron's keys and meanings (num_moe_experts null: a dense model)
    num_moe_experts: int | None
    moe_ffn_hidden_size: int | None  # each expert's; null: ffn_hidden_size
    moe_router_topk: int
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"]
    moe_aux_loss_coeff: float
    moe_z_loss_coeff: float | None
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"]
    moe_router_dtype: Literal["fp32", "fp64"] | None

    def conflicts(self) -> list[str]:
        positive = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                    "init_method_std", "make_vocab_size_divisible_by", "moe_router_topk")
        problems = [
            *_failing(self, positive, _positive, "must be > 0"),
            *_failing(self, ("hidden_dropout", "attention_dropout"), _in_unit_interval, "must be in [0, 1)"),
            *_failing(self, ("moe_aux_loss_coeff",), _non_negative, "must be >= 0"),
            *_divisibility([(self.key("num_attention_heads"), self.num_attention_heads,
                             self.key("hidden_size"), self.hidden_size)]),
        ]
        for name in ("num_moe_experts", "moe_ffn_hidden_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{self.key(name)}: must be null or > 0, got {getattr(self, name)!r}")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            problems.append(f"{self.key('moe_z_loss_coeff')}: must be null or >= 0, got {self.moe_z_loss_coeff!r}")
        experts = self.num_moe_experts
        if experts is not None and experts > 0:
            if self.moe_router_topk > experts:
                problems.append(f"{self.key('moe_router_topk')} ({self.moe_router_topk}) must be at most "
                                f"{self.key('num_moe_experts')} ({experts})")
            if self.add_bias_linear:
                problems.append(f"{self.key('add_bias_linear')}: true with {self.key('num_moe_experts')}: an MoE "
                                "model's experts take no bias (Megatron-Core's SequentialMLP adds it in place to its "
                                "TP reduction's output, an autograd error); set it to false")
        return problems


@dataclass(frozen=True, init=False)
class OptimizerConfig(StrictSection):
    """Adam hyper-parameters and gradient clipping (clip_grad 0 disables clipping)."""

    SECTION: ClassVar[str] = "policy.optimizer"

    lr: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    clip_grad: float

    def conflicts(self) -> list[str]:
        return [
            *_failing(self, ("lr", "adam_eps"), _positive, "must be > 0"),
            *_failing(self, ("weight_decay", "clip_grad"), _non_negative, "must be >= 0"),
            *_failing(self, ("adam_beta1", "adam_beta2"), _in_unit_interval, "must be in [0, 1)"),
        ]


@dataclass(frozen=True, init=False)
class SequencePackingConfig(StrictSection):
    """NeMo-RL's `policy.sequence_packing`, its keys with its meanings: each microbatch packs whole sequences end
    to end (THD, `loss.packing`) up to a token budget instead of `train_micro_batch_size` padded rows."""

    SECTION: ClassVar[str] = "policy.sequence_packing"

    enabled: bool
    train_mb_tokens: int  # tokens per packed microbatch of the training forward/backward
    logprob_mb_tokens: int | None  # tokens per packed microbatch of the prev and reference passes; None: train's
    algorithm: Literal["first_fit_decreasing", "balanced_first_fit_decreasing"]  # how sequences go into
    #   microbatches: NeMo-RL's first-fit decreasing (the one of its algorithms we have), or this runner's balanced
    #   one (as many microbatches, evened out: `loss.packing.balanced_first_fit_decreasing`)

    def conflicts(self) -> list[str]:
        problems = _failing(self, ("train_mb_tokens",), _positive, "must be > 0")
        if self.logprob_mb_tokens is not None and self.logprob_mb_tokens < 1:
            problems.append(f"{self.key('logprob_mb_tokens')}: must be null or > 0, got {self.logprob_mb_tokens!r}")
        return problems


@dataclass(frozen=True, init=False)
class RouterReplayConfig(StrictSection):
    """NeMo-RL's `policy.router_replay` (R3) for an MoE policy: `enabled` records each token's routes during the
    rollout and replays them in the prev pass and the training forward, as NeMo-RL does. The other two keys are this
    runner's own (docs/nemo-rl.md): the reference pass replaying them too (NeMo-RL's does not), and one more pass per
    step to log the mismatch without replay."""

    SECTION: ClassVar[str] = "policy.router_replay"

    enabled: bool
    replay_in_reference: bool  # the reference pass replays the rollout's routes too
    compare_without_replay: bool  # one more forward-only pass per step, by the router's own routes: its logprobs'
    #   mismatch with the generation logprobs (router_replay_off_token_mult_prob_error)

    def conflicts(self) -> list[str]:
        return [f"{self.key(name)}: true needs {self.key('enabled')}: true" for name in
                ("replay_in_reference", "compare_without_replay") if getattr(self, name) and not self.enabled]


@dataclass(frozen=True, init=False)
class PolicyConfig(StrictSection):
    """The trained policy: parallel layout, batch sizes, precision, initial weights, model and optimizer."""

    SECTION: ClassVar[str] = "policy"

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int  # each sequence split over this many ranks (the attention all-gathers K and V)
    expert_model_parallel_size: int  # an MoE model's experts split over this many ranks (taken from DP)
    sequence_parallel: bool  # activations outside attention and MLP split along the sequence over TP
    train_global_batch_size: int  # sequences per optimizer step, all DP ranks
    train_micro_batch_size: int  # sequences per microbatch per DP rank
    precision: Literal["fp32", "bf16"]  # no fp16: the train step does no loss scaling
    fused_linear_logprobs: bool  # logprobs from the final hidden states, no [tokens, vocab] logits
    fused_linear_loss: bool  # with fused_linear_logprobs: the training loss's gradient in forward (3 GEMMs, not 4)
    initial_checkpoint: str | None  # a Megatron-Core dist_checkpointing model directory; None = random init
    sequence_packing: SequencePackingConfig
    router_replay: RouterReplayConfig
    model: ModelConfig
    optimizer: OptimizerConfig

    def conflicts(self) -> list[str]:
        positive = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size", "train_global_batch_size", "train_micro_batch_size")
        problems = _failing(self, positive, _positive, "must be > 0")
        experts = self.model.num_moe_experts
        if experts is None:
            problems.extend(f"{key}: needs an MoE model ({self.model.key('num_moe_experts')}), got a dense one"
                            for key, on in ((self.key("expert_model_parallel_size"),
                                             self.expert_model_parallel_size > 1),
                                            (self.router_replay.key("enabled"), self.router_replay.enabled)) if on)
        else:
            if self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
                problems.append(f"{self.key('sequence_parallel')}: an MoE model at "
                                f"{self.key('tensor_model_parallel_size')} {self.tensor_model_parallel_size} needs "
                                "true (Megatron-Core's MoELayer refuses to train under TP without it)")
            problems.extend(_divisibility([(self.key("expert_model_parallel_size"), self.expert_model_parallel_size,
                                            self.model.key("num_moe_experts"), experts)]))
            if self.router_replay.enabled and self.context_parallel_size > 1:
                problems.append(f"{self.router_replay.key('enabled')}: true with {self.key('context_parallel_size')} "
                                f"{self.context_parallel_size}: the sampler records routes on whole sequences, and "
                                "under context parallelism each rank's forward sees its share")
        if self.fused_linear_loss and not self.fused_linear_logprobs:
            problems.append(f"{self.key('fused_linear_loss')}: true needs {self.key('fused_linear_logprobs')}: true")
        if self.initial_checkpoint is not None and not self.initial_checkpoint.strip():
            problems.append(f"{self.key('initial_checkpoint')}: must be null or a directory, got an empty string")
        return problems + _divisibility([(self.key("train_micro_batch_size"), self.train_micro_batch_size,
                                          self.key("train_global_batch_size"), self.train_global_batch_size)])


@dataclass(frozen=True, init=False)
class TaskConfig(StrictSection):
    """The toy task whose rewards drive training."""

    SECTION: ClassVar[str] = "task"

    name: Literal["copy", "reverse"]
    num_digits: int  # the digits of a prompt; with min_digits, the most
    min_digits: int | None  # None: every prompt has num_digits; else each draws its count from min..num_digits

    def conflicts(self) -> list[str]:
        problems = _failing(self, ("num_digits",), _positive, "must be > 0")
        if self.min_digits is not None and not 1 <= self.min_digits <= self.num_digits:
            problems.append(f"{self.key('min_digits')}: must be null or in [1, {self.key('num_digits')} = "
                            f"{self.num_digits}], got {self.min_digits!r}")
        return problems


@dataclass(frozen=True, init=False)
class GenerationConfig(StrictSection):
    """Sampling settings of the rollouts."""

    SECTION: ClassVar[str] = "generation"

    temperature: float
    top_k: int | None  # None = the full distribution
    top_p: float | None  # None or 1.0 = the full distribution; else the nucleus of mass top_p, after top_k
    max_new_tokens: int
    replay_kept_set: bool  # train on the sampler's own kept set of each token instead of recomputing top_k / top_p

    def conflicts(self) -> list[str]:
        """The sampling rules are `SamplingDistribution`'s (the one owner), named by this section's keys."""
        problems = _failing(self, ("max_new_tokens",), _positive, "must be > 0")
        sampling = SamplingDistribution.problems(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                                 replay_kept_set=self.replay_kept_set)
        problems += [f"{self.key(name)}: {problem.replace('None', 'null')}" for name, problem in sampling.items()]
        if self.replay_kept_set is True and self.top_k is None and self.top_p in (None, 1.0):
            problems.append(f"{self.key('replay_kept_set')}: true needs {self.key('top_k')} or {self.key('top_p')} "
                            "< 1: without a filter the sampler keeps every token, and there is nothing to replay")
        return problems


@dataclass(frozen=True, init=False)
class GrpoConfig(StrictSection):
    """The GRPO loop: rollout batch shape, length of the run, staleness and advantage estimation."""

    SECTION: ClassVar[str] = "grpo"

    num_prompts_per_step: int
    num_generations_per_prompt: int
    max_num_steps: int
    max_rollout_staleness: int  # 0 = rollouts always come from the current weights
    seq_logprob_error_threshold: float | None  # None = no masking of sequences by logprob mismatch
    normalize_rewards_by_std: bool  # False = Dr. GRPO
    leave_one_out_baseline: bool
    # NeMo-RL's switch, with its meaning: true = logprob_passes.reference: skip (needs a zero KL penalty)
    skip_reference_policy_logprobs_calculation: bool

    def conflicts(self) -> list[str]:
        positive = ("num_prompts_per_step", "num_generations_per_prompt", "max_num_steps")
        problems = [*_failing(self, positive, _positive, "must be > 0"),
                    *_failing(self, ("max_rollout_staleness",), _non_negative, "must be >= 0")]
        threshold = self.seq_logprob_error_threshold
        if threshold is not None and not threshold > 0:
            problems.append(f"{self.key('seq_logprob_error_threshold')}: must be null or > 0, got {threshold!r}")
        return problems


@dataclass(frozen=True, init=False)
class LogprobPassesConfig(StrictSection):
    """Per-pass overrides of the scheduler: auto decides, compute always runs, skip is validated; prev may also
    come without a pass from the generation logprobs (generation) or AReaL's interpolation (loglinear, linear),
    and compute_and_compare logs those approximations' errors against the pass (see megatron_grpo.scheduler)."""

    SECTION: ClassVar[str] = "logprob_passes"

    reference: PassMode
    prev: PrevMode


@dataclass(frozen=True, init=False)
class CheckpointConfig(StrictSection):
    """Where and how often to save (every_n_steps 0 = never)."""

    SECTION: ClassVar[str] = "checkpoint"

    dir: str
    every_n_steps: int
    verify_checksums: bool  # hash every file of a checkpoint on load against its COMPLETE marker

    def conflicts(self) -> list[str]:
        return _failing(self, ("every_n_steps",), _non_negative, "must be >= 0")


@dataclass(frozen=True, init=False)
class LoggingConfig(StrictSection):
    """Console output, and the scalar logs of the run directory (rank 0 writes; see runner/tensorboard_log.py)."""

    SECTION: ClassVar[str] = "logging"

    progress_bar: bool
    tensorboard: bool  # TensorBoard event files in run_dir, every scalar of metrics.jsonl
    wandb: bool  # W&B in offline mode under run_dir/wandb; needs the wandb package

    def conflicts(self) -> list[str]:
        return [f"{self.key(name)}: true needs the {name} package, which is not installed (pip install {name}, "
                f"or set {self.key(name)}: false)"
                for name in ("tensorboard", "wandb") if getattr(self, name) and importlib.util.find_spec(name) is None]


@dataclass(frozen=True, init=False)
class Config(StrictSection):
    """A whole run, built by `load_config`. Its `conflicts()` holds every rule that spans sections."""

    SECTION: ClassVar[str] = ""  # the root: its keys are the YAML's top-level keys

    seed: int
    run_dir: str
    distributed: DistributedConfig
    policy: PolicyConfig
    task: TaskConfig
    generation: GenerationConfig
    grpo: GrpoConfig
    loss_fn: ClippedPGLossConfig
    logprob_passes: LogprobPassesConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig

    def conflicts(self) -> list[str]:
        policy, model = self.policy, self.policy.model
        problems = []
        if not 0 <= self.seed <= MAX_SEED:
            problems.append(f"seed: must be in [0, 2**63 - 1], got {self.seed!r}")
        loss = self.loss_fn
        auxiliary = model.num_moe_experts is not None and (model.moe_z_loss_coeff or (
            model.moe_aux_loss_coeff > 0 and model.moe_router_load_balancing_type != "none"))
        if self.grpo.seq_logprob_error_threshold is not None and auxiliary:
            problems.append("grpo.seq_logprob_error_threshold with policy.model.moe_aux_loss_coeff / moe_z_loss_coeff: "
                            "the mask defers the step's normalisation to its end, which would divide Megatron's "
                            "auxiliary losses by the step's count too; set the coefficients to 0 / null, or the "
                            "threshold to null")
        if self.grpo.seq_logprob_error_threshold is not None and loss.positive_example_nll_weight > 0 \
                and loss.loss_agg_mode != "token-mean":
            problems.append(f"grpo.seq_logprob_error_threshold with loss_fn.positive_example_nll_weight > 0 and "
                            f"loss_fn.loss_agg_mode = {loss.loss_agg_mode}: the mask runs in the loss, which the step "
                            "then divides by one count, but VAPO's NLL divides by the trained tokens and the seq-mean "
                            "modes by the sequences; use token-mean, or no NLL term")
        tp, pp = "policy.tensor_model_parallel_size", "policy.pipeline_model_parallel_size"
        return problems + _divisibility([
            (tp, policy.tensor_model_parallel_size, "policy.model.num_attention_heads", model.num_attention_heads),
            (tp, policy.tensor_model_parallel_size, "policy.model.ffn_hidden_size", model.ffn_hidden_size),
            (pp, policy.pipeline_model_parallel_size, "policy.model.num_layers", model.num_layers),
        ])


def load_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> Config:
    """Reads a YAML file, its `defaults:` parents merged under it (`config_files.read_yaml_with_defaults`), or takes
    an already parsed mapping, into a `Config`; every problem is a ConfigError."""
    if isinstance(path_or_dict, Mapping):
        return build_section(Config, path_or_dict)
    merged, _files = read_yaml_with_defaults(path_or_dict)
    return build_section(Config, merged)


def write_resolved_config(cfg: Config, path: str | os.PathLike) -> None:
    """Writes every key of `cfg` (inherited and default values included) as YAML that `load_config` reads back into
    an equal `Config`: the run's whole configuration, explicit, whatever files and defaults it came from. Creates the
    directory (`--fresh` has just moved the earlier run directory aside)."""
    text = yaml.safe_dump(cfg.to_mapping(), sort_keys=False, default_flow_style=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as stream:
        stream.write(RESOLVED_HEADER + text)
    os.replace(tmp, path)
