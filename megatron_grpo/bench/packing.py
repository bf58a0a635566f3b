"""Packing benchmark: GRPO steps on a ragged task with padded microbatches against packed ones, in one run.

Launch under torchrun (TP comes from the config; the ragged CPU config is TP=2):

    megatron-grpo --nproc-per-node 2 bench packing --config configs/grpo_tiny_cpu_ragged.yaml

The packed variant is the config with `policy.sequence_packing.enabled: true`, the padded one the same with it
false. Both start from the same weights and see the same prompts and sampling seeds; their steps are interleaved so
that machine noise hits both alike. Their first rollout is the same; afterwards their weights differ by rounding
(another summation order), so their samples drift apart and the reward curves are compared by where each learns.

Reported per variant: tokens through the model per forward pass (padded: rows × the batch's width; packed: the
rows' own lengths, up to their last trained token), the median step time and training-phase time, the peak memory
of the training phase (rank 0, above its level when the phase began) and the reward curve with the step where its
10-step mean first reaches 0.9.

The long setting (`--response-tokens MIN MAX`, with `configs/grpo_tiny_cpu_long.yaml`): the task's responses are
a few tokens long, and attention costs little there. Here every step's rollout is synthetic instead: the task's
prompts, each followed by a response of MIN to MAX random digits (uniform per row) and <eos>, and random 0 / 1
rewards, the same in both variants; the steps train on them as on sampled rollouts. It measures time and memory
where attention matters (hundreds of tokens per sequence); there is no learning curve to compare.

    megatron-grpo --nproc-per-node 2 bench packing --config configs/grpo_tiny_cpu_long.yaml --response-tokens 256 1024
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from megatron_grpo.bench.measure import (
    DEFAULT_OUT,
    OUT_HELP,
    LiveTensorBytes,
    PeakMemory,
    machine_description,
    write_results,
)
from megatron_grpo.bench.scheduler import LEARNED, WINDOW, first_learned_step
from megatron_grpo.runner.config import Config, ConfigError, load_config
from megatron_grpo.runner.helptext import DefaultsHelpFormatter

EXIT_BAD_INPUT = 2
VARIANTS = ("padded", "packed")
STEM = "packing_cpu"
SYNTHETIC_STREAM = 2  # the long setting's rollouts draw from their own generator stream (`loop.step_generator`)


def variants_of(cfg: Config) -> dict[str, Config]:
    """The config with sequence packing off (padded) and on (packed), nothing else changed."""
    packing = cfg.policy.sequence_packing

    def with_packing(enabled: bool) -> Config:
        return dataclasses.replace(cfg, policy=dataclasses.replace(
            cfg.policy, sequence_packing=dataclasses.replace(packing, enabled=enabled)))

    return {"padded": with_packing(False), "packed": with_packing(True)}


def tokens_per_pass(batch: dict[str, torch.Tensor], packed: bool) -> int:
    """Tokens one forward pass over `batch` (padded `[B, S]`) runs through the model: all B × S padded; packed,
    each row up to its last trained token (`loss.packing.row_lengths`, what `PackedMicrobatches` packs)."""
    from megatron_grpo.loss.packing import row_lengths

    return sum(row_lengths(batch)) if packed else batch["input_ids"].numel()


@contextmanager
def measured_training(device: torch.device, packed: bool, count_live: bool = False) -> Iterator[dict]:
    """While open, the runner's train step (the logprob passes and the optimizer steps, `runner.loop.train_step`)
    reports into the yielded dict: `peak_extra_mib` (memory above the level when it began) and
    `tokens_through_model` (tokens per pass × the passes run); `count_live`: `live_peak_mib` too, the peak of live
    tensors (`LiveTensorBytes`: deterministic, but the step's time then means nothing)."""
    from megatron_grpo.runner import loop

    seen: dict = {}
    train_step = loop.train_step

    def measured(*args, **kwargs):
        batch = args[5]
        live = LiveTensorBytes() if count_live else contextlib.nullcontext()
        with PeakMemory(device) as peak, live:
            result = train_step(*args, **kwargs)
        seen["peak_extra_mib"] = peak.extra_bytes / 2**20
        if count_live:
            seen["live_peak_mib"] = live.peak_bytes / 2**20
        seen["tokens_through_model"] = tokens_per_pass(batch, packed) * (1 + len(result.passes_run))
        return result

    loop.train_step = measured
    try:
        yield seen
    finally:
        loop.train_step = train_step


def synthetic_rollout(trainer, step: int, response_tokens: tuple[int, int]):
    """The long setting's rollout of this DP rank at `step`: the step's prompts (as `Trainer.rollout` samples them),
    each followed by a response of `response_tokens` MIN..MAX random digits and <eos> (trained), then padding, and
    random 0 / 1 rewards; generation logprobs 0 (nothing in the ragged config's loss reads them). The same on every
    rank of a DP rank, and in both variants."""
    from megatron_grpo.runner.loop import PROMPT_STREAM, step_generator
    from megatron_grpo.runner.rollout import Rollout

    cfg, layout, task = trainer.cfg, trainer.layout, trainer.task
    prompts = task.sample(cfg.grpo.num_prompts_per_step, step_generator(cfg.seed, step, PROMPT_STREAM))
    per_rank = cfg.grpo.num_prompts_per_step // layout.dp_size
    mine = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
    generations = cfg.grpo.num_generations_per_prompt
    prompt_lengths = prompts.prompt_lengths[mine].repeat_interleave(generations)
    generator = step_generator(cfg.seed, step, SYNTHETIC_STREAM, layout.dp_rank)
    lengths = torch.randint(response_tokens[0], response_tokens[1] + 1, prompt_lengths.shape, generator=generator)
    rows, width = len(lengths), task.prompt_length + response_tokens[1] + 1
    tokenizer = task.tokenizer
    input_ids = torch.full((rows, width), tokenizer.pad_id, dtype=torch.int64)
    input_ids[:, :task.prompt_length] = prompts.prompts[mine].repeat_interleave(generations, dim=0)
    token_mask = torch.zeros(rows, width)
    digits = torch.randint(0, 10, (rows, response_tokens[1]), generator=generator)  # DigitTokenizer: ids 0-9
    for row, (start, length) in enumerate(zip(prompt_lengths.tolist(), lengths.tolist())):
        input_ids[row, start:start + length] = digits[row, :length]
        input_ids[row, start + length] = tokenizer.eos_id
        token_mask[row, start:start + length + 1] = 1
    width = int((prompt_lengths + lengths).max()) + 1
    rollout = Rollout(input_ids=input_ids[:, :width], token_mask=token_mask[:, :width],
                      generation_logprobs=torch.zeros(rows, width), prompt_length=task.prompt_length,
                      prompt_lengths=prompt_lengths)
    return rollout, torch.randint(0, 2, (rows,), generator=generator).to(torch.float32)


def long_setting_problems(cfg: Config, response_tokens: tuple[int, int] | None) -> list[str]:
    """`--response-tokens` must be MIN <= MAX, and its longest sequence (the longest prompt, MAX tokens and <eos>)
    must fit the model's positions and the packing budgets."""
    if response_tokens is None:
        return []
    low, high = response_tokens
    if not 1 <= low <= high:
        return [f"--response-tokens must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}"]
    from megatron_grpo.runner.tasks import DigitTask, DigitTokenizer

    prompt = DigitTask(cfg.task.name, cfg.task.num_digits, DigitTokenizer(), min_digits=cfg.task.min_digits)
    longest = prompt.prompt_length + high + 1
    packing = cfg.policy.sequence_packing
    limits = {"policy.model.max_position_embeddings": cfg.policy.model.max_position_embeddings,
              "policy.sequence_packing.train_mb_tokens": packing.train_mb_tokens,
              "policy.sequence_packing.logprob_mb_tokens": packing.logprob_mb_tokens}
    return [f"--response-tokens {low} {high}: the longest sequence (a prompt of {prompt.prompt_length}, {high} "
            f"tokens and <eos>) is {longest} tokens, more than {key} ({limit})"
            for key, limit in limits.items() if limit is not None and limit < longest]


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.steps < 1 or args.warmup < 0:
            raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
        response_tokens = tuple(args.response_tokens) if args.response_tokens else None
        problems = long_setting_problems(cfg, response_tokens)
        if problems:
            raise ConfigError(problems)
        configs = variants_of(cfg)
        from megatron_grpo.runner.plan_inputs import plan_for

        plans = {name: plan_for(variant) for name, variant in configs.items()}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import os

    if "RANK" not in os.environ:
        print("error: not launched by torchrun: use `megatron-grpo --nproc-per-node N bench packing --config X.yaml` "
              "(or torchrun --nproc-per-node N -m megatron_grpo bench packing ...), N = TP × PP × DP",
              file=sys.stderr)
        return EXIT_BAD_INPUT

    import torch.distributed as dist

    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.loop import Trainer  # imports megatron.core: only once the input is known to be good
    from megatron_grpo.runner.plugin_params import parallel_params

    layout = init_parallel(parallel_params(cfg))
    try:
        trainers = {}
        for name in VARIANTS:
            torch.manual_seed(cfg.seed)  # both variants start from the same weights
            trainers[name] = Trainer.build(configs[name], plans[name], layout)
            if response_tokens is not None:  # the long setting: synthetic rollouts (the module docstring)
                trainer = trainers[name]
                trainer.rollout = lambda step, trainer=trainer: synthetic_rollout(trainer, step, response_tokens)
        records: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        rewards: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for step in range(args.warmup + args.steps):
            for name in VARIANTS:  # interleaved: drift and noise hit both alike
                dist.barrier()
                with measured_training(layout.device, packed=name == "packed") as seen:
                    record = trainers[name].step(step)
                rewards[name].append(record["reward_mean"])
                if step >= args.warmup:
                    records[name].append({**record, **seen})
        live_peaks = {}
        for name in VARIANTS:  # one more step each, its live tensors counted: outside the timings and the curves
            dist.barrier()
            with measured_training(layout.device, packed=name == "packed", count_live=True) as seen:
                trainers[name].step(args.warmup + args.steps)
            live_peaks[name] = seen["live_peak_mib"]
        if layout.rank == 0:
            summary = summarise(records, rewards, cfg, world_size=layout.world_size, tp_size=layout.tp_size,
                                response_tokens=response_tokens, live_peaks=live_peaks)
            path = write_report(summary, args.out, args.config, argv)
            print(path.read_text() + f"wrote {path}")
    finally:
        destroy_parallel()
    return 0


def summarise(records: dict[str, list[dict]], rewards: dict[str, list[float]], cfg: Config, *, world_size: int,
              tp_size: int, response_tokens: tuple[int, int] | None = None,
              live_peaks: dict[str, float] | None = None) -> dict:
    """Per variant: tokens through the model (per step, median), median step and training-phase times, the largest
    training-phase peak, the counted step's peak of live tensors (`live_peaks`, rank 0's), the reward curve and
    where it learned; and the padded / packed ratios. `response_tokens`: the long setting's (synthetic rollouts: its
    rewards are random, no learning curve)."""
    variants = {}
    for name in VARIANTS:
        rows = records[name]
        variants[name] = {
            "tokens_through_model": statistics.median(r["tokens_through_model"] for r in rows),
            "step_s": statistics.median(r["step_time_s"] for r in rows),
            "train_phase_s": statistics.median(r["train_time_s"] for r in rows),
            "peak_extra_mib": max(r["peak_extra_mib"] for r in rows),
            "live_peak_mib": (live_peaks or {}).get(name),
            "train_phase_s_per_step": [r["train_time_s"] for r in rows],
            "peak_extra_mib_per_step": [r["peak_extra_mib"] for r in rows],
            "rewards": rewards[name],
            "first_learned_step": first_learned_step(rewards[name]),
            "last_window_reward": sum(rewards[name][-WINDOW:]) / min(WINDOW, len(rewards[name])),
        }
    padded, packed = variants["padded"], variants["packed"]

    def ratio(key: str) -> float | None:
        return padded[key] / packed[key] if packed[key] and padded[key] is not None else None

    packing = cfg.policy.sequence_packing
    return {
        "config": {"tp": tp_size, "world_size": world_size, "threads_per_rank": torch.get_num_threads(),
                   "rollout_sequences": cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt,
                   "micro_batch_size": cfg.policy.train_micro_batch_size,
                   "train_mb_tokens": packing.train_mb_tokens, "logprob_mb_tokens": packing.logprob_mb_tokens,
                   "packing_algorithm": packing.algorithm,
                   "digits": [cfg.task.min_digits or cfg.task.num_digits, cfg.task.num_digits],
                   "layers": cfg.policy.model.num_layers, "hidden": cfg.policy.model.hidden_size,
                   "response_tokens": list(response_tokens) if response_tokens else None},
        "steps": len(rewards["padded"]),
        "steps_timed": len(records["padded"]),
        "variants": variants,
        "padded_over_packed": {key: ratio(key) for key in ("tokens_through_model", "step_s", "train_phase_s",
                                                           "peak_extra_mib", "live_peak_mib")},
        "first_rollout_identical": bool(rewards["padded"][:1] == rewards["packed"][:1]),
        "machine": machine_description(torch.device("cpu")),
        "date": datetime.date.today().isoformat(),
    }


def write_report(summary: dict, out: Path, config: Path, argv: list[str]) -> Path:
    """packing_cpu.md (the long setting: packing_cpu_long.md), .json and a .png under `out`: the reward curves, or in
    the long setting the training phase's time per step; returns the .md path."""
    setup, variants, ratios = summary["config"], summary["variants"], summary["padded_over_packed"]
    long = setup["response_tokens"] is not None

    def learned(step: int | None) -> str:
        return f"{step} steps" if step is not None else "not within the run"

    def times(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    def mib(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else "-"

    rollouts = (f"synthetic rollouts (the long setting): the task's prompts ({setup['digits'][0]} to "
                f"{setup['digits'][1]} digits), each followed by {setup['response_tokens'][0]} to "
                f"{setup['response_tokens'][1]} random digits and <eos>, random rewards" if long else
                f"reverse {setup['digits'][0]} to {setup['digits'][1]} digits")
    reward_header = "" if long else " reward, last 10 | 10-step mean >= 0.9 after |"
    lines = [
        f"# Packing benchmark: padded against packed microbatches on `{config}`",
        "",
        f"- date: {summary['date']}",
        f"- machine: {summary['machine']}, shared with other jobs (timings are noisy: medians of interleaved "
        "steps)",
        f"- command: `megatron-grpo --nproc-per-node {setup['world_size']} bench packing {' '.join(argv)}`",
        "",
        f"TP={setup['tp']} over {setup['world_size']} ranks, {setup['threads_per_rank']} thread(s) per rank; "
        f"{rollouts}; {setup['rollout_sequences']} sequences per step; GPTModel of {setup['layers']} layers, hidden "
        f"{setup['hidden']}; padded: microbatches of {setup['micro_batch_size']} rows; packed: of at most "
        f"{setup['train_mb_tokens']} tokens (logprob passes: {setup['logprob_mb_tokens'] or setup['train_mb_tokens']})"
        f", by {setup['packing_algorithm']}. {summary['steps']} steps per variant; times and tokens are medians of "
        f"the last {summary['steps_timed']}.",
        "",
        "| variant | tokens through the model per step | step (s) | training phase (s) | "
        "peak extra memory, training phase, rank 0 (MiB) | live tensors' peak, training phase, rank 0 (MiB) |"
        + reward_header,
        "|---|---|---|---|---|---|" + ("" if long else "---|---|"),
        *(f"| {name} | {v['tokens_through_model']:.0f} | {v['step_s']:.3f} | {v['train_phase_s']:.3f} | "
          f"{v['peak_extra_mib']:.1f} | {mib(v['live_peak_mib'])} |"
          + ("" if long else f" {v['last_window_reward']:.3f} | {learned(v['first_learned_step'])} |")
          for name, v in variants.items()),
        f"| padded / packed | {times(ratios['tokens_through_model'])} | {times(ratios['step_s'])} | "
        f"{times(ratios['train_phase_s'])} | {times(ratios['peak_extra_mib'])} | {times(ratios['live_peak_mib'])} |"
        + ("" if long else " | |"),
        "",
        ("The rollouts are the same in both variants (synthetic, from the same seeds), and so is the objective: "
         "the variants differ in how the model sees the sequences only." if long else
         f"The first rollout is the same in both variants: {summary['first_rollout_identical']} (same weights, same "
         "seeds); later ones drift apart by rounding.")
        + " Without Transformer Engine the attention is `TorchDotProductAttention`: on the CPU, padded rows take one "
        "causal SDPA per microbatch (each row its own S × S) and a packed microbatch one causal SDPA per sequence "
        "(each its own L × L), never the microbatch's T × T. Peak memory is the resident high-water mark of rank 0, "
        "allocator noise included; the live tensors' peak counts the bytes of tensor storages alive at once during "
        "one more step after the timed ones (at the dispatcher: deterministic; a C++ kernel's own temporaries are "
        "not seen).",
    ]

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, v in variants.items():
            if long:
                ax.plot(v["train_phase_s_per_step"], marker="o", label=f"{name} ({v['tokens_through_model']:.0f} "
                                                                         "tokens/step)")
                continue
            curve = v["rewards"]
            means = [sum(curve[max(0, i - WINDOW + 1):i + 1]) / len(curve[max(0, i - WINDOW + 1):i + 1])
                     for i in range(len(curve))]
            ax.plot(range(len(curve)), means, label=f"{name} ({v['step_s']:.3f} s/step, "
                                                    f"{v['tokens_through_model']:.0f} tokens/step)")
        if long:
            ax.set_xlabel("timed step")
            ax.set_ylabel("training phase (s)")
            ax.set_ylim(bottom=0)
        else:
            ax.axhline(LEARNED, color="grey", linewidth=0.5)
            ax.set_xlabel("step")
            ax.set_ylabel(f"reward ({WINDOW}-step mean)")
        ax.set_title(f"{config.name}: padded vs packed microbatches", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return write_results(out, f"{STEM}_long" if long else STEM, "\n".join(lines) + "\n", summary, plot,
                         alt="training phase time per step" if long else "reward curves")


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron-grpo [torchrun options] bench packing",
                                     description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/grpo_tiny_cpu_ragged.yaml"),
                        help="the run config both variants train with (its TP and PP must fit the ranks launched)")
    parser.add_argument("--steps", type=int, default=250, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant, run first")
    parser.add_argument("--response-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="the long setting: synthetic rollouts with responses of MIN to MAX random digits "
                             "(configs/grpo_tiny_cpu_long.yaml); no learning curve (default: the task's own rollouts)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    parser.add_argument("--verbose", action="store_true", help="show Megatron-Core's notices, filtered by default")
    return parser.parse_args(argv)
