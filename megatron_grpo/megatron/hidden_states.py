"""The GPTModel forward without its output layer: final hidden states for `vocab_parallel_linear_logprobs`.

Why an adapter: Megatron-Core's `GPTModel.forward` (0.16 and 0.19) has no switch that returns the final
hidden states (after the final layernorm) of the last pipeline stage; it always ends in
`logits, _ = self.output_layer(hidden_states, weight=..., runtime_gather_output=...)` and, without labels,
`logits.transpose(0, 1).contiguous()`. Rebuilding its preprocessing (embeddings, rotary tables) outside
the model would copy private code that changes between versions. Instead, for the duration of one forward,
`without_output_layer` swaps the public `model.output_layer` submodule for `_HiddenStatesOut`, which returns
its input unchanged, so the forward returns `[b, s, h]` hidden states through Megatron's own code path. This
is the only place that does such a swap.

`_HiddenStatesOut` hands the fused ops the output layer's input as Megatron's ColumnParallelLinear sees it
(`output_layer_input`), replicated over TP and whole along the sequence:
- without sequence parallelism, `copy_to_tensor_model_parallel_region`: identity forward, all-reduce of the input
  gradient over TP in backward, which sums the per-shard `dH` partials of `vocab_parallel_linear_logprobs`;
- with it (the output layer's `sequence_parallel`, from the model config's; Megatron turns it off at TP 1), the
  final hidden states are `[s / tp, b, h]` on each rank, and `gather_from_sequence_parallel_region`
  all-gathers them along the sequence in forward and reduce-scatters the `dH` partials in backward: each rank gets
  the summed gradient of its own sequence slice, as from Megatron's layer. The whole-sequence `[s, b, h]` hidden
  states exist on every rank from there on (docs/design.md, "Sequence parallelism", says what that costs).
Megatron's all-reduce (`mappings._reduce`) reduces `grad.contiguous()` and returns `grad`: on a non-contiguous
gradient it reduces a copy and passes the unreduced one on. The gradient reaching the hidden states here is the
`[s, b, h]` view of the `[b, s, h]` output's gradient (GPTModel's final transpose), so `_ContiguousGrad` makes it
contiguous first.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

from megatron_grpo.megatron.ddp import unwrapped


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward passes on `grad.contiguous()` (see the module docstring)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def output_layer_input(hidden_states: torch.Tensor, *, sequence_parallel: bool,
                       group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
    """The final hidden states as the output layer's GEMM reads them: `[s, b, h]`, whole and replicated over the TP
    `group` (None: Megatron's TP group), their gradient summed over TP in backward (see the module docstring).

    `sequence_parallel`: `hidden_states` is this rank's `[s / tp, b, h]` slice of the sequence (Megatron's sequence
    parallelism); it is all-gathered along the sequence, and its gradient is reduce-scattered back to the slice."""
    if sequence_parallel:
        whole = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True, group=group)
    else:
        whole = copy_to_tensor_model_parallel_region(hidden_states, group=group)
    return _ContiguousGrad.apply(whole)


class _HiddenStatesOut(torch.nn.Module):
    """Stands in for the output layer: `(output_layer_input(hidden_states), None)`, with the replaced layer's
    sequence parallelism and TP group.

    `weight` is the replaced layer's (GPTModel reads it for tied embeddings on a stage without the embedding)."""

    def __init__(self, replaced: torch.nn.Module) -> None:
        super().__init__()
        self._replaced = [replaced]  # a list: not registered as a submodule, so no parameter appears twice

    @property
    def weight(self) -> torch.Tensor | None:
        return self._replaced[0].weight

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None, **_: object) -> tuple[torch.Tensor, None]:
        replaced = self._replaced[0]
        return output_layer_input(hidden_states, sequence_parallel=bool(getattr(replaced, "sequence_parallel", False)),
                                  group=getattr(replaced, "tp_group", None)), None


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This rank's `[V_local, H]` output-layer weight: the tied embedding when the model shares them."""
    model = unwrapped(model)
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the output layer's GEMM runs in: the autocast dtype when the model's config enables autocast (fp32
    master weights, bf16 compute), else the parameters' dtype.

    The fused paths cast the hidden states and the output weight to it. Megatron-Core 0.16 autocasts only the forward
    step, not the loss function that runs the fused GEMMs, and without Transformer Engine the local spec's final
    LayerNorm returns fp32 hidden states even under autocast: the hidden states' dtype would make them fp32 GEMMs,
    slower than the bf16 ones the output layer runs and unlike the logits the rollouts were sampled from."""
    config = unwrapped(model).config
    if getattr(config, "enable_autocast", False) and getattr(config, "autocast_dtype", None) is not None:
        return config.autocast_dtype
    return config.params_dtype


def check_supported(model: torch.nn.Module) -> None:
    """The settings under which the hidden states the forward returns are the output layer's whole input."""
    config = model.config
    problems = ["use_mup"] if getattr(config, "use_mup", False) else []
    if getattr(config, "mtp_num_layers", None):
        problems.append("mtp_num_layers")
    if getattr(model.output_layer, "bias", None) is not None:
        problems.append("output layer bias")
    if problems:
        raise ValueError(f"policy.fused_linear_logprobs: not supported with {', '.join(problems)}")


@contextmanager
def without_output_layer(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, `model(...)` on the last pipeline stage returns `[b, s, h]` final hidden states
    (TP-replicated and whole along the sequence, under sequence parallelism too; their gradient summed over TP as
    the output layer's input's is) instead of logits. Other stages are unchanged."""
    model = unwrapped(model)
    if not getattr(model, "post_process", False):
        yield
        return
    check_supported(model)
    original = model.output_layer
    model.output_layer = _HiddenStatesOut(original)
    try:
        yield
    finally:
        model.output_layer = original
