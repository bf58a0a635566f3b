"""The fused CUDA kernels against the memory roof: `python megatron_grpo/bench/roofline.py` (a CUDA machine).

For each shape and dtype, the forward (`vocab_parallel_logprobs`, fused, no group) and the backward alone
(`torch.autograd.grad` after an untimed forward) are timed with CUDA events, median of 20, and their bytes
moved per second are set against a large device-to-device copy's (read + write). The shapes are far larger than
the GPU's L2 cache, so nothing is served from it. Used by benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import statistics
import sys
from typing import Callable

import torch

from megatron_grpo.ops import fused_supports, vocab_parallel_logprobs

SHAPES = ((8192, 32768), (32768, 4096), (256, 131072))


def median_ms(run: Callable[[], object], prepare: Callable[[], object] = lambda: None, repeats: int = 20) -> float:
    """Median CUDA-event time of `run()`; `prepare()` runs before each, outside the timed region."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(repeats + 1):
        prepare()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_roof_gb_s() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e6


def main(argv: list[str] | None = None) -> int:
    """Prints the table; takes no options."""
    if argv:
        print(f"usage: megatron-grpo bench roofline (no options), got {' '.join(argv)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench roofline: no CUDA device", file=sys.stderr)
        return 2
    if not fused_supports(torch.device("cuda")):
        print("bench roofline: megatron_grpo._C has no CUDA kernels (build with a CUDA torch and nvcc)",
              file=sys.stderr)
        return 1
    roof = copy_roof_gb_s()
    print(f"device: {torch.cuda.get_device_name()}; device-to-device copy (read + write): {roof:.0f} GB/s")
    print(f"{'dtype':9} {'rows':>6} {'cols':>7} {'kernel':26} {'ms':>8} {'GB/s':>6} {'of copy':>7}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in SHAPES:
            logits = torch.randn(rows, cols, device="cuda").mul_(3).to(dtype)
            targets = torch.randint(0, cols, (rows,), device="cuda")
            size = logits.numel() * logits.element_size()
            for with_entropy in (False, True):
                suffix = " +entropy" if with_entropy else ""
                leaf = logits.detach().requires_grad_(True)

                def forward():
                    return vocab_parallel_logprobs(leaf, targets, with_entropy=with_entropy, check_inputs=False,
                                                   implementation="fused")

                graph = {}

                def prepare_backward():
                    out = forward()
                    graph["loss"] = sum(o.sum() for o in out) if with_entropy else out.sum()

                def backward():
                    torch.autograd.grad(graph.pop("loss"), leaf)

                for name, moved, ms in (
                    ("forward" + suffix, size, median_ms(forward)),
                    ("backward" + suffix, 2 * size, median_ms(backward, prepare_backward)),
                ):
                    rate = moved / ms / 1e6
                    print(f"{str(dtype)[6:]:9} {rows:6} {cols:7} {name:26} {ms:8.3f} {rate:6.0f} {rate / roof:7.1%}")
            del logits
    return 0

