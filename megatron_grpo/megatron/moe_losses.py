"""Megatron-Core's Mixture-of-Experts auxiliary losses (load balancing, z-loss) as one optimizer step reports them.

The losses themselves are Megatron's: each router adds its load-balancing and z-loss to the gradient in backward
(`MoEAuxLossAutoScaler`), scaled by the schedule with what it scales the main loss by per microbatch; the train
step's loss normalisation leaves that scale Megatron's (docs/moe.md, "The auxiliary losses"). Their values reach no
loss function: Megatron keeps them, per layer, in a tracker that sums `loss / coefficient` over the forwards since
it was last cleared. `AuxLossTracker` clears it before an optimizer step and reads it after, as Megatron-LM's
`track_moe_metrics` reports it: summed over the pipeline stages, reduced over each loss's own group, averaged over
DP, times 1 / the number of microbatches, and averaged over the MoE layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker


def has_aux_losses(model: torch.nn.Module) -> bool:
    """Whether `model`'s routers add auxiliary losses to its gradient (a load-balancing or z-loss coefficient)."""
    from megatron_grpo.megatron.ddp import unwrapped

    config = getattr(unwrapped(model), "config", None)
    if getattr(config, "num_moe_experts", None) is None:
        return False
    coefficients = config.moe_aux_loss_coeff
    coefficients = coefficients if isinstance(coefficients, (list, tuple)) else [coefficients]
    balancing = config.moe_router_load_balancing_type != "none" and any(c > 0 for c in coefficients)
    return balancing or bool(config.moe_z_loss_coeff)


def check_no_deferred_aux_losses(model: torch.nn.Module) -> None:
    """Deferred normalisation divides every gradient by the step's count after the schedule, Megatron's auxiliary
    losses' too, which the schedule has already scaled: a ValueError naming both settings."""
    if has_aux_losses(model):
        raise ValueError("defer_normalisation: the step's normalisation deferred to its end (the sequence mask by "
                         "logprob error, seq_logprob_error_threshold) would divide the MoE auxiliary losses' gradients "
                         "(moe_aux_loss_coeff, moe_z_loss_coeff) by the step's count too; turn them off, or the mask")


def clear_aux_losses() -> None:
    """Forget the auxiliary losses of earlier forwards (call before an optimizer step's schedule), their layer counts
    too: Megatron's tracker sizes each loss by the first model that logs it, and only zeros it when cleared, so a
    later model of more MoE layers in the same process would index past it."""
    clear_aux_losses_tracker()
    _tracked_losses().clear()


def _tracked_losses() -> dict:
    """Megatron's tracker's own dict of losses: `get_moe_metrics_tracker().metrics` from Megatron-Core 0.17 (where
    `get_moe_layer_wise_logging_tracker` returns a copy), the dict `get_moe_layer_wise_logging_tracker` returns
    before."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return get_moe_layer_wise_logging_tracker()
    return get_moe_metrics_tracker().metrics


def aux_losses(num_microbatches: int, num_moe_layers: int) -> dict[str, float]:
    """The auxiliary losses of the training forwards since `clear_aux_losses`, by Megatron's names
    (`load_balancing_loss`, `z_loss`, ...): each the mean over microbatches and MoE layers of the unscaled loss (without
    its coefficient), over the whole model and all DP ranks; the same on every rank.

    Megatron's own reduction leaves a loss without a reduce group (the z-loss) per rank: under sequence or context
    parallelism each TP × CP rank's value is the mean over its own slice of the tokens (its gradient is scaled by
    1 / (TP × CP) for it), and Megatron-Core 0.16 does not average it over DP either. Here such a loss is averaged
    over TP × CP, and every loss over DP unless its group spans DP already."""
    losses = {}
    for name, entry in sorted(get_moe_layer_wise_logging_tracker().items()):
        values = entry["values"].detach().clone().float()
        reduce_group = entry.get("reduce_group")
        per_slice = (parallel_state.get_tensor_and_context_parallel_group(), True) if reduce_group is None else \
            (reduce_group, False)
        for group, average in ((parallel_state.get_pipeline_model_parallel_group(), False), per_slice,
                               (entry.get("avg_group"), True)):
            values = _reduced(values, group, average)
        if not entry.get("reduce_group_has_dp", False) and entry.get("needs_dp_avg", True):
            values = _reduced(values, parallel_state.get_data_parallel_group(), average=True)
        losses[name] = values.sum().item() / (num_microbatches * num_moe_layers)
    return losses


def _reduced(values: torch.Tensor, group: dist.ProcessGroup | None, average: bool) -> torch.Tensor:
    """The sum (or mean) of `values` over `group` (a sum and a division: gloo has no average)."""
    if group is None or group.size() == 1:
        return values
    dist.all_reduce(values, group=group)
    return values / group.size() if average else values
