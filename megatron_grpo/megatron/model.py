"""Builds a Megatron-Core GPTModel from `GPTModelParams`: the runner's policy and reference model, and a
convenience for scripts (a model built with `GPTModel(...)` directly works with every function of this package).

Transformer Engine's layer spec is used only when TE imports cleanly and CUDA is available; otherwise Megatron's local
spec with `TorchDotProductAttention` (`attention.py`: packed sequences and context parallelism without TE). The
vocabulary is padded as Megatron-LM pads it (to a multiple of make_vocab_size_divisible_by × TP);
`vocab_shard_of(model, true_vocab_size)` then says which columns are padding. The TP, PP and CP sizes are the ones
`parallel_state` was initialised with. Logits stay vocab-parallel (`parallel_output=True`):
`[b, s, padded_vocab / tp]` per rank. Mixed precision (bf16) keeps fp32 master weights and runs the forward under
Megatron's autocast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.megatron.attention import torch_attention_layer_spec
from megatron_grpo.megatron.transformer_engine import transformer_engine_usable

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


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
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: fp32 master weights, the forward under autocast


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's rule: round the vocab up to a multiple of make_vocab_size_divisible_by × TP."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def layer_spec() -> ModuleSpec:
    """Transformer Engine's GPT layer spec where TE is usable, else the local one with `TorchDotProductAttention`."""
    if transformer_engine_usable():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    return torch_attention_layer_spec()


def transformer_config(params: GPTModelParams) -> TransformerConfig:
    """Megatron's TransformerConfig for `params` at the initialised TP / PP sizes; fp32 parameters (master weights)
    in every precision."""
    on_cpu = not torch.cuda.is_available()  # bf16 without CUDA is rejected by the runner's pre-flight checks
    return TransformerConfig(
        num_layers=params.num_layers,
        hidden_size=params.hidden_size,
        num_attention_heads=params.num_attention_heads,
        ffn_hidden_size=params.ffn_hidden_size,
        init_method_std=params.init_method_std,
        hidden_dropout=params.hidden_dropout,
        attention_dropout=params.attention_dropout,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        enable_autocast=params.precision in AUTOCAST_DTYPES,
        autocast_dtype=AUTOCAST_DTYPES.get(params.precision),
        use_cpu_initialization=on_cpu,  # CPU init is also what makes TP=1 and TP=2 start from the same weights
        sequence_parallel=False,  # the local spec's torch LayerNorm does not support it (cpu_support, item 7)
    )


def build_gpt_model(params: GPTModelParams, vocab_size: int, *,
                    share_embeddings_and_output_weights: bool = False) -> GPTModel:
    """A GPTModel for this rank's pipeline stage, its `vocab_size` tokens padded as Megatron-LM pads them (the
    model's own `vocab_size` is the padded size).

    `share_embeddings_and_output_weights`: tie the output layer to the input embedding (Megatron's option; the
    output layer then has no weight of its own). No config key sets it yet; the tests build tied models with it.
    Its attention takes packed (THD) batches and context parallelism (CP > 1 in parallel_state) with or without
    Transformer Engine (`layer_spec`).
    """
    padded = padded_vocab_size(vocab_size, params.make_vocab_size_divisible_by,
                               parallel_state.get_tensor_model_parallel_world_size())
    model = GPTModel(
        config=transformer_config(params),
        transformer_layer_spec=layer_spec(),
        vocab_size=padded,
        max_sequence_length=params.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=params.position_embedding_type,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
