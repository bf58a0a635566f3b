"""Step benchmark: the whole GRPO train step (`megatron.step`) on a mid-size GPTModel, four configurations.

Launch under torchrun, one rank by default (N ranks: TP = N, one model split over them):

    megatron-grpo --nproc-per-node 1 bench step

Each configuration adds one feature to the one before; all train the same objective (the same loss, KL included)
on the same rollout from the same weights:

1. `everything`: the prev and reference passes computed, logits materialised, padded microbatches (what NeMo-RL
   and verl run by default in this setting);
2. `plan`: the logprob plan (`plan_logprob_passes`) decides the passes: on-policy with one optimizer step per
   rollout and no dropout, the prev pass is redundant (prev = curr.detach()); the reference pass stays while the
   KL is on (`--kl-penalty 0` drops the KL from every configuration, and the plan then skips it too);
3. `fused`: the fused linear path (`fused_linear_logprobs`, and the loss-fused head, `fused_linear_loss`, for
   every loss setting and sampling distribution, unless `--no-fused-loss`);
4. `packed`: packed microbatches (`max_tokens_per_microbatch` = micro_batch_size × the rollout's width, as many
   as first-fit decreasing needs, evened out: `packing_algorithm="balanced_first_fit_decreasing"`).

The rollout is synthetic: short prompts and ragged responses of random tokens, uniform random rewards turned into
group-relative advantages, generation logprobs from a no-grad forward of the configuration's own current weights
(each step is a fresh on-policy rollout). The same rollout is trained on at every step, so the step's objective,
the mean over trained tokens of advantage × logprob, rises as the model learns it: the learning check. The
configurations are interleaved step by step (`--sequential`: one after the other, one model in memory at a time).

Reported per configuration: the median step time and time per phase (train_step's `StepTimer` sections), the
peak memory of the step above its start (CPU: resident high-water mark; CUDA: torch's allocator peak), the peak
of its live tensors (`measure.LiveTensorBytes`, deterministic: counted on one more, untimed step after the timed
ones, where the optimizer's state exists already), tokens through the model, the ratios against configuration 1,
and the first step's loss and gradient norm (the same objective from the same weights: equal to rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatron_grpo.bench.measure import (
    DEFAULT_OUT,
    OUT_HELP,
    LiveTensorBytes,
    PeakMemory,
    machine_description,
    synchronize,
    write_results,
)
from megatron_grpo.runner.helptext import DefaultsHelpFormatter

EXIT_BAD_INPUT = 2
CONFIGURATIONS = ("everything", "plan", "fused", "packed")
LABELS = {"everything": "1. everything computed", "plan": "2. + skip-aware plan", "fused": "3. + fused linear",
          "packed": "4. + packing"}
PHASES = ("reference_pass", "prev_pass", "forward_backward", "optimizer")


@dataclass(frozen=True)
class Setup:
    """The benchmark's shapes and settings (the CLI's options)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 32000
    prompts: int = 2
    generations: int = 4
    prompt_tokens: tuple[int, int] = (4, 16)
    response_tokens: tuple[int, int] = (16, 256)
    micro_batch_size: int = 2
    dtype: str = "fp32"
    kl_penalty: float = 0.01
    temperature: float = 1.0  # the distribution the rollouts sampled from, which every configuration trains
    top_k: int | None = None
    top_p: float | None = None
    fused_loss: bool = True
    lr: float = 1e-4
    seed: int = 1234

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    @property
    def max_length(self) -> int:
        return self.prompt_tokens[1] + self.response_tokens[1]

    @property
    def distribution(self):
        from megatron_grpo.ops import SamplingDistribution

        return SamplingDistribution.of_sampling(self.temperature, self.top_k, self.top_p)


