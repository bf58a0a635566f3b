"""Skip-aware logprob scheduler: which extra forward passes a GRPO step really needs, and why.

Besides its training forward/backward, a step may run a reference-policy logprob pass (for the KL penalty) and
a previous-policy logprob pass (for the importance ratio). `plan_logprob_passes` skips each one exactly when it
is provably redundant (docs/design.md, "Scheduler rules"), explains every decision in a sentence that names the
keys behind it, and rejects unsafe or contradictory settings with one ConfigError listing every conflict,
before any model is built. The sync and async loops both call this one function; `auto` never errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config import Config, ConfigError, PassMode

NUM_OPTIONAL_PASSES = 2  # reference and prev


@dataclass(frozen=True)
class LogprobPlan:
    """The extra forward passes of one training step, and the one decision of where the loss's prev comes from.

    `prev_from_current`: the loss takes prev = curr.detach() (`prev_logprobs_from_current=True`), and the train
    step reports curr as the prev logprobs. It holds whenever the prev pass is skipped, and also with
    `force_on_policy_ratio` when the pass runs only for a reader before the loss. The plan is its single source:
    `ClippedPGLoss` does not re-derive it from its own config. The reference model is built exactly when its
    pass runs.
    """

    compute_reference_logprobs: bool
    compute_prev_logprobs: bool
    prev_from_current: bool
    reasons: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.compute_prev_logprobs and not self.prev_from_current:
            raise ValueError("LogprobPlan: the prev pass is skipped, so the loss must take prev from current "
                             "(prev_from_current=True)")

    @property
    def build_reference_model(self) -> bool:
        return self.compute_reference_logprobs

    @property
    def passes_per_step(self) -> int:
        """Extra logprob forward passes (over the whole rollout batch) that each step runs."""
        return int(self.compute_reference_logprobs) + int(self.compute_prev_logprobs)

    @property
    def passes_saved_per_step(self) -> int:
        """Logprob forward passes (over the whole rollout batch) that each step skips."""
        return NUM_OPTIONAL_PASSES - self.passes_per_step


@dataclass(frozen=True)
class PlanKeys:
    """The config keys the plan's sentences and errors name: this project's by default; another layout (a NeMo-RL
    config read by `plan --nemo-rl-config`) names its own keys."""

    rollout_batch: str = "grpo.num_prompts_per_step × grpo.num_generations_per_prompt"
    global_batch: str = "policy.train_global_batch_size"
    staleness: str = "grpo.max_rollout_staleness"
    error_threshold: str = "grpo.seq_logprob_error_threshold"
    dropout: str = "policy.model.hidden_dropout / policy.model.attention_dropout"
    kl_penalty: str = "loss_fn.reference_policy_kl_penalty"
    kl_in_reward: str = "loss_fn.use_kl_in_reward"
    force_on_policy: str = "loss_fn.force_on_policy_ratio"
    prev_mode: str = "logprob_passes.prev"
    reference_mode: str = "logprob_passes.reference"
    skip_reference: str = "grpo.skip_reference_policy_logprobs_calculation"


@dataclass(frozen=True)
class PlanInputs:
    """The settings the rules read, under names that say what they mean, whatever config layout they came from."""

    rollout_batch: int
    global_batch: int
    staleness: int
    error_threshold: float | None
    dropout: bool
    kl_penalty: float
    kl_in_reward: bool
    force_on_policy: bool
    reference_mode: PassMode
    prev_mode: PassMode
    skip_reference: bool  # NeMo-RL's grpo.skip_reference_policy_logprobs_calculation
    keys: PlanKeys = PlanKeys()

    @classmethod
    def of(cls, cfg: Config) -> PlanInputs:
        model = cfg.policy.model
        return cls(
            rollout_batch=cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt,
            global_batch=cfg.policy.train_global_batch_size,
            staleness=cfg.grpo.max_rollout_staleness,
            error_threshold=cfg.grpo.seq_logprob_error_threshold,
            dropout=model.hidden_dropout > 0 or model.attention_dropout > 0,
            kl_penalty=cfg.loss_fn.reference_policy_kl_penalty,
            kl_in_reward=cfg.loss_fn.use_kl_in_reward,
            force_on_policy=cfg.loss_fn.force_on_policy_ratio,
            reference_mode=cfg.logprob_passes.reference,
            prev_mode=cfg.logprob_passes.prev,
            skip_reference=cfg.grpo.skip_reference_policy_logprobs_calculation,
        )

    @property
    def one_step_per_rollout(self) -> bool:
        return self.rollout_batch == self.global_batch

    @property
    def kl_active(self) -> bool:
        return self.kl_penalty > 0

    def training_forward_differences(self) -> list[str]:
        """Why the proximal policy (the weights at the start of an optimizer step, in eval mode) may differ from the
        training forward of that step (empty: the training forward is the proximal policy).

        Staleness is not among them: with one optimizer step per rollout, the weights at the start of the step are
        the ones the training forward runs, whatever weights generated the rollout. The staleness lies between
        generation and prev, where the importance weights and the mismatch metrics see it.
        """
        keys, causes = self.keys, []
        if not self.one_step_per_rollout:
            causes.append(f"{keys.rollout_batch} ({self.rollout_batch}) != {keys.global_batch} ({self.global_batch}), "
                          "so every optimizer step of a rollout after the first trains on moved weights")
        if self.dropout:
            causes.append(f"{keys.dropout} > 0 makes the train-mode forward differ from the proximal policy")
        return causes

    def prev_consumers_before_loss(self) -> list[str]:
        """What reads prev logprobs before the loss runs, so they cannot come from the training forward."""
        keys, consumers = self.keys, []
        if self.error_threshold is not None:
            consumers.append(f"{keys.error_threshold} = {self.error_threshold} masks sequences by prev logprobs")
        if self.kl_in_reward and self.kl_active:
            consumers.append(f"{keys.kl_in_reward} with {keys.kl_penalty} > 0 puts a KL of prev logprobs in the reward")
        return consumers


def plan_logprob_passes(cfg: Config | PlanInputs) -> LogprobPlan:
    """Plans the reference and prev logprob passes of a step; raises one ConfigError listing every conflict."""
    inputs = cfg if isinstance(cfg, PlanInputs) else PlanInputs.of(cfg)
    problems = _global_conflicts(inputs)
    compute_reference, reference_reason = _plan_reference(inputs, problems)
    compute_prev, prev_reason = _plan_prev(inputs, problems)
    if problems:
        raise ConfigError(problems)
    return LogprobPlan(
        compute_reference_logprobs=compute_reference,
        compute_prev_logprobs=compute_prev,
        prev_from_current=not compute_prev or inputs.force_on_policy,
        reasons=(reference_reason, prev_reason),
    )


def _global_conflicts(inputs: PlanInputs) -> list[str]:
    """Conflicts that hold whatever the per-pass overrides say."""
    keys, problems = inputs.keys, []
    if inputs.rollout_batch % inputs.global_batch:
        problems.append(f"{keys.rollout_batch} ({inputs.rollout_batch}) must be a multiple of {keys.global_batch} "
                        f"({inputs.global_batch})")
    if inputs.kl_in_reward and not inputs.kl_active:
        problems.append(f"{keys.kl_in_reward} is true but {keys.kl_penalty} is 0: a zero KL in the reward is "
                        "meaningless")
    if inputs.force_on_policy and not inputs.one_step_per_rollout:
        problems.append(f"{keys.force_on_policy} needs one optimizer step per rollout batch, but {keys.rollout_batch} "
                        f"({inputs.rollout_batch}) != {keys.global_batch} ({inputs.global_batch})")
    return problems


def _reference_mode(inputs: PlanInputs, problems: list[str]) -> tuple[PassMode, str]:
    """The reference pass's mode and the key that set it: NeMo-RL's skip switch, when true, means `skip`."""
    keys = inputs.keys
    if not inputs.skip_reference:
        return inputs.reference_mode, f"{keys.reference_mode} = {inputs.reference_mode}"
    if inputs.reference_mode == "compute":
        problems.append(f"{keys.skip_reference} = true and {keys.reference_mode} = compute disagree: set only one "
                        "of them")
    return "skip", f"{keys.skip_reference} = true"


def _plan_reference(inputs: PlanInputs, problems: list[str]) -> tuple[bool, str]:
    """The reference pass (and model) is needed exactly when the KL penalty is on."""
    keys = inputs.keys
    mode, setting = _reference_mode(inputs, problems)
    if mode == "compute":
        return True, f"reference logprobs computed: {setting}."
    if mode == "skip":
        if inputs.kl_active:
            problems.append(f"{setting} is unsafe: {keys.kl_penalty} = {inputs.kl_penalty} > 0 needs reference "
                            "logprobs")
        return False, f"reference logprobs and reference model skipped: {setting}."
    if inputs.kl_active:
        where = "the reward" if inputs.kl_in_reward else "the loss"
        return True, f"reference logprobs computed: {keys.kl_penalty} = {inputs.kl_penalty} > 0 puts a KL in {where}."
    return False, f"reference logprobs and reference model skipped: {keys.kl_penalty} = 0, so no KL needs them."


def _plan_prev(inputs: PlanInputs, problems: list[str]) -> tuple[bool, str]:
    """The prev pass is redundant when the training forward is the proximal policy and nothing reads prev before
    the loss: one optimizer step per rollout, no dropout, stale rollouts or not.

    With `force_on_policy_ratio` the loss never reads prev, so only a reader before the loss makes skipping
    unsafe; `auto` and `skip` share that one verdict.
    """
    keys, mode = inputs.keys, inputs.prev_mode
    differences = inputs.training_forward_differences()
    unsafe = inputs.prev_consumers_before_loss() + ([] if inputs.force_on_policy else differences)
    forced = (f" The loss's ratio still uses curr.detach(): {keys.force_on_policy} = true."
              if inputs.force_on_policy else "")
    if mode == "compute":
        return True, f"prev logprobs computed: {keys.prev_mode} = compute.{forced}"
    if mode == "skip":
        problems.extend(f"{keys.prev_mode} = skip is unsafe: {why}" for why in unsafe)
        return False, f"prev logprobs skipped, the loss uses curr.detach(): {keys.prev_mode} = skip."
    if unsafe:
        return True, "prev logprobs computed: " + "; ".join(unsafe) + "." + forced
    if differences:
        return False, (f"prev logprobs skipped: {keys.force_on_policy} makes the loss use curr.detach() and nothing "
                       "reads them before the loss.")
    if inputs.staleness > 0:
        return False, (f"prev logprobs skipped, the loss uses curr.detach(): stale rollouts ({keys.staleness} = "
                       f"{inputs.staleness}) with one update per rollout ({keys.rollout_batch} = {keys.global_batch}): "
                       "the proximal policy is the training forward's; the IS weights use curr against generation, "
                       "and nothing reads prev before the loss.")
    return False, (f"prev logprobs skipped, the loss uses curr.detach(): the step is on-policy ({keys.rollout_batch} "
                   f"= {keys.global_batch}, {keys.staleness} = 0, {keys.dropout} = 0) and nothing reads them before "
                   "the loss.")
