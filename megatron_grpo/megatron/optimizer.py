"""The policy's optimizer, and one optimizer step of it: clip to `clip_grad`, step, report the norm and the rate.

On CUDA it is Megatron-Core's own (`get_megatron_optimizer`, Adam, with the distributed optimizer: ZeRO-1, each
DP rank keeps the Adam state of its slice of DDP's buffers), as Megatron training scripts build it; it clips
inside its `step()`. On the CPU, where Megatron's optimizer cannot be built (cpu_support, item 13), it is
`AdamOverMainGrad`, torch's AdamW over the gradients DDP reduced, clipped here by `clip_grad_norm`. Both use
Megatron's parameter groups: no weight decay on biases and other 1-D parameters (norms).

Under Megatron's DDP the gradients are in each parameter's `main_grad`, not in `.grad`, so a plain torch optimizer's
`step()` would see none and silently change nothing. `optimizer_step` therefore steps any torch optimizer over
`main_grad` (`ddp.main_grad_as_grad`: views, no copy), and `AdamOverMainGrad` does the same in its own `step()` for
scripts that call it themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_grpo.megatron.ddp import gradient, main_grad_as_grad, unwrapped, zero_grads

Optimizer = Union[torch.optim.Optimizer, MegatronOptimizer]


class AdamOverMainGrad(torch.optim.AdamW):
    """torch's AdamW over the gradients Megatron's DDP reduced: for the length of its `step()` each parameter's
    `.grad` is its `main_grad` (`ddp.main_grad_as_grad`); a model outside DDP keeps its `.grad`. For scripts that
    call `optimizer.step()` themselves; `optimizer_step` does the same for any torch optimizer."""

    @torch.no_grad()
    def step(self, closure=None):
        with main_grad_as_grad(param for group in self.param_groups for param in group["params"]):
            return super().step(closure)


@dataclass(frozen=True)
class AdamParams:
    """Adam with decoupled weight decay, and the gradient-norm clip of each step (0: no clipping). The defaults
    other than the rate are Megatron-Core's `OptimizerConfig`'s."""

    lr: float
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0


def build_optimizer(model: torch.nn.Module, optim: AdamParams) -> Optimizer:
    """Adam with decoupled weight decay for `model` (wrapped in DDP with the distributed optimizer's buffer
    layout on CUDA, see `ddp.wrap_in_ddp`): Megatron's optimizer on CUDA, `AdamOverMainGrad` on the CPU."""
    if torch.cuda.is_available():
        return _megatron_optimizer(model, optim)
    decayed, not_decayed = [], []
    for name, param in model.named_parameters():
        (not_decayed if _no_weight_decay(name, param) else decayed).append(param)
    groups = [{"params": params, "weight_decay": decay} for params, decay in
              ((decayed, optim.weight_decay), (not_decayed, 0.0)) if params]
    return AdamOverMainGrad(groups, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)


def uses_distributed_optimizer() -> bool:
    """Whether `build_optimizer` builds Megatron's distributed optimizer here (which DDP must be told of)."""
    return torch.cuda.is_available()


def is_megatron_optimizer(optimizer: Optimizer) -> bool:
    return isinstance(optimizer, MegatronOptimizer)


def zero_optimizer_grads(model: torch.nn.Module, optimizer: Optimizer) -> None:
    """Fresh gradients for the next optimizer step: DDP's buffers, and Megatron's optimizer's own copies."""
    zero_grads(model)
    if is_megatron_optimizer(optimizer):
        optimizer.zero_grad()


