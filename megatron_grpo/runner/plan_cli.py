"""`megatron-grpo plan --config X.yaml | --nemo-rl-config Y.yaml`: the logprob-pass plan before launching.

Prints which extra forward passes each step runs, why, and how many are saved, and writes the resolved config
(every key, inherited and default values included) to `<run_dir>/config.yaml`, unless the run directory already
holds a run (whose config `train` rewrites when it starts). With `--nemo-rl-config` it reads
a NeMo-RL GRPO config in NeMo-RL's own layout (with its `defaults:` inheritance), prints the loop NeMo-RL runs for
it, our plan for it, where NeMo-RL would decide otherwise, the keys with no say in the plan and, apart, the keys
NeMo-RL does not know (with the nearest known one). A bad or unreadable config prints its
ConfigError (every problem, each naming its key) and exits with status 2. Never imports torch or Megatron-Core.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from megatron_grpo.runner.checkpoint_dir import describe_os_error
from megatron_grpo.runner.config import RESOLVED_CONFIG, Config, ConfigError, load_config, write_resolved_config
from megatron_grpo.runner.helptext import DefaultsHelpFormatter
from megatron_grpo.runner.plan_inputs import plan_inputs
from megatron_grpo.runner.run_start import holds_a_run
from megatron_grpo.scheduler import LogprobPlan, PlanInputs, plan_logprob_passes

EXIT_BAD_CONFIG = 2
WRAP = 112  # columns of the comparison with NeMo-RL
# Where the loss's prev comes from (LogprobPlan.prev_source, "and compared" for compute_and_compare), in the
# peers' own keys: docs/scheduler.md has the table.
PEER_TERMS = {
    "prev pass": "NeMo-RL's prev_logprobs, verl's recomputed old_log_prob (rollout_correction.bypass_mode: "
                 "false), AReaL's prox_logp_method: recompute, slime without --use-rollout-logprobs",
    "prev pass, compared": "AReaL's prox_logp_method: metrics",
    "curr.detach()": "NeMo-RL's loss_fn.force_on_policy_ratio: true (prev = curr.detach()), where it is exact",
    "generation": "verl's algorithm.rollout_correction.bypass_mode: true, slime's --use-rollout-logprobs",
    "loglinear": "AReaL's actor.prox_logp_method: loglinear",
    "linear": "AReaL's linear approximation (logged by its prox_logp_method: metrics)",
}
PREV_LINE = {
    "prev pass": "compute",
    "prev pass, compared": "compute (and the approximations compared with it)",
    "curr.detach()": "skip (loss uses curr.detach())",
    "generation": "skip (loss uses the generation logprobs)",
    "loglinear": "skip (loss interpolates prev: loglinear)",
    "linear": "skip (loss interpolates prev: linear)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-grpo plan", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsHelpFormatter,
                                     epilog="Exactly one of --config and --nemo-rl-config is required.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="FILE",
                        help="this project's YAML config, e.g. configs/grpo_tiny_cpu.yaml (no default)")
    source.add_argument("--nemo-rl-config", metavar="FILE",
                        help="a NeMo-RL GRPO config in NeMo-RL's own layout; its `defaults:` files are followed "
                             "(no default)")
    args = parser.parse_args(argv)
    if args.nemo_rl_config is not None:
        return _plan_nemo_rl(args.nemo_rl_config)
    try:
        cfg = load_config(args.config)
        inputs = plan_inputs(cfg)
        plan = plan_logprob_passes(inputs)
    except ConfigError as err:
        print(f"{args.config}: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(format_plan(plan, inputs))
    print(record_resolved_config(cfg))
    return 0


def record_resolved_config(cfg: Config) -> str:
    """Writes `cfg`, every key, to `<run_dir>/config.yaml` unless the run directory holds a run; the line saying
    where it went, or why not (a directory that cannot be written is `train`'s error, not the plan's)."""
    run_dir = Path(cfg.run_dir)
    path = run_dir / RESOLVED_CONFIG
    if holds_a_run(run_dir):
        return f"resolved config: not written, {run_dir} holds a run (train rewrites {path} when it starts)"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_resolved_config(cfg, path)
    except OSError as err:
        return f"resolved config: not written: {describe_os_error(err)}"
    return f"resolved config: {path}"


def format_plan(plan: LogprobPlan, inputs: PlanInputs) -> str:
    """The plan as a short human-readable report."""

    def runs(flag: bool) -> str:
        return "compute" if flag else "skip"

    source = plan.prev_source + (", compared" if plan.compare_approximations else "")
    prev_line = PREV_LINE[source]
    if plan.compute_prev_logprobs and plan.prev_from_current:  # the pass runs for a reader before the loss
        prev_line = "compute (loss uses curr.detach())"
    lines = [
        "logprob plan:",
        f"  reference logprobs: {runs(plan.compute_reference_logprobs)}"
        f" (reference model {'built' if plan.build_reference_model else 'not built'})",
        f"  prev logprobs:      {prev_line}",
        f"  prev in peers' terms: {PEER_TERMS[source]}",
        "reasons:",
        *(f"  - {reason}" for reason in plan.reasons),
        f"forward passes saved per step: {plan.passes_saved_per_step} of 2"
        f" ({plan.passes_saved_per_step * inputs.rollout_batch} sequence forwards of the "
        f"{inputs.rollout_batch}-sequence"
        " rollout batch)",
    ]
    return "\n".join(lines)


def _plan_nemo_rl(path: str) -> int:
    from megatron_grpo.runner.nemo_rl_config import NEMO_RL_COMMIT, comparison_lines, nemo_rl_plan_view

    try:
        view = nemo_rl_plan_view(path)
    except ConfigError as err:
        print(f"{path}: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    header = [f"NeMo-RL config: {' <- '.join(reversed(view.files))}", f"NeMo-RL loop: {view.loop.description}"]
    try:
        plan = plan_logprob_passes(view.inputs)
    except ConfigError as err:
        print("\n".join(header), file=sys.stderr)
        print(f"{path}: {err}", file=sys.stderr)
        print("compared with NeMo-RL:\n" + _bullets(comparison_lines(view, None, None)), file=sys.stderr)
        return EXIT_BAD_CONFIG
    report = [
        *header,
        format_plan(plan, view.inputs),
        "compared with NeMo-RL:",
        _bullets(comparison_lines(view, plan.compute_reference_logprobs, plan.compute_prev_logprobs)),
        "not mapped (no say in the plan):",
        _key_list(view.unmapped_keys),
        f"unknown to NeMo-RL at commit {NEMO_RL_COMMIT[:8]} (no effect there):",
        _key_list(f"{key}: {note}" for key, note in view.unknown_keys),
        "read, no say in the plan yet:",
        _bullets(view.not_yet) if view.not_yet else "  - none",
        "read from policy:",
        _key_list(["policy.train_global_batch_size", *dropout_source_lines()]),
        "sections that do not concern the plan:",
        _key_list(view.ignored_sections),
    ]
    print("\n".join(report))
    return 0


def dropout_source_lines() -> list[str]:
    """Where `plan --nemo-rl-config` looks for dropout, one line per source."""
    from megatron_grpo.runner.nemo_rl_config import DROPOUT_SOURCES

    lines = []
    for section, switch, keys in DROPOUT_SOURCES:
        what = f"{section}: every key named *dropout* or *pdrop*" if keys == "any" else f"{section}.{keys}"
        lines.append(what + (f" (when {section}.{switch} is true)" if switch else ""))
    return lines + ["(the pretrained model's own config.json is not read: set its dropout in "
                    "policy.hf_config_overrides to count it)"]


def _key_list(keys) -> str:
    """One key per line, or `  - none`."""
    lines = [f"  - {key}" for key in keys]
    return "\n".join(lines) if lines else "  - none"


def _bullets(lines: list[str]) -> str:
    return "\n".join(textwrap.fill(line, width=WRAP, initial_indent="  - ", subsequent_indent="    ") for line in lines)
