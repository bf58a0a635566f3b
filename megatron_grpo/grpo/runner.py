"""`python -m megatron_grpo train --config X.yaml [--resume]`: the GRPO job, launched by torchrun.

Everything that can be checked without peers is checked before any process group or model exists: the
config (a `ConfigError` naming each bad key), then the logprob plan and the runner's own limits, CUDA for
bf16 among them (one `ConfigError` listing the problems of both), and, on `--resume`, that a complete
checkpoint exists. Afterwards a failed collective means a peer died or hung; the survivor
says so, names the rank(s) it lost contact with, and exits non-zero instead of hanging.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.config import Config, ConfigError, load_config
from megatron_grpo.grpo.checkpoint_dir import CheckpointError, latest_checkpoint
from megatron_grpo.grpo.tasks import DigitTask, DigitTokenizer
from megatron_grpo.scheduler import LogprobPlan, plan_logprob_passes

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# gloo reports a dead or hung peer as a plain RuntimeError; these are its messages for it (NCCL raises DistError)
PEER_FAILURE_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Read error", "Timed out waiting")
# Megatron-Core's import-time notices about CUDA-only packages and settings: expected, and only noise, on the CPU
CPU_NOISE_WARNINGS = (r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed", r"full scope is deprecated",
                      r"When using async grad allreduce")


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_config(args.config)
        _require_torchrun()
        plan = checked_plan(cfg, world_size=int(os.environ["WORLD_SIZE"]), cuda_available=torch.cuda.is_available())
        resume_from = latest_checkpoint(Path(cfg.checkpoint.dir)) if args.resume else None
    except (ConfigError, CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT

    _quiet_cpu_notices()
    from megatron_grpo.grpo.loop import train  # imports megatron.core: only once the input is known to be good
    from megatron_grpo.megatron import destroy_parallel, init_parallel

    layout = init_parallel(cfg)
    try:
        train(cfg, plan, layout, resume_from=resume_from)
    except CheckpointError as err:  # a corrupt checkpoint shows only once there is a model to load it into
        print(f"error: rank {layout.rank}: {err}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except RuntimeError as err:
        if not is_peer_failure(err):
            raise
        print(_lost_peer_message(layout.rank, layout.world_size, err), file=sys.stderr, flush=True)
        return EXIT_FAILED
    destroy_parallel()
    return 0


def checked_plan(cfg: Config, *, world_size: int, cuda_available: bool) -> LogprobPlan:
    """The logprob plan of `cfg`, once the plan's and the runner's checks both pass; else one ConfigError with
    every problem of both."""
    problems = []
    plan = None
    try:
        plan = plan_logprob_passes(cfg)
    except ConfigError as err:
        problems.extend(err.problems)
    problems.extend(runner_config_problems(cfg, world_size=world_size, cuda_available=cuda_available))
    if problems:
        raise ConfigError(problems)
    return plan


def runner_config_problems(cfg: Config, *, world_size: int, cuda_available: bool) -> list[str]:
    """Settings the config accepts in general but this runner cannot run on `world_size` ranks (with or without
    CUDA), each naming its key."""
    problems = []
    if cfg.policy.precision != "fp32" and not cuda_available:
        problems.append(f"policy.precision: {cfg.policy.precision} needs CUDA, which is not available here; "
                        "use fp32 on the CPU")
    model_parallel = cfg.policy.tensor_model_parallel_size * cfg.policy.pipeline_model_parallel_size
    if world_size % model_parallel:
        problems.append(f"policy.tensor_model_parallel_size: {world_size} ranks do not split into groups of "
                        f"tensor × pipeline parallel size {model_parallel}")
    elif cfg.grpo.num_prompts_per_step % (world_size // model_parallel):
        problems.append(f"grpo.num_prompts_per_step ({cfg.grpo.num_prompts_per_step}) must be a multiple of the "
                        f"data-parallel size ({world_size // model_parallel}): each DP rank samples whole groups")
    if cfg.policy.pipeline_model_parallel_size != 1:
        problems.append("policy.pipeline_model_parallel_size: the GRPO runner's rollouts need the whole model on "
                        f"each rank; use 1, got {cfg.policy.pipeline_model_parallel_size}")
    if cfg.grpo.seq_logprob_error_threshold is not None:
        problems.append("grpo.seq_logprob_error_threshold: sequence masking by logprob error is not implemented "
                        "in the GRPO runner; use null")
    if cfg.loss_fn.use_kl_in_reward:
        problems.append("loss_fn.use_kl_in_reward: KL-shaped rewards are not implemented in the GRPO runner; "
                        "use false (the KL penalty in the loss works)")
    if cfg.grpo.num_generations_per_prompt < 2:
        problems.append("grpo.num_generations_per_prompt: a group-relative baseline needs >= 2 samples per "
                        f"prompt, got {cfg.grpo.num_generations_per_prompt}")
    task = DigitTask(cfg.task.name, cfg.task.num_digits, DigitTokenizer())
    longest = task.prompt_length + cfg.generation.max_new_tokens
    if cfg.policy.model.max_position_embeddings < longest:
        problems.append(f"policy.model.max_position_embeddings: a prompt ({task.prompt_length} tokens) plus "
                        f"generation.max_new_tokens ({cfg.generation.max_new_tokens}) needs {longest}, got "
                        f"{cfg.policy.model.max_position_embeddings}")
    return problems


def is_peer_failure(err: BaseException) -> bool:
    """Whether a collective failed because another rank died or stopped answering."""
    return isinstance(err, dist.DistError) or any(message in str(err) for message in PEER_FAILURE_MESSAGES)


def _quiet_cpu_notices() -> None:
    if not torch.cuda.is_available():
        for pattern in CPU_NOISE_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)


def _require_torchrun() -> None:
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise OSError(f"{', '.join(missing)} not set: launch with `torchrun --nproc-per-node N -m megatron_grpo "
                      "train --config X.yaml`")


def _lost_peer_message(rank: int, world_size: int, err: Exception) -> str:
    peers = [r for r in range(world_size) if r != rank]
    who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {', '.join(map(str, peers))}"
    return (f"error: rank {rank}: lost contact with {who}: a collective failed because that rank died, or hung for "
            "longer than distributed.timeout_seconds. The last checkpoint is still loadable with --resume.\n"
            f"  cause: {type(err).__name__}: {err}")


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_tiny_cpu.yaml")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in checkpoint.dir")
    return parser.parse_args(argv)
