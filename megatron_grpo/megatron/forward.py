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

from megatron_grpo.loss.packing import CU_SEQLENS, POSITION_IDS, SequenceLayout
from megatron_grpo.megatron.attention import takes_packed_sequences
from megatron_grpo.megatron.ddp import unwrapped
from megatron_grpo.megatron.hidden_states import without_output_layer
from megatron_grpo.megatron.routing_replay import (
    MOE_PADDING_MASK,
    ROUTED_EXPERTS,
    ROUTES_COUNTED,
    OnRoutes,
    RouteChanges,
    forward_routing,
    moe_layers,
    placeholder_routes,
)

Batch = Mapping[str, torch.Tensor]
ForwardStep = Callable[[Iterator[Batch], torch.nn.Module], tuple[torch.Tensor, Callable]]


def model_forward(model: torch.nn.Module, input_ids: torch.Tensor, *, hidden_states: bool = False,
                  cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  routes: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                  record: OnRoutes | None = None, changes: RouteChanges | None = None,
                  counted: torch.Tensor | None = None) -> torch.Tensor:
    """GPTModel forward over `[B, S]` rows, causal over positions 0..S-1; or over a packed row `[1, T]` of sequences
    cut by `cu_seqlens` (int32 `[N + 1]`, `loss.packing`), each attending only to itself;
    or over a context-parallel rank's share of either (`context_parallel.split_for_context_parallel`'s, with its
    `position_ids`: each token's position in its sequence, required).

    Packed batches go through Megatron's THD path, `PackedSeqParams(qkv_format="thd")` of the whole sequences (under
    CP `CP ×` the share's `cu_seqlens`), which the model's core attention must take
    (`attention.takes_packed_sequences`: `TorchDotProductAttention` or Transformer Engine's; else a ValueError naming
    `cu_seqlens`); RoPE then restarts in every sequence, and learned absolute positions read `position_ids`
    (default: restarting at 0 in every sequence; a packed batch's own, `loss.packing.pack_rows`, are 0 on padding).
    Padded rows: that attention is causal without a mask; Megatron's local `DotProductAttention` gets an explicit
    causal mask (True = masked out), on the batch's device (its default one is built on "cuda"). A CP share takes no
    mask: the attention is causal across the ranks. A model without attention (`takes_packed_sequences` None) gets
    neither.
    `hidden_states`: the last stage returns the `[b, s, h]` final hidden states (after the final norm) instead
    of the logits, their gradient all-reduced over TP as the output layer's input is
    (`hidden_states.without_output_layer`).

    Mixture-of-Experts models (`routing_replay`): `routes` `[b, s, L, k]` are replayed, `record` is handed the
    routes the routers chose, `changes` collects which of the `counted` `[b, s]` tokens replay changed;
    `padding_mask` `[b, s]` (True: padding, the model's `padding_mask`) leaves tokens out of the auxiliary losses.
    Under sequence parallelism (without CP) a sequence whose length is no multiple of TP is padded at its end for
    the forward (later positions, which no earlier one attends to; its routes `0 .. k-1`, padding for the auxiliary
    losses) and the output cut back.
    """
    seq_len = input_ids.shape[1]
    context_parallel = parallel_state.get_context_parallel_world_size() > 1
    if context_parallel and position_ids is None:
        raise ValueError("position_ids: under context parallelism the model takes a rank's share of the batch "
                         "with its tokens' positions (split_for_context_parallel's)")
    share = position_ids is not None and (cu_seqlens is None or context_parallel)  # a context-parallel share
    layers = moe_layers(model)
    pad = sequence_parallel_padding(model, seq_len)
    if pad:
        input_ids, cu_seqlens, position_ids, routes, padding_mask = _padded_for_sequence_parallel(
            input_ids, pad, cu_seqlens, position_ids, routes, padding_mask, layers)
        if counted is not None:
            counted = torch.nn.functional.pad(counted, (0, pad), value=False)
    extra = {}
    if layers is not None and padding_mask is not None:
        extra["padding_mask"] = _padding_mask_of_stage(padding_mask, unwrapped(model).config)
    causal_mask = None
    if share:
        if cu_seqlens is not None and _packed_attention(model, cu_seqlens):
            extra["packed_seq_params"] = _context_parallel_thd_params(cu_seqlens)
    else:
        causal_mask, position_ids = _attention_inputs(model, input_ids, cu_seqlens, position_ids, extra)
        if pad:  # the padding's positions 0, as packing's: none beyond the model's position embeddings
            position_ids = torch.nn.functional.pad(position_ids[:, :seq_len], (0, pad))
    if record is not None and pad:
        record = _cut_recorded(record, seq_len)
    with forward_routing(model, input_ids.shape[0], routes=routes, record=record, changes=changes, counted=counted):
        with without_output_layer(model) if hidden_states else nullcontext():
            output = model(input_ids, position_ids,
                           attention_mask=None if causal_mask is None else causal_mask[None, None], **extra)
    if pad and getattr(unwrapped(model), "post_process", True):
        output = output[:, :seq_len].contiguous()
    return output


