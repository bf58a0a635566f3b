"""Shared inputs of the ClippedPGLoss tests: configs from the exemplar YAML, and random batches.

The random batches carry prev / generation / reference logprobs near the true logprobs of the logits, so
ratios spread around 1 and every clipping branch is taken; they include a dropped sequence, a sequence with no
trained token and garbage (huge, even infinite) values off the trained-token mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from _configs import tiny

from megatron_grpo.loss import ClippedPGLossConfig


def exemplar_loss_section() -> dict[str, Any]:
    """The `loss_fn:` section of the exemplar config, as plain YAML data."""
    return tiny()["loss_fn"]


def loss_config(**overrides: Any) -> ClippedPGLossConfig:
    """The exemplar loss config with `overrides`; `truncated_importance_sampling` may be a partial dict."""
    section = exemplar_loss_section()
    tis_overrides = overrides.pop("truncated_importance_sampling", {})
    section.update(overrides)
    section["truncated_importance_sampling"] = {**section["truncated_importance_sampling"], **tis_overrides}
    return ClippedPGLossConfig(**section)


@dataclasses.dataclass
class LossInputs:
    logits: torch.Tensor  # float32 [B, S, V], padding columns (if any) filled with garbage
    batch: dict[str, torch.Tensor]
    true_vocab_size: int


def random_inputs(
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    *,
    seed: int,
    padded_vocab_size: int | None = None,
    per_sequence_advantages: bool = False,
) -> LossInputs:
    """Random float32 logits (garbage in the padding columns) and a `batch_for_logits` batch."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, seq_len, padded_vocab_size or vocab_size, generator=gen) * 2
    logits[..., vocab_size:] = 50.0  # padding must take no part, whatever its value
    batch = batch_for_logits(logits, vocab_size, seed=seed + 1, per_sequence_advantages=per_sequence_advantages)
    return LossInputs(logits=logits, batch=batch, true_vocab_size=vocab_size)


def batch_for_logits(
    logits: torch.Tensor, vocab_size: int, *, seed: int, per_sequence_advantages: bool = False, spread: float = 0.3
) -> dict[str, torch.Tensor]:
    """A batch for `logits [B, S, V]` whose logprob inputs differ from the true ones by about `spread` nats."""
    gen = torch.Generator().manual_seed(seed)
    batch_size, seq_len = logits.shape[:2]
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    true_logprobs = torch.zeros(batch_size, seq_len, dtype=torch.float64)
    log_softmax = torch.log_softmax(logits.detach()[:, :-1, :vocab_size].double(), dim=-1)
    true_logprobs[:, 1:] = log_softmax.gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    def near_true() -> torch.Tensor:
        return (true_logprobs + spread * torch.randn(true_logprobs.shape, generator=gen, dtype=torch.float64)).float()

    token_mask = (torch.rand(batch_size, seq_len, generator=gen) < 0.8).to(torch.int64)
    token_mask[:, : max(1, seq_len // 3)] = 0  # a prompt
    token_mask[batch_size - 1] = 0  # a sequence with no trained token
    sample_mask = torch.ones(batch_size, dtype=torch.float32)
    sample_mask[0] = 0  # a dropped sequence
    advantage_shape = (batch_size,) if per_sequence_advantages else (batch_size, seq_len)
    batch = {
        "input_ids": input_ids,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": torch.randn(advantage_shape, generator=gen),
        "prev_logprobs": near_true(),
        "generation_logprobs": near_true(),
        "reference_policy_logprobs": near_true(),
    }
    untrained = token_mask == 0
    batch["prev_logprobs"][untrained] = -torch.inf  # garbage off the mask must never leak
    batch["generation_logprobs"][untrained] = 1e6
    batch["rewards"] = (torch.rand(batch_size, generator=gen) < 0.5).to(torch.float32)  # VAPO's positive samples
    return batch
