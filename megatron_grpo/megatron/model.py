"""Builds the policy (and reference) Megatron-Core GPTModel from `cfg.policy`.

Transformer Engine's layer spec is used only when TE imports cleanly and CUDA is available, the local spec
otherwise. The vocabulary is padded as Megatron-LM pads it (to a multiple of make_vocab_size_divisible_by × TP);
`model.true_vocab_size` keeps the real size so losses can exclude the padding columns.
Logits stay vocab-parallel (`parallel_output=True`): `[b, s, padded_vocab / tp]` per rank.
Mixed precision (bf16) keeps fp32 master weights and runs the forward under Megatron's autocast.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_grpo.config import Config

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's rule: round the vocab up to a multiple of make_vocab_size_divisible_by × TP."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_engine_usable() -> bool:
    """TE only with CUDA; an installed TE without CUDA libraries raises RuntimeError (not ImportError) on import."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def layer_spec() -> ModuleSpec:
    if transformer_engine_usable():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec()


def transformer_config(cfg: Config) -> TransformerConfig:
    """Megatron's TransformerConfig for `cfg.policy`; fp32 parameters (master weights) in every precision."""
    policy, model = cfg.policy, cfg.policy.model
    on_cpu = not torch.cuda.is_available()  # bf16 without CUDA is rejected by the runner's pre-flight checks
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        tensor_model_parallel_size=policy.tensor_model_parallel_size,
        pipeline_model_parallel_size=policy.pipeline_model_parallel_size,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        enable_autocast=policy.precision in AUTOCAST_DTYPES,
        autocast_dtype=AUTOCAST_DTYPES.get(policy.precision),
        use_cpu_initialization=on_cpu,  # CPU init is also what makes TP=1 and TP=2 start from the same weights
        sequence_parallel=False,  # the local spec's torch LayerNorm does not support it (cpu_support, item 6)
    )


def build_gpt_model(cfg: Config, vocab_size: int, *, share_embeddings_and_output_weights: bool = False) -> GPTModel:
    """A GPTModel for this rank's pipeline stage, with `true_vocab_size` and `padded_vocab_size` attributes.

    `share_embeddings_and_output_weights`: tie the output layer to the input embedding (Megatron's option; the
    output layer then has no weight of its own). No config key sets it yet; the tests build tied models with it.
    """
    policy, model_cfg = cfg.policy, cfg.policy.model
    padded = padded_vocab_size(vocab_size, model_cfg.make_vocab_size_divisible_by, policy.tensor_model_parallel_size)
    model = GPTModel(
        config=transformer_config(cfg),
        transformer_layer_spec=layer_spec(),
        vocab_size=padded,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=model_cfg.position_embedding_type,
    )
    model.true_vocab_size = vocab_size
    model.padded_vocab_size = padded
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
