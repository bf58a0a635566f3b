"""The GRPO loop: rollout, reward, group advantages, one planned `train_step`, report, checkpoint.

Rollouts come from a `RolloutQueue`: from the current weights when `grpo.max_rollout_staleness` is 0, else from
weights up to that many steps older, as an asynchronous system would deliver them. One loop serves both cases.
Every random draw of a step comes from generators keyed by `(seed, step)`, and a prompt's samples by its global
index too, never by rank: every layout of the same ranks draws the same prompts and tokens. Each DP rank samples
and trains on its share of whole prompt groups; the metrics are aggregated over all ranks. Together with a
bit-exact checkpoint of model, optimizer and the rollouts in flight, this makes a resumed run repeat the
uninterrupted run's metrics exactly (fp32 on the CPU).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_grpo.loss import ClippedPGLoss
from megatron_grpo.megatron import (
    Optimizer,
    ParallelLayout,
    RouteRecorder,
    StepConfig,
    build_gpt_model,
    build_optimizer,
    draws_from_last_stage,
    last_position_logits,
    load_model_weights,
    train_step,
    uses_distributed_optimizer,
    vocab_shard_of,
    wrap_in_ddp,
)
from megatron_grpo.ops import VocabShard
from megatron_grpo.runner.advantages import group_relative_advantages
from megatron_grpo.runner.checkpoint import load_checkpoint, save_checkpoint
from megatron_grpo.runner.config import Config
from megatron_grpo.runner.plugin_params import adam_params, model_params, step_config
from megatron_grpo.runner.reporting import Reporter, is_collapsed
from megatron_grpo.runner.rollout import Rollout, SamplingParams, generate
from megatron_grpo.runner.rollout_queue import RolloutQueue
from megatron_grpo.runner.shaping import PrevLogprobShaping
from megatron_grpo.runner.statistics import rollout_statistics
from megatron_grpo.runner.tasks import DigitTask, DigitTokenizer, answer_reward
from megatron_grpo.runner.tensorboard_log import MetricWriters
from megatron_grpo.scheduler import LogprobPlan
from megatron_grpo.timing import StepTimer

PROMPT_STREAM, SAMPLING_STREAM = 0, 1


def step_generator(seed: int, step: int, stream: int, prompt: int = 0) -> torch.Generator:
    """A CPU generator private to (seed, step, stream, global prompt index): no state carries from one step to
    the next, and none depends on the layout.

    The key is taken modulo 2**64, the range `manual_seed` accepts, so every seed in [0, 2**63 - 1] works.
    """
    key = ((seed * 1_000_003 + step) * 4 + stream) * 65_537 + prompt
    return torch.Generator().manual_seed(key % 2**64)


@dataclass
class Trainer:
    """The models, optimizer and task of one run, and the plan every step follows."""

    cfg: Config
    plan: LogprobPlan
    layout: ParallelLayout
    task: DigitTask
    model: torch.nn.Module
    vocab: VocabShard  # the model's vocab shard, the task's tokens real and the rest padding
    reference_model: Optional[torch.nn.Module]
    optimizer: Optimizer
    loss_fn: ClippedPGLoss
    rollouts: RolloutQueue = field(init=False)
    step_config: StepConfig = field(init=False)

    def __post_init__(self) -> None:
        self.rollouts = RolloutQueue(self._timed_rollout, self.cfg.grpo.max_rollout_staleness)
        self.step_config = step_config(self.cfg)  # its distribution is the sampler's too

    @classmethod
    def build(cls, cfg: Config, plan: LogprobPlan, layout: ParallelLayout) -> Trainer:
        tokenizer = DigitTokenizer()
        model = build_gpt_model(model_params(cfg), tokenizer.vocab_size)
        if cfg.policy.initial_checkpoint is not None:  # also when resuming: the reference model copies it
            load_model_weights(model, cfg.policy.initial_checkpoint, true_vocab_size=tokenizer.vocab_size)
        reference_model = None
        if plan.build_reference_model:  # a frozen copy of the initial policy
            reference_model = build_gpt_model(model_params(cfg), tokenizer.vocab_size)
            reference_model.load_state_dict(model.state_dict())
            reference_model.requires_grad_(False)
        model = wrap_in_ddp(model, use_distributed_optimizer=uses_distributed_optimizer())
        return cls(
            cfg=cfg,
            plan=plan,
            layout=layout,
            task=DigitTask(cfg.task.name, cfg.task.num_digits, tokenizer, min_digits=cfg.task.min_digits),
            model=model,
            vocab=vocab_shard_of(model, tokenizer.vocab_size),
            reference_model=reference_model,
            optimizer=build_optimizer(model, adam_params(cfg)),
            loss_fn=ClippedPGLoss(cfg.loss_fn),
        )

    def resume(self, step_dir: Path) -> int:
        """Loads a checkpoint; returns the number of steps it had done. The reference model is the initial policy,
        rebuilt from the seed or policy.initial_checkpoint, so it is not saved."""
        return load_checkpoint(step_dir, model=self.model, optimizer=self.optimizer, rank=self.layout.rank,
                               world_size=self.layout.world_size, verify=self.cfg.checkpoint.verify_checksums,
                               rollouts=self.rollouts)

    def save(self, steps_done: int) -> None:
        save_checkpoint(Path(self.cfg.checkpoint.dir), steps_done=steps_done, model=self.model,
                        optimizer=self.optimizer, rank=self.layout.rank, world_size=self.layout.world_size,
                        barrier=dist.barrier, rollouts=self.rollouts)

    def rollout(self, step: int) -> tuple[Rollout, torch.Tensor]:
        """This DP rank's prompts, each sampled `num_generations_per_prompt` times, and the samples' rewards."""
        grpo, layout = self.cfg.grpo, self.layout
        batch = self.task.sample(grpo.num_prompts_per_step, step_generator(self.cfg.seed, step, PROMPT_STREAM))
        per_rank = grpo.num_prompts_per_step // layout.dp_size
        mine = range(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)  # global prompt indices
        prompts = batch.prompts[mine.start:mine.stop].repeat_interleave(grpo.num_generations_per_prompt, dim=0)
        answers = batch.answers[mine.start:mine.stop].repeat_interleave(grpo.num_generations_per_prompt, dim=0)
        answer_lengths = batch.answer_lengths[mine.start:mine.stop].repeat_interleave(
            grpo.num_generations_per_prompt, dim=0)
        prompt_lengths = batch.prompt_lengths[mine.start:mine.stop].repeat_interleave(
            grpo.num_generations_per_prompt, dim=0)
        tokenizer = self.task.tokenizer
        params = SamplingParams(
            max_new_tokens=self.cfg.generation.max_new_tokens,
            distribution=self.step_config.distribution,  # the policy the train step trains
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        )
        # R3: the routes each token is given as the sampler reads it, replayed by the train step
        routes = (RouteRecorder(self.model, prompts.shape[0], prompts.shape[1] + params.max_new_tokens)
                  if self.cfg.policy.router_replay.enabled else None)
        self.model.eval()
        try:
            rollout = generate(
                lambda input_ids, last_positions=None: last_position_logits(
                    self.model, input_ids.to(layout.device), last_positions, routes=routes),
                prompts,
                params,
                true_vocab_size=tokenizer.vocab_size,
                generators=[step_generator(self.cfg.seed, step, SAMPLING_STREAM, prompt) for prompt in mine],
                tp_group=layout.tp_group,
                share_draws=lambda draws: draws_from_last_stage(draws, layout.device),
                prompt_lengths=prompt_lengths if self.task.ragged else None,
            )
        finally:
            self.model.train()
        if routes is not None:
            rollout = dataclasses.replace(rollout, routed_experts=routes.routes(rollout.input_ids.shape[1],
                                                                                layout.device))
        return rollout, answer_reward(rollout.responses, answers, answer_lengths)

    def _timed_rollout(self, step: int) -> tuple[Rollout, torch.Tensor, float]:
        started = time.perf_counter()
        rollout, rewards = self.rollout(step)
        return rollout, rewards, time.perf_counter() - started

    def step(self, step: int) -> dict[str, Any]:
        """One GRPO step; returns its metrics record (identical on every rank)."""
        started = time.perf_counter()
        timer = StepTimer()
        queued = self.rollouts.take(step)  # generated now, or up to grpo.max_rollout_staleness steps ago
        rollout, rewards = queued.rollout, queued.rewards
        rollout_done = time.perf_counter()
        group_size = self.cfg.grpo.num_generations_per_prompt
        advantages = group_relative_advantages(
            rewards,
            group_size,
            normalize_by_std=self.cfg.grpo.normalize_rewards_by_std,
            leave_one_out=self.cfg.grpo.leave_one_out_baseline,
        )
        batch = {
            "input_ids": rollout.input_ids,
            "token_mask": rollout.token_mask,
            "sample_mask": torch.ones(rollout.input_ids.shape[0]),
            "advantages": advantages.advantages,
            "generation_logprobs": rollout.generation_logprobs,
            "rewards": rewards.to(torch.float32),  # VAPO's positive-example NLL reads them
            # the weights that generated each sample (AReaL's approximation of prev reads it)
            "rollout_weight_version": torch.full((rollout.input_ids.shape[0],), queued.weight_version,
                                                 dtype=torch.int64),
        }
        if rollout.routed_experts is not None:  # R3: the prev pass and the training forward replay them
            batch["routed_experts"] = rollout.routed_experts
        if rollout.kept_set is not None:  # the sampler's kept sets: replayed (generation.replay_kept_set), and logged
            batch.update(kept_set_offsets=rollout.kept_set_offsets, kept_set_ids=rollout.kept_set_ids)
        device_batch = {key: value.to(self.layout.device) for key, value in batch.items()}
        shaping = None
        if PrevLogprobShaping.needed(self.cfg):  # reads prev logprobs after their pass, before the loss
            dp_group = self.layout.dp_group
            shaping = PrevLogprobShaping(self.cfg, rewards, dp_group)
        result = train_step(self.step_config, self.model, self.optimizer, self.loss_fn, self.plan, device_batch,
                            vocab=self.vocab, reference_model=self.reference_model, prepare_batch=shaping, timer=timer,
                            prev_version=step)  # the weights have done `step` steps
        finished = time.perf_counter()
        record = {
            "step": step,
            **self._reward_metrics(rewards, rollout, advantages.groups_without_variance),
            **rollout_statistics(rewards, advantages.advantages, rollout.token_mask, rollout.responses,
                                 self.task.tokenizer.eos_id,
                                 group=self.layout.dp_group, device=self.layout.device),
            **mean_over_optimizer_steps(result.step_metrics),
            **result.routing_metrics,
            **(shaping.metrics if shaping is not None else {}),
            **self._pass_metrics(step, result.passes_run),
            **self._kept_set_metrics(rollout),
            "sample": self.task.tokenizer.decode(rollout.input_ids[0].tolist()),
            "rollout_weight_version": queued.weight_version,
            "rollout_age": queued.age,
            **timer.times(),
            "rollout_time_s": rollout_done - started,
            "train_time_s": finished - rollout_done,
            "step_time_s": finished - started,
        }
        record["collapsed"] = is_collapsed(record["groups_without_variance"], record["num_groups"],
                                           record["reward_mean"])
        return record

    def _reward_metrics(self, rewards: torch.Tensor, rollout: Rollout, no_variance: int) -> dict[str, Any]:
        """Reward statistics over all DP ranks (the TP ranks of a DP rank hold the same rollout). The totals are
        reduced on the layout's device: the DP group is NCCL on GPUs."""
        response_lengths = rollout.token_mask.sum(dim=1)
        totals = torch.tensor([rewards.double().sum(), rewards.numel(), float(no_variance), response_lengths.sum(),
                               float((rewards == 1.0).sum())], dtype=torch.float64).to(self.layout.device)
        if self.layout.dp_size > 1:
            dist.all_reduce(totals, group=self.layout.dp_group)
        reward_sum, count, groups_without_variance, length_sum, perfect = totals.tolist()
        return {
            "reward_mean": reward_sum / count,
            "perfect_fraction": perfect / count,
            "response_length_mean": length_sum / count,
            "groups_without_variance": int(groups_without_variance),
            "num_groups": self.cfg.grpo.num_prompts_per_step,
        }

    def _kept_set_metrics(self, rollout: Rollout) -> dict[str, Any]:
        """`rollout_kept_set_size`: the sampler's kept ids per response token, over all DP ranks (8 bytes each in the
        batch, with 8 per token of offsets), where the distribution is filtered."""
        if rollout.kept_set is None:
            return {}
        totals = torch.tensor([float(rollout.kept_set_ids.numel()), float(rollout.token_mask.sum())],
                              dtype=torch.float64).to(self.layout.device)
        if self.layout.dp_size > 1:
            dist.all_reduce(totals, group=self.layout.dp_group)
        ids, tokens = totals.tolist()
        return {"rollout_kept_set_size": ids / max(tokens, 1.0)}

    def _pass_metrics(self, step: int, passes_run: dict[str, int]) -> dict[str, Any]:
        """Which optional logprob passes ran this step, and how many were skipped since step 0."""
        return {
            "reference_pass_ran": "reference" in passes_run,
            "prev_pass_ran": "prev" in passes_run,
            "reference_passes_skipped": (step + 1) * int(not self.plan.compute_reference_logprobs),
            "prev_passes_skipped": (step + 1) * int(not self.plan.compute_prev_logprobs),
        }


