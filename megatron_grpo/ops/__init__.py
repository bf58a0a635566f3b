"""Vocab-parallel logprob ops, from logits (`vocab_parallel`) and from hidden states and the output weight
(`linear_logprobs`), with the values every call carries (`VocabShard`, `SamplingDistribution`, `ContextShard`, and a
rollout engine's `KeptSet` to replay) and the one owner of the current policy's logprobs (`current`). `core/` holds
what both ops are built from: the kernel choice and the plain-torch kernels, the partials and their TP combine, the
top-k / top-p threshold, the kept sets' replay, the chunking policy and the chunk GEMMs, the per-row glue and the
checks.

Names load lazily, so that `megatron_grpo.ops.distribution` (a config reader's) imports no torch.
"""

from __future__ import annotations

from megatron_grpo._lazy import lazy_exports

_EXPORTS = {
    "vocab_parallel_logprobs": "megatron_grpo.ops.vocab_parallel",
    "vocab_parallel_linear_logprobs": "megatron_grpo.ops.linear_logprobs",
    "current_logprobs": "megatron_grpo.ops.current",
    "CurrentLogprobs": "megatron_grpo.ops.current",
    "kept_set_metrics": "megatron_grpo.ops.current",
    "KeptSetMetrics": "megatron_grpo.ops.current",
    "KeptSet": "megatron_grpo.ops.kept_set",
    "HiddenStates": "megatron_grpo.ops.current",
    "VocabShard": "megatron_grpo.ops.vocab_shard",
    "ContextShard": "megatron_grpo.ops.context_shard",
    "sum_over_context": "megatron_grpo.ops.context_shard",
    "SamplingDistribution": "megatron_grpo.ops.distribution",
    "extension_status": "megatron_grpo.ops.core.backends",
    "fused_supports": "megatron_grpo.ops.core.backends",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
