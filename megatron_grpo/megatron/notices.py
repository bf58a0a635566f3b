"""Megatron-Core's known notices, filtered by their exact text: quiet by default, every one of them with --verbose.

Megatron-Core warns on import and setup about things a user of this project cannot act on: Transformer Engine
and Apex missing (it then uses its local kernels, the only ones the CPU has anyway), defaults of its own, its
GPTModel's deprecation, torch's deprecations that its checkpoint loader and sequence-parallel collectives trigger, a
checkpoint saved again over an incomplete one, and CUDA tuning hints where there is no CUDA. Each is listed below by
its exact text under megatron-core 0.16 and 0.19, so any other warning, or a known one whose text changes, still
shows.
The filters live in this process only: no environment variable is set, and a process started from this one
installs its own. `megatron_summary` says once, in one line, what the filtered notices were about where it
matters (on a CUDA machine); on the CPU there is nothing to say.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings

# Python warnings, by category and exact text.
KNOWN_WARNINGS = (
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to local implementations of "
                  "multi_tensor_applier and multi_tensor_scale"),
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to local implementations of "
                  "multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale"),
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."),  # its default
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer."),  # 0.19
    # torch's, raised where Megatron-Core's dist_checkpointing loads a checkpoint
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` "
                    "instead."),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
    # ... and where megatron-core 0.19's loader calls torch's `load` (the reader positional, no_dist=True)
    (UserWarning, "The argument order of load has been changed. Please check the document to avoid future "
                  "breakages."),
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
                  "single process."),
    # torch's, raised where Megatron-Core's sequence-parallel gathers and scatters call the collectives
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                    "`torch.distributed.all_gather_single` instead."),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                    "`torch.distributed.reduce_scatter_single` instead."),
    (UserWarning, "moe_ffn_hidden_size is not set, using ffn_hidden_size instead."),  # its documented default
)
# CUDA tuning hints: noise only where there is no CUDA.
CPU_ONLY_WARNINGS = (
    (UserWarning, "When using async grad allreduce it is recommended to set the environment variable "
                  "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"),
    (UserWarning, "When using sequence parallelism it is recommended to set the environment variable "
                  "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"),
)
# Log records at WARNING level, by logger and exact text.
KNOWN_LOG_RECORDS = {
    # a step directory that a crash left without its COMPLETE marker is saved again (the runner has said so)
    "megatron.core.dist_checkpointing.serialization": ("Overwriting old incomplete / corrupted checkpoint...",),
    # megatron-core 0.19
    "megatron.core.models.gpt.gpt_model": (
        "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features. Please reference "
        "the migration guide `docs/user-guide/hybrid-model-migration.md` for details on how to use `HybridModel`",
    ),
    "megatron.core.dist_checkpointing.strategies.torch": (
        "MCore's async save is deprecated and will be removed in the future releases. Please, use NVRx async "
        "solution by setting `async_strategy` to `nvrx`.",
    ),
}


class _DropKnownRecords(logging.Filter):
    """Drops the log records whose message is one of `texts`, exactly."""

    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = frozenset(texts)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.texts


def quiet_megatron_notices(*, verbose: bool = False, cuda_available: bool | None = None) -> None:
    """Filters Megatron-Core's known notices in this process (call before importing megatron.core); with
    `verbose`, nothing is filtered. `cuda_available` (None: whether torch sees CUDA) keeps the notices that matter
    on a CUDA machine (Transformer Engine or Apex missing there)."""
    if verbose:
        return
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    texts = KNOWN_WARNINGS if cuda_available else KNOWN_WARNINGS + CPU_ONLY_WARNINGS
    for category, text in texts:
        warnings.filterwarnings("ignore", message=re.escape(text) + r"\Z", category=category)
    for name, records in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownRecords) for f in logger.filters):
            logger.addFilter(_DropKnownRecords(records))


def megatron_summary(*, cuda_available: bool) -> str | None:
    """One line on what the filtered notices said, where it matters: on CUDA, when Transformer Engine or Apex is
    missing, Megatron-Core runs its local kernels. None on the CPU (neither can run there) or with both present."""
    if not cuda_available:
        return None
    missing = [name for name, module in (("TE", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return f"{' and '.join(missing)} not found: local kernels"
