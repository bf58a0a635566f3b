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
    """`out = scale * a @ b` in one GEMM (fp32 accumulation), the scale applied before the single rounding; with
    beta=0 the GEMM ignores `out`'s old contents (NaN and inf included), so `out` is also its (unread) input. Scale 1
    is a plain `mm` (oneDNN's bf16 `addmm` with beta=0 takes 4% longer on a chunk's logits)."""
    if scale == 1.0:
        return torch.mm(a, b, out=out)
    return torch.addmm(out, a, b, beta=0, alpha=scale, out=out)


def chunk_logits(hidden_chunk: torch.Tensor, weight_valid: torch.Tensor, scale: float,
                 out: torch.Tensor) -> torch.Tensor:
    """The chunk's logits over the real columns: `out = scale * hidden_chunk @ weight_valid.T`."""
    return scaled_mm(hidden_chunk, weight_valid.t(), scale, out)


def hidden_gradient(grad_logits: torch.Tensor, weight_valid: torch.Tensor, scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    """The chunk's `dH = scale * dlogits @ weight_valid`: this rank's partial sum over its vocab shard."""
    return scaled_mm(grad_logits, weight_valid, scale, out)


# An fp32 sum of dW (`[V_local, H]`, 4 bytes an element) for bf16 / fp16 weights is kept only where it is at most this
# fraction of the `[rows, V_local]` logits the fused paths do not materialise: 4 H / (rows * 2) = 2H/T for bf16 and
# fp16, so T >= 64 H. Elsewhere each chunk's product is added straight into the returned dW in the weight's dtype (the
# GEMM accumulates in fp32 and rounds the running sum once per chunk, as Liger-Kernel's fused linear cross entropy
# does by default), and the fused paths' extra memory stays within their 10% of the materialised path's.
FP32_SUM_SHARE = 1 / 32


def fp32_sum_is_small(rows: int, hidden_size: int, dtype: torch.dtype) -> bool:
    """Whether an fp32 `[V_local, H]` sum is at most `FP32_SUM_SHARE` of `rows` rows of logits in `dtype`."""
    return 4 * hidden_size <= FP32_SUM_SHARE * rows * torch.empty((), dtype=dtype).element_size()


class WeightGradient:
    """dW of the shard's real rows, `sum over chunks of scale * dlogits^T h`; padding rows never enter it.

    It is written once, into its final home: into `main_grad` when the weight has Megatron DDP's (see `main_grad_of`;
    added to what the buffer holds); else into the returned gradient in the weight's dtype, the first chunk's
    product written over it (no zero fill) and each later one added with beta=1; for bf16 / fp16 weights cut into
    several chunks where `fp32_sum_is_small`, into an fp32 sum first, so that the rounding does not grow with the
    chunk count, rounded into the gradient once by `gradient()`.
    """

    def __init__(self, weight: torch.Tensor, valid_cols: int, rows: int, chunks: int,
                 main_grad: torch.Tensor | None = None) -> None:
        self.weight, self.valid_cols = weight, valid_cols
        self.in_main_grad = main_grad is not None
        self._grad = None
        self._written = self.in_main_grad  # main_grad is added to; a fresh buffer is written by the first chunk
        if main_grad is not None:
            self.total = main_grad[:valid_cols]
        elif weight.dtype in LOW_PRECISION and chunks > 1 and fp32_sum_is_small(rows, weight.shape[1], weight.dtype):
            self.total = torch.empty((valid_cols, weight.shape[1]), dtype=torch.float32, device=weight.device)
        else:
            self._grad = torch.empty_like(weight, memory_format=torch.contiguous_format)
            self._grad[valid_cols:].zero_()
            self.total = self._grad[:valid_cols]

    def add(self, grad_logits: torch.Tensor, hidden_chunk: torch.Tensor, scale: float) -> None:
        """Adds one chunk's `scale * grad_logits^T @ hidden_chunk` (the first one written over the fresh buffer)."""
        first, self._written = not self._written, True
        if self.total.dtype == grad_logits.dtype:
            torch.addmm(self.total, grad_logits.t(), hidden_chunk, beta=0 if first else 1, alpha=scale,
                        out=self.total)
        else:
            if first:
                self.total.zero_()
            add_product_in_fp32(self.total, grad_logits.t(), hidden_chunk, scale)

    def gradient(self) -> torch.Tensor | None:
        """The weight's gradient, `[V_local, H]` in its dtype (padding rows 0); None when it went into `main_grad`."""
        if self.in_main_grad:
            return None
        if not self._written:  # no chunk: no trained row
            self.total.zero_()
            self._written = True
        if self._grad is None:  # the fp32 sum, rounded once
            self._grad = self.weight.new_empty(self.weight.shape)
            self._grad[self.valid_cols:].zero_()
            self._grad[:self.valid_cols] = self.total
            self.total = self._grad[:self.valid_cols]
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