def check_setup(setup: Setup, device: str) -> list[str]:
    """Every bad option, each naming its flag."""
    problems = []
    minimums = (("--layers", setup.layers, 1), ("--hidden", setup.hidden, 1), ("--heads", setup.heads, 1),
                ("--vocab", setup.vocab, 2), ("--prompts", setup.prompts, 1), ("--generations", setup.generations, 2),
                ("--micro-batch-size", setup.micro_batch_size, 1))
    for flag, value, least in minimums:
        if value < least:
            problems.append(f"{flag} must be >= {least}, got {value}")
    if setup.heads >= 1 and setup.hidden % setup.heads:
        problems.append(f"--hidden ({setup.hidden}) must be a multiple of --heads ({setup.heads})")
    for flag, (low, high) in (("--prompt-tokens", setup.prompt_tokens), ("--response-tokens", setup.response_tokens)):
        if not 1 <= low <= high:
            problems.append(f"{flag} must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}")
    if setup.micro_batch_size >= 1 and setup.rows % setup.micro_batch_size:
        problems.append(f"--micro-batch-size ({setup.micro_batch_size}) must divide the rollout's --prompts × "
                        f"--generations = {setup.rows} sequences")
    if setup.kl_penalty < 0:
        problems.append(f"--kl-penalty must be >= 0, got {setup.kl_penalty}")
    from megatron_grpo.ops import SamplingDistribution

    problems += [f"--{name.replace('_', '-')} {problem}" for name, problem in SamplingDistribution.problems(
        temperature=setup.temperature, top_k=setup.top_k, top_p=setup.top_p).items()]
    if setup.lr <= 0:
        problems.append(f"--lr must be > 0, got {setup.lr}")
    if device == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if setup.dtype == "bf16" and device != "cuda":
        problems.append("--dtype bf16 needs --device cuda (the CPU runs the model in fp32)")
    return problems


def synthetic_rollout(setup: Setup, seed: int) -> dict[str, torch.Tensor]:
    """A padded rollout `[rows, width]`: per row a prompt and a response of random tokens, their lengths uniform in
    the given ranges; the response tokens trained; uniform random rewards; GRPO's group-relative advantages
    (normalised by the group's std, NeMo-RL's default)."""
    from megatron_grpo.runner.advantages import group_relative_advantages

    generator = torch.Generator().manual_seed(seed)

    def lengths(low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high + 1, (setup.rows,), generator=generator)

    prompt, response = lengths(*setup.prompt_tokens), lengths(*setup.response_tokens)
    width = int((prompt + response).max())
    input_ids = torch.randint(0, setup.vocab, (setup.rows, width), generator=generator)
    positions = torch.arange(width)
    token_mask = ((positions >= prompt[:, None]) & (positions < (prompt + response)[:, None])).to(torch.float32)
    input_ids = input_ids * (positions < (prompt + response)[:, None])  # padding: token 0, untrained
    rewards = torch.rand(setup.rows, generator=generator)
    advantages = group_relative_advantages(rewards, setup.generations, normalize_by_std=True, leave_one_out=False)
    return {"input_ids": input_ids, "token_mask": token_mask, "sample_mask": torch.ones(setup.rows),
            "advantages": advantages.advantages, "rewards": rewards}


def tokens_per_pass(batch: dict[str, torch.Tensor], packed: bool) -> int:
    """Tokens one pass over the rollout runs through the model: padded, every row at the rollout's width; packed,
    each row up to its last trained token (what `loss.packing.PackedMicrobatches` packs)."""
    from megatron_grpo.loss.packing import row_lengths

    return sum(row_lengths(batch)) if packed else batch["input_ids"].numel()


