"""The fused CUDA kernels against the memory roof: `megatron-grpo bench roofline` (a CUDA machine; also
`python megatron_grpo/bench/roofline.py`). Used by benchmarks/gpu_check.sh.

Two figures per shape, dtype and pass, side by side, each as bytes moved per second against a large
device-to-device copy's (read + write; the shapes are far larger than the GPU's L2 cache):

- **kernels**: the kernels alone, `CALLS` raw launches of the extension's ops (`logprob_forward`: the TP 1 forward,
  its outputs written by the kernel; `logprob_backward` into a gradient buffer of its own: the out-of-place backward)
  captured back to back in one CUDA graph and replayed, timed with CUDA events, per launch;
- **op**: the whole op per call, `vocab_parallel_logprobs(..., check_inputs=False)` forward, and its backward
  (`torch.autograd.grad` after an untimed forward), each timed with CUDA events around one call: the custom op, its
  autograd node, the Python around it and the kernels.

`op / kernels` is their ratio: what a call costs beyond its kernels. Medians of `REPEATS`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import torch

SHAPES = ((8192, 32768), (32768, 4096), (256, 131072))
REPEATS = 10
CALLS = 10


def median_ms(run: Callable[[], object], prepare: Callable[[], object] = lambda: None, repeats: int = REPEATS
              ) -> float:
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


def graph_ms(launch: Callable[[], object], calls: int = CALLS, repeats: int = REPEATS) -> float:
    """Per-launch time of `calls` launches captured back to back in a CUDA graph (no host time between them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()  # warm-up: plans, occupancy queries and workspaces are settled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            launch()
    ms = median_ms(graph.replay, repeats=repeats) / calls
    del graph
    return ms


def copy_roof_gb_s() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e6


def measure(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> dict[str, tuple[float, float]]:
    """{"forward": (kernels ms, op ms), "backward": (kernels ms, op ms)} of one shape."""
    from megatron_grpo.ops import vocab_parallel_logprobs

    ops = torch.ops.megatron_grpo
    rows, cols = logits.shape
    leaf = logits.detach().requires_grad_(True)
    _, _, lse, mean_x = ops.logprob_forward(logits, targets, 0, cols, with_entropy, None, 1.0)
    ones = torch.ones(rows, device=logits.device)
    grad = torch.empty_like(logits)

    def forward_kernels():
        ops.logprob_forward(logits, targets, 0, cols, with_entropy, None, 1.0)

    def backward_kernels():
        ops.logprob_backward(logits, targets, 0, cols, lse, mean_x if with_entropy else None, ones,
                             ones if with_entropy else None, grad, None, 1.0)

    def forward_op():
        return vocab_parallel_logprobs(leaf, targets, with_entropy=with_entropy, check_inputs=False,
                                       implementation="fused")

    pending = {}

    def prepare_backward():
        out = forward_op()
        pending["loss"] = sum(o.sum() for o in out) if with_entropy else out.sum()

    def backward_op():
        torch.autograd.grad(pending.pop("loss"), leaf)

    return {"forward": (graph_ms(forward_kernels), median_ms(forward_op)),
            "backward": (graph_ms(backward_kernels), median_ms(backward_op, prepare_backward))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-grpo bench roofline", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    from megatron_grpo.ops import fused_supports

    if not torch.cuda.is_available():
        print("bench roofline: no CUDA device", file=sys.stderr)
        return 2
    if not fused_supports(torch.device("cuda")):
        print("bench roofline: megatron_grpo._C has no CUDA kernels (build with a CUDA torch and nvcc)",
              file=sys.stderr)
        return 1
    roof = copy_roof_gb_s()
    print(f"device: {torch.cuda.get_device_name()}; device-to-device copy (read + write): {roof:.0f} GB/s")
    print(f"kernels: {CALLS} raw launches back to back in a CUDA graph, per launch; op: the whole op per call, CUDA "
          f"events around it; medians of {REPEATS}; % of the copy's bytes per second")
    print(f"{'dtype':9} {'rows':>6} {'cols':>7} {'pass':18} {'kernels ms':>10} {'of copy':>7} {'op ms':>8} "
          f"{'of copy':>7} {'op/kernels':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in SHAPES:
            logits = torch.randn(rows, cols, device="cuda").mul_(3).to(dtype)
            targets = torch.randint(0, cols, (rows,), device="cuda")
            size = logits.numel() * logits.element_size()
            for with_entropy in (False, True):
                suffix = " +entropy" if with_entropy else ""
                for name, (kernels, op) in measure(logits, targets, with_entropy).items():
                    moved = size if name == "forward" else 2 * size
                    print(f"{str(dtype)[6:]:9} {rows:6} {cols:7} {name + suffix:18} {kernels:10.3f} "
                          f"{moved / kernels / 1e6 / roof:7.1%} {op:8.3f} {moved / op / 1e6 / roof:7.1%} "
                          f"{op / kernels:10.2f}")
            del logits
    return 0


if __name__ == "__main__":
    sys.exit(main())
