"""The chunked linear layer under the fused paths (`vocab_parallel_linear_logprobs` and the loss-fused path): how a
call is cut into chunks of rows, the chunk GEMMs, and dW summed over the chunks.

Per chunk, `logits = scale * h @ W_valid^T` over the shard's real (non-padding) columns only, into one reused
buffer; in backward the kernel overwrites that buffer with d/d(logits), then `dH = scale * dlogits @ W_valid` and
`dW_valid += scale * dlogits^T h` (`WeightGradient`).
"""

from __future__ import annotations

import functools

import torch

from .dtypes import LOW_PRECISION

# Default budget for one chunk of logits (in the hidden states' dtype): large enough that each GEMM is big,
# small enough to be negligible next to the `[T, V_local]` logits the op avoids. See `chunk_rows_for` (read at each
# call, so a test may lower it).
CHUNK_BYTES = 256 * 2**20
MIN_CHUNKS = 8
MIN_CHUNK_ROWS = 256
# A chunk buffer's row stride is a multiple of this many elements (128 bytes of bf16), so every GEMM row starts
# aligned whatever the shard's valid width; the kernels take any row stride.
ROW_ALIGN = 64
# On the CPU a chunk's dW product is formed in the inputs' dtype before it is added in fp32: in pieces of at most
# this many bytes, so the temporary stays small next to the chunk buffer.
PRODUCT_PIECE_BYTES = 4 * 2**20


def chunk_rows_for(rows: int, shard_cols: int, dtype: torch.dtype, budget_bytes: int | None = None) -> int:
    """Rows per chunk when the caller gives none: a call of `rows` trained rows is cut into at least
    `MIN_CHUNKS` chunks (so one chunk's logits are at most 1/8 of the whole call's, the op's extra memory),
    each of at least `MIN_CHUNK_ROWS` rows (so each GEMM stays large) and at most `budget_bytes` (default
    `CHUNK_BYTES`) of logits rows of `shard_cols` columns (256 MiB: 2048 rows of a 65536-column bf16 shard, 441 of
    a 152064-column fp32 one).

    `shard_cols` must be the same on every rank of the TP group: the shard's whole width (`weight.shape[0]`,
    padding included), never its valid columns, which are fewer on the rank holding the padding. Ranks that cut
    a call differently run different numbers and shapes of per-chunk collectives (a mismatch: gloo aborts, NCCL
    hangs)."""
    budget = CHUNK_BYTES if budget_bytes is None else budget_bytes
    row_bytes = max(aligned_width(shard_cols), 1) * torch.empty((), dtype=dtype).element_size()
    by_budget = max(1, budget // row_bytes)
    by_share = max(MIN_CHUNK_ROWS, -(-rows // MIN_CHUNKS))
    return max(1, min(by_budget, by_share))


def aligned_width(cols: int) -> int:
    """`cols` rounded up to a multiple of `ROW_ALIGN`: the row stride of a chunk buffer."""
    return -(-cols // ROW_ALIGN) * ROW_ALIGN


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
