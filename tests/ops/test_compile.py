"""The ops under `torch.compile(fullgraph=True)`: `vocab_parallel_logprobs` and `vocab_parallel_linear_logprobs` are
`torch.library` custom ops with fake kernels and registered backwards, so a function calling them compiles as one
graph, and its value and gradients are eager's. Also `torch.library.opcheck` on both ops (schema, fake kernel against
the real one, autograd registration, AOT dispatch with dynamic shapes).

One rank with inductor (the compiler users run; it lays out the code around the ops from the fake kernels), and two
gloo ranks with `aot_eager` (the same graph capture and autograd tracing; there the point is the TP group travelling
by name, and inductor's C++ build would cost each rank another ~20 s).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_on_ranks

from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_linear_logprobs, vocab_parallel_logprobs

TRUE_VOCAB, PADDED, HIDDEN = 37, 40, 8
DISTRIBUTION = SamplingDistribution.of_sampling(0.7, top_k=9)


def problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TRUE_VOCAB, (2, 7), generator=gen)
    tokens[0, 3] = -1  # an untrained token
    return (torch.randn(2, 7, PADDED, generator=gen) * 2, torch.randn(2, 7, HIDDEN, generator=gen),
            torch.randn(PADDED, HIDDEN, generator=gen), tokens)


def from_logits(logits, tokens, shard):
    logprob, entropy = vocab_parallel_logprobs(logits, tokens, shard=shard, distribution=DISTRIBUTION, shift=True,
                                               with_entropy=True, check_inputs=False)
    return (torch.where(torch.isfinite(logprob), logprob, 0.0) * 1.5).sum() + 0.1 * entropy.sum()


def from_hidden(hidden, weight, tokens, shard):
    logprob, entropy = vocab_parallel_linear_logprobs(hidden, weight, tokens, shard=shard, distribution=DISTRIBUTION,
                                                      shift=True, with_entropy=True, chunk_rows=3)
    return (torch.where(torch.isfinite(logprob), logprob, 0.0) * 1.5).sum() + 0.1 * entropy.sum()


def value_and_grads(fn, inputs, tokens, shard):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    value = fn(*leaves, tokens, shard)
    value.backward()
    return value.detach(), [x.grad for x in leaves]


def from_both(logits, hidden, weight, tokens, shard):
    """Both ops in one graph, so one compilation (inductor's C++ build is most of this test's time)."""
    return from_logits(logits, tokens, shard) + from_hidden(hidden, weight, tokens, shard)


def compiled_against_eager(backend: str, shard: VocabShard, logits, hidden, weight, tokens) -> tuple:
    """(compiled value, compiled grads, eager value, eager grads) of `from_both`."""
    torch._dynamo.reset()
    inputs = (logits, hidden, weight)
    compiled = torch.compile(from_both, fullgraph=True, backend=backend)
    return (*value_and_grads(compiled, inputs, tokens, shard), *value_and_grads(from_both, inputs, tokens, shard))


def assert_compiled_is_eager(results: tuple, label: str) -> None:
    value, grads, eager_value, eager_grads = results
    # The ops run their eager kernels inside the graph; only the sums around them may be reordered (56 terms of
    # size < 30 in fp32: within 56 * 2^-24 < 1e-5 relative).
    torch.testing.assert_close(value, eager_value, rtol=1e-5, atol=0, msg=f"{label}: value")
    for name, grad, eager in zip(("logits", "hidden", "weight"), grads, eager_grads):
        # The upstream gradient (1.5 where finite, 0.1) is exact, and the backward ops are the eager ones.
        assert torch.equal(grad, eager), f"{label}: the gradient of {name} differs"


def test_compiled_with_fullgraph_equals_eager():
    logits, hidden, weight, tokens = problem()
    shard = VocabShard(true_vocab_size=TRUE_VOCAB)
    assert_compiled_is_eager(compiled_against_eager("inductor", shard, logits, hidden, weight, tokens), "TP=1")


def tp_worker(rank: int, world: int) -> tuple:
    logits, hidden, weight, tokens = problem()
    local = PADDED // world
    shard = VocabShard(true_vocab_size=TRUE_VOCAB, group=dist.group.WORLD)
    return compiled_against_eager("aot_eager", shard, logits[..., rank * local:(rank + 1) * local], hidden,
                                  weight[rank * local:(rank + 1) * local], tokens)


def test_compiled_with_fullgraph_equals_eager_over_two_ranks():
    for rank, results in enumerate(run_on_ranks(2, tp_worker)):
        assert_compiled_is_eager(results, f"TP=2 rank {rank}")


@pytest.mark.parametrize("op", ["vocab_parallel_logprobs", "vocab_parallel_linear_logprobs"])
def test_the_ops_pass_opcheck(op):
    logits, hidden, weight, tokens = problem(seed=1)
    rows = tokens.reshape(-1).clone()
    args = {
        "vocab_parallel_logprobs": (logits.reshape(-1, PADDED).requires_grad_(True), rows, None, TRUE_VOCAB, "",
                                    DISTRIBUTION.logit_scale, DISTRIBUTION.top_k, None, True, True, "auto"),
        "vocab_parallel_linear_logprobs": (hidden.reshape(-1, HIDDEN).requires_grad_(True),
                                           weight.requires_grad_(True), rows, None, TRUE_VOCAB, "",
                                           DISTRIBUTION.logit_scale, None, 0.9, True, 4, True, "auto"),
    }[op]
    results = torch.library.opcheck(getattr(torch.ops.megatron_grpo, op).default, args)
    assert set(results.values()) == {"SUCCESS"}, results
