"""Skip-aware logprob scheduler: which extra forward passes a GRPO step really needs, and why.

Besides its training forward/backward, a step may run a reference-policy logprob pass (for the KL penalty) and
a previous-policy logprob pass (for the importance ratio). `plan_logprob_passes` skips each one exactly when it
is provably redundant (docs/design.md, "Scheduler rules"), explains every decision in a sentence that names the
keys behind it, and rejects unsafe or contradictory settings with one ConfigError listing every conflict,
before any model is built. The sync and async loops both call this one function; `auto` never errors.

Without its pass, prev is `curr.detach()` (when that is exact), or, only when the user asks for it
(`logprob_passes.prev: generation | loglinear | linear`), the generation logprobs or AReaL's interpolation between
them and curr (`megatron_grpo.loss.prev_approximation`); `compute_and_compare` runs the pass and logs how far each
approximation is from it. Never imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from megatron_grpo.loss.config import APPROXIMATIONS, ApproximationMethod, ClippedPGLossConfig
from megatron_grpo.strict_config import ConfigError

PassMode = Literal["auto", "compute", "skip"]  # logprob_passes.reference
PrevMode = Literal["auto", "compute", "skip", "generation", "loglinear", "linear", "compute_and_compare"]
NUM_OPTIONAL_PASSES = 2  # reference and prev
# What reads the prev logprobs besides the ratio: the mismatch metrics, identically trivial with prev = generation.
MISMATCH_METRICS = ("token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio", "is_oob_ratio",
                    "gen_ratio_outside_band")


@dataclass(frozen=True)
class LogprobPlan:
    """The extra forward passes of one training step, and the one decision of where the loss's prev comes from.

    `prev_from_current`: the loss takes prev = curr.detach() (`prev_logprobs_from_current=True`), and the train
    step reports curr as the prev logprobs. It holds whenever the prev pass is skipped, and also with
    `force_on_policy_ratio` when the pass runs only for a reader before the loss. The plan is its single source
    for the runner and the train step. The reference model is built exactly when its pass runs.

    `prev_approximation`: the loss takes prev from the generation logprobs or interpolates it (no pass; see
    `megatron_grpo.loss.prev_approximation`). `compare_approximations`: the pass runs and the loss also logs each
    approximation's error against it.

    `seq_logprob_error_threshold`: NeMo-RL's sequence mask by logprob error, which the step applies inside the loss
    (`LossCall.seq_logprob_error_threshold`): from the prev pass when it runs, else from the training forward's
    curr.detach(), the prev policy exactly there; the step's normalisation is then deferred to its last forward.
    """

    compute_reference_logprobs: bool
    compute_prev_logprobs: bool
    prev_from_current: bool
    reasons: tuple[str, ...]
    prev_approximation: ApproximationMethod | None = None
    compare_approximations: bool = False
    seq_logprob_error_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.prev_approximation is not None:
            if self.prev_approximation not in APPROXIMATIONS:
                raise ValueError(f"LogprobPlan: prev_approximation must be one of {', '.join(APPROXIMATIONS)}, got "
                                 f"{self.prev_approximation!r}")
            if self.compute_prev_logprobs or self.prev_from_current:
                raise ValueError("LogprobPlan: an approximated prev needs no pass and is not curr.detach()")
        elif not self.compute_prev_logprobs and not self.prev_from_current:
            raise ValueError("LogprobPlan: the prev pass is skipped, so the loss must take prev from current "
                             "(prev_from_current=True) or approximate it (prev_approximation)")
        if self.compare_approximations and (not self.compute_prev_logprobs or self.prev_from_current):
            raise ValueError("LogprobPlan: compare_approximations compares with the prev pass the loss uses")
        if self.seq_logprob_error_threshold is not None and self.prev_approximation is not None:
            raise ValueError("LogprobPlan: the sequence mask by logprob error reads a computed prev, not an "
                             "approximated one")

    @property
    def prev_source(self) -> str:
        """Where the loss's prev comes from, in words: "prev pass", "curr.detach()" or the approximation's name."""
        if self.prev_approximation is not None:
            return self.prev_approximation
        return "curr.detach()" if self.prev_from_current else "prev pass"

    @property
    def needs_versions(self) -> bool:
        """Whether each step needs the samples' weight versions (an interpolation, or comparing with them)."""
        return self.prev_approximation in ("loglinear", "linear") or self.compare_approximations

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
    """The names the plan's sentences and errors give its inputs. By default the caller's own: `PlanInputs`' fields,
    as a script passes them to `PlanInputs.for_loss`, and the loss config's keys. A config layout names its keys
    instead: the runner's (`runner/plan_inputs.py`), a NeMo-RL config's (`plan --nemo-rl-config`)."""

    rollout_batch: str = "rollout_batch"
    global_batch: str = "global_batch"
    staleness: str = "staleness"
    error_threshold: str = "error_threshold"
    dropout: str = "dropout"
    kl_penalty: str = "ClippedPGLossConfig.reference_policy_kl_penalty"
    kl_in_reward: str = "ClippedPGLossConfig.kl_in_sequence_reward"
    force_on_policy: str = "ClippedPGLossConfig.force_on_policy_ratio"
    importance_sampling: str = "ClippedPGLossConfig.use_importance_sampling_correction"
    prev_mode: str = "prev_mode"
    reference_mode: str = "reference_mode"
    skip_reference: str = "skip_reference"
    moe: str = "moe"
    router_replay: str = "router_replay"


