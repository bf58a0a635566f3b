"""Scheduler benchmark: GRPO steps with the `auto` logprob plan against the same config with both passes computed.

Launch under torchrun (TP comes from the config; the tiny CPU config is TP=2):

    torchrun --nproc-per-node 2 -m megatron_grpo bench scheduler --config configs/grpo_tiny_cpu.yaml

Both variants start from the same weights and see the same prompts and sampling seeds; their steps are
interleaved so that machine noise hits both alike. With `auto` skipping only provably redundant passes, the
two runs train identically, which the report checks through the reward. Reported: the median time of the
training phase (logprob passes + train step) and of the whole step (generation included), and their ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_grpo.bench.measure import DEFAULT_OUT, PeakMemory, machine_description
from megatron_grpo.config import Config, ConfigError, load_config
from megatron_grpo.helptext import DefaultsHelpFormatter
from megatron_grpo.scheduler import LogprobPlan, plan_logprob_passes

EXIT_BAD_INPUT = 2
VARIANTS = ("auto", "compute")


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_config(args.config)
        configs = {"auto": cfg, "compute": with_all_passes_computed(cfg)}
        plans = {name: plan_logprob_passes(variant) for name, variant in configs.items()}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if "RANK" not in os.environ:
        print("error: not launched by torchrun: use `torchrun --nproc-per-node N -m megatron_grpo bench scheduler "
              "--config X.yaml`, N = TP × DP", file=sys.stderr)
        return EXIT_BAD_INPUT

    from megatron_grpo.grpo.loop import Trainer  # imports megatron.core: only once the input is known to be good
    from megatron_grpo.megatron import destroy_parallel, init_parallel

    layout = init_parallel(cfg)
    try:
        trainers = {}
        for name in VARIANTS:
            torch.manual_seed(cfg.seed)  # both variants start from the same weights
            trainers[name] = Trainer.build(configs[name], plans[name], layout)
        records: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for step in range(args.warmup + args.steps):
            for name in VARIANTS:  # interleaved: drift and noise hit both variants alike
                dist.barrier()  # every rank starts the step together, so no rank's wait is timed as work
                with PeakMemory(layout.device) as peak:
                    record = trainers[name].step(step)
                if step >= args.warmup:
                    records[name].append({**record, "peak_extra_mib": peak.extra_bytes / 2**20})
        if layout.rank == 0:
            summary = summarise(records, plans, cfg, world_size=layout.world_size, tp_size=layout.tp_size)
            write_report(summary, args.out)
    finally:
        destroy_parallel()
    return 0


def with_all_passes_computed(cfg: Config) -> Config:
    """The same run with the reference and prev logprob passes forced on: the baseline without the scheduler."""
    return dataclasses.replace(cfg, logprob_passes=dataclasses.replace(cfg.logprob_passes, reference="compute",
                                                                       prev="compute"))


def summarise(records: dict[str, list[dict]], plans: dict[str, LogprobPlan], cfg: Config, *, world_size: int,
              tp_size: int) -> dict:
    """Medians per variant, the speed-ups of `auto`, and whether both variants trained identically."""
    medians = {
        name: {"train_phase_s": statistics.median(r["train_time_s"] for r in rows),
               "step_s": statistics.median(r["step_time_s"] for r in rows),
               "peak_extra_mib": max(r["peak_extra_mib"] for r in rows)}
        for name, rows in records.items()
    }
    rewards = {name: [r["reward_mean"] for r in rows] for name, rows in records.items()}
    return {
        "config": {"tp": tp_size, "world_size": world_size, "threads_per_rank": torch.get_num_threads(),
                   "rollout_sequences": cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt,
                   "layers": cfg.policy.model.num_layers, "hidden": cfg.policy.model.hidden_size},
        "steps_timed": len(records["auto"]),
        "passes_per_step": {name: plan.passes_per_step for name, plan in plans.items()},
        "medians": medians,
        "train_phase_speedup": medians["compute"]["train_phase_s"] / medians["auto"]["train_phase_s"],
        "step_speedup": medians["compute"]["step_s"] / medians["auto"]["step_s"],
        "identical_rewards": rewards["auto"] == rewards["compute"],
        "auto_reasons": list(plans["auto"].reasons),
        "machine": machine_description(torch.device("cpu")),
        "date": datetime.date.today().isoformat(),
    }


def write_report(summary: dict, out: Path) -> None:
    medians = summary["medians"]
    lines = [
        "# Scheduler benchmark: `auto` plan vs. both logprob passes computed",
        "",
        f"- date: {summary['date']}",
        f"- machine: {summary['machine']}",
        "- command: `torchrun --nproc-per-node 2 -m megatron_grpo bench scheduler --config "
        "configs/grpo_tiny_cpu.yaml`",
        "",
        f"TP={summary['config']['tp']} over {summary['config']['world_size']} ranks, "
        f"{summary['config']['threads_per_rank']} thread(s) per rank, "
        f"{summary['config']['rollout_sequences']} sequences per step, median of {summary['steps_timed']} steps.",
        "",
        "| variant | extra logprob passes | training phase (s) | whole step (s) | peak extra memory, rank 0 (MiB) |",
        "|---|---|---|---|---|",
        *(f"| {name} | {summary['passes_per_step'][name]} | {medians[name]['train_phase_s']:.4f} | "
          f"{medians[name]['step_s']:.4f} | {medians[name]['peak_extra_mib']:.1f} |" for name in VARIANTS),
        "",
        f"Training phase: **{summary['train_phase_speedup']:.2f}x** faster with `auto` (target >= 1.5x). "
        f"Whole step: {summary['step_speedup']:.2f}x.",
        f"Identical rewards in both variants (the skipped passes were redundant): {summary['identical_rewards']}.",
        "Peak extra memory is rank 0's resident high-water mark above its level when the step began; at this "
        "model size it is within the allocator's noise (the reference model, when built, is not in it).",
        "",
        "Why `auto` skipped what it skipped:",
        *(f"- {reason}" for reason in summary["auto_reasons"]),
    ]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduler_cpu.md").write_text(text)
    (out / "scheduler_cpu.json").write_text(json.dumps(summary, indent=1))
    print(text + f"wrote {out / 'scheduler_cpu.md'}")


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron-grpo [torchrun options] bench scheduler",
                                     description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/grpo_tiny_cpu.yaml"),
                        help="the run config both variants train with (its TP and PP must fit the ranks launched)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant, run first")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for scheduler_cpu.md and scheduler_cpu.json (default: runs/bench; `make "
                             "bench` writes the committed benchmarks/results)")
    parser.add_argument("--verbose", action="store_true", help="show Megatron-Core's notices, filtered by default")
    return parser.parse_args(argv)