def _attention_inputs(model: torch.nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                      position_ids: torch.Tensor | None, extra: dict) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The causal mask `[S, S]` (True = masked out; only for an attention that is not causal by itself, Megatron's
    local `DotProductAttention`, on the batch's device: its default one is built on "cuda") and the positions of a
    padded batch or a packed row; a packed row's THD `packed_seq_params` go into `extra`."""
    seq_len = input_ids.shape[1]
    if cu_seqlens is None:
        causal_mask = None
        if not takes_packed_sequences(model):  # Megatron's DotProductAttention (or no attention at all)
            causal_mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=input_ids.device).triu(diagonal=1)
        return causal_mask, torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    if input_ids.shape[0] != 1:
        raise ValueError(f"batch['input_ids']: a packed batch (with cu_seqlens) is [1, T], got "
                         f"{list(input_ids.shape)}")
    layout = SequenceLayout.packed(cu_seqlens, seq_len)
    if position_ids is None:
        position_ids = layout.positions
    if _packed_attention(model, cu_seqlens):
        extra["packed_seq_params"] = _thd_params(cu_seqlens, layout.max_seqlen)
    return None, position_ids


def sequence_parallel_padding(model: torch.nn.Module, seq_len: int) -> int:
    """How many positions a forward of `seq_len` tokens is padded by: under sequence parallelism (without context
    parallelism, whose split fixes the length) up to a multiple of TP, which Megatron's sequence split needs."""
    config = getattr(unwrapped(model), "config", None)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not getattr(config, "sequence_parallel", False) or tp == 1 or seq_len % tp == 0:
        return 0
    if parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError(f"batch['input_ids']: under sequence and context parallelism each rank's share of a sequence "
                         f"must be a multiple of TP ({tp}) long, got {seq_len} (pad the sequences to a multiple of "
                         "2·CP·TP)")
    return tp - seq_len % tp


def _padded_for_sequence_parallel(input_ids, pad, cu_seqlens, position_ids, routes, padding_mask, layers):
    """The forward's inputs with `pad` positions after the last: token 0 at position 0, the last packed sequence
    extended over them, routes `0 .. k-1` and (MoE) marked as padding."""
    input_ids = torch.nn.functional.pad(input_ids, (0, pad))
    if cu_seqlens is not None:
        cu_seqlens = torch.cat([cu_seqlens[:-1], cu_seqlens[-1:] + pad])
    if position_ids is not None:
        position_ids = torch.nn.functional.pad(position_ids, (0, pad))
    if routes is not None:
        filler = placeholder_routes((routes.shape[0], pad, routes.shape[2]), routes.shape[3], routes.device)
        routes = torch.cat([routes.to(torch.int64), filler], dim=1)
    if layers is not None:
        if padding_mask is None:
            padding_mask = torch.zeros(input_ids.shape[0], input_ids.shape[1] - pad, dtype=torch.bool,
                                       device=input_ids.device)
        padding_mask = torch.nn.functional.pad(padding_mask, (0, pad), value=True)
    return input_ids, cu_seqlens, position_ids, routes, padding_mask


