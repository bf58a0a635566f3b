"""Kernel benchmark: `python -m megatron_grpo bench logprob [--quick] [--device cpu|cuda] [--out DIR]`.

In one run, for each setup (TP size, dtype, T x V_local per rank), it times forward and forward+backward of the
fused op (default and in-place backward modes), the plain-torch reference, naive torch (TP=1), Megatron-Core's
`vocab_parallel_cross_entropy` and TE's `parallel_cross_entropy` where importable. Every method gets a fresh
clone of the same logits, made outside the timed region. It reports medians, peak extra memory, ratios
against the peers and the fraction of a copy's memory bandwidth that the fused forward reaches.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_grpo.ops import vocab_parallel_logprobs

from .measure import copy_bandwidth_bytes_per_s, machine_description, median_seconds, peak_extra_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Setup:
    tp: int
    dtype: str
    tokens: int
    v_local: int


@dataclass
class Result:
    setup: Setup
    method: str
    forward_ms: float
    forward_backward_ms: float
    peak_extra_mib: float        # above the live inputs, during forward+backward
    gradient_mib: float          # the size of a fresh gradient (0 when written in place)


# A method maps (logits shard, targets, TP group) to per-token logprobs whose backward is timed.
Method = Callable[[torch.Tensor, torch.Tensor, "dist.ProcessGroup | None"], torch.Tensor]


def fused(x, targets, group):
    return vocab_parallel_logprobs(x, targets, group=group, check_inputs=False)


def fused_inplace(x, targets, group):
    return vocab_parallel_logprobs(x, targets, group=group, check_inputs=False, inplace_backward=True)


def reference(x, targets, group):
    return vocab_parallel_logprobs(x, targets, group=group, check_inputs=False, implementation="reference")


def naive_torch(x, targets, group):
    return torch.log_softmax(x.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def megatron_cross_entropy(x, targets, group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(x, targets)  # consumes fp32 input in place: no extra clone given


def transformer_engine_cross_entropy():
    """TE's parallel_cross_entropy when TE imports and runs here (it raises RuntimeError without CUDA libs)."""
    try:
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy
    except Exception:  # noqa: BLE001 - any failure means "not available on this machine"
        return None

    def method(x, targets, group):
        return -parallel_cross_entropy(x[None], targets[None], 0.0, False, group).squeeze(0)

    return method


def methods_for(setup: Setup, device: torch.device) -> dict[str, Method]:
    methods: dict[str, Method] = {
        "fused": fused,
        "fused (inplace_backward)": fused_inplace,
        "reference": reference,
        "megatron vocab_parallel_cross_entropy": megatron_cross_entropy,
    }
    if setup.tp == 1:
        methods["naive torch"] = naive_torch
    te = transformer_engine_cross_entropy() if device.type == "cuda" else None
    if te is not None:
        methods["te parallel_cross_entropy"] = te
    return methods


def benchmark_setup(setup: Setup, device: torch.device, group, repeats: int) -> list[Result]:
    rank = 0 if group is None else dist.get_rank(group)
    dtype = DTYPES[setup.dtype]
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    logits = (torch.randn(setup.tokens, setup.v_local, generator=gen) * 3).to(device=device, dtype=dtype)
    full_vocab = setup.v_local * setup.tp
    targets = torch.randint(0, full_vocab, (setup.tokens,), generator=torch.Generator().manual_seed(7)).to(device)
    grad_out = torch.ones(setup.tokens, device=device)
    results = []
    for name, method in methods_for(setup, device).items():
        def fresh():
            return logits.clone().requires_grad_(True)

        def forward(x):
            method(x, targets, group)

        def forward_backward(x):
            method(x, targets, group).backward(grad_out)

        fwd = median_seconds(forward, fresh, device, repeats)
        fwd_bwd = median_seconds(forward_backward, fresh, device, repeats)
        peak = peak_extra_bytes(forward_backward, fresh, device)
        in_place = name == "fused (inplace_backward)"
        results.append(Result(
            setup=setup, method=name, forward_ms=1e3 * fwd, forward_backward_ms=1e3 * fwd_bwd,
            peak_extra_mib=peak / 2**20, gradient_mib=0.0 if in_place else logits.nbytes / 2**20,
        ))
    return results


