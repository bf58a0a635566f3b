"""The model's forward, and Megatron's pipeline schedule that drives it, for training, logprob passes and sampling.

`run_schedule` is the one call of `get_forward_backward_func()` (no pipelining, or the 1F1B pipeline, as
parallel_state says); only the last pipeline stage computes outputs, and `from_last_stage` hands them to the
other stages.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_grpo.megatron.hidden_states import without_output_layer

Batch = Mapping[str, torch.Tensor]
ForwardStep = Callable[[Iterator[Batch], torch.nn.Module], tuple[torch.Tensor, Callable]]


def model_forward(model: torch.nn.Module, input_ids: torch.Tensor, *, hidden_states: bool = False,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """GPTModel forward over positions 0..S-1 with an explicit causal mask (True = masked out).

    Passing the mask keeps it on the batch's device: Megatron's default causal mask is built on "cuda".
    `hidden_states`: the last stage returns the `[b, s, h]` final hidden states (after the final norm) instead
    of the logits, their gradient all-reduced over TP as the output layer's input is
    (`hidden_states.without_output_layer`).
    `position_ids`: a context-parallel rank's share (`context_parallel.split_for_context_parallel`): its tokens'
    global positions, and no mask (Transformer Engine's attention applies the causal mask across the CP ranks).
    """
    mask = None
    if position_ids is None:
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=input_ids.device).triu(diagonal=1)[None, None]
    with without_output_layer(model) if hidden_states else nullcontext():
        return model(input_ids, position_ids, attention_mask=mask)


def run_schedule(forward_step: ForwardStep, model: torch.nn.Module, microbatches: list[Batch],
                 *, forward_only: bool) -> list:
    """One call of Megatron's forward/backward schedule; returns what the last stage's loss_func produced.

    Megatron-Core 0.16 and 0.19 take these keywords; `get_forward_backward_func()` without arguments reads the
    pipeline layout from parallel_state in both.
    """
    batch_size, seq_length = microbatches[0]["input_ids"].shape
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=batch_size,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """With pipeline parallelism, only the last stage computes losses and logprobs: broadcast them."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return tensor


def metrics_from_last_stage(metrics: dict[str, float]) -> dict[str, float]:
    """The loss's metrics, which only the last pipeline stage computes, on every stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics]
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return box[0]