def _padding_mask_of_stage(padding_mask: torch.Tensor, config) -> torch.Tensor:
    """The `padding_mask` a pipeline stage's GPTModel takes. Megatron-Core's GPTModel scatters it over TP for
    sequence parallelism on the first stage only (0.16.1 gpt_model.py:306-321, 0.19.2 :339-360); a later stage must be
    handed this TP rank's slice of the sequence itself, or its routers see the whole mask (a shape error)."""
    if not config.sequence_parallel or parallel_state.is_pipeline_first_stage():
        return padding_mask
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return padding_mask.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()].contiguous()


def _cut_recorded(record: OnRoutes, seq_len: int) -> OnRoutes:
    def cut(routes: dict[int, torch.Tensor]) -> None:
        record({layer: layer_routes[:, :seq_len] for layer, layer_routes in routes.items()})

    return cut


def batch_forward(model: torch.nn.Module, batch: Batch, *, hidden_states: bool = False,
                  changes: RouteChanges | None = None) -> torch.Tensor:
    """`model_forward` of a batch: padded, packed (`batch['cu_seqlens']`, with its `position_ids`), or a
    context-parallel rank's share of either (CP > 1: `split_for_context_parallel`'s, with its `position_ids`); an MoE
    model replays the batch's `routed_experts` and leaves its `moe_padding_mask` out of the auxiliary losses."""
    packed = CU_SEQLENS in batch
    positions = packed or parallel_state.get_context_parallel_world_size() > 1
    return model_forward(model, batch["input_ids"], hidden_states=hidden_states, cu_seqlens=batch.get(CU_SEQLENS),
                         position_ids=batch.get(POSITION_IDS) if positions else None,
                         routes=batch.get(ROUTED_EXPERTS), padding_mask=batch.get(MOE_PADDING_MASK), changes=changes,
                         counted=batch.get(ROUTES_COUNTED))


def _packed_attention(model: torch.nn.Module, cu_seqlens: torch.Tensor) -> bool:
    """Whether the packed batch goes to the model's attention as THD `PackedSeqParams`: yes where it takes them, no
    for a model without attention; a model whose attention cannot take them is a ValueError (its dense alternative,
    one [T, T] attention under a block-diagonal mask, is kept only as the tests' reference)."""
    takes = takes_packed_sequences(model)
    if takes is False:
        names = sorted({type(module.core_attention).__name__ for module in model.modules()
                        if hasattr(module, "core_attention")})
        raise ValueError(f"cu_seqlens: this model's core attention ({', '.join(names)}) takes no packed (THD) "
                         "sequences; build its layers with megatron_grpo.megatron.torch_attention_layer_spec() "
                         "(or Transformer Engine's spec), or pass padded rows")
    return bool(takes)


def _thd_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """Megatron's `PackedSeqParams` for THD attention over sequences that span `cu_seqlens` (their padding, if
    any, is untrained and sits at each sequence's end, where causal attention never lets a real token see it).
    `max_seqlen` is the longest whole sequence (RoPE's table length; varlen_attn's bound)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def _context_parallel_thd_params(local_cu_seqlens: torch.Tensor):
    """`PackedSeqParams` for a context-parallel rank's share of a packed batch, as Megatron's
    `get_thd_batch_on_this_cp_rank` builds them: the whole (padded) sequences' `cu_seqlens`, `CP ×` the share's;
    the attention works out each rank's chunks itself."""
    size = parallel_state.get_context_parallel_world_size()
    cu_seqlens = local_cu_seqlens * size
    return _thd_params(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))


def run_schedule(forward_step: ForwardStep, model: torch.nn.Module, microbatches: list[Batch],
                 *, forward_only: bool) -> list:
    """One call of Megatron's forward/backward schedule; returns what the last stage's loss_func produced.

    Megatron-Core 0.16 and 0.19 take these keywords; `get_forward_backward_func()` without arguments reads the
    pipeline layout from parallel_state in both.
    """
    batch_size, seq_length = microbatches[0]["input_ids"].shape  # packed microbatches: 1 and T (one T for PP)
    seq_length += sequence_parallel_padding(model, seq_length)  # the length the stages exchange
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
