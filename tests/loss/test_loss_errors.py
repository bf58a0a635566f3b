"""Bad batches make ClippedPGLoss raise a ValueError that names the offending key."""

from __future__ import annotations

import pytest
import torch
from _loss_inputs import loss_config, random_inputs

from megatron_grpo.loss import ClippedPGLoss, aggregate_metrics, count_valid, trained_token_mask

B, S, V = 3, 6, 7


def call_loss(batch, *, logits=None, cfg=None, **kwargs):
    logits = torch.randn(B, S, V) if logits is None else logits
    return ClippedPGLoss(cfg or loss_config())(logits, batch, global_valid_tokens=5, global_valid_seqs=2, **kwargs)


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    return random_inputs(B, S, V, seed=0).batch


@pytest.mark.parametrize("key", ["input_ids", "token_mask", "sample_mask", "advantages", "prev_logprobs"])
def test_missing_required_key_is_named(batch, key):
    del batch[key]
    with pytest.raises(ValueError, match=f"batch\\['{key}'\\] is missing"):
        call_loss(batch)


@pytest.mark.parametrize(
    "key, bad_shape",
    [
        ("input_ids", (B, S, 1)),
        ("token_mask", (B, S + 1)),
        ("sample_mask", (B, 1)),
        ("advantages", (B + 1,)),
        ("advantages", (B, S - 1)),
        ("prev_logprobs", (B, S - 1)),
        ("generation_logprobs", (S, B)),
        ("reference_policy_logprobs", (B,)),
    ],
)
def test_wrong_shape_is_named(batch, key, bad_shape):
    batch[key] = torch.zeros(bad_shape, dtype=batch[key].dtype)
    with pytest.raises(ValueError, match=f"batch\\['{key}'\\]: expected shape"):
        call_loss(batch)


@pytest.mark.parametrize(
    "key, bad_dtype",
    [
        ("input_ids", torch.int32),
        ("input_ids", torch.float32),
        ("token_mask", torch.complex64),
        ("sample_mask", torch.complex64),
        ("advantages", torch.int64),
        ("prev_logprobs", torch.int64),
        ("generation_logprobs", torch.bool),
        ("reference_policy_logprobs", torch.int32),
    ],
)
def test_wrong_dtype_is_named(batch, key, bad_dtype):
    batch[key] = batch[key].to(bad_dtype)
    with pytest.raises(ValueError, match=f"batch\\['{key}'\\]: expected .*dtype"):
        call_loss(batch)


def test_a_value_that_is_not_a_tensor_is_named(batch):
    batch["advantages"] = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"batch\['advantages'\]: expected a torch.Tensor, got list"):
        call_loss(batch)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_non_finite_advantages_are_rejected(batch, bad, per_sequence):
    advantages = torch.randn(B) if per_sequence else torch.randn(B, S)
    advantages.view(-1)[1] = bad
    batch["advantages"] = advantages
    with pytest.raises(ValueError, match=r"batch\['advantages'\]: contains NaN or infinite values"):
        call_loss(batch)


def test_reference_logprobs_are_required_only_when_the_loss_carries_a_kl(batch):
    del batch["reference_policy_logprobs"]
    with pytest.raises(
        ValueError, match=r"batch\['reference_policy_logprobs'\] is missing.*reference_policy_kl_penalty"
    ):
        call_loss(batch, cfg=loss_config(reference_policy_kl_penalty=0.1))
    loss, _ = call_loss(batch, cfg=loss_config(reference_policy_kl_penalty=0.1, kl_in_sequence_reward=True))
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(use_importance_sampling_correction=True), "use_importance_sampling_correction"),
        (dict(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True), "use_on_policy_kl_approximation"),
    ],
)
def test_generation_logprobs_are_required_by_the_options_that_use_them(batch, overrides, reason):
    del batch["generation_logprobs"]
    with pytest.raises(ValueError, match=rf"batch\['generation_logprobs'\] is missing.*{reason}"):
        call_loss(batch, cfg=loss_config(**overrides))


def test_without_generation_logprobs_the_mismatch_metrics_are_absent(batch):
    del batch["generation_logprobs"]
    _, metrics = call_loss(batch)
    assert not {"token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio", "is_oob_ratio"} & set(metrics)


def test_prev_logprobs_are_optional_when_taken_from_current(batch):
    del batch["prev_logprobs"]
    with pytest.raises(ValueError, match=r"batch\['prev_logprobs'\] is missing.*prev_logprobs_from_current"):
        call_loss(batch)
    for loss, _ in (
        call_loss(batch, prev_logprobs_from_current=True),
        call_loss(batch, cfg=loss_config(force_on_policy_ratio=True), prev_logprobs_from_current=True),
        call_loss(batch, cfg=loss_config(force_on_policy_ratio=True)),  # the key alone, as in NeMo-RL
    ):
        assert torch.isfinite(loss)


def test_force_on_policy_ratio_contradicted_by_the_caller_is_named(batch):
    with pytest.raises(ValueError, match="force_on_policy_ratio is true but prev_logprobs_from_current=False"):
        call_loss(batch, cfg=loss_config(force_on_policy_ratio=True), prev_logprobs_from_current=False)


@pytest.mark.parametrize("bad_logits", [torch.randn(B, S + 1, V), torch.randn(B, S * V), torch.randn(B + 1, S, V)])
def test_logits_that_do_not_match_input_ids_are_named(batch, bad_logits):
    with pytest.raises(ValueError, match=r"logits: expected shape"):
        call_loss(batch, logits=bad_logits)


