"""The clipped policy-gradient loss on vocab-sharded logits, its config and its metric aggregation.

Names load lazily, so that reading a config (`megatron_grpo.loss.config`) never imports torch.
"""

from __future__ import annotations

from megatron_grpo._lazy import lazy_exports

_EXPORTS = {
    "check_batch_values": "megatron_grpo.loss.batch",
    "count_valid": "megatron_grpo.loss.batch",
    "trained_token_mask": "megatron_grpo.loss.batch",
    "trained_token_targets": "megatron_grpo.loss.batch",
    "LossCall": "megatron_grpo.loss.call",
    "PrevSource": "megatron_grpo.loss.call",
    "StepLoss": "megatron_grpo.loss.call",
    "ClippedPGLoss": "megatron_grpo.loss.clipped_pg",
    "loss_fused_linear": "megatron_grpo.loss.fused_head",
    "ClippedPGLossConfig": "megatron_grpo.loss.config",
    "TruncatedImportanceSamplingConfig": "megatron_grpo.loss.config",
    "METRIC_AGGREGATION": "megatron_grpo.loss.metrics",
    "Aggregation": "megatron_grpo.loss.metrics",
    "aggregate_metrics": "megatron_grpo.loss.metrics",
    "PrevApproximation": "megatron_grpo.loss.prev_approximation",
    "StepVersions": "megatron_grpo.loss.prev_approximation",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
