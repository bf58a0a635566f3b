"""The gradient buffer of the out-of-place backward: each row with the 16-byte alignment of the logits' row.

The kernels read and write 16-byte vectors; a row takes the vector path where its gradient and its logits share their
alignment modulo 16 bytes. A sliced or offset view of logits would otherwise get a gradient buffer aligned
differently, and the kernels would fall back to scalar stores for most rows. The fused kernels allocate the same
buffer in C++ (`empty_with_alignment_of` in csrc/bindings.cpp); the backward op's fake kernel reports its strides.
"""

from __future__ import annotations

import torch

VECTOR_BYTES = 16  # the kernels' vector width


def gradient_row_stride(logits: torch.Tensor) -> int:
    """The row stride of `empty_with_alignment_of(logits)`: the smallest one `>= cols` that is congruent to the
    logits' modulo 16 bytes (so at most 15 bytes per row are wasted)."""
    rows, cols = logits.shape
    element = logits.element_size()
    if rows <= 1 or cols == 0 or VECTOR_BYTES % element:
        return cols
    return cols + (logits.stride(0) - cols) % (VECTOR_BYTES // element)


def empty_with_alignment_of(logits: torch.Tensor) -> torch.Tensor:
    """An uninitialised `[rows, cols]` tensor whose every row has the 16-byte alignment of the logits' row."""
    rows, cols = logits.shape
    element = logits.element_size()
    if rows == 0 or cols == 0 or VECTOR_BYTES % element:
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    per_vector = VECTOR_BYTES // element
    row_stride = gradient_row_stride(logits)
    offset = (logits.data_ptr() % VECTOR_BYTES) // element
    size = offset + (rows - 1) * row_stride + cols + per_vector
    storage = torch.empty(size, dtype=logits.dtype, device=logits.device)
    offset = (offset - (storage.data_ptr() % VECTOR_BYTES) // element) % per_vector
    return storage.as_strided((rows, cols), (row_stride, 1), offset)