@dataclass(frozen=True)
class PlanInputs:
    """The settings the rules read, under names that say what they mean, whatever config layout they came from.

    A Megatron script builds it with `PlanInputs.for_loss(loss_config, rollout_batch=..., global_batch=...,
    dropout=...)`, which reads the loss's own keys; the runner adapts its config (`runner/plan_inputs.py`), and
    `plan --nemo-rl-config` a NeMo-RL one (`runner/nemo_rl_config.py`). The defaults are an on-policy loop with nothing
    overridden.
    """

    rollout_batch: int  # sequences per rollout, all DP ranks
    global_batch: int  # sequences per optimizer step, all DP ranks
    dropout: bool  # any dropout > 0 in the trained model: its train-mode forward is not the prev policy
    kl_penalty: float  # the loss's reference_policy_kl_penalty (> 0: a KL needs reference logprobs)
    staleness: int | None = 0  # how many optimizer steps older than the trained weights a rollout's weights may be;
    #   None: stale without a known bound (NeMo-RL's ready_first sampler)
    error_threshold: float | None = None  # NeMo-RL's seq_logprob_error_threshold: sequences masked by the error of
    #   generation against prev (in the loss; `LogprobPlan.seq_logprob_error_threshold`); None = off
    kl_in_reward: bool = False  # the loss's kl_in_sequence_reward: the KL reads prev before the loss
    prev_readers: tuple[str, ...] = ()  # other readers of prev before the loss, each a phrase naming its key (a
    #   NeMo-RL config's OPD advantage, `teacher - prev`)
    force_on_policy: bool = False  # the loss's force_on_policy_ratio
    reference_mode: PassMode = "auto"
    prev_mode: PrevMode = "auto"
    skip_reference: bool = False  # NeMo-RL's grpo.skip_reference_policy_logprobs_calculation
    keys: PlanKeys = PlanKeys()
    importance_sampling: bool = False  # the loss's IS correction against the generation logprobs
    moe: bool = False  # the policy is a Mixture-of-Experts model: each forward routes each token to experts
    router_replay: bool = False  # the rollout's routes are replayed in the prev pass and the training forward (R3,
    #   NeMo-RL's policy.router_replay.enabled): False, the default, routes by the router in every forward

    @classmethod
    def for_loss(cls, loss: ClippedPGLossConfig, *, rollout_batch: int, global_batch: int, dropout: bool,
                 **settings) -> PlanInputs:
        """The plan's inputs for a loop training `ClippedPGLoss(loss)`: the KL, the forced ratio and the IS
        correction from the loss's own keys, the loop's facts as given; `settings` are the other fields
        (staleness, error_threshold, reference_mode, prev_mode, keys, ...)."""
        return cls(
            rollout_batch=rollout_batch,
            global_batch=global_batch,
            dropout=dropout,
            kl_penalty=loss.reference_policy_kl_penalty,
            kl_in_reward=loss.kl_in_sequence_reward,
            force_on_policy=loss.force_on_policy_ratio,
            importance_sampling=loss.use_importance_sampling_correction,
            **settings,
        )

    @property
    def one_step_per_rollout(self) -> bool:
        return self.rollout_batch == self.global_batch

    @property
    def kl_active(self) -> bool:
        return self.kl_penalty > 0

    def training_forward_differences(self) -> list[str]:
        """Why the prev policy (the weights at the start of an optimizer step, in eval mode) may differ from the
        training forward of that step (empty: the training forward is the prev policy).

        Staleness is not among them: with one optimizer step per rollout, the weights at the start of the step are
        the ones the training forward runs, whatever weights generated the rollout. The staleness lies between
        generation and prev, where the importance weights and the mismatch metrics see it.
        """
        keys, causes = self.keys, []
        if not self.one_step_per_rollout:
            causes.append(f"{keys.rollout_batch} ({self.rollout_batch}) != {keys.global_batch} ({self.global_batch}), "
                          "so every optimizer step of a rollout after the first trains on moved weights")
        if self.dropout:
            causes.append(f"{keys.dropout} > 0 makes the train-mode forward differ from the prev policy")
        return causes

    @property
    def error_mask_in_training_forward(self) -> bool:
        """Whether the sequence mask by logprob error can read the training forward's curr.detach() instead of a
        prev pass: exactly when that forward is the prev policy. The mask then changes the step's counts during its
        forwards, which deferred normalisation absorbs (the loss is linear in its divisors)."""
        return self.error_threshold is not None and not self.training_forward_differences()

    def prev_consumers_before_loss(self) -> list[str]:
        """What reads prev logprobs before the loss runs, so they cannot come from the training forward."""
        keys, consumers = self.keys, []
        if self.error_threshold is not None and not self.error_mask_in_training_forward:
            consumers.append(f"{keys.error_threshold} = {self.error_threshold} masks sequences by prev logprobs")
        if self.kl_in_reward and self.kl_active:
            consumers.append(f"{keys.kl_in_reward} with {keys.kl_penalty} > 0 puts a KL of prev logprobs in the "
                             "reward, hence in advantages that the first backward needs and that enter the loss "
                             "non-linearly, so they cannot wait for the training forward")
        consumers.extend(self.prev_readers)
        return consumers


