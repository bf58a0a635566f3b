"""What the compiler makes of the CUDA kernels for sm_90 (H100/H200), checked without a GPU where nvcc exists.

- Every kernel variant stays within its register budget (what `__launch_bounds__` leaves it at 256 threads: 64 for the
  forward kernels, 85 for the backward ones) and spills nothing (ptxas's report).
- The streaming kernels read the logits in 16-byte vectors: each has at least kUnroll + 1 128-bit global loads in its
  PTX (the unrolled loop and its remainder), and the kernels that never alias their gradient read them through the
  non-coherent path (`ld.global.nc.v4`, what `__restrict__` allows).
- In the SASS (where cuobjdump and nvdisasm are found: on PATH, next to nvcc, or the PyPI wheels `make install`
  adds where nvcc exists), the innermost loop of each streaming kernel loads 128 bits at a time, and
  in the out-of-place backward all four of its loads issue before its first store.

The compiled artifacts come from `make cuda-check` (build/cuda-check, as CI runs it before the tests) when they are
newer than csrc/; otherwise this module compiles the kernels itself for sm_90 (some 20 s of CPU time).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
CHECK_DIR = REPO / "build" / "cuda-check"
SOURCES = ("logprob_cuda", "top_p_cuda")
NVCC = shutil.which("nvcc") or (str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
                                if os.environ.get("CUDA_HOME") else None)
UNROLL = 4  # kUnroll in csrc/logprob_cuda.cu
BUDGETS = {"forward_": 64, "backward_": 85, "merge_splits_kernel": 40, "combine_kernel": 48,
           "value_histogram_kernel": 40, "candidates_kernel": 40, "bucket_masses_kernel": 40}

pytestmark = pytest.mark.skipif(NVCC is None or not Path(NVCC).exists(),
                                reason="nvcc not found (on PATH or in $CUDA_HOME/bin): no CUDA compile check here")


def _fresh(artifact: Path) -> bool:
    newest_source = max(path.stat().st_mtime for path in CSRC.iterdir() if path.suffix in (".cu", ".h"))
    return artifact.exists() and artifact.stat().st_mtime >= newest_source


def _compile(name: str, directory: Path) -> tuple[str, str, Path]:
    """(ptxas report, PTX, cubin) of one source for sm_90: make cuda-check's when fresh, else compiled here."""
    made = [CHECK_DIR / f"{name}.{suffix}" for suffix in ("ptxas.txt", "compute_90.ptx", "compute_90.cubin")]
    if all(_fresh(path) for path in made):
        return made[0].read_text(), made[1].read_text(), made[2]
    done = subprocess.run([NVCC, "-std=c++17", "-O3", f"-I{CSRC}", "-c", str(CSRC / f"{name}.cu"), "-o",
                           str(directory / f"{name}.o"), "-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v",
                           "--keep", "--keep-dir", str(directory)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr, (directory / f"{name}.ptx").read_text(), directory / f"{name}.cubin"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[str, str, Path]]:
    directory = tmp_path_factory.mktemp("cuda")
    return {name: _compile(name, directory) for name in SOURCES}


def _short(mangled: str) -> str:
    """A kernel's mangled name without its namespaces (for messages)."""
    return re.sub(r"^_ZN13megatron_grpo\d+_GLOBAL__N__\w+?_cu_[0-9a-f]+", "", mangled)


def _ptxas_report(text: str) -> dict[str, tuple[int, int]]:
    """kernel -> (registers, spill bytes) for sm_90."""
    report, current = {}, None
    for line in text.splitlines():
        entry = re.search(r"Compiling entry function '(\S+)' for 'sm_90'", line)
        if entry:
            current = entry.group(1)
            continue
        if current is None:
            continue
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spills:
            report[current] = (report.get(current, (0, 0))[0], int(spills.group(1)) + int(spills.group(2)))
        registers = re.search(r"Used (\d+) registers", line)
        if registers:
            report[current] = (int(registers.group(1)), report.get(current, (0, 0))[1])
            current = None
    return report


def _ptx_entries(ptx: str) -> dict[str, str]:
    return {part.split("(")[0].strip(): part for part in re.split(r"\.entry\s+", ptx)[1:]}


def _streaming(name: str) -> bool:
    return ("forward_" in name or "backward_" in name) and "merge" not in name


def test_every_kernel_fits_its_register_budget_without_spilling(compiled):
    seen = 0
    for name, (report, _, _) in compiled.items():
        kernels = _ptxas_report(report)
        assert kernels, f"{name}: no sm_90 kernel in ptxas's report"
        for kernel, (registers, spilled) in kernels.items():
            budget = next((b for key, b in BUDGETS.items() if key in kernel), None)
            assert budget is not None, f"{_short(kernel)} has no register budget here"
            assert registers <= budget, f"{_short(kernel)}: {registers} registers, budget {budget}"
            assert spilled == 0, f"{_short(kernel)} spills {spilled} bytes"
            seen += 1
    assert seen == 3 * 4 * 7 + 1 + 3 * 3  # dtypes x entropy x filter x (2 forward, 4 backward, merge), combine, top-p


def test_the_streaming_kernels_load_16_bytes_at_a_time(compiled):
    entries = _ptx_entries(compiled["logprob_cuda"][1])
    streaming = {name: body for name, body in entries.items() if _streaming(name)}
    assert len(streaming) == 3 * 4 * 6
    for name, body in streaming.items():
        vector_loads = re.findall(r"ld\.global(\.nc)?\.v4\.", body)
        assert len(vector_loads) >= UNROLL + 1, f"{_short(name)}: {len(vector_loads)} 128-bit loads"
        if "in_place" not in name:  # __restrict__ logits: the read-only, non-coherent path
            assert all(nc for nc in vector_loads), f"{_short(name)}: a 128-bit load outside the non-coherent path"


def _cuda_tool(name: str) -> str | None:
    """A CUDA binary tool: on PATH, next to nvcc, or from NVIDIA's PyPI wheel in this environment (nvidia/cu*/bin)."""
    wheels = sorted(Path(sys.prefix).glob(f"lib/python*/site-packages/nvidia/cu*/bin/{name}"))
    candidates = [shutil.which(name), str(Path(NVCC).parent / name) if NVCC else None, *map(str, wheels)]
    return next((path for path in candidates if path and Path(path).exists()), None)


CUOBJDUMP, NVDISASM = _cuda_tool("cuobjdump"), _cuda_tool("nvdisasm")


def _innermost_loops(sass: list[str]) -> list[list[str]]:
    """The instruction lines of each loop that holds no other loop (a branch back to an earlier address)."""
    address = [int(m.group(1), 16) if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line)) else None for line in sass]
    loops = []
    for i, line in enumerate(sass):
        branch = re.search(r"BRA (0x[0-9a-f]+)", line)
        if branch and address[i] is not None and int(branch.group(1), 16) < address[i]:
            start = next(j for j in range(i + 1) if address[j] is not None and address[j] >= int(branch.group(1), 16))
            loops.append((start, i))
    inner = [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
    return [sass[s:e + 1] for s, e in inner]


@pytest.mark.skipif(CUOBJDUMP is None or NVDISASM is None,
                    reason="cuobjdump or nvdisasm not found (on PATH, next to nvcc, or as NVIDIA's PyPI wheels, which "
                           "`make install` adds where nvcc exists): the SASS check needs both")
def test_the_hot_loops_issue_128_bit_loads_before_their_stores(compiled):
    sass = subprocess.run([CUOBJDUMP, "-sass", str(compiled["logprob_cuda"][2])], capture_output=True, text=True,
                          check=True, env={**os.environ, "NVDISASM_PATH": str(Path(NVDISASM).parent)}).stdout
    functions = re.split(r"\n\s*Function : ", sass)[1:]
    checked = 0
    for function in functions:
        name, *lines = function.splitlines()
        if not _streaming(name):
            continue
        hot = [loop for loop in _innermost_loops(lines) if sum("LDG.E.128" in line for line in loop) >= UNROLL]
        assert hot, f"{_short(name)}: no loop issues {UNROLL} 128-bit loads"
        for loop in hot:
            loads = [line for line in loop if "LDG" in line]
            assert all("LDG.E.128" in line for line in loads), f"{_short(name)}: a narrower load in its hot loop"
            if "backward" in name and "in_place" not in name:
                first_store = next(i for i, line in enumerate(loop) if "STG" in line)
                before = sum("LDG.E.128" in line for line in loop[:first_store])
                assert before >= UNROLL, f"{_short(name)}: {before} loads before the first store"
        checked += 1
    assert checked == 3 * 4 * 6
