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

Mixture-of-Experts models (`_apply_moe_support`; docs/moe.md, "On the CPU"), each checked by a test in
tests/megatron/test_cpu_support.py:

6. (0.16 only) the router's gating GEMM reads `moe_utils.te_general_gemm`, which 0.16 defines only where
   Transformer Engine imports: it is set to None, the torch GEMM branch (0.19 sets it so itself).
7. (0.16, 0.19) the `alltoall` token dispatcher creates one class-wide `torch.cuda.Stream()` for its
   device-to-host copies the first time one is built: it gets a CPU stream whose work is already done.
8. (0.16, 0.19) the `alltoall` dispatcher hands its split sizes to `all_to_all_single` as numpy arrays only when
   they were on a GPU (`moe_utils.maybe_move_tensor_to_cpu`); gloo rejects them as tensors once EP > 1: CPU split
   sizes are made numpy arrays too.
9. (0.16, 0.19) with EP > 1 and expert-TP > 1 the `alltoall` dispatcher all-gathers and reduce-scatters unequal
   token counts over expert-TP (`tensor_parallel.mappings`), which gloo cannot: the uneven branches pad to equal
   sizes and cut (the all-gather), or all-reduce and slice (the reduce-scatter).
10. (0.16, 0.19) activation recompute (`tensor_parallel.checkpoint`, MoE layers' recompute) saves and restores the
   CUDA RNG state: on the CPU it saves and restores the CPU generator and Megatron's RNG tracker only.

Handled where they arise rather than by patching:
11. The RNG tracker: `model_parallel_cuda_manual_seed` needs CUDA RNG state, so `parallel.init_parallel` asks
   for Megatron's inference tracker on CPU (its forks are no-ops; dropout then draws from the CPU generator).
12. `sequence_parallel`: the local spec's torch norm refuses it; `model.build_gpt_model` builds its norms as
   `model.SequenceParallelTorchNorm` then (a spec choice, on any device without Transformer Engine).
13. `megatron.core.optimizer` allocates on "cuda" in its constructor: on the CPU the policy's optimizer is a torch
   one over the gradients Megatron's DDP reduced into `main_grad` (`optimizer.py`).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

_applied = False


def apply_cpu_support() -> bool:
    """Applies workarounds 1-10 once if CUDA is unavailable; returns whether the process runs on the CPU."""
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
        _apply_moe_support()
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


class _CpuEvent:
    """An event recorded on a `_CpuStream`: it has happened when it is recorded."""

    def synchronize(self) -> None:
        """Nothing is pending."""

    def wait(self, stream: object = None) -> None:
        """Nothing is pending."""

    def query(self) -> bool:
        return True


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

    def record_event(self, event: object = None) -> _CpuEvent:
        return _CpuEvent()


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


def _apply_moe_support() -> None:
    """Workarounds 5-9 (the module docstring), for Megatron-Core's MoE layers and activation recompute."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as tensor_parallel_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):  # 5: 0.16.1 moe_utils.py:24-39, read at :1192 and :1225
        moe_utils.te_general_gemm = None
    # 6: 0.16.1 token_dispatcher.py:444-445 (0.19.2 :468-469) create it only while the class attribute is None
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CpuStream()
    # 7: 0.16.1 moe_utils.py:1078-1100 (0.19.2 :1169-1191); token_dispatcher imports the helper by name
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_as_numpy(moe_utils.maybe_move_tensor_to_cpu)
    # 8: 0.16.1 mappings.py:150-151 and :183-192 (0.19.2 :154, :197): dist.all_gather / dist.reduce_scatter with
    # unequal sizes; the autograd functions of `mappings` call these module globals
    mappings._gather_along_first_dim = _uneven_on_gloo_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_on_gloo_reduce_scatter(
        mappings._reduce_scatter_along_first_dim)
    # 9: 0.16.1 random.py:444-460 (0.19.2 :525-541), read by CheckpointFunction's forward and backward
    tensor_parallel_random._get_all_rng_states = _rng_states_without_cuda
    tensor_parallel_random._set_all_rng_states = _set_rng_states_without_cuda


def _split_sizes_as_numpy(move_to_cpu):
    """`maybe_move_tensor_to_cpu` that also turns CPU tensors into numpy arrays when asked (`as_numpy=True`), as it
    does with GPU tensors: gloo's `all_to_all_single` takes split sizes as a sequence of ints, not a tensor."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _uneven_on_gloo_gather(gather):
    """Megatron's `_gather_along_first_dim`, whose uneven branch (`output_split_sizes`) gloo cannot run: each rank's
    part padded to the largest, one equal all-gather, each part cut back to its size."""

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(size) for size in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    return _gather_along_first_dim


def _uneven_on_gloo_reduce_scatter(reduce_scatter):
    """Megatron's `_reduce_scatter_along_first_dim`, whose uneven branch (`input_split_sizes`) gloo cannot run: one
    all-reduce of the whole input, then this rank's slice."""

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(size) for size in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[:group.rank()])
        return total[start:start + sizes[group.rank()]].clone()

    return _reduce_scatter_along_first_dim


def _rng_states_without_cuda():
    """Megatron's `_get_all_rng_states` without the CUDA generator: the CPU generator's state and the tracker's."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return torch.get_rng_state(), None, get_cuda_rng_tracker().get_states()


def _set_rng_states_without_cuda(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker) -> None:
    """Megatron's `_set_all_rng_states` without the CUDA generator."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(cpu_rng_state)
    get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)
