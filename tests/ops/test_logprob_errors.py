"""Bad input to vocab_parallel_logprobs: a ValueError that names the problem, never a silent wrong answer.

Each case runs on the CPU and, where CUDA is present, on the GPU (conftest's `device`; the cuda cases are marked
`gpu`)."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.ops import VocabShard, vocab_parallel_logprobs


def logits_and_targets(device, rows=4, vocab=10):
    return torch.randn(rows, vocab, device=device), torch.randint(0, vocab, (rows,), device=device)


def test_target_at_or_beyond_true_vocab_names_the_id(device):
    logits, _ = logits_and_targets(device)
    targets = torch.tensor([0, 7, 8, 3], device=device)  # 8 is the only id at or beyond the true vocab
    with pytest.raises(ValueError, match=r"token id 8.*true_vocab_size=8"):
        vocab_parallel_logprobs(logits, targets, shard=VocabShard(true_vocab_size=8))


def test_target_beyond_the_padded_vocab_names_the_id(device):
    logits, targets = logits_and_targets(device)
    targets[0] = 10
    with pytest.raises(ValueError, match=r"token id 10.*true_vocab_size=10"):
        vocab_parallel_logprobs(logits, targets)


def test_check_inputs_false_skips_only_the_value_check(device):
    logits, targets = logits_and_targets(device)
    targets[1] = 9
    logprob = vocab_parallel_logprobs(logits, targets, shard=VocabShard(true_vocab_size=8), check_inputs=False)
    assert logprob[1] == float("-inf")  # an unowned id: documented behaviour when the check is off
    with pytest.raises(ValueError, match="integer token ids"):
        vocab_parallel_logprobs(logits, targets.float(), check_inputs=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_non_integer_targets(dtype, device):
    logits, targets = logits_and_targets(device)
    with pytest.raises(ValueError, match=f"targets must hold integer token ids, got dtype {dtype}"):
        vocab_parallel_logprobs(logits, targets.to(dtype))


def test_int32_targets_are_accepted(device):
    logits, targets = logits_and_targets(device)
    torch.testing.assert_close(
        vocab_parallel_logprobs(logits, targets.int()), vocab_parallel_logprobs(logits, targets)
    )


def test_mismatched_shapes(device):
    logits, targets = logits_and_targets(device)
    with pytest.raises(ValueError, match=r"targets shape \(3,\) must equal the logits shape .* got logits \(4, 10\)"):
        vocab_parallel_logprobs(logits, targets[:3])


def test_unsupported_logits_dtype(device):
    logits, targets = logits_and_targets(device)
    with pytest.raises(ValueError, match="logits must be float32, bfloat16, float16 or float64, got torch.int64"):
        vocab_parallel_logprobs(logits.long(), targets)


def test_fused_refuses_float64(device):
    logits, targets = logits_and_targets(device)
    with pytest.raises(ValueError, match="fused kernels support float32, bfloat16 and float16 logits"):
        vocab_parallel_logprobs(logits.double(), targets, implementation="fused")


def test_true_vocab_larger_than_the_sharded_vocab(device):
    logits, targets = logits_and_targets(device)
    with pytest.raises(ValueError, match=r"true_vocab_size=12 exceeds the sharded vocab of 1 rank\(s\) x 10"):
        vocab_parallel_logprobs(logits, targets, shard=VocabShard(true_vocab_size=12))


def test_negative_vocab_start(device):
    logits, targets = logits_and_targets(device)
    with pytest.raises(ValueError, match="vocab shard start_index must be >= 0, got -3"):
        vocab_parallel_logprobs(logits, targets, shard=VocabShard(start_index=-3, true_vocab_size=10))


def test_empty_vocab_dim(device):
    with pytest.raises(ValueError, match="empty vocab dim"):
        vocab_parallel_logprobs(torch.randn(3, 0, device=device), torch.zeros(3, dtype=torch.long, device=device))


def test_all_rows_ignored_gives_zeros_and_zero_gradient(device):
    logits = torch.randn(5, 9, device=device, requires_grad=True)
    logprob, entropy = vocab_parallel_logprobs(logits, torch.full((5,), -1, device=device), with_entropy=True)
    (logprob.sum() + entropy.sum()).backward()
    assert torch.equal(logprob.cpu(), torch.zeros(5)) and torch.equal(entropy.cpu(), torch.zeros(5))
    assert torch.equal(logits.grad.cpu(), torch.zeros(5, 9))


def test_zero_rows(device):
    logits = torch.randn(0, 9, device=device, requires_grad=True)
    logprob = vocab_parallel_logprobs(logits, torch.zeros(0, dtype=torch.long, device=device))
    logprob.sum().backward()
    assert logprob.shape == (0,) and logits.grad.shape == (0, 9)


def test_targets_on_another_device(device):
    logits, targets = logits_and_targets(device)
    with pytest.raises(ValueError, match=f"logits are on {device}.* but targets on meta"):
        vocab_parallel_logprobs(logits, targets.to("meta"))


def test_kernel_op_refuses_a_bad_logit_scale(device):
    import megatron_grpo._C  # noqa: F401  (registers torch.ops.megatron_grpo)

    logits, targets = logits_and_targets(device)
    # "got 0" too: an extension with a C++ runtime of its own lost the number from this message, or crashed here
    # (an H200 image whose g++ linked libstdc++ statically: setup.py's torch_cxx_runtime)
    with pytest.raises(RuntimeError, match="logit_scale must be a finite number > 0, got 0"):
        torch.ops.megatron_grpo.logprob_partials(logits, targets, 0, logits.shape[1], False, None, 0.0)
