"""The only package that imports megatron.core: parallel init, CPU support, GPTModel building, train-step hooks,
checkpoints in Megatron's distributed format, and Megatron-Core's known notices filtered.

Every function takes its own small parameter object (`ParallelParams`, `GPTModelParams`, `AdamParams`,
`StepConfig`) and works on any Megatron-Core GPTModel, `vocab_shard_of(model, true_vocab_size)` giving its vocab
shard. Nothing here reads the runner's config (`megatron_grpo.runner.plugin_params` adapts it)."""

from __future__ import annotations

from megatron_grpo._lazy import lazy_exports

# Names load lazily: `megatron_grpo.megatron.notices` (quieting Megatron-Core before it is imported) must not
# import megatron.core itself.
_EXPORTS = {
    "AdamOverMainGrad": "megatron_grpo.megatron.optimizer",
    "AdamParams": "megatron_grpo.megatron.optimizer",
    "apply_deferred_normalisation": "megatron_grpo.megatron.step",
    "apply_cpu_support": "megatron_grpo.megatron.cpu_support",
    "build_gpt_model": "megatron_grpo.megatron.model",
    "build_optimizer": "megatron_grpo.megatron.optimizer",
    "CheckpointMismatchError": "megatron_grpo.megatron.checkpointing",
    "clip_grad_norm": "megatron_grpo.megatron.optimizer",
    "compute_logprobs": "megatron_grpo.megatron.step",
    "context_shard": "megatron_grpo.megatron.context_parallel",
    "destroy_parallel": "megatron_grpo.megatron.parallel",
    "draws_from_last_stage": "megatron_grpo.megatron.generation",
    "gather_from_context_parallel": "megatron_grpo.megatron.context_parallel",
    "GPTModelParams": "megatron_grpo.megatron.model",
    "init_parallel": "megatron_grpo.megatron.parallel",
    "is_megatron_optimizer": "megatron_grpo.megatron.optimizer",
    "last_error_line": "megatron_grpo.megatron.checkpointing",
    "last_position_logits": "megatron_grpo.megatron.generation",
    "load_model_weights": "megatron_grpo.megatron.checkpointing",
    "load_sharded": "megatron_grpo.megatron.checkpointing",
    "make_forward_step": "megatron_grpo.megatron.step",
    "model_forward": "megatron_grpo.megatron.forward",
    "ModelCheckpointError": "megatron_grpo.megatron.checkpointing",
    "Optimizer": "megatron_grpo.megatron.optimizer",
    "optimizer_step": "megatron_grpo.megatron.optimizer",
    "padded_vocab_size": "megatron_grpo.megatron.model",
    "ParallelLayout": "megatron_grpo.megatron.parallel",
    "ParallelParams": "megatron_grpo.megatron.parallel",
    "per_rank_object": "megatron_grpo.megatron.checkpointing",
    "quiet_megatron_notices": "megatron_grpo.megatron.notices",
    "ROUTED_EXPERTS": "megatron_grpo.megatron.routing_replay",
    "RouteRecorder": "megatron_grpo.megatron.routing_replay",
    "check_routes": "megatron_grpo.megatron.routing_replay",
    "save_sharded": "megatron_grpo.megatron.checkpointing",
    "sharded_model_and_optimizer": "megatron_grpo.megatron.checkpointing",
    "takes_packed_sequences": "megatron_grpo.megatron.attention",
    "torch_attention_layer_spec": "megatron_grpo.megatron.attention",
    "TorchDotProductAttention": "megatron_grpo.megatron.attention",
    "split_for_context_parallel": "megatron_grpo.megatron.context_parallel",
    "StepConfig": "megatron_grpo.megatron.step",
    "train_step": "megatron_grpo.megatron.step",
    "TrainStepResult": "megatron_grpo.megatron.step",
    "unwrapped": "megatron_grpo.megatron.ddp",
    "uses_distributed_optimizer": "megatron_grpo.megatron.optimizer",
    "vocab_shard_of": "megatron_grpo.megatron.vocab",
    "wrap_in_ddp": "megatron_grpo.megatron.ddp",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