def test_integer_logits_are_named(batch):
    with pytest.raises(ValueError, match=r"logits: expected a floating dtype"):
        call_loss(batch, logits=torch.zeros(B, S, V, dtype=torch.int64))


def test_out_of_vocab_ids_are_ignored_off_the_mask_but_rejected_on_it(batch):
    untrained = batch["token_mask"] == 0
    batch["input_ids"][untrained] = V + 100  # e.g. a padding id beyond the vocab
    loss, _ = call_loss(batch)
    assert torch.isfinite(loss)
    b, t = trained_token_mask(batch).nonzero()[-1]
    batch["input_ids"][b, t] = V + 100
    with pytest.raises(ValueError, match="vocab"):
        call_loss(batch)


def test_count_valid_names_a_missing_mask():
    with pytest.raises(ValueError, match=r"batch\['sample_mask'\] is missing"):
        count_valid({"input_ids": torch.zeros(2, 3, dtype=torch.int64), "token_mask": torch.ones(2, 3)})


def _metrics(**values: float) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(value) for name, value in values.items()}


def test_aggregate_metrics_rejects_mismatched_microbatches():
    with pytest.raises(ValueError, match=r"microbatch 1 has metrics \['loss', 'num_valid_tokens'\]"):
        aggregate_metrics(
            [_metrics(loss=1.0, num_valid_tokens=2.0, entropy=0.5), _metrics(loss=1.0, num_valid_tokens=2.0)]
        )


def test_aggregate_metrics_rejects_undeclared_metrics_by_name():
    with pytest.raises(ValueError, match=r"without a declared aggregation: \['reward'\]"):
        aggregate_metrics([_metrics(loss=1.0, num_valid_tokens=2.0, reward=0.5)])


def test_aggregate_metrics_needs_the_token_count_for_token_means():
    with pytest.raises(ValueError, match="'num_valid_tokens' is missing"):
        aggregate_metrics([_metrics(loss=1.0, entropy=0.5)])


def test_aggregate_metrics_needs_the_sequence_count_for_sequence_means():
    from megatron_grpo.loss import METRIC_AGGREGATION, Aggregation

    per_sequence = {**METRIC_AGGREGATION, "is_oob_ratio": Aggregation.SEQUENCE_MEAN}
    with pytest.raises(ValueError, match="'num_valid_samples' is missing"):
        aggregate_metrics([_metrics(loss=1.0, num_valid_tokens=2.0, is_oob_ratio=0.5)], aggregation=per_sequence)
    combined = aggregate_metrics(
        [
            _metrics(loss=1.0, num_valid_tokens=2.0, num_valid_samples=1.0, is_oob_ratio=1.0),
            _metrics(loss=1.0, num_valid_tokens=9.0, num_valid_samples=3.0, is_oob_ratio=0.0),
        ],
        aggregation=per_sequence,
    )
    assert combined["is_oob_ratio"] == pytest.approx(1 / 4)  # weighted by sequences, not by tokens


@pytest.mark.parametrize("name, value, message", [
    ("global_valid_tokens", 0, r"global_valid_tokens: 0 is less than this microbatch's own \d+ trained tokens"),
    ("global_valid_tokens", -5, r"global_valid_tokens: must be a finite count >= 0 .*got -5"),
    ("global_valid_tokens", torch.tensor(-5.0), r"global_valid_tokens: must be a finite count >= 0 .*got -5"),
    ("global_valid_tokens", torch.tensor(1), r"global_valid_tokens: 1 is less than this microbatch's own"),
    ("global_valid_seqs", float("nan"), r"global_valid_seqs: must be a finite count >= 0 .*got nan"),
    ("global_valid_seqs", float("inf"), r"global_valid_seqs: must be a finite count >= 0 .*got inf"),
    ("global_valid_seqs", 0, r"global_valid_seqs: 0 is less than this microbatch's own \d+ sequences"),
    ("global_valid_seqs", "3", r"global_valid_seqs: expected a number"),
    ("global_valid_tokens", torch.ones(2), r"global_valid_tokens: expected a number or a one-element real tensor"),
])
def test_a_global_count_that_cannot_normalise_the_step_is_named(batch, name, value, message):
    counts = {"global_valid_tokens": 50, "global_valid_seqs": 3, name: value}
    with pytest.raises(ValueError, match=message):
        ClippedPGLoss(loss_config())(torch.randn(B, S, V), batch, **counts)


def test_an_empty_step_with_zero_counts_has_a_zero_loss(batch):
    batch["sample_mask"] = torch.zeros(B)
    loss, metrics = ClippedPGLoss(loss_config())(torch.randn(B, S, V, requires_grad=True), batch,
                                                 global_valid_tokens=0, global_valid_seqs=0)
    assert float(loss.detach()) == 0.0 and float(metrics["num_valid_tokens"]) == 0.0


def test_a_packed_looking_batch_without_cu_seqlens_names_cu_seqlens(batch):
    packed = {key: value.reshape(1, B * S) for key, value in batch.items() if value.dim() == 2}
    packed.update(sample_mask=torch.ones(B), advantages=torch.randn(B))  # [N] per sequence: three sequences
    with pytest.raises(ValueError, match=r"batch\['cu_seqlens'\] is missing: batch\['sample_mask'\] holds 3 values"):
        ClippedPGLoss(loss_config())(torch.randn(1, B * S, V), packed, global_valid_tokens=50, global_valid_seqs=3)
