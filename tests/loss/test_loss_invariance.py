"""The global normalisation makes the gradient independent of how a step is split: over microbatches, over
data-parallel ranks (gloo), and over tensor-parallel vocab shards (with padded vocab).

The logits come from a tiny linear head `features @ weight`, so every split is compared on the gradient of
one shared parameter, as in training.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _dist import run_on_ranks
from _loss_inputs import batch_for_logits, loss_config

from megatron_grpo.loss import ClippedPGLoss, ClippedPGLossConfig, aggregate_metrics, count_valid
from megatron_grpo.ops import VocabShard

BATCH, SEQ, HIDDEN, VOCAB, PADDED_VOCAB = 6, 7, 5, 13, 16
# A split sums the same fp32 terms in another order. The loss and the metrics are means of at most 42 token terms of
# magnitude below 4: (n - 1) u mean|term| = 1e-5 at worst, whatever their sum cancels to. A weight-gradient element
# sums 42 tokens' terms that may cancel: its error is relative to the largest element, not to itself.
SCALAR_ATOL = 1e-5
SPLIT_RTOL = 1e-5
MICROBATCH_SIZES = (2, 3, 1)  # uneven, and the last one holds only the sequence without trained tokens

# (loss_agg_mode, GSPO): every aggregation mode, and GSPO's sequence ratio on top of a seq-mean mode.
SPLITS = [
    ("token-mean", False),
    ("seq-mean-token-mean", False),
    ("seq-mean-token-sum", False),
    ("seq-mean-token-sum-norm", False),
    ("seq-mean-token-mean", True),
]


@dataclasses.dataclass
class LinearHeadProblem:
    features: torch.Tensor  # [B, S, H]
    weight: torch.Tensor  # [H, PADDED_VOCAB]; the padding columns hold garbage that must not matter
    batch: dict[str, torch.Tensor]


def linear_head_problem(seed: int) -> LinearHeadProblem:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    weight = torch.randn(HIDDEN, PADDED_VOCAB, generator=gen)
    weight[:, VOCAB:] = 30.0
    batch = batch_for_logits(features @ weight, VOCAB, seed=seed + 1)
    return LinearHeadProblem(features, weight, batch)


def rich_config(mode: str, gspo: bool) -> ClippedPGLossConfig:
    """Every term of the loss switched on, so every term is checked for invariance."""
    return loss_config(
        loss_agg_mode=mode,
        max_response_length=9,
        sequence_level_importance_ratio=gspo,
        ratio_clip_c=1.3,
        reference_policy_kl_penalty=0.2,
        kl_output_clamp_value=0.5,
        use_importance_sampling_correction=True,
        truncated_importance_sampling=dict(type="icepop", ratio_min=0.6, ratio_max=1.6),
        entropy_coef=0.03,
    )


def rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {key: value[start:stop] for key, value in batch.items()}


def weight_gradient(
    problem: LinearHeadProblem, cfg: ClippedPGLossConfig, start: int, stop: int, tokens, seqs, **loss_kwargs
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss, metrics, d loss / d weight) of sequences `start:stop` under the given global counts."""
    weight = loss_kwargs.pop("weight", problem.weight).clone().requires_grad_()
    logits = problem.features[start:stop] @ weight
    loss, metrics = ClippedPGLoss(cfg)(
        logits, rows(problem.batch, start, stop), global_valid_tokens=tokens, global_valid_seqs=seqs, **loss_kwargs
    )
    loss.backward()
    return loss.detach(), metrics, weight.grad


def full_batch(problem: LinearHeadProblem, cfg: ClippedPGLossConfig):
    tokens, seqs = count_valid(problem.batch)
    return weight_gradient(problem, cfg, 0, BATCH, tokens, seqs, shard=VocabShard(true_vocab_size=VOCAB))


def assert_same_metrics(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name] == pytest.approx(value, rel=SPLIT_RTOL, abs=SCALAR_ATOL), name


