"""The model side of sampling under any TP × PP × CP layout: the last position's logits, and the draws shared.

Each decoding step runs the whole batch through Megatron's forward-only schedule as one microbatch, so under
pipeline parallelism it passes through every stage; only the last stage has logits. That stage samples (its TP
ranks alike, from identically seeded generators), and `draws_from_last_stage` hands its tokens and their
logprobs to the other stages, so every rank extends the sequences with the same tokens. Under context parallelism
every CP rank holds the whole sequences (as the train step's batches): each forward runs on the rank's zigzag share
of them, extended to a multiple of 2·CP, as training does, and the rank that holds a row's last position hands its
logits to the others (a sum over the CP group, the others adding zeros: exact). A Mixture-of-Experts model's routes
can be recorded as the loop reads each token (`routing_replay.RouteRecorder`), for replay in training (not under
context parallelism).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_grpo.loss.packing import POSITION_IDS
from megatron_grpo.megatron.context_parallel import (
    context_parallel_size,
    padded_for_context_parallel,
    split_for_context_parallel,
)
from megatron_grpo.megatron.forward import Batch, from_last_stage, model_forward, run_schedule
from megatron_grpo.megatron.routing_replay import RouteRecorder


def last_position_logits(model: torch.nn.Module, input_ids: torch.Tensor,
                         last_positions: torch.Tensor | None = None,
                         routes: RouteRecorder | None = None) -> torch.Tensor | None:
    """This TP rank's `[B, V_local]` logits of the last position of `input_ids` `[B, S]` (or, `last_positions`
    `[B]`, of row `b`'s position `last_positions[b]`: right-padded rows of different lengths, the padding after it
    unseen under causal attention) on the last pipeline stage (no gradient), None on the other stages.

    `routes`: the routers record their routes, and `routes` keeps those of the positions each row reads for the
    first time (up to its last position); not under context parallelism (a ValueError)."""
    rows, width = input_ids.shape
    if last_positions is None:
        last_positions = torch.full((rows,), width - 1, dtype=torch.int64)
    last_positions = last_positions.to(input_ids.device)
    context_parallel = context_parallel_size() > 1
    if context_parallel and routes is not None:
        raise ValueError("routes: recording an MoE model's routes while decoding under context parallelism is not "
                         "supported (each rank's forward sees its share of the positions)")
    shares: list[Batch] = []

    def last_position(output_tensor: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        if not context_parallel:
            return output_tensor[torch.arange(rows, device=output_tensor.device), last_positions]
        held = shares[0][POSITION_IDS] == last_positions[:, None]  # [B, S / CP]: the row's last position, if here
        local = output_tensor[torch.arange(rows, device=output_tensor.device), held.int().argmax(dim=1)]
        logits = torch.where(held.any(dim=1, keepdim=True), local, torch.zeros_like(local))
        dist.all_reduce(logits, group=parallel_state.get_context_parallel_group())
        return logits

    def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
        batch = next(data_iterator)
        if not context_parallel:
            record = None if routes is None else routes.on_forward(last_positions)
            return model_forward(model, batch["input_ids"], record=record), last_position
        shares.append(split_for_context_parallel(batch))
        return model_forward(model, shares[0]["input_ids"], position_ids=shares[0][POSITION_IDS]), last_position

    with torch.no_grad():
        outputs = run_schedule(forward_step, model, [padded_for_context_parallel({"input_ids": input_ids})],
                               forward_only=True)
    return outputs[0] if parallel_state.is_pipeline_last_stage() else None


def draws_from_last_stage(draws: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The last pipeline stage's `draws` (a CPU tensor; on the other stages any tensor of the same shape and
    dtype) on every stage, through `device` (NCCL broadcasts from the GPU)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return draws
    return from_last_stage(draws.to(device)).to("cpu")