def plan_logprob_passes(inputs: PlanInputs) -> LogprobPlan:
    """Plans the reference and prev logprob passes of a step; raises one ConfigError listing every conflict."""
    if not isinstance(inputs, PlanInputs):
        raise TypeError(f"plan_logprob_passes: expected PlanInputs (PlanInputs.for_loss builds one), got "
                        f"{type(inputs).__name__}")
    problems = _global_conflicts(inputs)
    compute_reference, reference_reason = _plan_reference(inputs, problems)
    prev = _plan_prev(inputs, problems)
    if prev.approximation is None:
        prev = dataclasses.replace(prev, reason=prev.reason + _routing_assumption(inputs, skipped=not prev.compute))
    if problems:
        raise ConfigError(problems)
    return LogprobPlan(
        compute_reference_logprobs=compute_reference,
        compute_prev_logprobs=prev.compute,
        prev_from_current=prev.approximation is None and (not prev.compute or inputs.force_on_policy),
        reasons=(reference_reason, prev.reason),
        prev_approximation=prev.approximation,
        compare_approximations=prev.compare,
        seq_logprob_error_threshold=inputs.error_threshold,
    )


def _global_conflicts(inputs: PlanInputs) -> list[str]:
    """Conflicts that hold whatever the per-pass overrides say."""
    keys, problems = inputs.keys, []
    if inputs.staleness is not None and inputs.staleness < 0:
        problems.append(f"{keys.staleness}: must be >= 0, got {inputs.staleness}")
    if inputs.rollout_batch % inputs.global_batch:
        problems.append(f"{keys.rollout_batch} ({inputs.rollout_batch}) must be a multiple of {keys.global_batch} "
                        f"({inputs.global_batch})")
    if inputs.kl_in_reward and not inputs.kl_active:
        problems.append(f"{keys.kl_in_reward} is true but {keys.kl_penalty} is 0: a zero KL in the reward is "
                        "meaningless")
    if inputs.force_on_policy and not inputs.one_step_per_rollout:
        problems.append(f"{keys.force_on_policy} needs one optimizer step per rollout batch, but {keys.rollout_batch} "
                        f"({inputs.rollout_batch}) != {keys.global_batch} ({inputs.global_batch})")
    if inputs.router_replay and not inputs.moe:
        problems.append(f"{keys.router_replay} replays the routes of a Mixture-of-Experts policy, but {keys.moe} is "
                        "false: a dense model has none")
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


