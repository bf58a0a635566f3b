"""The runner's config adapted to the scheduler's `PlanInputs`: the plugin never reads the runner's `Config`.

Torch-free, as the `plan` command and the runner's checks before any rank starts need it.
"""

from __future__ import annotations

from megatron_grpo.runner.config import Config
from megatron_grpo.scheduler import LogprobPlan, PlanInputs, plan_logprob_passes


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
    )


def plan_for(cfg: Config) -> LogprobPlan:
    """The logprob plan of a runner config; one ConfigError lists every conflict, each naming its keys."""
    return plan_logprob_passes(plan_inputs(cfg))