def optimizer_step(model: torch.nn.Module, optimizer: Optimizer, clip_grad: float) -> float:
    """Clips the reduced gradients to total norm `clip_grad` (0: no clipping) and steps; returns the norm before
    clipping. Megatron's optimizer clips to its own `config.clip_grad`, which must be `clip_grad`. A torch optimizer
    steps over DDP's `main_grad` where the model is wrapped in it (`ddp.main_grad_as_grad`); one whose parameters
    have no gradient at all (built over other parameters) is a ValueError, never a silent no-op."""
    if not is_megatron_optimizer(optimizer):
        norm = clip_grad_norm(model, clip_grad)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        with main_grad_as_grad(params) as in_main_grad:
            if not in_main_grad and not any(param.grad is not None for param in params):
                raise ValueError("optimizer: none of its parameters has a gradient after the backward (neither "
                                 "DDP's main_grad nor .grad): build it over this model's parameters")
            optimizer.step()
        return norm
    if optimizer.config.clip_grad != clip_grad:
        raise ValueError(f"clip_grad: the step clips to {clip_grad}, the Megatron optimizer to its "
                         f"config.clip_grad = {optimizer.config.clip_grad}; build both from one value")
    updated, norm, _ = optimizer.step()
    if not updated:  # only a loss scaler skips a step, and the train step uses none
        raise RuntimeError("optimizer: Megatron's optimizer skipped the step (non-finite gradients)")
    return float(norm)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clips to a total norm over the whole model-parallel model (TP duplicates counted once); 0 = no clipping.

    A weight Megatron marks `shared` (the output layer's copy of the embedding on the last pipeline stage, whose
    gradient is all-reduced with the embedding's) is left out of the norm, as Megatron's optimizer leaves it out, so
    that it counts once.

    A Mixture-of-Experts model's expert parameters (Megatron marks them `allreduce=False`) live on one expert-parallel
    rank each: their squares are summed over Megatron's expert-tensor × expert × pipeline group (expert-TP
    duplicates counted once), the other parameters' over TP × PP, and the norm is the root of both sums, as
    Megatron's optimizer computes it (one norm on every rank, so the DP-replicated weights take the same clip). The
    squares are summed in fp32 (float64 for a float64 model).

    Returns the norm before clipping.
    """
    grads = [(p, grad) for p in model.parameters() if (grad := gradient(p)) is not None]
    counted = [(p, grad) for p, grad in grads if param_is_not_shared(p)]
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group() if _has_experts(model) else None
    dense_squares, expert_squares = [], []
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # float64 for a float64 model
    for param, grad in counted:
        if not getattr(param, "allreduce", True):
            if param_is_not_tensor_parallel_duplicate(param, expert_tp_group):
                expert_squares.append(grad.to(dtype).square().sum())
        elif param_is_not_tensor_parallel_duplicate(param):
            dense_squares.append(grad.to(dtype).square().sum())
    zero = torch.zeros((), dtype=dtype, device=next(model.parameters()).device)
    dense = torch.stack(dense_squares).sum() if dense_squares else zero
    experts = torch.stack(expert_squares).sum() if expert_squares else zero.clone()
    if parallel_state.get_model_parallel_group().size() > 1:
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
    if expert_tp_group is not None:  # every rank of an MoE model, whether its stage holds expert layers or not
        group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        if group.size() > 1:
            dist.all_reduce(experts, group=group)
    norm = (dense + experts).sqrt().item()
    scale = clip_coefficient(norm, max_norm)
    if scale != 1.0:
        for _, grad in grads:
            grad.mul_(scale)
    return norm


def _has_experts(model: torch.nn.Module) -> bool:
    """Whether `model` is a Mixture-of-Experts model (its config says so on every pipeline stage); any module without
    a Megatron config is not."""
    return getattr(getattr(unwrapped(model), "config", None), "num_moe_experts", None) is not None


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor `clip_grad_norm` scales the gradients by: 1 when `max_norm` is 0 (no clipping) or the norm is
    within it, else `max_norm / (norm + 1e-6)`, Megatron's and torch's clip coefficient."""
    return max_norm / (norm + 1e-6) if 0 < max_norm < norm else 1.0


def grad_norm_after_clipping(norm: float, max_norm: float) -> float:
    """The gradient norm `clip_grad_norm` leaves, from the norm before clipping that it returned."""
    return norm * clip_coefficient(norm, max_norm)


def learning_rate(optimizer: Optimizer) -> float:
    """The learning rate of the optimizer's first parameter group (one that every group shares in this runner;
    Megatron logs the first group's likewise): the rate the next `optimizer.step()` uses."""
    return float(optimizer.param_groups[0]["lr"])


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's default rule: biases and 1-D parameters (norm weights) take no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def _megatron_optimizer(model: torch.nn.Module, optim: AdamParams) -> MegatronOptimizer:
    config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        params_dtype=torch.float32,  # fp32 master weights in every precision (bf16 runs under autocast)
        use_distributed_optimizer=True,
    )
    return get_megatron_optimizer(config, [model])