@dataclass(frozen=True)
class _PrevDecision:
    compute: bool
    reason: str
    approximation: ApproximationMethod | None = None
    compare: bool = False


def _routing_assumption(inputs: PlanInputs, skipped: bool) -> str:
    """What a prev decision assumes of an MoE policy's routes (empty for a dense one)."""
    keys = inputs.keys
    if not inputs.moe:
        return ""
    if inputs.router_replay:
        if skipped:
            return (f" The prev pass would replay the rollout's routes, as the training forward does "
                    f"({keys.router_replay}): curr.detach() is what it computes, whatever routes the router would "
                    "choose.")
        return f" The prev pass replays the rollout's routes, as the training forward does ({keys.router_replay})."
    if skipped:
        return (f" The policy is an MoE model without replayed routes ({keys.moe}, {keys.router_replay} off): the "
                "skip assumes the prev pass would route every token as the training forward does, with the same "
                "weights and numerics; a near-tie between experts can route a token differently in forwards of other "
                "shapes, and the rollout's routes may differ from both (the IS weights see that).")
    return ""


def _plan_prev(inputs: PlanInputs, problems: list[str]) -> _PrevDecision:
    """The prev pass is redundant when the training forward is the prev policy and nothing reads prev before
    the loss: one optimizer step per rollout, no dropout, stale rollouts or not.

    With `force_on_policy_ratio` the loss never reads prev, so only a reader before the loss makes skipping
    unsafe; `auto` and `skip` share that one verdict. The approximations and the comparison with them are the
    user's choice only, each checked against what it cannot serve.
    """
    keys, mode = inputs.keys, inputs.prev_mode
    if mode in APPROXIMATIONS:
        problems.extend(_approximation_conflicts(inputs, mode))
        return _PrevDecision(False, _approximation_reason(inputs, mode), approximation=mode)
    if mode == "compute_and_compare":
        if inputs.force_on_policy:
            problems.append(f"{keys.prev_mode} = compute_and_compare and {keys.force_on_policy}: the forced ratio "
                            "never reads the pass the approximations are compared with; set at most one")
        return _PrevDecision(True, f"prev logprobs computed: {keys.prev_mode} = compute_and_compare (AReaL's "
                                   "prox_logp_method: metrics); each step also logs how far the generation, "
                                   "loglinear and linear approximations are from them (prox_<method>_abs_error, "
                                   "_rel_error, _is_weight_abs_error, _ratio_abs_error).", compare=True)
    differences = inputs.training_forward_differences()
    unsafe = inputs.prev_consumers_before_loss() + ([] if inputs.force_on_policy else differences)
    forced = (f" The loss's ratio still uses curr.detach(): {keys.force_on_policy} = true."
              if inputs.force_on_policy else "")
    if mode == "compute":
        return _PrevDecision(True, f"prev logprobs computed: {keys.prev_mode} = compute.{forced}")
    if mode == "skip":
        problems.extend(f"{keys.prev_mode} = skip is unsafe: {why}" for why in unsafe)
        return _PrevDecision(False, f"prev logprobs skipped, the loss uses curr.detach(): {keys.prev_mode} = skip.")
    if unsafe:
        return _PrevDecision(True, "prev logprobs computed: " + "; ".join(unsafe) + "." + forced)
    if differences:
        return _PrevDecision(False, f"prev logprobs skipped: {keys.force_on_policy} makes the loss use curr.detach() "
                                    "and nothing reads them before the loss.")
    nothing_reads = "nothing reads prev before the loss" + _mask_in_forward(inputs)
    if inputs.staleness != 0:
        bound = "no known bound" if inputs.staleness is None else f"= {inputs.staleness}"
        separator = ": " if inputs.staleness is None else " "
        return _PrevDecision(False, (
            f"prev logprobs skipped, the loss uses curr.detach(): stale rollouts ({keys.staleness}{separator}{bound}) "
            f"with one update per rollout ({keys.rollout_batch} = {keys.global_batch}): the prev policy is the "
            f"training forward's; the IS weights use curr against generation, and {nothing_reads}."))
    return _PrevDecision(False, (
        f"prev logprobs skipped, the loss uses curr.detach(): the step is on-policy ({keys.rollout_batch} = "
        f"{keys.global_batch}, {keys.staleness} = 0, {keys.dropout} = 0) and {nothing_reads}."))


