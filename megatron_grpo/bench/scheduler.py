"""Scheduler benchmark: GRPO steps with the `auto` logprob plan against the same config with both passes computed.

Launch under torchrun (TP comes from the config; the tiny CPU config is TP=2):

    torchrun --nproc-per-node 2 -m megatron_grpo bench scheduler --config configs/grpo_tiny_cpu.yaml

Both variants start from the same weights and see the same prompts and sampling seeds; their steps are
interleaved so that machine noise hits both alike. With `auto` skipping only provably redundant passes, the
two runs train identically, which the report checks through the reward. Reported: the median time of the
training phase (logprob passes + train step) and of the whole step (generation included), and their ratios.

With `--prev-modes auto,compute,...` the variants are instead the config under each `logprob_passes.prev` mode
(the reference pass as the config says), compared by step time, the prev pass's share of it, the reward curve
and the step where the reward's 10-step mean first reaches 0.9 (`scheduler_prev_modes_<config>.md`, `.json` and
a `.png` of the reward curves). `--seq-logprob-error-threshold X` sets `grpo.seq_logprob_error_threshold` in every
variant (the sequence mask by logprob error, which `auto` runs in the training forward where it can); the report
then gives the share of sequences it masked.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import typing
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_grpo.bench.measure import DEFAULT_OUT, PeakMemory, machine_description, write_results
from megatron_grpo.runner.config import Config, ConfigError, PrevMode, load_config
from megatron_grpo.runner.helptext import DefaultsHelpFormatter
from megatron_grpo.runner.plan_inputs import plan_for
from megatron_grpo.scheduler import LogprobPlan

EXIT_BAD_INPUT = 2
VARIANTS = ("auto", "compute")
LEARNED = 0.9  # the reward's 10-step mean that counts as learned
WINDOW = 10


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.staleness is not None and args.staleness < 0:
            raise ConfigError(f"--staleness: must be >= 0, got {args.staleness}")
        if args.staleness is not None:
            cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, max_rollout_staleness=args.staleness))
        if args.seq_logprob_error_threshold is not None:  # through the config's checks, the threshold's among them
            grpo = dataclasses.replace(cfg.grpo, seq_logprob_error_threshold=args.seq_logprob_error_threshold)
            cfg = load_config(dataclasses.replace(cfg, grpo=grpo).to_mapping())
        configs = (with_prev_modes(cfg, args.prev_modes) if args.prev_modes
                   else {"auto": cfg, "compute": with_all_passes_computed(cfg)})
        plans = {name: plan_for(variant) for name, variant in configs.items()}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if "RANK" not in os.environ:
        print("error: not launched by torchrun: use `torchrun --nproc-per-node N -m megatron_grpo bench scheduler "
              "--config X.yaml`, N = TP × DP", file=sys.stderr)
        return EXIT_BAD_INPUT

    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.loop import Trainer  # imports megatron.core: only once the input is known to be good
    from megatron_grpo.runner.plugin_params import parallel_params

    layout = init_parallel(parallel_params(cfg))
    try:
        trainers = {}
        for name in configs:
            torch.manual_seed(cfg.seed)  # every variant starts from the same weights
            trainers[name] = Trainer.build(configs[name], plans[name], layout)
        records: dict[str, list[dict]] = {name: [] for name in configs}
        rewards: dict[str, list[float]] = {name: [] for name in configs}  # every step's, warmup included
        for step in range(args.warmup + args.steps):
            for name in configs:  # interleaved: drift and noise hit every variant alike
                dist.barrier()  # every rank starts the step together, so no rank's wait is timed as work
                with PeakMemory(layout.device) as peak:
                    record = trainers[name].step(step)
                rewards[name].append(record["reward_mean"])
                if step >= args.warmup:
                    records[name].append({**record, "peak_extra_mib": peak.extra_bytes / 2**20})
        if layout.rank == 0 and args.prev_modes:
            summary = summarise_prev_modes(records, rewards, plans, cfg, world_size=layout.world_size,
                                           tp_size=layout.tp_size)
            write_prev_modes_report(summary, args.out, args.config, argv, args.staleness,
                                    args.seq_logprob_error_threshold)
        elif layout.rank == 0:
            summary = summarise(records, plans, cfg, world_size=layout.world_size, tp_size=layout.tp_size)
            write_report(summary, args.out)
    finally:
        destroy_parallel()
    return 0


def with_all_passes_computed(cfg: Config) -> Config:
    """The same run with the reference and prev logprob passes forced on: the baseline without the scheduler."""
    return dataclasses.replace(cfg, logprob_passes=dataclasses.replace(cfg.logprob_passes, reference="compute",
                                                                       prev="compute"))


def with_prev_modes(cfg: Config, modes: list[str]) -> dict[str, Config]:
    """The config under each `logprob_passes.prev` mode, by mode; an unknown mode is a ConfigError. Under
    `generation` the importance-sampling correction is off (with prev = generation it is a no-op, which the plan
    rejects), and so is its truncation."""
    known = typing.get_args(PrevMode)
    unknown = [mode for mode in modes if mode not in known]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise ConfigError(f"--prev-modes: expected distinct modes among {', '.join(known)}, got {','.join(modes)}")
    variants = {}
    for mode in modes:
        variant = dataclasses.replace(cfg, logprob_passes=dataclasses.replace(cfg.logprob_passes, prev=mode))
        if mode == "generation":
            loss = variant.loss_fn
            variant = dataclasses.replace(variant, loss_fn=dataclasses.replace(
                loss, use_importance_sampling_correction=False,
                truncated_importance_sampling=dataclasses.replace(loss.truncated_importance_sampling, type=None)))
        variants[mode] = variant
    return variants


def first_learned_step(rewards: list[float], window: int = WINDOW, threshold: float = LEARNED) -> int | None:
    """After how many steps the trailing `window`-step mean reward first is >= `threshold` (None: never)."""
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window:end]) / window >= threshold:
            return end
    return None


def summarise_prev_modes(records: dict[str, list[dict]], rewards: dict[str, list[float]],
                         plans: dict[str, LogprobPlan], cfg: Config, *, world_size: int, tp_size: int) -> dict:
    """Per prev mode: median step and training-phase time, the prev pass's median share of the step (each step's
    share, then the median: a ratio measured within one step), the reward curve and where it first learned, and
    the medians of every approximation-error metric the mode logged (`compute_and_compare`)."""
    first = next(iter(records))
    modes = {}
    for name, rows in records.items():
        error_keys = sorted(key for key in rows[0] if key.startswith("prox_"))
        modes[name] = {
            "prev_passes_per_step": int(plans[name].compute_prev_logprobs),
            "prev_source": plans[name].prev_source,
            # off under generation (see with_prev_modes)
            "is_correction": cfg.loss_fn.use_importance_sampling_correction
            and plans[name].prev_approximation != "generation",
            "step_s": statistics.median(r["step_time_s"] for r in rows),
            "train_phase_s": statistics.median(r["train_time_s"] for r in rows),
            "prev_pass_share": statistics.median(r["prev_pass_time_s"] / r["step_time_s"] for r in rows),
            "step_time_vs_first": (statistics.median(r["step_time_s"] for r in rows)
                                   / statistics.median(r["step_time_s"] for r in records[first])),
            "rewards": rewards[name],
            "first_learned_step": first_learned_step(rewards[name]),
            "last_window_reward": sum(rewards[name][-WINDOW:]) / min(WINDOW, len(rewards[name])),
            "identical_rewards_to_first": rewards[name] == rewards[first],
            "approximation_errors": {key: statistics.median(r[key] for r in rows) for key in error_keys},
            "masked_fraction": (statistics.fmean(r["masked_seqs_by_logprob_error_fraction"] for r in rows)
                                if "masked_seqs_by_logprob_error_fraction" in rows[0] else None),
            "reason": plans[name].reasons[1],
        }
    return {
        "config": {"tp": tp_size, "world_size": world_size, "threads_per_rank": torch.get_num_threads(),
                   "rollout_sequences": cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt,
                   "global_batch": cfg.policy.train_global_batch_size, "staleness": cfg.grpo.max_rollout_staleness,
                   "seq_logprob_error_threshold": cfg.grpo.seq_logprob_error_threshold,
                   "layers": cfg.policy.model.num_layers, "hidden": cfg.policy.model.hidden_size},
        "steps": len(rewards[first]),
        "steps_timed": len(records[first]),
        "modes": modes,
        "machine": machine_description(torch.device("cpu")),
        "load_average": [round(load, 2) for load in os.getloadavg()],  # 1, 5, 15 min, as the run ends: the machine
        #   is shared
        "date": datetime.date.today().isoformat(),
    }


def write_prev_modes_report(summary: dict, out: Path, config: Path, argv: list[str],
                            staleness: int | None = None, threshold: float | None = None) -> None:
    """`scheduler_prev_modes_<config stem>[_staleness<N>][_threshold<X>].md` and `.json`, and a `.png` of the reward
    curves."""
    stem = (f"scheduler_prev_modes_{config.stem}" + (f"_staleness{staleness}" if staleness is not None else "")
            + (f"_threshold{threshold:g}" if threshold is not None else ""))
    setup = summary["config"]
    modes = summary["modes"]
    masked = all(m["masked_fraction"] is not None for m in modes.values())
    lines = [
        f"# Scheduler benchmark: `logprob_passes.prev` modes on `{config}`",
        "",
        f"- date: {summary['date']}",
        f"- machine: {summary['machine']}, shared with other jobs (timings are noisy: medians, and ratios taken "
        "within one run)"
        + (f"; load average {', '.join(map(str, summary['load_average']))} (1, 5, 15 min) as the run ended"
           if "load_average" in summary else ""),
        f"- command: `torchrun --nproc-per-node {setup['world_size']} -m megatron_grpo bench scheduler "
        f"{' '.join(argv)}`",
        "",
        f"TP={setup['tp']} over {setup['world_size']} ranks, {setup['threads_per_rank']} thread(s) per rank, "
        f"{setup['rollout_sequences']} sequences per rollout, {setup['global_batch']} per optimizer step, staleness "
        f"{setup['staleness']}"
        + (f", grpo.seq_logprob_error_threshold {setup['seq_logprob_error_threshold']:g}"
           if setup.get("seq_logprob_error_threshold") is not None else "")
        + f"; {summary['steps']} steps per mode, interleaved, times are medians of the last "
        f"{summary['steps_timed']}.",
        "",
        "| prev mode | prev from | IS correction | prev passes per step | step (s) | vs first | prev pass share | "
        + ("sequences masked (mean) | " if masked else "")
        + "reward, last 10 | 10-step mean >= 0.9 after | same rewards as first |",
        "|---|---|---|---|---|---|---|" + ("---|" if masked else "") + "---|---|---|",
        *(f"| {name} | {m['prev_source']} | {'on' if m['is_correction'] else 'off'} | {m['prev_passes_per_step']} | "
          f"{m['step_s']:.4f} | {m['step_time_vs_first']:.2f} | "
          f"{100 * m['prev_pass_share']:.1f}% | "
          + (f"{100 * m['masked_fraction']:.1f}% | " if masked else "")
          + f"{m['last_window_reward']:.3f} | "
          f"{str(m['first_learned_step']) + ' steps' if m['first_learned_step'] is not None else 'never'} | "
          f"{m['identical_rewards_to_first']} |" for name, m in modes.items()),
    ]
    errors = {name: m["approximation_errors"] for name, m in modes.items() if m["approximation_errors"]}
    for name, figures in errors.items():
        lines += ["", f"Approximation errors against the prev pass (`{name}`, medians over the timed steps of the "
                  "per-step token means):", "", "| metric | median |", "|---|---|",
                  *(f"| `{key}` | {value:.3g} |" for key, value in figures.items())]
    lines += ["", "Why each mode takes prev where it does:", *(f"- {name}: {m['reason']}" for name, m in modes.items())]

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, m in modes.items():
            curve = m["rewards"]
            means = [sum(curve[max(0, i - WINDOW + 1):i + 1]) / len(curve[max(0, i - WINDOW + 1):i + 1])
                     for i in range(len(curve))]
            ax.plot(range(len(curve)), means, label=f"{name} ({m['step_s']:.3f} s/step)")
        ax.axhline(LEARNED, color="grey", linewidth=0.5)
        ax.set_xlabel("step")
        ax.set_ylabel(f"reward ({WINDOW}-step mean)")
        ax.set_title(f"{config.name}: logprob_passes.prev modes", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    path = write_results(out, stem, "\n".join(lines) + "\n", summary, plot, alt="reward curves")
    print(path.read_text() + f"wrote {path}")


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
    parser.add_argument("--prev-modes", type=lambda text: text.split(","), default=[], metavar="MODE,MODE,...",
                        help="compare these logprob_passes.prev modes on the config (e.g. auto,compute), the "
                             "reference pass as the config says; default: none, i.e. the auto plan against both "
                             "passes computed")
    parser.add_argument("--staleness", type=int, default=None, metavar="N",
                        help="run with grpo.max_rollout_staleness = N instead of the config's (default: the "
                             "config's); the report's name then ends in _staleness<N>")
    parser.add_argument("--seq-logprob-error-threshold", type=float, default=None, metavar="X",
                        help="run with grpo.seq_logprob_error_threshold = X instead of the config's (default: the "
                             "config's); the report's name then ends in _threshold<X>")
    return parser.parse_args(argv)
