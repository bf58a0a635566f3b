"""The `VocabShard` of a Megatron-Core model: which padded-vocab columns this TP rank's output layer holds."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_grpo.megatron.ddp import unwrapped
from megatron_grpo.ops import VocabShard


def vocab_shard_of(model: torch.nn.Module) -> VocabShard:
    """This rank's shard of `model`'s vocab: Megatron splits the padded vocab evenly over the TP ranks; ids at or
    beyond `model.true_vocab_size` (our GPTModel attribute, see `megatron.model`) are padding."""
    model = unwrapped(model)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    local_size = model.padded_vocab_size // tp_size
    return VocabShard(
        start_index=parallel_state.get_tensor_model_parallel_rank() * local_size,
        true_vocab_size=model.true_vocab_size,
        group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None,
    )