def _rank_main(rank: int, world: int, port: int, setups: list[Setup], device_type: str, repeats: int,
               threads: int, queue) -> None:
    """One TP rank: joins the group, runs the setups of this TP size, and rank 0 reports."""
    from megatron.core import parallel_state

    torch.set_num_threads(threads)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        group = parallel_state.get_tensor_model_parallel_group()
        results = [r for setup in setups for r in benchmark_setup(setup, device, group, repeats)]
        if rank == 0:
            queue.put([asdict(r) for r in results])
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run_tp(tp: int, setups: list[Setup], device_type: str, repeats: int) -> list[dict]:
    """Runs the setups on `tp` fresh processes (a gloo or NCCL group, even for TP=1)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, torch.get_num_threads() // tp) if device_type == "cpu" else 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, setups, device_type, repeats, threads, queue))
             for r in range(tp)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"benchmark rank exited with {p.exitcode}")
    return results


def speedup(peer_ms: float | None, ms: float) -> str:
    return "-" if peer_ms is None else f"{peer_ms / ms:.2f}x"


def report(results: list[dict], device: torch.device, bandwidth: float, repeats: int, quick: bool) -> str:
    lines = [
        f"# Logprob kernel benchmark ({device.type}{', quick' if quick else ''})",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {machine_description(device)}",
        f"- command: `python -m megatron_grpo bench logprob --device {device.type}{' --quick' if quick else ''}`",
        f"- median of {repeats} runs after a warm-up; each method gets a fresh clone of the same logits, made "
        "outside the timed region; forward+backward uses an upstream gradient of ones.",
        f"- memory roof: a large copy moves {bandwidth / 1e9:.1f} GB/s (read + write).",
        "- peak extra: resident memory above the live inputs during forward+backward; 'beyond input+grad' "
        "subtracts the gradient the method must return (0 for in-place), as a percentage of the logits' size.",
        "",
    ]
    setups = sorted({tuple(r["setup"].values()) for r in results})
    for tp, dtype, tokens, v_local in setups:
        rows = [r for r in results if tuple(r["setup"].values()) == (tp, dtype, tokens, v_local)]
        by_name = {r["method"]: r for r in rows}
        logits_mib = tokens * v_local * (4 if dtype == "fp32" else 2) / 2**20
        fused_fwd_s = by_name["fused"]["forward_ms"] / 1e3
        achieved = tp * tokens * v_local * (4 if dtype == "fp32" else 2) / fused_fwd_s  # all ranks together
        lines += [
            f"## TP={tp}, {dtype}, T={tokens} x V_local={v_local} per rank (logits {logits_mib:.0f} MiB per rank)",
            "",
            f"Fused forward reads {achieved / 1e9:.1f} GB/s over all ranks: {100 * achieved / bandwidth:.0f}% of the "
            "copy roof.",
            "",
            "| method | forward ms | fwd+bwd ms | fwd+bwd vs megatron | fwd+bwd vs naive | peak extra MiB | "
            "beyond input+grad |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        megatron = by_name["megatron vocab_parallel_cross_entropy"]["forward_backward_ms"]
        naive = by_name.get("naive torch", {}).get("forward_backward_ms")
        for r in rows:
            beyond = max(r["peak_extra_mib"] - r["gradient_mib"], 0.0)
            lines.append(
                f"| {r['method']} | {r['forward_ms']:.1f} | {r['forward_backward_ms']:.1f} | "
                f"{speedup(megatron, r['forward_backward_ms'])} | {speedup(naive, r['forward_backward_ms'])} | "
                f"{r['peak_extra_mib']:.0f} | {100 * beyond / logits_mib:.1f}% |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = sorted({tuple(r["setup"].values()) for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(setups)), 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs, ys = [], []
        for j, setup in enumerate(setups):
            match = [r for r in results if r["method"] == method and tuple(r["setup"].values()) == setup]
            if match:
                xs.append(j + i * width)
                ys.append(match[0]["forward_backward_ms"])
        ax.bar(xs, ys, width, label=method)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(setups))])
    ax.set_xticklabels([f"TP={s[0]} {s[1]}\n{s[2]}x{s[3]}" for s in setups])
    ax.set_ylabel("forward+backward, ms (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo bench logprob", description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes, TP=1 and 2, fp32 and bf16, 3 runs")
    parser.add_argument("--tp", type=int, nargs="+", default=None,
                        help="TP sizes; default 1 and 2 (on CUDA, 2 only with two GPUs)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--v-local", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=None, help="default: 5, or 3 with --quick")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    tokens, v_local = (1024, 4096) if args.quick else (args.tokens, args.v_local)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    device = torch.device(args.device)
    results = []
    tp_sizes = args.tp or ([1, 2] if args.device == "cpu" or torch.cuda.device_count() >= 2 else [1])
    for tp in tp_sizes:
        setups = [Setup(tp=tp, dtype=d, tokens=tokens, v_local=v_local) for d in args.dtypes]
        results += run_tp(tp, setups, args.device, repeats)
    bandwidth = copy_bandwidth_bytes_per_s(device, 2**30 if not args.quick else 2**27, repeats)
    text = report(results, device, bandwidth, repeats, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"logprob_{args.device}{'_quick' if args.quick else ''}"
    (args.out / f"{stem}.md").write_text(text + f"\n![forward+backward time]({stem}.png)\n")
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / f"{stem}.png")
    print(text)
    print(f"wrote {args.out / (stem + '.md')}")
    return 0
