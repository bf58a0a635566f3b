"""The clipped policy-gradient loss on vocab-sharded logits, its config and its metric aggregation."""

from megatron_grpo.loss.batch import count_valid, trained_token_mask
from megatron_grpo.loss.clipped_pg import ClippedPGLoss
from megatron_grpo.loss.config import ClippedPGLossConfig, TruncatedImportanceSamplingConfig
from megatron_grpo.loss.metrics import METRIC_AGGREGATION, Aggregation, aggregate_metrics

__all__ = [
    "METRIC_AGGREGATION",
    "Aggregation",
    "ClippedPGLoss",
    "ClippedPGLossConfig",
    "TruncatedImportanceSamplingConfig",
    "aggregate_metrics",
    "count_valid",
    "trained_token_mask",
]
