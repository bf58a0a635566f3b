"""The runner's config adapted to the scheduler's `PlanInputs`: the plugin never reads the runner's `Config`.

Torch-free, as the `plan` command and the runner's checks before any rank starts need it.
"""

from __future__ import annotations

from megatron_grpo.runner.config import Config
from megatron_grpo.scheduler import LogprobPlan, PlanInputs, PlanKeys, plan_logprob_passes

# The runner config's keys, as the plan's sentences and errors name them.
RUNNER_KEYS = PlanKeys(
    rollout_batch="grpo.num_prompts_per_step × grpo.num_generations_per_prompt",
    global_batch="policy.train_global_batch_size",
    staleness="grpo.max_rollout_staleness",
    error_threshold="grpo.seq_logprob_error_threshold",
    dropout="policy.model.hidden_dropout / policy.model.attention_dropout",
    kl_penalty="loss_fn.reference_policy_kl_penalty",
    kl_in_reward="loss_fn.kl_in_sequence_reward",
    force_on_policy="loss_fn.force_on_policy_ratio",
    importance_sampling="loss_fn.use_importance_sampling_correction",
    prev_mode="logprob_passes.prev",
    reference_mode="logprob_passes.reference",
    skip_reference="grpo.skip_reference_policy_logprobs_calculation",
    moe="policy.model.num_moe_experts",
    router_replay="policy.router_replay.enabled",
)


def plan_inputs(cfg: Config) -> PlanInputs:
    """The plan's inputs of a runner config (`grpo.*`, `policy.*`, `loss_fn.*`, `logprob_passes.*`)."""
    model = cfg.policy.model
    return PlanInputs.for_loss(
        cfg.loss_fn,
        rollout_batch=cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt,
        global_batch=cfg.policy.train_global_batch_size,
        dropout=model.hidden_dropout > 0 or model.attention_dropout > 0,
        staleness=cfg.grpo.max_rollout_staleness,
        error_threshold=cfg.grpo.seq_logprob_error_threshold,
        reference_mode=cfg.logprob_passes.reference,
        prev_mode=cfg.logprob_passes.prev,
        skip_reference=cfg.grpo.skip_reference_policy_logprobs_calculation,
        moe=model.num_moe_experts is not None,
        router_replay=cfg.policy.router_replay.enabled,
        keys=RUNNER_KEYS,
    )


def plan_for(cfg: Config) -> LogprobPlan:
    """The logprob plan of a runner config; one ConfigError lists every conflict, each naming its keys."""
    return plan_logprob_passes(plan_inputs(cfg))
