"""Process groups and seeding: torch.distributed from the torchrun environment, then Megatron's TP/PP/DP groups.

NCCL with CUDA, gloo without it (and then the CPU support module). One timeout, `ParallelParams.timeout_seconds`,
reaches both the default group and every Megatron group, so a hung peer fails the job after that long.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_grpo.megatron.cpu_support import apply_cpu_support


@dataclass(frozen=True)
class ParallelParams:
    """The model-parallel sizes (DP = world / (TP * PP * CP)), the seed of every RNG, and the collectives' timeout.
    Defaults are Megatron-LM's (`--seed 1234`, `--distributed-timeout-minutes 10`, `--expert-model-parallel-size 1`,
    `--expert-tensor-parallel-size` = TP). Expert parallelism (EP) splits a Mixture-of-Experts model's experts over
    ranks (ETP × EP × PP must divide the world, Megatron's expert grid); the batch is still split over DP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1  # each sequence split over this many ranks (Megatron's zigzag of 2·CP chunks)
    expert_model_parallel_size: int = 1  # an MoE model's experts split over this many ranks, taken from DP × CP
    expert_tensor_parallel_size: int | None = None  # each expert's weights split over this many; None: the TP size
    seed: int = 1234
    timeout_seconds: float = 600.0  # a hung peer fails every collective after this long


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: global rank and world, and its TP/PP/DP/CP ranks and sizes (DP excludes CP: the CP
    ranks of a DP rank share its sequences)."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """Megatron's tensor-parallel group, or None without tensor parallelism."""
        return parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Megatron's data-parallel group, or None without data parallelism."""
        return parallel_state.get_data_parallel_group() if self.dp_size > 1 else None


def init_parallel(params: ParallelParams = ParallelParams()) -> ParallelLayout:
    """Initialises torch.distributed (unless a launcher already did) and Megatron's groups, then seeds all RNGs.

    Rank and world come from torchrun's RANK / WORLD_SIZE / LOCAL_RANK. DP = world / (TP * PP * CP). A size below 1,
    or a world size that is not a multiple of TP × PP × CP, is a ValueError naming the key.
    """
    sizes = {"tensor_model_parallel_size": params.tensor_model_parallel_size,
             "pipeline_model_parallel_size": params.pipeline_model_parallel_size,
             "context_parallel_size": params.context_parallel_size,
             "expert_model_parallel_size": params.expert_model_parallel_size}
    if params.expert_tensor_parallel_size is not None:
        sizes["expert_tensor_parallel_size"] = params.expert_tensor_parallel_size
    for key, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{key}: must be an integer >= 1, got {size!r}")
    on_cpu = apply_cpu_support()
    timeout = timedelta(seconds=params.timeout_seconds)
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(
            backend="gloo" if on_cpu else "nccl",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    tp, pp, cp = (params.tensor_model_parallel_size, params.pipeline_model_parallel_size,
                  params.context_parallel_size)
    world_size = dist.get_world_size()
    if world_size % (tp * pp * cp):
        raise ValueError(f"context_parallel_size: world size {world_size} is not a multiple of "
                         f"tensor_model_parallel_size ({tp}) × pipeline_model_parallel_size ({pp}) × "
                         f"context_parallel_size ({cp})" if cp > 1 else
                         f"world size {world_size} is not a multiple of tensor_model_parallel_size ({tp}) "
                         f"× pipeline_model_parallel_size ({pp})")
    ep, etp = params.expert_model_parallel_size, params.expert_tensor_parallel_size or tp
    if world_size % (etp * ep * pp):
        raise ValueError(f"expert_model_parallel_size: world size {world_size} is not a multiple of "
                         f"expert_tensor_parallel_size ({etp}) × expert_model_parallel_size ({ep}) × "
                         f"pipeline_model_parallel_size ({pp}) (Megatron's expert grid)")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=params.expert_tensor_parallel_size,
        distributed_timeout_minutes=params.timeout_seconds / 60,  # same keyword in 0.16 and 0.19
    )
    seed_all(params.seed, on_cpu)
    return current_layout()


def seed_all(seed: int, on_cpu: bool) -> None:
    """Seeds torch and Megatron's model-parallel RNG tracker (the inference tracker on CPU: see cpu_support)."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu)


def current_layout() -> ParallelLayout:
    """The layout of this process; needs init_parallel first."""
    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"),
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
    )


def destroy_parallel() -> None:
    """Tears down Megatron's groups and the default group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
