"""The model side of sampling under any TP × PP layout: the last position's logits, and the draws shared.

Each decoding step runs the whole batch through Megatron's forward-only schedule as one microbatch, so under
pipeline parallelism it passes through every stage; only the last stage has logits. That stage samples (its TP
ranks alike, from identically seeded generators), and `draws_from_last_stage` hands its tokens and their
logprobs to the other stages, so every rank extends the sequences with the same tokens. A Mixture-of-Experts
model's routes can be recorded as the loop reads each token (`routing_replay.RouteRecorder`), for replay in training.
"""

from __future__ import annotations

from typing import Iterator

import torch
from megatron.core import parallel_state

from megatron_grpo.megatron.forward import Batch, from_last_stage, model_forward, run_schedule
from megatron_grpo.megatron.routing_replay import RouteRecorder


def last_position_logits(model: torch.nn.Module, input_ids: torch.Tensor,
                         last_positions: torch.Tensor | None = None,
                         routes: RouteRecorder | None = None) -> torch.Tensor | None:
    """This TP rank's `[B, V_local]` logits of the last position of `input_ids` `[B, S]` (or, `last_positions`
    `[B]`, of row `b`'s position `last_positions[b]`: right-padded rows of different lengths, the padding after it
    unseen under causal attention) on the last pipeline stage (no gradient), None on the other stages.

    `routes`: the routers record their routes, and `routes` keeps those of the positions each row reads for the
    first time (up to its last position)."""

    def last_position(output_tensor: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        if last_positions is None:
            return output_tensor[:, -1, :]
        rows = torch.arange(output_tensor.shape[0], device=output_tensor.device)
        return output_tensor[rows, last_positions.to(output_tensor.device)]

    def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
        record = None
        if routes is not None:
            last = (last_positions if last_positions is not None
                    else torch.full((input_ids.shape[0],), input_ids.shape[1] - 1))
            record = routes.on_forward(last)
        return model_forward(model, next(data_iterator)["input_ids"], record=record), last_position

    with torch.no_grad():
        outputs = run_schedule(forward_step, model, [{"input_ids": input_ids}], forward_only=True)
    return outputs[0] if parallel_state.is_pipeline_last_stage() else None


def draws_from_last_stage(draws: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The last pipeline stage's `draws` (a CPU tensor; on the other stages any tensor of the same shape and
    dtype) on every stage, through `device` (NCCL broadcasts from the GPU)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return draws
    return from_last_stage(draws.to(device)).to("cpu")
