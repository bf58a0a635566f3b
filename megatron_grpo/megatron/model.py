"""Builds a Megatron-Core GPTModel from `GPTModelParams`: the runner's policy and reference model, and a
convenience for scripts (a model built with `GPTModel(...)` directly works with every function of this package).

Transformer Engine's layer spec is used only when TE imports cleanly and CUDA is available; otherwise Megatron's local
spec with `TorchDotProductAttention` (`attention.py`: packed sequences and context parallelism without TE); under
sequence parallelism the local spec's norms are `SequenceParallelTorchNorm` (Megatron's torch norm refuses it). A
Mixture-of-Experts model (`num_moe_experts`) takes Megatron's MoE settings under Megatron's names (docs/moe.md). The
vocabulary is padded as Megatron-LM pads it (to a multiple of make_vocab_size_divisible_by × TP);
`vocab_shard_of(model, true_vocab_size)` then says which columns are padding. The TP, PP and CP sizes are the ones
`parallel_state` was initialised with. Logits stay vocab-parallel (`parallel_output=True`):
`[b, s, padded_vocab / tp]` per rank. Mixed precision (bf16) keeps fp32 master weights and runs the forward under
Megatron's autocast; fp64 builds a float64 model (every parameter, and what the pipeline stages exchange), for checks
to float64 rounding on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.megatron.attention import torch_attention_layer_spec
from megatron_grpo.megatron.transformer_engine import transformer_engine_usable

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}  # bf16: fp32 master weights


@dataclass(frozen=True)
class GPTModelParams:
    """The GPTModel's architecture and precision. Defaults are Megatron's (`TransformerConfig`, `GPTModel`, and
    Megatron-LM's `--make-vocab-size-divisible-by`) where it has one."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    max_position_embeddings: int
    ffn_hidden_size: int | None = None  # None: 4 × hidden_size, Megatron's default
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    init_method_std: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    make_vocab_size_divisible_by: int = 128  # the vocab is padded to a multiple of this times the TP size
    precision: Literal["fp32", "bf16", "fp64"] = "fp32"  # bf16: fp32 master weights, the forward under autocast;
    #   fp64: float64 weights and activations, for checks to float64 rounding (on the CPU: Megatron's CUDA optimizer
    #   takes no float64 parameters, Megatron-Core 0.16.1 optimizer/distrib_optimizer.py:420-437)
    add_bias_linear: bool = True  # biases in the linear layers (False for an MoE model: its experts take none)
    sequence_parallel: bool = False  # split the activations outside attention and MLP along the sequence over TP;
    #   an MoE model at TP > 1 needs it in training (Megatron's MoELayer refuses TP without it)
    # Mixture of Experts, under Megatron's names and with its defaults (None experts: a dense model)
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # each expert's; None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0  # the load-balancing loss, added to the loss's gradient as Megatron adds it
    moe_z_loss_coeff: float | None = None  # the router z-loss (None: none)
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    moe_router_dtype: Literal["fp32", "fp64"] | None = None  # the router's GEMM and softmax dtype; None: the model's
    moe_grouped_gemm: bool = False  # Transformer Engine's grouped GEMM for the experts (CUDA with TE only)
    moe_enable_routing_replay: bool = False  # a RouterReplay per router: routes can be recorded and replayed (R3,
    #   `megatron.routing_replay`)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's rule: round the vocab up to a multiple of make_vocab_size_divisible_by × TP."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class SequenceParallelTorchNorm:
    """Megatron's torch norm (`WrappedTorchNorm`: `torch.nn.LayerNorm` or `RMSNorm` as `config.normalization` says)
    under sequence parallelism, which `WrappedTorchNorm` refuses. A norm is per token, so it is the same on a
    sequence slice; its parameters are marked `sequence_parallel` (as Transformer Engine's norms are), so that
    Megatron's `finalize_model_grads` sums their gradients, which each TP rank computes from its slice alone."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> torch.nn.Module:
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization: {config.normalization!r} under sequence parallelism without Transformer "
                             f"Engine: only {' or '.join(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(config: TransformerConfig | None = None,
               params: GPTModelParams | None = None) -> ModuleSpec | TransformerBlockSubmodules:
    """Transformer Engine's layer spec where it is usable, else the local spec with `TorchDotProductAttention`
    (`attention.torch_attention_layer_spec`; an MoE model's with its `SequentialMLP` experts); under sequence
    parallelism the local spec's norms, the final one included, are `SequenceParallelTorchNorm`."""
    experts = {} if params is None or not params.is_moe else {"num_experts": params.num_moe_experts,
                                                              "moe_grouped_gemm": params.moe_grouped_gemm}
    if transformer_engine_usable():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(**experts)
    spec = torch_attention_layer_spec(**experts)
    if config is None or not config.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def check_params(params: GPTModelParams) -> None:
    """The settings `build_gpt_model` cannot build here: a ValueError naming the first."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if params.is_moe:
        if params.add_bias_linear:
            raise ValueError("add_bias_linear: an MoE model's experts take no bias (Megatron-Core's SequentialMLP adds "
                             "an expert's bias in place to its TP reduction's output, an autograd error); set "
                             "add_bias_linear=False")
        if tp > 1 and not params.sequence_parallel:
            raise ValueError(f"sequence_parallel: an MoE model at tensor_model_parallel_size {tp} needs "
                             "sequence_parallel=True (Megatron-Core's MoELayer refuses to train under TP without it)")
        if not transformer_engine_usable():
            if params.moe_token_dispatcher_type == "flex":
                raise ValueError("moe_token_dispatcher_type: flex (DeepEP / HybridEP) needs CUDA; use allgather or "
                                 "alltoall")
            if params.moe_grouped_gemm:
                raise ValueError("moe_grouped_gemm: needs Transformer Engine's grouped GEMM (CUDA)")
    elif params.moe_enable_routing_replay:
        raise ValueError("moe_enable_routing_replay: routing replay needs an MoE model (num_moe_experts)")


def _moe_settings(params: GPTModelParams) -> dict[str, object]:
    if not params.is_moe:
        return {}
    return {
        "num_moe_experts": params.num_moe_experts,
        "moe_ffn_hidden_size": params.moe_ffn_hidden_size,
        "moe_router_topk": params.moe_router_topk,
        "moe_router_load_balancing_type": params.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": params.moe_aux_loss_coeff,
        "moe_z_loss_coeff": params.moe_z_loss_coeff,
        "moe_token_dispatcher_type": params.moe_token_dispatcher_type,
        "moe_router_dtype": params.moe_router_dtype,
        "moe_grouped_gemm": params.moe_grouped_gemm,
        "moe_enable_routing_replay": params.moe_enable_routing_replay,
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def transformer_config(params: GPTModelParams) -> TransformerConfig:
    """Megatron's TransformerConfig for `params` at the initialised TP / PP / EP sizes; fp32 parameters (master
    weights) and pipeline activations under fp32 and bf16, float64 ones under fp64."""
    on_cpu = not torch.cuda.is_available()  # bf16 without CUDA is rejected by the runner's pre-flight checks
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return TransformerConfig(
        num_layers=params.num_layers,
        hidden_size=params.hidden_size,
        num_attention_heads=params.num_attention_heads,
        ffn_hidden_size=params.ffn_hidden_size,
        init_method_std=params.init_method_std,
        hidden_dropout=params.hidden_dropout,
        attention_dropout=params.attention_dropout,
        tensor_model_parallel_size=tp,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=PARAMS_DTYPES[params.precision],  # the activations the pipeline stages exchange
        params_dtype=PARAMS_DTYPES[params.precision],
        enable_autocast=params.precision in AUTOCAST_DTYPES,
        autocast_dtype=AUTOCAST_DTYPES.get(params.precision),
        use_cpu_initialization=on_cpu,  # CPU init is also what makes TP=1 and TP=2 start from the same weights
        sequence_parallel=params.sequence_parallel and tp > 1,  # Megatron's: none at TP 1
        add_bias_linear=params.add_bias_linear,
        **_moe_settings(params),
    )


def build_gpt_model(params: GPTModelParams, vocab_size: int, *,
                    share_embeddings_and_output_weights: bool = False) -> GPTModel:
    """A GPTModel for this rank's pipeline stage, its `vocab_size` tokens padded as Megatron-LM pads them (the
    model's own `vocab_size` is the padded size).

    `share_embeddings_and_output_weights`: tie the output layer to the input embedding (Megatron's option; the
    output layer then has no weight of its own). No config key sets it yet; the tests build tied models with it.

    Its attention takes packed (THD) batches and context parallelism (CP > 1 in parallel_state) with or without
    Transformer Engine (`layer_spec`). An MoE setting that cannot be built here is a ValueError (`check_params`).
    """
    check_params(params)
    padded = padded_vocab_size(vocab_size, params.make_vocab_size_divisible_by,
                               parallel_state.get_tensor_model_parallel_world_size())
    config = transformer_config(params)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, params),
        vocab_size=padded,
        max_sequence_length=params.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=params.position_embedding_type,
    )
    if config.params_dtype == torch.float64:
        # Megatron-Core builds some modules in torch's default dtype, not params_dtype: the learned position embedding
        # (0.16.1 and 0.19.2 models/common/embeddings/language_model_embedding.py:67) and the local spec's norms
        # (WrappedTorchNorm, transformer/torch_norm.py:51 in 0.16.1, :69 in 0.19.2): float32 modules, whose
        # gradients would be summed in float32, in a float64 model.
        model.to(dtype=torch.float64)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
