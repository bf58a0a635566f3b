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
from megatron_grpo.megatron.hidden_states import without_output_layer

Batch = Mapping[str, torch.Tensor]
ForwardStep = Callable[[Iterator[Batch], torch.nn.Module], tuple[torch.Tensor, Callable]]


def model_forward(model: torch.nn.Module, input_ids: torch.Tensor, *, hidden_states: bool = False,
                  cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """GPTModel forward over positions 0..S-1 with an explicit causal mask (True = masked out), or over a packed
    row `[1, T]` of sequences cut by `cu_seqlens` (int32 `[N + 1]`, `loss.packing`), each attending only to itself,
    or over a context-parallel rank's share of `[B, S]` rows or of a packed row.

    Passing the mask keeps it on the batch's device: Megatron's default causal mask is built on "cuda".
    Packed: with Transformer Engine's attention, Megatron's `PackedSeqParams(qkv_format="thd")` and no mask;
    otherwise (the local spec, which takes no `packed_seq_params`) a block-diagonal causal mask, `[1, 1, T, T]`.
    Either way the positions restart at 0 in every sequence, unless `position_ids` `[1, T]` are given (a packed
    batch's own, `loss.packing.pack_rows`: 0 on padding).
    `position_ids` without `cu_seqlens`: a context-parallel rank's share
    (`context_parallel.split_for_context_parallel`), its tokens' global positions, and no mask (Transformer
    Engine's attention applies the causal mask across the CP ranks). A context-parallel rank's share of a packed
    batch (CP > 1 with `cu_seqlens`, the share's own, and its `position_ids`, each token's position in its sequence,
    required): no mask either (a model without attention, in the tests; the local spec has no CP), and with TE's
    attention the THD `PackedSeqParams` of the whole sequences (`_context_parallel_thd_params`).
    `hidden_states`: the last stage returns the `[b, s, h]` final hidden states (after the final norm) instead
    of the logits, their gradient all-reduced over TP as the output layer's input is
    (`hidden_states.without_output_layer`).
    """
    seq_len = input_ids.shape[1]
    extra = {}
    context_parallel = parallel_state.get_context_parallel_world_size() > 1
    if context_parallel and cu_seqlens is not None and position_ids is None:
        raise ValueError("position_ids: a context-parallel rank's share of a packed batch needs its tokens' "
                         "positions (split_for_context_parallel's)")
    if position_ids is not None and (cu_seqlens is None or context_parallel):  # a context-parallel share
        if cu_seqlens is not None and _uses_transformer_engine_attention(model):
            extra["packed_seq_params"] = _context_parallel_thd_params(cu_seqlens)
        with without_output_layer(model) if hidden_states else nullcontext():
            return model(input_ids, position_ids, attention_mask=None, **extra)
    causal_mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=input_ids.device).triu(diagonal=1)
    if cu_seqlens is not None:
        layout = SequenceLayout.packed(cu_seqlens, seq_len) if input_ids.shape[0] == 1 else None
        if layout is None:
            raise ValueError(f"batch['input_ids']: a packed batch (with cu_seqlens) is [1, T], got "
                             f"{list(input_ids.shape)}")
        if position_ids is None:
            position_ids = layout.positions
    else:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    if cu_seqlens is not None:
        if _uses_transformer_engine_attention(model):
            extra["packed_seq_params"] = _thd_params(cu_seqlens, layout.max_seqlen)
            causal_mask = None
        else:
            _check_positions_restart(model)
            ids = layout.sequence_ids[0]
            causal_mask = causal_mask | (ids[:, None] != ids[None, :])
    with without_output_layer(model) if hidden_states else nullcontext():
        return model(input_ids, position_ids, attention_mask=None if causal_mask is None else causal_mask[None, None],
                     **extra)


def batch_forward(model: torch.nn.Module, batch: Batch, *, hidden_states: bool = False) -> torch.Tensor:
    """`model_forward` of a batch: padded, packed (`batch['cu_seqlens']`, with its `position_ids`), or a
    context-parallel rank's share of either (CP > 1: `split_for_context_parallel`'s, with its `position_ids`)."""
    packed = CU_SEQLENS in batch
    positions = packed or parallel_state.get_context_parallel_world_size() > 1
    return model_forward(model, batch["input_ids"], hidden_states=hidden_states, cu_seqlens=batch.get(CU_SEQLENS),
                         position_ids=batch.get(POSITION_IDS) if positions else None)


def _uses_transformer_engine_attention(model: torch.nn.Module) -> bool:
    """Whether the model's core attention is Transformer Engine's (which takes THD `packed_seq_params`)."""
    return any(type(module).__name__ == "TEDotProductAttention" for module in model.modules())


def _thd_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """Megatron's `PackedSeqParams` for THD attention over sequences that span `cu_seqlens` (their padding, if
    any, is untrained and sits at each sequence's end, where causal attention never lets a real token see it)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def _context_parallel_thd_params(local_cu_seqlens: torch.Tensor):
    """`PackedSeqParams` for a context-parallel rank's share of a packed batch, as Megatron's
    `get_thd_batch_on_this_cp_rank` builds them: the whole (padded) sequences' `cu_seqlens`, `CP ×` the share's,
    and TE's attention works out each rank's chunks itself. Not run without Transformer Engine (no CPU test)."""
    size = parallel_state.get_context_parallel_world_size()
    cu_seqlens = local_cu_seqlens * size
    return _thd_params(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))


def _check_positions_restart(model: torch.nn.Module) -> None:
    """The local spec's GPTModel applies RoPE over positions 0..T-1 whatever `position_ids` say: packed sequences
    would be rotated by their offset in the row. Learned absolute positions read `position_ids`."""
    for module in model.modules():
        kind = getattr(module, "position_embedding_type", None)
        if kind is not None and kind != "learned_absolute":
            raise ValueError(f"cu_seqlens: a packed batch without Transformer Engine's attention needs learned "
                             f"absolute position embeddings (this model's are {kind!r}, applied over the packed "
                             "row's positions 0..T-1)")


def run_schedule(forward_step: ForwardStep, model: torch.nn.Module, microbatches: list[Batch],
                 *, forward_only: bool) -> list:
    """One call of Megatron's forward/backward schedule; returns what the last stage's loss_func produced.

    Megatron-Core 0.16 and 0.19 take these keywords; `get_forward_backward_func()` without arguments reads the
    pipeline layout from parallel_state in both.
    """
    batch_size, seq_length = microbatches[0]["input_ids"].shape  # packed microbatches: 1 and T (one T for PP)
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
