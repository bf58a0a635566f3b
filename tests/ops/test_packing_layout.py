"""The packed (THD) layout: the checks of `cu_seqlens` and per-sequence tensors, segment ids and sums, the shift
that never crosses a sequence boundary, first-fit-decreasing packing (and its balanced variant) and the way back."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.loss import ClippedPGLoss, count_valid
from megatron_grpo.loss.packing import (
    PackedMicrobatches,
    SequenceLayout,
    balanced_first_fit_decreasing,
    first_fit_decreasing,
    next_token_targets_of,
    pack_rows,
    row_lengths,
)
from megatron_grpo.ops import vocab_parallel_logprobs


def _packed_batch(cu, **extra):
    total = cu[-1]
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.int64), "token_mask": torch.ones(1, total),
             "sample_mask": torch.ones(len(cu) - 1), "advantages": torch.ones(1, total),
             "prev_logprobs": torch.zeros(1, total), "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
    batch.update(extra)
    return batch


@pytest.mark.parametrize("cu, message", [
    (torch.tensor([0, 2, 5], dtype=torch.int64), "expected dtype torch.int32"),
    (torch.tensor([0, 3, 3, 5], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([0, 4, 2, 5], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([1, 3, 5], dtype=torch.int32), "must start at 0"),
    (torch.tensor([0, 2, 4], dtype=torch.int32), "must end at T = 5"),
    (torch.tensor([[0, 5]], dtype=torch.int32), r"expected shape \[N \+ 1\]"),
])
def test_bad_cu_seqlens_is_a_value_error_naming_it(cu, message):
    batch = _packed_batch([0, 2, 5])
    batch["cu_seqlens"] = cu
    with pytest.raises(ValueError, match=rf"batch\['cu_seqlens'\]: .*{message}"):
        count_valid(batch)


@pytest.mark.parametrize("key", ["sample_mask", "advantages", "rewards", "rollout_weight_version"])
def test_per_sequence_tensor_of_the_wrong_length_is_a_value_error_naming_it(key):
    batch = _packed_batch([0, 2, 5], rewards=torch.ones(2), rollout_weight_version=torch.zeros(2))
    batch[key] = torch.ones(3)  # 3 values for 2 sequences
    from _loss_inputs import loss_config

    from megatron_grpo.loss.prev_approximation import PrevApproximation, StepVersions
    batch["generation_logprobs"] = torch.zeros(1, 5)
    cfg = loss_config(positive_example_nll_weight=0.1)
    approx = PrevApproximation("loglinear", StepVersions(prev=1.0, current=1.5))
    with pytest.raises(ValueError, match=rf"batch\['{key}'\]: expected shape \[2\] \(one value per sequence"):
        ClippedPGLoss(cfg)(torch.zeros(1, 5, 3), batch, global_valid_tokens=3, global_valid_seqs=2,
                           prev_approximation=approx)


def test_a_packed_input_ids_must_be_one_row():
    batch = _packed_batch([0, 2, 5])
    batch["input_ids"] = torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"batch\['input_ids'\]: a packed batch \(with cu_seqlens\) is \[1, T\]"):
        count_valid(batch)


def test_segment_ids_starts_and_sums():
    layout = SequenceLayout.packed(torch.tensor([0, 3, 4, 8], dtype=torch.int32), 8)
    assert layout.num_sequences == 3 and layout.max_seqlen == 4
    assert layout.sequence_ids.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]
    assert layout.sequence_starts.tolist() == [[True, False, False, True, True, False, False, False]]
    values = torch.arange(1.0, 9.0)[None]
    assert layout.sum(values).tolist() == [6.0, 4.0, 26.0]
    assert layout.broadcast(torch.tensor([10.0, 20.0, 30.0])).tolist() == [[10, 10, 10, 20, 30, 30, 30, 30]]
    padded = SequenceLayout.padded(2, 3)  # the special case: one sequence per row
    assert padded.sum(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).tolist() == [6.0, 15.0]
    assert padded.sequence_starts[:, 0].all() and not padded.sequence_starts[:, 1:].any()
    empty = SequenceLayout.packed(torch.tensor([0], dtype=torch.int32), 0)
    assert empty.num_sequences == 0 and empty.sum(torch.zeros(1, 0)).shape == (0,)


def test_the_op_shift_never_crosses_a_sequence_boundary():
    """The op's `shift=True` on a packed row, with the packing's targets, gives each sequence's logprobs exactly as
    the sequence alone gives them (float64 reference path: same arithmetic per row, so equal to 1e-12), and 0 at
    every first token."""
    gen = torch.Generator().manual_seed(0)
    lengths = [4, 1, 6]
    logits = torch.randn(1, sum(lengths), 7, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 7, (1, sum(lengths)), generator=gen)
    layout = SequenceLayout.packed(torch.tensor([0, 4, 5, 11], dtype=torch.int32), sum(lengths))
    packed = vocab_parallel_logprobs(logits, next_token_targets_of(ids, layout), shift=True)
    start = 0
    for length in lengths:
        alone = vocab_parallel_logprobs(logits[:, start:start + length], ids[:, start:start + length], shift=True)
        torch.testing.assert_close(packed[:, start:start + length], alone, rtol=1e-12, atol=1e-12)
        assert float(packed[0, start]) == 0.0
        start += length


def test_first_fit_decreasing_fills_the_first_bin_that_fits():
    # Longest first: 6 -> bin 0; 5 -> bin 1; 4 -> bin 2 (fits neither); 3 -> bin 1 (5 + 3); 2 -> bin 0 (6 + 2).
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[3, 4], [0, 1], [2]]
    assert first_fit_decreasing([], 8) == []
    with pytest.raises(ValueError, match="max_tokens_per_microbatch: row 1 holds 9 tokens, more than 8"):
        first_fit_decreasing([2, 9], 8)


def test_balanced_first_fit_decreasing_evens_out_first_fit_decreasings_bins():
    lengths = [2, 7, 2, 2, 7, 2, 2, 2]  # first-fit decreasing: 7 + 7 + 2 = 16 tokens, then the other 2s (10)
    assert first_fit_decreasing(lengths, 16) == [[0, 1, 4], [2, 3, 5, 6, 7]]
    balanced = balanced_first_fit_decreasing(lengths, 16)  # as many bins, 13 tokens each
    assert balanced == [[0, 1, 3, 6], [2, 4, 5, 7]]
    assert [sum(lengths[r] for r in rows) for rows in balanced] == [13, 13]
    # Spreading 3, 3, 2, 2, 2 over two bins of 6 would put 7 tokens in one: first-fit decreasing's bins stay.
    assert balanced_first_fit_decreasing([3, 3, 2, 2, 2], 6) == first_fit_decreasing([3, 3, 2, 2, 2], 6)
    assert balanced_first_fit_decreasing([], 8) == []
    with pytest.raises(ValueError, match="max_tokens_per_microbatch: row 1 holds 9 tokens, more than 8"):
        balanced_first_fit_decreasing([2, 9], 8)
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "token_mask": torch.ones(2, 3)}
    with pytest.raises(ValueError, match="algorithm: one of .*'first_fit_decreasing'.*, got 'modified_first_fit"):
        PackedMicrobatches(batch, 6, algorithm="modified_first_fit_decreasing")


def test_pack_and_unpack_round_trip():
    token_mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    batch = {"input_ids": torch.arange(20).reshape(4, 5), "token_mask": token_mask,
             "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]), "advantages": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    assert row_lengths(batch) == [3, 1, 5, 2]
    packed = pack_rows(batch, [3, 0], [3, 1, 5, 2], pad_multiple=2)
    assert packed["cu_seqlens"].tolist() == [0, 2, 6]
    assert packed["input_ids"].tolist() == [[15, 16, 0, 1, 2, 0]]
    assert packed["token_mask"].tolist() == [[1, 1, 0, 1, 1, 0]]
    assert packed["advantages"].tolist() == [4.0, 1.0]
    assert packed["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0]]  # restarting per sequence, 0 on padding
    packing = PackedMicrobatches(batch, max_tokens=6, same_length=True)
    assert packing.rows == [[1, 2], [0, 3]]  # 5 -> bin 0; 3 -> bin 1; 2 -> bin 1; 1 -> bin 0
    assert [mb["input_ids"].shape[1] for mb in packing.microbatches] == [6, 6]  # one length: the longest
    restored = packing.unpack([mb["input_ids"] for mb in packing.microbatches])
    for row, length in enumerate(row_lengths(batch)):
        assert restored[row, :length].tolist() == batch["input_ids"][row, :length].tolist()
        assert not restored[row, length:].any()
    tokens = sum(float(count_valid(mb)[0]) for mb in packing.microbatches)
    seqs = sum(float(count_valid(mb)[1]) for mb in packing.microbatches)
    assert (tokens, seqs) == tuple(float(c) for c in count_valid(batch)) == (3.0, 2.0)