def _mask_in_forward(inputs: PlanInputs) -> str:
    """The end of a skip reason when the sequence mask by logprob error moves into the training forward."""
    if not inputs.error_mask_in_training_forward:
        return ""
    return (f": {inputs.keys.error_threshold} = {inputs.error_threshold} masks sequences inside the training "
            "forward, by its detached logprobs, and the loss is normalised once the step's masked counts are known")


def _approximation_conflicts(inputs: PlanInputs, mode: str) -> list[str]:
    """Every setting a prev without a pass cannot serve, each naming both keys."""
    keys, setting, problems = inputs.keys, f"{inputs.keys.prev_mode} = {mode}", []
    if inputs.force_on_policy:
        problems.append(f"{setting} and {keys.force_on_policy}: the forced ratio takes prev = curr.detach(); set at "
                        "most one")
    if mode == "generation":
        if inputs.importance_sampling:
            problems.append(f"{setting} and {keys.importance_sampling}: with prev = the generation logprobs the IS "
                            "weights exp(prev - generation) are 1 (verl keeps its bypass and its rollout correction "
                            "apart); set at most one")
        if inputs.error_threshold is not None:
            problems.append(f"{setting} and {keys.error_threshold}: prev is the generation logprobs, so their "
                            "mismatch is 0 and the threshold never masks; set at most one")
        return problems
    if inputs.error_threshold is not None:
        problems.append(f"{setting} and {keys.error_threshold}: the threshold reads prev before the loss, and the "
                        "interpolation needs curr from the training forward; use compute")
    if inputs.kl_in_reward and inputs.kl_active:
        problems.append(f"{setting} and {keys.kl_in_reward}: the reward's KL reads prev before the loss, and the "
                        "interpolation needs curr from the training forward; use compute")
    problems.extend(f"{setting} and {reader}: the interpolation needs curr from the training forward; use compute"
                    for reader in inputs.prev_readers)
    if inputs.dropout:
        problems.append(f"{setting} and {keys.dropout}: curr from a train-mode forward with dropout is not the "
                        "policy to interpolate; use compute")
    return problems


def _approximation_reason(inputs: PlanInputs, mode: str) -> str:
    setting = f"{inputs.keys.prev_mode} = {mode}"
    if mode == "generation":
        return (f"prev logprobs from generation, no pass: {setting} (verl's rollout_correction.bypass_mode, slime's "
                "--use-rollout-logprobs), so PPO clips against the behaviour policy; prev against generation would "
                f"compare them with themselves, so {', '.join(MISMATCH_METRICS)} are not reported.")
    formula, peer = (("prev = gen + alpha (curr - gen)", "AReaL's prox_logp_method: loglinear") if mode == "loglinear"
                     else ("prev = log((1 - alpha) exp(gen) + alpha exp(curr))",
                           "AReaL's linear approximation, which its metrics mode logs"))
    return (f"prev logprobs approximated, no pass: {setting} ({peer}): {formula} with curr "
            "detached, alpha = (v_prox - v_behave) / (v_theta - v_behave) per sample from its rollout weight "
            "version; alpha = 1 (the first update of each rollout, or v_theta = v_behave) is curr.detach() exactly.")
