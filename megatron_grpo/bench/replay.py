"""Kept-set replay report: the GRPO runner with a top-p sampler and stale rollouts, trained once recomputing the
filter from the training logits and once replaying the sampler's own kept sets (`generation.replay_kept_set`).

Launch under torchrun (TP comes from the config; the tiny CPU configs are TP=2):

    megatron-grpo --nproc-per-node 2 bench replay --config configs/grpo_tiny_cpu_stale.yaml --top-p 0.8

Both variants start from the same weights and see the same prompts and sampling seeds, their steps interleaved; their
trajectories part after the first step. Reported per variant, over every step after the first (whose rollout the
current weights made): the fraction of trained tokens whose importance ratio `exp(prev - generation)` lies outside
[0.9, 1.1] (`gen_ratio_outside_band`: the ratio TRL #7269 and vLLM #49577 report), and, on the very same tokens and
weights, that fraction with the current logprobs over the replayed and over the recomputed set
(`kept_set_{replayed,recomputed}_ratio_outside_band`: one update per rollout, so curr is prev); how often the
recomputed kept set differs from the sampler's (`kept_set_differs`), the sampler's set's mass under the training
forward (`kept_set_mass`), the kept ids per token, the reward, and the median step time (the replay's cost, noisy on a
shared machine). Writes `replay_<config stem>_top_p<p>.md`, `.json` and a `.png` of the per-step fractions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_grpo.bench.measure import DEFAULT_OUT, OUT_HELP, machine_description, write_results
from megatron_grpo.runner.config import Config, ConfigError, load_config
from megatron_grpo.runner.helptext import DefaultsHelpFormatter
from megatron_grpo.runner.plan_inputs import plan_for

EXIT_BAD_INPUT = 2
VARIANTS = {"recompute": False, "replay": True}  # name: generation.replay_kept_set
METRICS = ("gen_ratio_outside_band", "kept_set_replayed_ratio_outside_band", "kept_set_recomputed_ratio_outside_band",
           "kept_set_differs", "kept_set_mass", "rollout_kept_set_size", "reward_mean")


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_config(args.config)
        configs = variants(cfg, top_p=args.top_p, top_k=args.top_k, staleness=args.staleness)
        plans = {name: plan_for(variant) for name, variant in configs.items()}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if "RANK" not in os.environ:
        print("error: not launched by torchrun: use `megatron-grpo --nproc-per-node N bench replay --config X.yaml`, "
              "N = TP × PP × DP", file=sys.stderr)
        return EXIT_BAD_INPUT

    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.loop import Trainer  # imports megatron.core: only once the input is known to be good
    from megatron_grpo.runner.plugin_params import parallel_params

    layout = init_parallel(parallel_params(cfg))
    try:
        trainers = {}
        for name, variant in configs.items():
            torch.manual_seed(cfg.seed)  # every variant starts from the same weights
            trainers[name] = Trainer.build(variant, plans[name], layout)
        records: dict[str, list[dict]] = {name: [] for name in configs}
        for step in range(args.steps):
            for name in configs:  # interleaved: drift and noise hit both variants alike
                dist.barrier()
                records[name].append(trainers[name].step(step))
        if layout.rank == 0:
            summary = summarise(records, configs, world_size=layout.world_size, tp_size=layout.tp_size)
            write_report(summary, args.out, args.config, argv)
    finally:
        destroy_parallel()
    return 0


def variants(cfg: Config, *, top_p: float | None, top_k: int | None, staleness: int | None) -> dict[str, Config]:
    """The config with the sampler's `top_p` / `top_k` (and `staleness`) set, recomputing and replaying the kept
    sets; a config that does not allow both (e.g. no filter) is a ConfigError."""
    generation = dataclasses.replace(cfg.generation, top_p=top_p, top_k=top_k)
    grpo = cfg.grpo if staleness is None else dataclasses.replace(cfg.grpo, max_rollout_staleness=staleness)
    return {name: dataclasses.replace(cfg, grpo=grpo, generation=dataclasses.replace(generation,
                                                                                     replay_kept_set=replay))
            for name, replay in VARIANTS.items()}


def summarise(records: dict[str, list[dict]], configs: dict[str, Config], *, world_size: int, tp_size: int) -> dict:
    """Per variant: each metric's mean over the steps after the first, its per-step values, and the median step
    time; the replay's median step time relative to the recomputing variant's."""
    first = next(iter(configs.values()))
    per_variant = {}
    for name, rows in records.items():
        later = rows[1:] if len(rows) > 1 else rows
        per_variant[name] = {
            "means": {key: statistics.fmean(r[key] for r in later) for key in METRICS},
            "per_step": {key: [r[key] for r in rows] for key in METRICS},
            "step_s": statistics.median(r["step_time_s"] for r in rows),
        }
    return {
        "config": {"tp": tp_size, "world_size": world_size, "top_p": first.generation.top_p,
                   "top_k": first.generation.top_k, "temperature": first.generation.temperature,
                   "staleness": first.grpo.max_rollout_staleness,
                   "rollout_sequences": first.grpo.num_prompts_per_step * first.grpo.num_generations_per_prompt,
                   "is_correction": first.loss_fn.use_importance_sampling_correction,
                   "tis": first.loss_fn.truncated_importance_sampling.type},
        "steps": len(next(iter(records.values()))),
        "variants": per_variant,
        "replay_step_time_vs_recompute": per_variant["replay"]["step_s"] / per_variant["recompute"]["step_s"],
        "machine": machine_description(torch.device("cpu")),
        "load": _load_average(),
        "date": datetime.date.today().isoformat(),
    }


def _load_average() -> str:
    try:
        return ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def write_report(summary: dict, out: Path, config: Path, argv: list[str]) -> None:
    setup = summary["config"]
    stem = f"replay_{config.stem}_top_p{setup['top_p']}"
    variants_ = summary["variants"]
    lines = [
        f"# Kept-set replay: `{config}`, top-p {setup['top_p']}, rollouts {setup['staleness']} step(s) stale",
        "",
        f"- date: {summary['date']}",
        f"- machine: {summary['machine']}; load average at the end (1, 5, 15 min): {summary['load']}",
        f"- command: `megatron-grpo --nproc-per-node {setup['world_size']} bench replay {' '.join(argv)}`",
        "",
        f"TP={setup['tp']} over {setup['world_size']} ranks; temperature {setup['temperature']}, top-k "
        f"{setup['top_k']}, top-p {setup['top_p']}; {setup['rollout_sequences']} sequences per rollout; IS "
        f"correction {'on' if setup['is_correction'] else 'off'} (truncation {setup['tis']}). {summary['steps']} steps "
        "per variant from the same weights, interleaved (the runs part after the first step); the means are over "
        "every step after the first (its rollout came from the current weights).",
        "",
        "| training run | ratio outside [0.9, 1.1], trained | same tokens: replayed | same tokens: recomputed | "
        "recomputed set differs | sampler's set's mass | kept ids / token | reward | step (s, median) |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {name} | {100 * v['means']['gen_ratio_outside_band']:.1f}% | "
          f"{100 * v['means']['kept_set_replayed_ratio_outside_band']:.1f}% | "
          f"{100 * v['means']['kept_set_recomputed_ratio_outside_band']:.1f}% | "
          f"{100 * v['means']['kept_set_differs']:.1f}% | {v['means']['kept_set_mass']:.3f} | "
          f"{v['means']['rollout_kept_set_size']:.2f} | {v['means']['reward_mean']:.3f} | {v['step_s']:.3f} |"
          for name, v in variants_.items()),
        "",
        "- ratio: `exp(prev - generation)` per trained token, generation the sampler's logprob, prev the training "
        "forward's (the prev pass is skipped: one update per rollout) under the distribution the run trains: "
        "`gen_ratio_outside_band` (a token outside the recomputed set is dropped from it). The next two columns take "
        "the same tokens and weights both ways, curr over the sampler's replayed set and over the recomputed one "
        "(ratio 0, outside, where the recomputed set drops the token): with replay both sides normalise over the same "
        "set, and what is left is the one step of staleness.",
        "- recomputed set differs: the filter recomputed from the training logits keeps another set than the sampler "
        "kept (the sampler's weights are a step older).",
        f"- the replay's median step time is {summary['replay_step_time_vs_recompute']:.2f}x the recomputing "
        "variant's (interleaved; a shared machine's noise).",
    ]

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        def smoothed(values: list[float]) -> list[float]:  # the trailing 10-step mean, in %
            return [100 * statistics.fmean(values[max(0, i - 9):i + 1]) for i in range(len(values))]

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, v in variants_.items():
            for way, style in (("replayed", "-"), ("recomputed", "--")):
                axes[0].plot(smoothed(v["per_step"][f"kept_set_{way}_ratio_outside_band"]), style,
                             label=f"{name} run, {way} set")
            axes[1].plot(smoothed(v["per_step"]["kept_set_differs"]), label=f"{name} run")
        axes[0].set_title("tokens with exp(curr - generation) outside [0.9, 1.1] (10-step mean)", fontsize=9)
        axes[1].set_title("tokens whose recomputed kept set differs (10-step mean)", fontsize=9)
        for ax in axes:
            ax.set_xlabel("step")
            ax.set_ylabel("% of trained tokens")
            ax.legend(fontsize=8)
        fig.suptitle(f"{config.name}, top-p {setup['top_p']}, staleness {setup['staleness']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    path = write_results(out, stem, "\n".join(lines) + "\n", summary, plot,
                         alt="per-step fractions of ratios outside the band and of differing sets")
    print(path.read_text() + f"wrote {path}")


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron-grpo [torchrun options] bench replay",
                                     description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/grpo_tiny_cpu_stale.yaml"),
                        help="the run config both variants train with (its TP and PP must fit the ranks launched)")
    parser.add_argument("--top-p", type=float, default=0.8, help="the sampler's generation.top_p")
    parser.add_argument("--top-k", type=int, default=None, help="the sampler's generation.top_k (default: none)")
    parser.add_argument("--staleness", type=int, default=None, metavar="N",
                        help="grpo.max_rollout_staleness (default: the config's)")
    parser.add_argument("--steps", type=int, default=30, help="steps per variant")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    parser.add_argument("--verbose", action="store_true", help="show Megatron-Core's notices, filtered by default")
    return parser.parse_args(argv)