@pytest.mark.parametrize("mode, gspo", SPLITS)
def test_microbatches_sum_to_the_full_batch(mode, gspo):
    problem, cfg = linear_head_problem(seed=3), rich_config(mode, gspo)
    full_loss, full_metrics, full_grad = full_batch(problem, cfg)
    assert full_grad.abs().max() > 0

    bounds = torch.tensor((0,) + MICROBATCH_SIZES).cumsum(0).tolist()
    counts = [count_valid(rows(problem.batch, a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    parts = [
        weight_gradient(problem, cfg, a, b, tokens, seqs, shard=VocabShard(true_vocab_size=VOCAB))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]

    torch.testing.assert_close(sum(p[0] for p in parts), full_loss, rtol=SPLIT_RTOL, atol=SCALAR_ATOL)
    torch.testing.assert_close(sum(p[2] for p in parts), full_grad, rtol=SPLIT_RTOL,
                               atol=SPLIT_RTOL * float(full_grad.abs().max()))
    assert_same_metrics(aggregate_metrics([p[1] for p in parts]), aggregate_metrics([full_metrics]))


@dataclasses.dataclass
class SplitResult:
    """One rank's loss, weight gradient and metrics for a split, next to the whole batch's on one rank.

    Plain Python values: tensors sent back from a spawned rank that has exited cannot be received.
    """

    loss: float
    expected_loss: float
    grad: list
    expected_grad: list
    metrics: dict[str, float]
    expected_metrics: dict[str, float]

    @staticmethod
    def of(loss, expected_loss, grad, expected_grad, metrics, expected_metrics) -> SplitResult:
        return SplitResult(
            float(loss), float(expected_loss), grad.tolist(), expected_grad.tolist(), metrics, expected_metrics
        )


def _data_parallel_split(rank: int, world_size: int, mode: str, gspo: bool) -> SplitResult:
    """This rank trains on its half of the sequences; counts, losses and gradients are all-reduced."""
    problem, cfg = linear_head_problem(seed=5), rich_config(mode, gspo)
    full_loss, full_metrics, full_grad = full_batch(problem, cfg)
    half = BATCH // world_size
    start, stop = rank * half, (rank + 1) * half
    counts = torch.stack(count_valid(rows(problem.batch, start, stop)))
    dist.all_reduce(counts)
    loss, metrics, grad = weight_gradient(problem, cfg, start, stop, counts[0], counts[1],
                                          shard=VocabShard(true_vocab_size=VOCAB))
    dist.all_reduce(loss)
    dist.all_reduce(grad)
    return SplitResult.of(
        loss,
        full_loss,
        grad,
        full_grad,
        aggregate_metrics([metrics], group=dist.group.WORLD),
        aggregate_metrics([full_metrics]),
    )


def _tensor_parallel_split(rank: int, world_size: int, mode: str, gspo: bool) -> list[SplitResult]:
    """This rank holds a vocab shard of the padded head; compared with TP=1 on the padded and unpadded head."""
    problem, cfg = linear_head_problem(seed=7), rich_config(mode, gspo)
    tokens, seqs = count_valid(problem.batch)
    shard = slice(rank * PADDED_VOCAB // world_size, (rank + 1) * PADDED_VOCAB // world_size)
    loss, metrics, grad = weight_gradient(
        problem,
        cfg,
        0,
        BATCH,
        tokens,
        seqs,
        weight=problem.weight[:, shard],
        shard=VocabShard(true_vocab_size=VOCAB, group=dist.group.WORLD),
    )
    padded_loss, padded_metrics, padded_grad = full_batch(problem, cfg)
    unpadded_loss, unpadded_metrics, unpadded_grad = weight_gradient(
        problem, cfg, 0, BATCH, tokens, seqs, weight=problem.weight[:, :VOCAB]
    )
    unpadded_grad = torch.cat([unpadded_grad, torch.zeros(HIDDEN, PADDED_VOCAB - VOCAB)], dim=1)
    actual = aggregate_metrics([metrics])
    return [
        SplitResult.of(loss, padded_loss, grad, padded_grad[:, shard], actual, aggregate_metrics([padded_metrics])),
        SplitResult.of(
            loss, unpadded_loss, grad, unpadded_grad[:, shard], actual, aggregate_metrics([unpadded_metrics])
        ),
    ]


def _distributed_worker(rank: int, world_size: int) -> dict[str, list[SplitResult]]:
    """Both checks in one launch of the 2 gloo ranks: starting processes dominates the test's time."""
    return {
        "data_parallel": [_data_parallel_split(rank, world_size, mode, gspo) for mode, gspo in SPLITS],
        "tensor_parallel": [r for mode, gspo in SPLITS for r in _tensor_parallel_split(rank, world_size, mode, gspo)],
    }


@pytest.fixture(scope="module")
def distributed_results() -> list[dict[str, list[SplitResult]]]:
    return run_on_ranks(2, _distributed_worker)


def assert_split_matches(result: SplitResult) -> None:
    expected_grad = torch.tensor(result.expected_grad)
    assert result.loss == pytest.approx(result.expected_loss, rel=SPLIT_RTOL, abs=SCALAR_ATOL)
    torch.testing.assert_close(torch.tensor(result.grad), expected_grad, rtol=SPLIT_RTOL,
                               atol=SPLIT_RTOL * float(expected_grad.abs().max()))
    assert_same_metrics(result.metrics, result.expected_metrics)


def test_two_data_parallel_ranks_all_reduce_to_the_full_batch_gradient(distributed_results):
    for rank_results in distributed_results:
        assert len(rank_results["data_parallel"]) == len(SPLITS)
        for (mode, gspo), result in zip(SPLITS, rank_results["data_parallel"], strict=True):
            assert torch.tensor(result.expected_grad).abs().max() > 0, (mode, gspo)
            assert_split_matches(result)


def test_two_tensor_parallel_ranks_match_one_rank_with_padded_and_unpadded_vocab(distributed_results):
    for rank_results in distributed_results:
        assert len(rank_results["tensor_parallel"]) == 2 * len(SPLITS)
        for result in rank_results["tensor_parallel"]:
            assert torch.tensor(result.expected_grad).abs().max() > 0
            assert_split_matches(result)


def test_aggregation_sums_weights_token_means_by_tokens_and_takes_extremes():
    def metrics(**values: float) -> dict[str, torch.Tensor]:
        return {name: torch.tensor(value) for name, value in values.items()}

    first = metrics(loss=0.5, num_valid_tokens=3, probs_ratio=1.0, probs_ratio_min=0.8, probs_ratio_max=1.2)
    second = metrics(loss=0.25, num_valid_tokens=1, probs_ratio=2.0, probs_ratio_min=2.0, probs_ratio_max=2.0)
    empty = metrics(
        loss=0.0, num_valid_tokens=0, probs_ratio=0.0, probs_ratio_min=float("inf"), probs_ratio_max=-float("inf")
    )
    assert aggregate_metrics([first, empty, second]) == {
        "loss": 0.75,
        "num_valid_tokens": 4.0,
        "probs_ratio": (3 * 1.0 + 1 * 2.0) / 4,
        "probs_ratio_min": pytest.approx(0.8),
        "probs_ratio_max": 2.0,
    }
