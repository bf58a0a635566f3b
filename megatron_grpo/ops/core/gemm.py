"""The chunked linear layer under the fused paths (`vocab_parallel_linear_logprobs` and the loss-fused head): the chunk
GEMMs and dW summed over the chunks (the chunks themselves are cut by `chunking`).

Per chunk, `logits = scale * h @ W_valid^T` over the shard's real (non-padding) columns only, into one reused
buffer; in backward the kernel overwrites that buffer with d/d(logits), then `dH = scale * dlogits @ W_valid` and
`dW_valid += scale * dlogits^T h` (`WeightGradient`).

dW goes into Megatron DDP's gradient buffers where the weight has them, as its `ColumnParallelLinear` does with
`gradient_accumulation_fusion`. Megatron-Core's `DistributedDataParallel` gives every trained parameter a `main_grad`
(a view into its fp32 gradient buffer) and a flag `grad_added_to_main_grad`, reset by `zero_grad_buffer()`. Its
backward hook adds `param.grad` into `main_grad`, unless a layer already added its weight gradient there and said so
with the flag. The fused paths then sum dW straight into `main_grad`, with no fp32 accumulator of their own and no dW
in the weight's dtype, and hand autograd the dummy gradient Megatron's layers hand it (the hook still runs, which
`overlap_grad_reduce` needs). The dummy is zeros where the weight is also used elsewhere (`zero_out_wgrad`, which
Megatron sets on an output weight tied to the input embedding: the embedding's own gradient arrives through the same
hook); else uninitialised.
"""

from __future__ import annotations

import functools

import torch

from megatron_grpo.ops.core.chunking import aligned_width
from megatron_grpo.ops.core.dtypes import LOW_PRECISION

# On the CPU a chunk's dW product is formed in the inputs' dtype before it is added in fp32: in pieces of at most
# this many bytes, so the temporary stays small next to the chunk buffer.
PRODUCT_PIECE_BYTES = 4 * 2**20


def chunk_buffer(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised `[rows, cols]` buffer in `like`'s dtype and device whose row stride is `aligned_width(cols)`
    (the GEMMs write into it through `out=`, the kernels read and write it in place)."""
    return like.new_empty(rows, aligned_width(cols))[:, :cols]


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """`out = scale * a @ b` in one GEMM (fp32 accumulation), the scale applied before the single rounding."""
    return torch.addmm(out.new_zeros(()), a, b, beta=0, alpha=scale, out=out)


def chunk_logits(hidden_chunk: torch.Tensor, weight_valid: torch.Tensor, scale: float,
                 out: torch.Tensor) -> torch.Tensor:
    """The chunk's logits over the real columns: `out = scale * hidden_chunk @ weight_valid.T`."""
    return scaled_mm(hidden_chunk, weight_valid.t(), scale, out)


def hidden_gradient(grad_logits: torch.Tensor, weight_valid: torch.Tensor, scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    """The chunk's `dH = scale * dlogits @ weight_valid`: this rank's partial sum over its vocab shard."""
    return scaled_mm(grad_logits, weight_valid, scale, out)


class WeightGradient:
    """dW of the shard's real rows, `sum over chunks of scale * dlogits^T h`; padding rows never enter it.

    It is summed where no second buffer is needed: into `main_grad` when the weight has Megatron DDP's (see
    `main_grad`); else, for bf16 / fp16 weights cut into several chunks, into an fp32 accumulator, so that the
    rounding does not grow with the chunk count; else straight into a gradient in the weight's dtype.
    """

    def __init__(self, weight: torch.Tensor, valid_cols: int, chunks: int,
                 main_grad: torch.Tensor | None = None) -> None:
        self.weight, self.valid_cols = weight, valid_cols
        self.in_main_grad = main_grad is not None
        self._grad = None
        if main_grad is not None:
            self.total = main_grad[:valid_cols]
        elif weight.dtype in LOW_PRECISION and chunks > 1:
            self.total = torch.zeros((valid_cols, weight.shape[1]), dtype=torch.float32, device=weight.device)
        else:
            self._grad = torch.zeros_like(weight)
            self.total = self._grad[:valid_cols]

    def add(self, grad_logits: torch.Tensor, hidden_chunk: torch.Tensor, scale: float) -> None:
        """Adds one chunk's `scale * grad_logits^T @ hidden_chunk`."""
        if self.total.dtype == grad_logits.dtype:
            self.total.addmm_(grad_logits.t(), hidden_chunk, alpha=scale)
        else:
            add_product_in_fp32(self.total, grad_logits.t(), hidden_chunk, scale)

    def gradient(self) -> torch.Tensor | None:
        """The weight's gradient, `[V_local, H]` in its dtype (padding rows 0); None when it went into `main_grad`."""
        if self.in_main_grad:
            return None
        if self._grad is None:  # the fp32 sum, rounded once
            self._grad = self.weight.new_zeros(self.weight.shape)
            self._grad[:self.valid_cols] = self.total
        return self._grad


def add_product_in_fp32(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """`total += alpha * a @ b` for an fp32 `total` and bf16/fp16 `a`, `b` (dW summed over chunks).

    On CUDA one GEMM writes its fp32 accumulator straight into `total` (`addmm` with `out_dtype=torch.float32`),
    so no chunk's product is rounded to bf16 first; where this torch cannot take an fp32 `total` there
    (`fp32_out_addmm_accumulates`), the product comes out in fp32 and is added. Elsewhere (the CPU) the product is
    rounded to `a`'s dtype, then added in fp32, in pieces of rows of at most `PRODUCT_PIECE_BYTES`."""
    if a.device.type == "cuda":
        if fp32_out_addmm_accumulates(a.device, a.dtype):
            torch.addmm(total, a, b, alpha=alpha, out_dtype=torch.float32, out=total)
        else:
            total.add_(torch.mm(a, b, out_dtype=torch.float32), alpha=alpha)
        return
    piece = max(1, PRODUCT_PIECE_BYTES // max(1, b.shape[1] * a.element_size()))
    for start in range(0, a.shape[0], piece):
        total[start:start + piece].add_(torch.mm(a[start:start + piece], b), alpha=alpha)


@functools.cache
def fp32_out_addmm_accumulates(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(total_fp32, a, b, out_dtype=torch.float32, out=total_fp32)` runs for `dtype` a, b on
    `device` (CUDA builds of torch take it; some want `total` in `a`'s dtype), tried once on 1x1 tensors."""
    one = torch.ones(1, 1, dtype=dtype, device=device)
    total = torch.zeros(1, 1, dtype=torch.float32, device=device)
    try:
        torch.addmm(total, one, one, out_dtype=torch.float32, out=total)
    except (RuntimeError, TypeError):
        return False
    return float(total) == 1.0

def main_grad_of(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight.main_grad` where `weight` follows Megatron DDP's protocol (`main_grad` of its shape and
    `grad_added_to_main_grad`), else None. A cast or a copy of the parameter has neither: it takes the plain path."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    return main_grad if main_grad.shape == weight.shape else None


def added_to_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """Marks `weight`'s gradient as added to its `main_grad` and returns the dummy gradient autograd gets instead
    (Megatron's `LinearWithGradAccumulationAndAsyncCommunication` does the same)."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
