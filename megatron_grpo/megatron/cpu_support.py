"""Makes Megatron-Core 0.16+ run on a machine without CUDA (checked with gloo, TP=2). A no-op when CUDA exists.

Every workaround lives here, with its reason (docs/design.md, "Platforms and Megatron-Core on the CPU"):

1. `torch.cuda.current_device()` places buffers in RoPE, `GlobalMemoryBuffer` and the TP gathers. Without CUDA
   it must name the CPU: it returns "cpu".
2. `forward_backward_no_pipelining` creates `torch.zeros([], device="cuda")` for its token count. The tensor
   factories of that one module are redirected to the CPU, so the Megatron schedule stays the only code path.
3. `dist_checkpointing` calls `torch.cuda.synchronize()`; with no device there is nothing to wait for: no-op.
4. Megatron-Core 0.19's DDP asks `torch.cuda.current_stream()` for the stream that waits on CUDA-graph events
   before each gradient reduction; without a device it gets a stream that has nothing to wait for.
5. Under context parallelism RoPE takes this rank's zigzag chunks of its table (padded `[s, b]` batches) with
   `get_pos_emb_on_this_cp_rank`, whose index is built `pin_memory=True` and moved with `.cuda()` (Megatron-Core 0.16
   and 0.19): without CUDA the same chunks are taken with an index on the table's device.

Handled where they arise rather than by patching:
6. The RNG tracker: `model_parallel_cuda_manual_seed` needs CUDA RNG state, so `parallel.init_parallel` asks
   for Megatron's inference tracker on CPU (its forks are no-ops; dropout then draws from the CPU generator).
7. `sequence_parallel` needs TE's LayerNorm: `model.build_gpt_model` keeps it off (its local spec has torch's);
   a script's own GPTModel with TE can turn it on, and the fused paths then gather its hidden states
   (`hidden_states.py`).
8. `megatron.core.optimizer` allocates on "cuda" in its constructor: on the CPU the policy's optimizer is a torch
   one over the gradients Megatron's DDP reduced into `main_grad` (`optimizer.py`).
"""

from __future__ import annotations

import types

import torch

_applied = False


def apply_cpu_support() -> bool:
    """Applies workarounds 1-5 once if CUDA is unavailable; returns whether the process runs on the CPU."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        torch.cuda.current_device = _cpu_device
        torch.cuda.synchronize = _no_synchronize
        torch.cuda.current_stream = _CpuStream
        from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
        from megatron.core.pipeline_parallel import schedules

        schedules.torch = _CpuFactoryTorch()
        for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):  # each imported it by name
            module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
        _applied = True
    return True


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's `get_pos_emb_on_this_cp_rank` without CUDA: chunks r and 2·CP−1−r of the table's 2·CP along
    `seq_dim`."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    chunks = chunks.index_select(seq_dim, index)
    return chunks.view(*chunks.shape[:seq_dim], -1, *chunks.shape[seq_dim + 2:])


def _cpu_device() -> str:
    return "cpu"


def _no_synchronize(device: object = None) -> None:
    """There is no device stream to wait for."""


class _CpuStream:
    """The current "stream" of a process without a device: work is already done when it is issued."""

    def __init__(self, device: object = None) -> None:
        pass

    def wait_event(self, event: object) -> None:
        """Nothing is pending."""

    def wait_stream(self, stream: object) -> None:
        """Nothing is pending."""

    def synchronize(self) -> None:
        """Nothing is pending."""


class _CpuFactoryTorch(types.ModuleType):
    """`torch` as seen by one Megatron module: the same, except that `device="cuda"` factories build CPU tensors."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor")

    def __init__(self) -> None:
        super().__init__("torch")
        for name in self._FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def _on_cpu(factory):
    def build(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    build.__name__ = factory.__name__
    return build
