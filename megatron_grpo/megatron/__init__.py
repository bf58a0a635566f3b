"""The only package that imports megatron.core: parallel init, CPU support, GPTModel building, train-step hooks,
checkpoints in Megatron's distributed format.

Every function takes its own small parameter object (`ParallelParams`, `GPTModelParams`, `AdamParams`,
`StepConfig`) and works on any Megatron-Core GPTModel, `vocab_shard_of(model, true_vocab_size)` giving its vocab
shard. Nothing here reads the runner's config (`megatron_grpo.grpo.plugin_params` adapts it)."""

from megatron_grpo.megatron.checkpointing import (
    CheckpointMismatchError,
    ModelCheckpointError,
    last_error_line,
    load_model_weights,
    load_sharded,
    per_rank_object,
    save_sharded,
    sharded_model_and_optimizer,
)
from megatron_grpo.megatron.context_parallel import (
    context_shard,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from megatron_grpo.megatron.cpu_support import apply_cpu_support
from megatron_grpo.megatron.ddp import unwrapped, wrap_in_ddp
from megatron_grpo.megatron.forward import model_forward
from megatron_grpo.megatron.generation import draws_from_last_stage, last_position_logits
from megatron_grpo.megatron.model import GPTModelParams, build_gpt_model, padded_vocab_size
from megatron_grpo.megatron.optimizer import (
    AdamParams,
    Optimizer,
    build_optimizer,
    clip_grad_norm,
    is_megatron_optimizer,
    optimizer_step,
    uses_distributed_optimizer,
)
from megatron_grpo.megatron.parallel import ParallelLayout, ParallelParams, destroy_parallel, init_parallel
from megatron_grpo.megatron.train_step import (
    StepConfig,
    TrainStepResult,
    compute_logprobs,
    make_forward_step,
    train_step,
)
from megatron_grpo.megatron.vocab import vocab_shard_of

__all__ = [
    "AdamParams",
    "CheckpointMismatchError",
    "GPTModelParams",
    "ModelCheckpointError",
    "Optimizer",
    "ParallelLayout",
    "ParallelParams",
    "StepConfig",
    "TrainStepResult",
    "apply_cpu_support",
    "build_gpt_model",
    "build_optimizer",
    "clip_grad_norm",
    "compute_logprobs",
    "context_shard",
    "destroy_parallel",
    "draws_from_last_stage",
    "gather_from_context_parallel",
    "init_parallel",
    "is_megatron_optimizer",
    "last_error_line",
    "last_position_logits",
    "load_model_weights",
    "load_sharded",
    "make_forward_step",
    "model_forward",
    "optimizer_step",
    "padded_vocab_size",
    "per_rank_object",
    "save_sharded",
    "split_for_context_parallel",
    "sharded_model_and_optimizer",
    "train_step",
    "unwrapped",
    "uses_distributed_optimizer",
    "vocab_shard_of",
    "wrap_in_ddp",
]
