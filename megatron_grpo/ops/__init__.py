"""Vocab-parallel logprob ops: kernels (fused or reference), the TP combine, and the autograd APIs (from logits,
and from hidden states and the output weight)."""

from .backends import extension_status, fused_supports
from .linear_logprobs import vocab_parallel_linear_logprobs
from .vocab_parallel import vocab_parallel_logprobs
from .vocab_shard import VocabShard

__all__ = [
    "vocab_parallel_logprobs", "vocab_parallel_linear_logprobs", "VocabShard", "extension_status", "fused_supports",
]