def mean_over_optimizer_steps(step_metrics: list[dict[str, float]]) -> dict[str, float]:
    """The train step's metrics (loss, ratios, mismatch, grad_norm; prev backfilled from curr when its pass was
    skipped), averaged over the optimizer steps of one rollout: one step when on-policy."""
    return {name: sum(m[name] for m in step_metrics) / len(step_metrics) for name in step_metrics[0]}


def train(cfg: Config, plan: LogprobPlan, layout: ParallelLayout, *, resume_from: Optional[Path],
          on_step: Optional[Callable[[int], None]] = None) -> str:
    """Runs steps until `grpo.max_num_steps`, from scratch or from `resume_from`; returns the summary table.
    `on_step(step)` is told each step (0-based) as it begins."""
    trainer = Trainer.build(cfg, plan, layout)
    first_step = trainer.resume(resume_from) if resume_from is not None else 0
    if layout.rank == 0:
        print("\n".join(["logprob plan:", *(f"  - {reason}" for reason in plan.reasons)]), flush=True)
    reporter = Reporter(
        Path(cfg.run_dir),
        first_step=first_step,
        total_steps=cfg.grpo.max_num_steps,
        enabled=layout.rank == 0,
        progress_bar=cfg.logging.progress_bar,
    )
    writers = MetricWriters.from_config(cfg.logging, Path(cfg.run_dir), enabled=layout.rank == 0,
                                        first_step=first_step)
    every = cfg.checkpoint.every_n_steps
    try:
        for step in range(first_step, cfg.grpo.max_num_steps):
            if on_step is not None:
                on_step(step)
            record = trainer.step(step)
            steps_done = step + 1
            if every and (steps_done % every == 0 or steps_done == cfg.grpo.max_num_steps):
                started = time.perf_counter()
                trainer.save(steps_done)
                record["checkpoint_time_s"] = time.perf_counter() - started
                record["step_time_s"] += record["checkpoint_time_s"]
            reporter.log_step(record)
            writers.write(record)
    finally:
        writers.close()
    return reporter.finish()
