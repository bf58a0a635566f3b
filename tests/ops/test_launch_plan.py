"""The CUDA kernels' launch rules (csrc/launch_plan.h), run on the CPU: the header is plain C++, so a small driver
compiled with the host compiler asks it for plans and occupancies and prints them.

- The occupancy cache is per kernel variant: two variants of one kernel (the same function type, other template
  arguments) each get their own query and value, per device and block size, each asked once.
- The split rule never starts a near-empty second wave: rows x splits stays within one wave, and takes as many
  splits as fit (up to one per 4096 columns).
- Rows of up to 8K columns go one warp per row when there are enough of them, on a grid of at most one wave.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
COMPILER = shutil.which("c++") or shutil.which("g++")

DRIVER = r"""
#include <cstdio>
#include "launch_plan.h"

using namespace megatron_grpo::launch;

template <bool kVariant> void kernel(const float*, int) {}

int main() {
  OccupancyCache cache;
  int queries = 0;
  auto query_returning = [&](int value) {
    return [&queries, value](int* out) { ++queries; *out = value; return 0; };
  };
  int blocks = 0;
  const void* a = reinterpret_cast<const void*>(&kernel<false>);
  const void* b = reinterpret_cast<const void*>(&kernel<true>);
  cache.blocks_per_sm(a, 0, 256, &blocks, query_returning(4)); std::printf("a0_256 %d\n", blocks);
  cache.blocks_per_sm(b, 0, 256, &blocks, query_returning(8)); std::printf("b0_256 %d\n", blocks);
  cache.blocks_per_sm(a, 0, 256, &blocks, query_returning(99)); std::printf("a0_256_again %d\n", blocks);
  cache.blocks_per_sm(a, 1, 256, &blocks, query_returning(3)); std::printf("a1_256 %d\n", blocks);
  cache.blocks_per_sm(a, 0, 128, &blocks, query_returning(6)); std::printf("a0_128 %d\n", blocks);
  const int failed = cache.blocks_per_sm(b, 2, 64, &blocks, [](int*) { return 7; });
  std::printf("failed_status %d\n", failed);
  std::printf("queries %d entries %zu\n", queries, cache.size());
  long long rows, valid, cols, vector, wave, warp_wave;
  while (std::scanf("%lld %lld %lld %lld %lld %lld", &rows, &valid, &cols, &vector, &wave, &warp_wave) == 6) {
    const LaunchPlan plan = use_warp_rows(rows, cols, warp_wave) ? plan_warp_rows(rows, warp_wave)
                                                                 : plan_block_rows(rows, valid, cols, vector, wave);
    std::printf("plan %d %d %d %d %lld\n", plan.warp_rows ? 1 : 0, plan.splits, plan.split_cols, plan.threads,
                static_cast<long long>(plan.blocks));
  }
}
"""

# rows, valid_cols, cols, vector elements, wave of the block kernel, wave of the warp kernel (blocks)
CASES = [
    (256, 131072, 131072, 8, 1056, 528),   # the roofline's short-wide shape: 4 splits, not 5 (ceil: 1.21 waves)
    (256, 131072, 131072, 4, 1056, 528),
    (8192, 32768, 32768, 8, 1056, 528),    # many long rows: one block each, no split
    (32768, 4096, 4096, 8, 1056, 528),     # many short rows: a warp each, one wave of blocks
    (32768, 4096, 4096, 4, 1056, 528),
    (1000, 4096, 4096, 8, 1056, 528),      # short rows but too few to fill the warps: blocks (and no split)
    (3, 100000, 100003, 4, 1056, 528),     # a few rows: one split per 4096 columns at most
    (7, 0, 64, 4, 1056, 528),              # a shard of padding only
    (1, 10, 10, 8, 1056, 528),
    (4224, 8192, 8192, 8, 1056, 528),      # exactly the warp kernel's resident warps
]


@pytest.fixture(scope="module")
def driver_output(tmp_path_factory) -> list[str]:
    if COMPILER is None:
        pytest.skip("no host C++ compiler (c++ or g++) on PATH")
    directory = tmp_path_factory.mktemp("launch_plan")
    (directory / "driver.cpp").write_text(DRIVER)
    binary = directory / "driver"
    subprocess.run([COMPILER, "-std=c++17", "-O1", f"-I{CSRC}", str(directory / "driver.cpp"), "-o", str(binary),
                    "-pthread"], check=True, capture_output=True, text=True)
    stdin = "".join(" ".join(map(str, case)) + "\n" for case in CASES)
    return subprocess.run([str(binary)], input=stdin, check=True, capture_output=True, text=True).stdout.splitlines()


def test_the_occupancy_cache_is_per_kernel_variant_device_and_block_size(driver_output):
    values = dict(line.split(maxsplit=1) for line in driver_output if not line.startswith("plan"))
    assert values["a0_256"] == "4" and values["b0_256"] == "8"  # two variants of one kernel: two values
    assert values["a0_256_again"] == "4"  # cached: the second query is never asked
    assert values["a1_256"] == "3" and values["a0_128"] == "6"  # per device, per block size
    assert values["failed_status"] == "7"  # a failed query is returned, not cached
    assert values["queries"] == "4 entries 4"


def plans(driver_output) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in line.split()[1:]) for line in driver_output if line.startswith("plan")]


def test_the_split_rule_fills_one_wave_and_never_starts_a_second(driver_output):
    for (rows, valid, _, _, wave, _), (warp_rows, splits, split_cols, threads, blocks) in zip(
            CASES, plans(driver_output)):
        if warp_rows:
            continue
        assert blocks == rows * splits
        assert splits == 1 or rows * splits <= wave, (rows, valid, splits)
        most_useful = max(1, -(-valid // 4096))
        assert splits <= max(1, min(wave // rows, most_useful)), (rows, valid, splits)
        assert split_cols % 8 == 0 and (splits - 1) * split_cols < max(valid, 1)
        assert threads in (32, 64, 128, 256)
    by_case = dict(zip(CASES, plans(driver_output)))
    assert by_case[CASES[0]][1] == 4  # floor(1056 / 256); ceil would give 5, a second wave 21% full
    assert by_case[CASES[6]][1] == 25  # 100000 columns: 25 splits of 4000, not 352
    assert by_case[CASES[7]][:2] == (0, 1)  # padding only: one block per row, nothing to split


def test_short_rows_go_one_warp_each_on_a_persistent_grid(driver_output):
    by_case = dict(zip(CASES, plans(driver_output)))
    for case in (CASES[3], CASES[4], CASES[9]):
        warp_rows, splits, _, threads, blocks = by_case[case]
        assert (warp_rows, splits, threads) == (1, 1, 256)
        assert blocks == min(-(-case[0] // 8), case[5])  # at most one wave of the warp kernel
    assert by_case[CASES[3]][4] == 528  # 32768 rows: one wave of 528 blocks loops over them
    assert by_case[CASES[5]][0] == 0  # 1000 rows cannot fill 528 x 8 warps
    assert by_case[CASES[2]][0] == 0  # 32768 columns: one block per row
