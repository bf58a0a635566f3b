"""The `VocabShard` of any Megatron-Core GPTModel: which padded-vocab columns this TP rank's output layer holds, and
where the real vocabulary ends.

Read from Megatron's own layers, so a model built by a script's own `GPTModel(...)` works as well as one from
`build_gpt_model`: the output layer's `ColumnParallelLinear.output_size_per_partition` on the last pipeline
stage, the input embedding's `VocabParallelEmbedding.vocab_start_index` on the first, and on a stage with neither
(the middle of a pipeline, which computes no logprobs) the model's padded `vocab_size` split evenly, as Megatron
splits it. The true vocabulary size is the tokenizer's: Megatron pads the vocab and keeps no record of the real one.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_grpo.megatron.ddp import unwrapped
from megatron_grpo.ops import VocabShard


def vocab_shard_of(model: torch.nn.Module, true_vocab_size: int) -> VocabShard:
    """This rank's shard of `model`'s (padded) vocab; ids at or beyond `true_vocab_size` are padding.

    `model` may be wrapped (DDP, Float16Module). A `true_vocab_size` that is not positive or exceeds the padded
    vocab is a ValueError naming both sizes."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    start, local = _local_columns(unwrapped(model), parallel_state.get_tensor_model_parallel_rank(), tp_size)
    if not 0 < true_vocab_size <= local * tp_size:
        raise ValueError(f"true_vocab_size: must be in [1, {local * tp_size}] (the model's padded vocab: {tp_size} "
                         f"TP rank(s) x {local} columns), got {true_vocab_size}")
    return VocabShard(
        start_index=start,
        true_vocab_size=int(true_vocab_size),
        group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None,
    )


def _local_columns(model: torch.nn.Module, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(the global id of this rank's first vocab column, its number of columns), from Megatron's own layers."""
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None and hasattr(output_layer, "output_size_per_partition"):
        local = int(output_layer.output_size_per_partition)
        return tp_rank * local, local
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if embedding is not None and hasattr(embedding, "vocab_start_index"):
        return int(embedding.vocab_start_index), int(embedding.num_embeddings_per_partition)
    padded = getattr(model, "vocab_size", None)
    if padded is None:
        raise ValueError(f"model: {type(model).__name__} has no output layer, input embedding or vocab_size to read "
                         "its vocab shard from; pass the VocabShard explicitly")
    local = int(padded) // tp_size
    return tp_rank * local, local
