"""The only package that imports megatron.core: parallel init, CPU support, GPTModel building, train-step hooks."""

from megatron_grpo.megatron.cpu_support import apply_cpu_support
from megatron_grpo.megatron.model import build_gpt_model, padded_vocab_size
from megatron_grpo.megatron.parallel import ParallelLayout, destroy_parallel, init_parallel
from megatron_grpo.megatron.train_step import (
    StepConfig,
    TrainStepResult,
    build_optimizer,
    compute_logprobs,
    make_forward_step,
    model_forward,
    train_step,
)

__all__ = [
    "ParallelLayout",
    "StepConfig",
    "TrainStepResult",
    "apply_cpu_support",
    "build_gpt_model",
    "build_optimizer",
    "compute_logprobs",
    "destroy_parallel",
    "init_parallel",
    "make_forward_step",
    "model_forward",
    "padded_vocab_size",
    "train_step",
]
