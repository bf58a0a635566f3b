"""Vocab-parallel logprob op: kernels (fused or reference), the TP combine, and the autograd API."""

from .backends import extension_status, fused_supports
from .vocab_parallel import ShardLayout, vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs", "ShardLayout", "extension_status", "fused_supports"]
