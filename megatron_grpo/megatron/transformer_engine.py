"""Whether Transformer Engine (TE) is usable here, and its core attention class where a model may hold it.

TE is optional and never installed by this project: Megatron-Core's TE layer spec is used only where TE imports
cleanly and CUDA is available (`model.layer_spec`), and TE's THD split where it is (`context_parallel`).
"""

from __future__ import annotations

import sys

import torch

_TE_EXTENSION = "megatron.core.extensions.transformer_engine"


def transformer_engine_usable() -> bool:
    """TE only with CUDA; an installed TE without CUDA libraries raises RuntimeError (not ImportError) on import."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def te_core_attention_class() -> type | None:
    """Megatron-Core's `TEDotProductAttention`, if its TE extension module is loaded (a model built with TE's
    layer spec loaded it) with TE behind it; None otherwise, without importing TE. (Without TE, Megatron-Core's
    layer specs load that module too, and it names a `MagicMock` there.)"""
    attention = getattr(sys.modules.get(_TE_EXTENSION), "TEDotProductAttention", None)
    return attention if isinstance(attention, type) else None