def weighted_logprob(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> float:
    """The mean over trained tokens of advantage × logprob: what the policy gradient raises on a fixed rollout."""
    mask = batch["token_mask"].to(logprobs.device)
    advantages = batch["advantages"].to(logprobs.device)[:, None]
    return float((advantages * logprobs * mask).sum() / mask.sum())


# ---- one configuration: its plan, step config, model and optimizer ----

def plans_and_steps(setup: Setup) -> tuple[dict[str, tuple], object]:
    """Per configuration, (LogprobPlan, StepConfig); and the one `ClippedPGLossConfig` all four train with.
    Configuration 1 forces both passes (`compute`); the others take the plan's `auto` decisions."""
    from megatron_grpo.loss import ClippedPGLossConfig
    from megatron_grpo.megatron.step import StepConfig
    from megatron_grpo.scheduler import PlanInputs, plan_logprob_passes

    loss = ClippedPGLossConfig(reference_policy_kl_penalty=setup.kl_penalty)

    def plan(mode: str):
        return plan_logprob_passes(PlanInputs.for_loss(loss, rollout_batch=setup.rows, global_batch=setup.rows,
                                                       dropout=False, reference_mode=mode, prev_mode=mode))

    padded = StepConfig(global_batch_size=setup.rows, micro_batch_size=setup.micro_batch_size,
                        distribution=setup.distribution)
    fused = replace(padded, fused_linear_logprobs=True, fused_linear_loss=setup.fused_loss)
    packed = replace(fused, max_tokens_per_microbatch=setup.micro_batch_size * setup.max_length,
                     packing_algorithm="balanced_first_fit_decreasing")
    return {"everything": (plan("compute"), padded), "plan": (plan("auto"), padded), "fused": (plan("auto"), fused),
            "packed": (plan("auto"), packed)}, loss


@dataclass
class Run:
    name: str
    plan: object
    step: object
    model: torch.nn.Module
    optimizer: object
    vocab: object


def model_params(setup: Setup):
    from megatron_grpo.megatron import GPTModelParams

    return GPTModelParams(num_layers=setup.layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
                          max_position_embeddings=setup.max_length, hidden_dropout=0.0, attention_dropout=0.0,
                          precision=setup.dtype)


def build_model(setup: Setup) -> torch.nn.Module:
    """The GPTModel from the benchmark's seed: every configuration (and the reference model) starts from the same
    weights."""
    from megatron_grpo.megatron import build_gpt_model
    from megatron_grpo.megatron.parallel import seed_all

    seed_all(setup.seed, on_cpu=not torch.cuda.is_available())
    return build_gpt_model(model_params(setup), setup.vocab)


def build_run(name: str, plan, step, setup: Setup) -> Run:
    from megatron_grpo.megatron import (
        AdamParams,
        build_optimizer,
        uses_distributed_optimizer,
        vocab_shard_of,
        wrap_in_ddp,
    )

    model = wrap_in_ddp(build_model(setup), use_distributed_optimizer=uses_distributed_optimizer())
    optimizer = build_optimizer(model, AdamParams(lr=setup.lr))
    return Run(name, plan, step, model, optimizer, vocab_shard_of(model, setup.vocab))


def one_step(run: Run, rollout: dict[str, torch.Tensor], loss_fn, reference_model, device: torch.device,
             count_live: bool = False) -> dict:
    """One on-policy GRPO step of `run` on `rollout`: generation logprobs from the current weights (untimed), then
    `train_step` timed, with its phases and peak memory; `count_live`: under `LiveTensorBytes` instead (its time
    then means nothing), its peak of live tensors as `live_peak_mib`."""
    from megatron_grpo.megatron import compute_logprobs, train_step
    from megatron_grpo.timing import StepTimer

    batch = {key: value.to(device) for key, value in rollout.items()}
    batch["generation_logprobs"] = compute_logprobs(
        run.model, batch, micro_batch_size=run.step.micro_batch_size, vocab=run.vocab,
        distribution=run.step.distribution, fused_linear=run.step.fused_linear_logprobs,
        max_tokens_per_microbatch=run.step.max_tokens_per_microbatch)
    timer = StepTimer(PHASES, sync=(lambda: synchronize(device)) if device.type == "cuda" else None)
    synchronize(device)
    live = LiveTensorBytes() if count_live else contextlib.nullcontext()
    with PeakMemory(device) as peak, live:
        start = time.perf_counter()
        result = train_step(run.step, run.model, run.optimizer, loss_fn, run.plan, batch, vocab=run.vocab,
                            reference_model=reference_model, timer=timer)
        synchronize(device)
        seconds = time.perf_counter() - start
    if count_live:
        return {"live_peak_mib": live.peak_bytes / 2**20}
    metrics = result.step_metrics[0]
    passes = 1 + len(result.passes_run)
    record = {"step_s": seconds, **timer.times(), "peak_extra_mib": peak.extra_bytes / 2**20,
              "tokens_through_model": tokens_per_pass(rollout, run.step.max_tokens_per_microbatch is not None) * passes,
              "passes_run": sorted(result.passes_run), "loss": float(metrics["loss"]),
              "grad_norm": float(metrics["grad_norm"]), "objective": weighted_logprob(result.curr_logprobs, batch)}
    if "prev" in result.passes_run:  # the prev pass and the generation forward are the same no-grad forward
        # over the trained tokens; equal values differ by 0 (a token the filter drops is -inf in both)
        prev, generation = result.prev_logprobs, batch["generation_logprobs"]
        difference = torch.where((prev == generation) | ~batch["token_mask"].bool(), 0.0, prev - generation)
        record["prev_vs_generation_max_abs"] = float(difference.abs().max())
    return record


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    setup = setup_of(args)
    problems = check_setup(setup, args.device)
    if args.steps < 1:
        problems.append(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        problems.append(f"--warmup must be >= 0, got {args.warmup}")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return EXIT_BAD_INPUT
    if "RANK" not in os.environ:
        print("error: not launched by torchrun: use `megatron-grpo --nproc-per-node 1 bench step` (N ranks: TP = N), "
              "or torchrun --nproc-per-node 1 -m megatron_grpo bench step ...", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.device == "cpu" and torch.cuda.is_available():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the plugin picks CUDA whenever it sees it

    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import ParallelParams, destroy_parallel, init_parallel

    layout = init_parallel(ParallelParams(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"]), seed=setup.seed))
    try:
        configurations, loss_config = plans_and_steps(setup)
        loss_fn = ClippedPGLoss(loss_config)
        rollout = synthetic_rollout(setup, setup.seed)
        reference_model = None
        if any(plan.compute_reference_logprobs for plan, _ in configurations.values()):
            reference_model = build_model(setup)  # the initial policy, frozen
            reference_model.requires_grad_(False)
        records: dict[str, list[dict]] = {name: [] for name in CONFIGURATIONS}
        live_peaks: dict[str, float] = {}

        def steps_of(run: Run, step: int) -> None:
            reference = reference_model if run.plan.compute_reference_logprobs else None
            if step < args.warmup + args.steps:
                records[run.name].append(one_step(run, rollout, loss_fn, reference, layout.device))
            else:  # the last, counted step: outside the timings and the learning curve
                live_peaks[run.name] = one_step(run, rollout, loss_fn, reference, layout.device,
                                                count_live=True)["live_peak_mib"]

        if args.sequential:
            for name in CONFIGURATIONS:
                run = build_run(name, *configurations[name], setup)
                for step in range(args.warmup + args.steps + 1):
                    steps_of(run, step)
                del run
                gc.collect()
                if layout.device.type == "cuda":
                    torch.cuda.empty_cache()
        else:
            runs = [build_run(name, *configurations[name], setup) for name in CONFIGURATIONS]
            for step in range(args.warmup + args.steps + 1):
                for run in runs:  # interleaved: machine noise hits every configuration alike
                    steps_of(run, step)
        if layout.rank == 0:
            plans = {name: list(plan.reasons) for name, (plan, _) in configurations.items()}
            summary = summarise(records, live_peaks, args.warmup, setup, plans, device=layout.device,
                                tp=layout.tp_size, sequential=args.sequential)
            path = write_report(summary, args.out, argv)
            print(path.read_text() + f"wrote {path}")
    finally:
        destroy_parallel()
    return 0


def summarise(records: dict[str, list[dict]], live_peaks: dict[str, float], warmup: int, setup: Setup,
              plans: dict[str, list[str]], *, device: torch.device, tp: int, sequential: bool) -> dict:
    """Per configuration: medians of the timed steps (after `warmup`), the largest peak, the counted step's peak of
    live tensors (`live_peaks`), the learning curve; ratios
    against configuration 1 (its value / this one's: > 1 is faster or smaller); the first step's loss and gradient
    norm against configuration 1's."""
    configurations = {}
    for name in CONFIGURATIONS:
        timed = records[name][warmup:]
        first = records[name][0]
        configurations[name] = {
            "step_s": statistics.median(r["step_s"] for r in timed),
            "phases_s": {phase: statistics.median(r[f"{phase}_time_s"] for r in timed) for phase in PHASES},
            "peak_extra_mib": max(r["peak_extra_mib"] for r in timed),
            "live_peak_mib": live_peaks[name],
            "tokens_through_model": statistics.median(r["tokens_through_model"] for r in timed),
            "passes_run": first["passes_run"],
            "first_loss": first["loss"],
            "first_grad_norm": first["grad_norm"],
            "objective": [r["objective"] for r in records[name]],
            "loss": [r["loss"] for r in records[name]],
            "prev_vs_generation_max_abs": max((r["prev_vs_generation_max_abs"] for r in records[name]
                                               if "prev_vs_generation_max_abs" in r), default=None),
        }
    base = configurations["everything"]

    def ratio(numerator: float, denominator: float) -> float | None:
        return numerator / denominator if denominator > 0 else None

    def relative(value: float, reference: float) -> float:
        return abs(value - reference) / max(abs(reference), 1e-30)

    for c in configurations.values():
        c["vs_everything"] = {"step_time": ratio(base["step_s"], c["step_s"]),
                              "peak_memory": ratio(base["peak_extra_mib"], c["peak_extra_mib"]),
                              "live_peak": ratio(base["live_peak_mib"], c["live_peak_mib"]),
                              "tokens": ratio(base["tokens_through_model"], c["tokens_through_model"])}
        c["first_loss_rel_diff"] = relative(c["first_loss"], base["first_loss"])
        c["first_grad_norm_rel_diff"] = relative(c["first_grad_norm"], base["first_grad_norm"])
    return {
        "setup": {**setup.__dict__, "rows": setup.rows, "device": device.type, "tp": tp,
                  "threads": torch.get_num_threads(), "order": "sequential" if sequential else "interleaved"},
        "steps": len(records["everything"]),
        "steps_timed": len(records["everything"]) - warmup,
        "plans": plans,
        "configurations": configurations,
        "machine": machine_description(device),
        "date": datetime.date.today().isoformat(),
    }


def write_report(summary: dict, out: Path, argv: list[str]) -> Path:
    """step_<device>.md, .json and .png under `out`; returns the .md path."""
    setup, configurations = summary["setup"], summary["configurations"]

    def times(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    kl = (f"KL to the reference in the loss (`reference_policy_kl_penalty` {setup['kl_penalty']}) in every "
          "configuration, so the reference pass runs in all four" if setup["kl_penalty"] > 0 else
          "no KL (`reference_policy_kl_penalty` 0) in any configuration; configuration 1 computes the reference pass "
          "anyway")
    shared = ", shared with other jobs (timings are noisy: medians of interleaved steps)" \
        if setup["device"] == "cpu" else ""
    lines = [
        "# Step benchmark: the whole GRPO train step, four configurations",
        "",
        f"- date: {summary['date']}",
        f"- machine: {summary['machine']}{shared}",
        f"- command: `megatron-grpo --nproc-per-node {setup['tp']} bench step {' '.join(argv)}`",
        "",
        f"GPTModel {setup['layers']} layers, hidden {setup['hidden']}, {setup['heads']} heads, vocab {setup['vocab']} "
        f"(padded as Megatron pads it), {setup['dtype']}, TP {setup['tp']}, on {setup['device']}, "
        f"{setup['threads']} thread(s). Rollout: {setup['prompts']} prompts × {setup['generations']} generations = "
        f"{setup['rows']} sequences, prompts of {setup['prompt_tokens'][0]}-{setup['prompt_tokens'][1]} tokens, "
        f"responses of {setup['response_tokens'][0]}-{setup['response_tokens'][1]}; one optimizer step per rollout "
        f"(on-policy), microbatches of {setup['micro_batch_size']} rows (packed: of at most "
        f"{setup['micro_batch_size']} × the rollout's width tokens, balanced first-fit decreasing), Adam lr "
        f"{setup['lr']}, no dropout. {kl}. "
        f"Sampling distribution, trained by every configuration: temperature {setup['temperature']}, top-k "
        f"{setup['top_k']}, top-p {setup['top_p']}; configuration 3 "
        f"{'runs the loss-fused head' if setup['fused_loss'] else 'recomputes the chunks in backward (the fused op)'}. "
        f"{summary['steps']} steps per configuration ({setup['order']}); times are medians of the last "
        f"{summary['steps_timed']}.",
        "",
        "| configuration | passes | tokens through the model | step (s) | " + " | ".join(
            f"{p} (s)" for p in PHASES) + " | peak extra memory (MiB) | live tensors' peak (MiB) | step time vs 1 | "
        "peak memory vs 1 | live tensors' peak vs 1 |",
        "|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|---|",
        *(f"| {LABELS[name]} | {', '.join(c['passes_run']) or 'none'} | {c['tokens_through_model']:.0f} | "
          f"{c['step_s']:.3f} | " + " | ".join(f"{c['phases_s'][p]:.3f}" for p in PHASES)
          + f" | {c['peak_extra_mib']:.1f} | {c['live_peak_mib']:.1f} | {times(c['vs_everything']['step_time'])} | "
          f"{times(c['vs_everything']['peak_memory'])} | {times(c['vs_everything']['live_peak'])} |"
          for name, c in configurations.items()),
        "",
        "\"vs 1\": configuration 1's value divided by this one's (> 1: faster, smaller). Peak memory: above the "
        "level when the step began" + (", the resident high-water mark (allocator noise included)"
                                       if setup["device"] == "cpu" else ", torch's allocator peak") + ". Live "
        "tensors' peak: the most bytes of tensor storages alive at once during one more step after the timed ones "
        "(counted at the dispatcher, beyond those alive when it began: deterministic; a C++ kernel's own temporaries "
        "are not seen).",
        "",
        "Learning check: the same objective from the same weights, so the first step's loss and gradient norm agree "
        "to rounding; then each configuration trains on the same rollout, and the mean advantage × logprob over the "
        "trained tokens (taken before each step's update) rises alike.",
        "",
        "| configuration | first loss | rel. diff vs 1 | first grad norm | rel. diff vs 1 | advantage × logprob, "
        "first → last step |",
        "|---|---|---|---|---|---|",
        *(f"| {LABELS[name]} | {c['first_loss']:.7g} | {c['first_loss_rel_diff']:.1e} | {c['first_grad_norm']:.7g} | "
          f"{c['first_grad_norm_rel_diff']:.1e} | {c['objective'][0]:.5f} → {c['objective'][-1]:.5f} |"
          for name, c in configurations.items()),
        "",
        "The plan's reasons (configuration 2): " + " ".join(summary["plans"]["plan"]),
    ]
    prev_check = configurations["everything"]["prev_vs_generation_max_abs"]
    if prev_check is not None:
        lines += ["", f"Configuration 1's prev pass against the generation logprobs (the same no-grad forward of "
                      f"the same weights): max |difference| {prev_check:.1e}."]

    def plot(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (times_ax, memory_ax, learn_ax) = plt.subplots(1, 3, figsize=(13, 4))
        names = list(configurations)
        labels = [LABELS[name].split(". ", 1)[1] for name in names]
        bottom = [0.0] * len(names)
        for phase in PHASES:
            values = [configurations[name]["phases_s"][phase] for name in names]
            times_ax.bar(labels, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
        other = [max(configurations[name]["step_s"] - b, 0.0) for name, b in zip(names, bottom)]
        times_ax.bar(labels, other, bottom=bottom, label="other", color="lightgrey")
        times_ax.set_ylabel("median step time (s)")
        times_ax.legend(fontsize=7)
        memory_ax.bar(labels, [configurations[name]["live_peak_mib"] for name in names], color="tab:purple")
        memory_ax.set_ylabel("live tensors' peak during the step (MiB)")
        for name, label in zip(names, labels):
            learn_ax.plot(configurations[name]["objective"], label=label)
        learn_ax.set_xlabel("step")
        learn_ax.set_ylabel("mean advantage × logprob (trained tokens)")
        learn_ax.legend(fontsize=7)
        for ax in (times_ax, memory_ax):
            ax.tick_params(axis="x", labelsize=7, rotation=15)
        fig.suptitle(f"GRPO step, {setup['layers']}L h{setup['hidden']} V{setup['vocab']}, {setup['rows']} sequences, "
                     f"{setup['device']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return write_results(out, f"step_{setup['device']}", "\n".join(lines) + "\n", summary, plot,
                         alt="step time by phase, peak memory and the learning check")


def setup_of(args: argparse.Namespace) -> Setup:
    return Setup(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, prompts=args.prompts,
                 generations=args.generations, prompt_tokens=tuple(args.prompt_tokens),
                 response_tokens=tuple(args.response_tokens), micro_batch_size=args.micro_batch_size,
                 dtype=args.dtype, kl_penalty=args.kl_penalty, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, fused_loss=args.fused_loss, lr=args.lr)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = Setup()
    parser = argparse.ArgumentParser(prog="megatron-grpo [torchrun options] bench step",
                                     description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=defaults.dtype,
                        help="the model's precision (bf16: fp32 master weights, forward under autocast; CUDA only)")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="attention heads")
    parser.add_argument("--vocab", type=int, default=defaults.vocab,
                        help="true vocabulary size (the model pads it as Megatron does)")
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="prompts per rollout")
    parser.add_argument("--generations", type=int, default=defaults.generations, help="responses per prompt")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(defaults.prompt_tokens), help="prompt lengths, uniform in [MIN, MAX]")
    parser.add_argument("--response-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(defaults.response_tokens), help="response lengths, uniform in [MIN, MAX]")
    parser.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size,
                        help="rows per padded microbatch (packed: that many rows' width in tokens)")
    parser.add_argument("--kl-penalty", type=float, default=defaults.kl_penalty,
                        help="the loss's reference_policy_kl_penalty, in every configuration (0: no KL, and the plan "
                             "skips the reference pass)")
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="the sampling temperature of the rollouts, which every configuration trains under")
    parser.add_argument("--top-k", type=int, default=defaults.top_k,
                        help="the rollouts' top-k filter, which every configuration trains (default: none)")
    parser.add_argument("--top-p", type=float, default=defaults.top_p,
                        help="the rollouts' top-p filter, likewise (default: none)")
    parser.add_argument("--no-fused-loss", dest="fused_loss", action="store_false",
                        help="configuration 3 recomputes the logits' chunks in backward instead of the loss-fused path")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam's learning rate")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration, run first")
    parser.add_argument("--sequential", action="store_true",
                        help="run the configurations one after the other, one model in memory at a time (for shapes "
                             "whose four models do not fit together), instead of interleaving their steps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    parser.add_argument("--verbose", action="store_true", help="show Megatron-Core's notices, filtered by default")
    return parser.parse_args(argv)
