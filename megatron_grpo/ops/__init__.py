"""Vocab-parallel logprob ops: kernels (fused or reference), the TP combine, and the autograd APIs (from logits,
and from hidden states and the output weight), with the two values every call carries: the `VocabShard` and the
`SamplingDistribution`.

Names load lazily, so that `megatron_grpo.ops.distribution` (a config reader's) imports no torch.
"""

from __future__ import annotations

from megatron_grpo._lazy import lazy_exports

_EXPORTS = {
    "vocab_parallel_logprobs": "megatron_grpo.ops.vocab_parallel",
    "vocab_parallel_linear_logprobs": "megatron_grpo.ops.linear_logprobs",
    "loss_fused_linear": "megatron_grpo.ops.loss_fused_linear",
    "current_logprobs": "megatron_grpo.ops.current",
    "CurrentLogprobs": "megatron_grpo.ops.current",
    "HiddenStates": "megatron_grpo.ops.current",
    "VocabShard": "megatron_grpo.ops.vocab_shard",
    "ContextShard": "megatron_grpo.ops.context_shard",
    "sum_over_context": "megatron_grpo.ops.context_shard",
    "SamplingDistribution": "megatron_grpo.ops.distribution",
    "extension_status": "megatron_grpo.ops.backends",
    "fused_supports": "megatron_grpo.ops.backends",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
