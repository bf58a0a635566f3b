"""The runner's config adapted to the Megatron layer's parameter objects: the plugin never reads `Config`.

One function per parameter object, each reading only the keys behind it. (The scheduler's `PlanInputs` come from
`plan_inputs`, which stays torch-free for the checks before any rank starts.)
"""

from __future__ import annotations

from megatron_grpo.megatron import AdamParams, GPTModelParams, ParallelParams, StepConfig
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.runner.config import Config


def parallel_params(cfg: Config) -> ParallelParams:
    """`policy.tensor_model_parallel_size`, `policy.pipeline_model_parallel_size`, `policy.context_parallel_size`,
    `policy.expert_model_parallel_size`, `seed`, `distributed.timeout_seconds`."""
    return ParallelParams(
        tensor_model_parallel_size=cfg.policy.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.policy.pipeline_model_parallel_size,
        context_parallel_size=cfg.policy.context_parallel_size,
        expert_model_parallel_size=cfg.policy.expert_model_parallel_size,
        seed=cfg.seed,
        timeout_seconds=cfg.distributed.timeout_seconds,
    )


def model_params(cfg: Config) -> GPTModelParams:
    """`policy.model.*`, `policy.precision`, `policy.sequence_parallel`, and `policy.router_replay.enabled` (the
    routers of an MoE policy built to record and replay routes)."""
    model = cfg.policy.model
    return GPTModelParams(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        max_position_embeddings=model.max_position_embeddings,
        ffn_hidden_size=model.ffn_hidden_size,
        position_embedding_type=model.position_embedding_type,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        precision=cfg.policy.precision,
        add_bias_linear=model.add_bias_linear,
        sequence_parallel=cfg.policy.sequence_parallel,
        num_moe_experts=model.num_moe_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_router_dtype=model.moe_router_dtype,
        moe_enable_routing_replay=cfg.policy.router_replay.enabled,
    )


def adam_params(cfg: Config) -> AdamParams:
    """`policy.optimizer.*`."""
    optim = cfg.policy.optimizer
    return AdamParams(lr=optim.lr, adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                      weight_decay=optim.weight_decay, clip_grad=optim.clip_grad)


def step_config(cfg: Config) -> StepConfig:
    """The train step's settings: `policy.*` batch sizes, fused paths, sequence packing and routing replay, the clip,
    and the sampling settings the trained distribution follows (`generation.*`)."""
    packing = cfg.policy.sequence_packing
    return StepConfig(
        global_batch_size=cfg.policy.train_global_batch_size,
        micro_batch_size=cfg.policy.train_micro_batch_size,
        clip_grad=cfg.policy.optimizer.clip_grad,
        distribution=SamplingDistribution.of_sampling(cfg.generation.temperature, cfg.generation.top_k,
                                                      cfg.generation.top_p, cfg.generation.replay_kept_set),
        fused_linear_logprobs=cfg.policy.fused_linear_logprobs,
        fused_linear_loss=cfg.policy.fused_linear_loss,
        max_tokens_per_microbatch=packing.train_mb_tokens if packing.enabled else None,
        logprob_max_tokens_per_microbatch=packing.logprob_mb_tokens if packing.enabled else None,
        packing_algorithm=packing.algorithm,
        reference_replays_routes=cfg.policy.router_replay.replay_in_reference,
        compare_without_replay=cfg.policy.router_replay.compare_without_replay,
    )
