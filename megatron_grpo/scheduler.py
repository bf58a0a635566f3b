"""Skip-aware logprob scheduler: which extra forward passes a GRPO step really needs, and why.

Besides its training forward/backward, a step may run a reference-policy logprob pass (for the KL penalty) and
a previous-policy logprob pass (for the importance ratio). `plan_logprob_passes` skips each one exactly when it
is provably redundant (DESIGN.md, "Scheduler contract"), explains every decision in a sentence that names the
keys behind it, and rejects unsafe or contradictory settings with one ConfigError listing every conflict,
before any model is built. The sync and async loops both call this one function; `auto` never errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config import Config, ConfigError

ROLLOUT_BATCH = "grpo.num_prompts_per_step × grpo.num_generations_per_prompt"
GLOBAL_BATCH = "policy.train_global_batch_size"
STALENESS = "grpo.max_rollout_staleness"
ERROR_THRESHOLD = "grpo.seq_logprob_error_threshold"
DROPOUT = "policy.model.hidden_dropout / policy.model.attention_dropout"
KL_PENALTY = "loss_fn.reference_policy_kl_penalty"
KL_IN_REWARD = "loss_fn.use_kl_in_reward"
FORCE_ON_POLICY = "loss_fn.force_on_policy_ratio"
PREV_MODE = "logprob_passes.prev"
REFERENCE_MODE = "logprob_passes.reference"

NUM_OPTIONAL_PASSES = 2  # reference and prev


@dataclass(frozen=True)
class LogprobPlan:
    """The extra forward passes of one training step.

    The reference model is built exactly when its pass runs, and prev comes from the training forward exactly
    when its pass is skipped: both are derived, so a plan cannot contradict itself.
    """

    compute_reference_logprobs: bool
    compute_prev_logprobs: bool
    reasons: tuple[str, ...]

    @property
    def build_reference_model(self) -> bool:
        return self.compute_reference_logprobs

    @property
    def prev_from_current(self) -> bool:
        """The loss takes prev = curr.detach() (`prev_logprobs_from_current=True`), and the train step reports curr
        as the prev logprobs."""
        return not self.compute_prev_logprobs

    @property
    def passes_per_step(self) -> int:
        """Extra logprob forward passes (over the whole rollout batch) that each step runs."""
        return int(self.compute_reference_logprobs) + int(self.compute_prev_logprobs)

    @property
    def passes_saved_per_step(self) -> int:
        """Logprob forward passes (over the whole rollout batch) that each step skips."""
        return NUM_OPTIONAL_PASSES - self.passes_per_step


@dataclass(frozen=True)
class _Facts:
    """The config values the rules read, under names that say what they mean."""

    rollout_batch: int
    global_batch: int
    staleness: int
    error_threshold: float | None
    dropout: bool
    kl_penalty: float
    kl_in_reward: bool
    force_on_policy: bool

    @classmethod
    def of(cls, cfg: Config) -> _Facts:
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
        )

    @property
    def one_step_per_rollout(self) -> bool:
        return self.rollout_batch == self.global_batch

    @property
    def kl_active(self) -> bool:
        return self.kl_penalty > 0

    def off_policy_causes(self) -> list[str]:
        """Why the training forward may differ from the policy that produced the rollouts (empty: on-policy)."""
        causes = []
        if not self.one_step_per_rollout:
            causes.append(f"{ROLLOUT_BATCH} ({self.rollout_batch}) != {GLOBAL_BATCH} ({self.global_batch}), "
                          "so later optimizer steps train on rollouts from older weights")
        if self.staleness > 0:
            causes.append(f"{STALENESS} = {self.staleness} lets rollouts come from older weights")
        if self.dropout:
            causes.append(f"{DROPOUT} > 0 makes the train-mode forward differ from the rollout policy")
        return causes

    def prev_consumers_before_loss(self) -> list[str]:
        """What reads prev logprobs before the loss runs, so they cannot come from the training forward."""
        consumers = []
        if self.error_threshold is not None:
            consumers.append(f"{ERROR_THRESHOLD} = {self.error_threshold} masks sequences by prev logprobs")
        if self.kl_in_reward and self.kl_active:
            consumers.append(f"{KL_IN_REWARD} with {KL_PENALTY} > 0 puts a KL of prev logprobs in the reward")
        return consumers


def plan_logprob_passes(cfg: Config) -> LogprobPlan:
    """Plans the reference and prev logprob passes of a step; raises one ConfigError listing every conflict."""
    facts = _Facts.of(cfg)
    problems = _global_conflicts(facts)
    compute_reference, reference_reason = _plan_reference(cfg.logprob_passes.reference, facts, problems)
    compute_prev, prev_reason = _plan_prev(cfg.logprob_passes.prev, facts, problems)
    if problems:
        raise ConfigError(problems)
    return LogprobPlan(
        compute_reference_logprobs=compute_reference,
        compute_prev_logprobs=compute_prev,
        reasons=(reference_reason, prev_reason),
    )


def _global_conflicts(facts: _Facts) -> list[str]:
    """Conflicts that hold whatever the per-pass overrides say."""
    problems = []
    if facts.rollout_batch % facts.global_batch:
        problems.append(f"{ROLLOUT_BATCH} ({facts.rollout_batch}) must be a multiple of {GLOBAL_BATCH} "
                        f"({facts.global_batch})")
    if facts.kl_in_reward and not facts.kl_active:
        problems.append(f"{KL_IN_REWARD} is true but {KL_PENALTY} is 0: a zero KL in the reward is meaningless")
    if facts.force_on_policy and not facts.one_step_per_rollout:
        problems.append(f"{FORCE_ON_POLICY} needs one optimizer step per rollout batch, but {ROLLOUT_BATCH} "
                        f"({facts.rollout_batch}) != {GLOBAL_BATCH} ({facts.global_batch})")
    if facts.force_on_policy and facts.staleness > 0:
        problems.append(f"{FORCE_ON_POLICY} needs rollouts from the current weights, but {STALENESS} = "
                        f"{facts.staleness}")
    return problems


def _plan_reference(mode: str, facts: _Facts, problems: list[str]) -> tuple[bool, str]:
    """The reference pass (and model) is needed exactly when the KL penalty is on."""
    if mode == "compute":
        return True, f"reference logprobs computed: {REFERENCE_MODE} = compute."
    if mode == "skip":
        if facts.kl_active:
            problems.append(f"{REFERENCE_MODE} = skip is unsafe: {KL_PENALTY} = {facts.kl_penalty} > 0 needs "
                            "reference logprobs")
        return False, f"reference logprobs and reference model skipped: {REFERENCE_MODE} = skip."
    if facts.kl_active:
        where = "the reward" if facts.kl_in_reward else "the loss"
        return True, f"reference logprobs computed: {KL_PENALTY} = {facts.kl_penalty} > 0 puts a KL in {where}."
    return False, f"reference logprobs and reference model skipped: {KL_PENALTY} = 0, so no KL needs them."


def _plan_prev(mode: str, facts: _Facts, problems: list[str]) -> tuple[bool, str]:
    """The prev pass is redundant when the step is on-policy and nothing reads prev before the loss.

    With `force_on_policy_ratio` the loss never reads prev, so only a reader before the loss makes skipping
    unsafe; `auto` and `skip` share that one verdict.
    """
    off_policy = facts.off_policy_causes()
    unsafe = facts.prev_consumers_before_loss() + ([] if facts.force_on_policy else off_policy)
    if mode == "compute":
        return True, f"prev logprobs computed: {PREV_MODE} = compute."
    if mode == "skip":
        problems.extend(f"{PREV_MODE} = skip is unsafe: {why}" for why in unsafe)
        return False, f"prev logprobs skipped, the loss uses curr.detach(): {PREV_MODE} = skip."
    if unsafe:
        return True, "prev logprobs computed: " + "; ".join(unsafe) + "."
    if off_policy:
        return False, (f"prev logprobs skipped: {FORCE_ON_POLICY} makes the loss use curr.detach() and nothing "
                       "reads them before the loss.")
    return False, (f"prev logprobs skipped, the loss uses curr.detach(): the step is on-policy ({ROLLOUT_BATCH} "
                   f"= {GLOBAL_BATCH}, {STALENESS} = 0, {DROPOUT} = 0) and nothing reads them before the loss.")
