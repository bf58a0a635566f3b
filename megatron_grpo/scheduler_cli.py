"""`python -m megatron_grpo plan --config X.yaml`: show the logprob-pass plan of a config before launching.

Prints which extra forward passes each step runs, why, and how many are saved. A bad config prints its
ConfigError (every problem, each naming its key) and exits with status 2. Never imports torch or Megatron-Core.
"""

from __future__ import annotations

import argparse
import sys

from megatron_grpo.config import Config, ConfigError, load_config
from megatron_grpo.scheduler import LogprobPlan, plan_logprob_passes

EXIT_BAD_CONFIG = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config file, e.g. configs/grpo_tiny_cpu.yaml")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        plan = plan_logprob_passes(cfg)
    except ConfigError as err:
        print(f"{args.config}: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(format_plan(plan, cfg))
    return 0


def format_plan(plan: LogprobPlan, cfg: Config) -> str:
    """The plan as a short human-readable report."""
    rollout_batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt

    def runs(flag: bool) -> str:
        return "compute" if flag else "skip"

    lines = [
        "logprob plan:",
        f"  reference logprobs: {runs(plan.compute_reference_logprobs)}"
        f" (reference model {'built' if plan.build_reference_model else 'not built'})",
        f"  prev logprobs:      {runs(plan.compute_prev_logprobs)}"
        + (" (loss uses curr.detach())" if plan.prev_from_current else ""),
        "reasons:",
        *(f"  - {reason}" for reason in plan.reasons),
        f"forward passes saved per step: {plan.passes_saved_per_step} of 2"
        f" ({plan.passes_saved_per_step * rollout_batch} sequence forwards of the {rollout_batch}-sequence rollout"
        " batch)",
    ]
    return "\n".join(lines)
