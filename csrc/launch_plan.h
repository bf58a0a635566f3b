// Host-side launch planning of the CUDA logprob kernels: which kernel shape takes a call, how rows are cut across
// blocks, and the occupancy each kernel variant reaches. Plain C++ (no CUDA headers), so that the rules are tested
// on any machine (tests/ops/test_launch_plan.py compiles them with the host compiler).
//
// Two shapes of kernel stream the logits:
//   - rows of up to kWarpRowMaxCols columns, when there are enough of them to fill the GPU, go one warp per row, on
//     a persistent grid of one wave (each warp loops over rows; no shared memory, no block barrier);
//   - longer rows, or too few of them, go one block per row, split across several blocks while the rows are fewer
//     than one wave of the kernel: splits = floor(wave / rows), so that rows * splits never exceeds one wave (a
//     ceil would start a second wave that is only a fraction full).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace megatron_grpo {
namespace launch {

constexpr int kWarpSize = 32;
constexpr int kBlockThreads = 256;  // the most threads a block has (and the warp-per-row kernels' block)
constexpr int kWarpsPerBlock = kBlockThreads / kWarpSize;
// A block is sized so that each of its threads streams at least this many vectors of its row (chunk).
constexpr int kMinVectorsPerThread = 4;
// No split of a row gets fewer columns than this: splitting never costs more than it gains.
constexpr int64_t kMinSplitCols = 4096;
// Split boundaries are multiples of this many columns (16 bytes of 2-byte logits), so every split of a row sees the
// same alignment.
constexpr int64_t kSplitAlignCols = 8;
// Rows of up to this many columns can go one warp per row: 32 lanes then stream at most 64 16-byte vectors each.
constexpr int64_t kWarpRowMaxCols = 8192;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How a launch covers the rows.
struct LaunchPlan {
  bool warp_rows;  // one warp per row, persistent grid; else one block per row (split)
  int splits;      // blocks per row (1 for warp rows)
  int split_cols;  // columns per split (the last split of a row may get fewer)
  int threads;     // threads per block
  int64_t blocks;  // blocks of the grid (rows * splits for block rows; at most one wave for warp rows)
};

// Threads of a block streaming `width` columns: a power of two from a warp to kBlockThreads, each thread with at
// least kMinVectorsPerThread vectors where the width allows.
inline int threads_for(int64_t width, int64_t vector_size) {
  const int64_t vectors = ceil_div(width, vector_size);
  int threads = kWarpSize;
  while (threads < kBlockThreads && 2 * threads * kMinVectorsPerThread <= vectors) threads *= 2;
  return threads;
}

// Whether `rows` rows of `cols` columns go one warp per row: short enough rows, and at least as many rows as the
// warp kernel keeps resident (`warp_wave_blocks` blocks of kWarpsPerBlock warps), so that no SM idles.
inline bool use_warp_rows(int64_t rows, int64_t cols, int64_t warp_wave_blocks) {
  return cols <= kWarpRowMaxCols && rows >= std::max<int64_t>(warp_wave_blocks, 1) * kWarpsPerBlock;
}

// The warp-per-row launch: a persistent grid of at most one wave.
inline LaunchPlan plan_warp_rows(int64_t rows, int64_t warp_wave_blocks) {
  const int64_t blocks = std::min(ceil_div(rows, kWarpsPerBlock), std::max<int64_t>(warp_wave_blocks, 1));
  return {true, 1, 0, kBlockThreads, std::max<int64_t>(blocks, 1)};
}

// The block-per-row launch. A row's `valid_cols` are split (a mostly-padding shard launches no idle blocks) while
// there are fewer rows than `wave_blocks` (one wave of the kernel on the device): splits = floor(wave / rows), at most
// one split per kMinSplitCols columns. A block's threads follow its widest share of `cols` (backward's last split also
// writes the padding after the valid columns).
inline LaunchPlan plan_block_rows(int64_t rows, int64_t valid_cols, int64_t cols, int64_t vector_size,
                                  int64_t wave_blocks) {
  int64_t splits = 1;
  const int64_t wave = std::max<int64_t>(wave_blocks, 1);
  if (rows > 0 && rows < wave) {
    const int64_t most_useful = std::max<int64_t>(1, ceil_div(valid_cols, kMinSplitCols));
    splits = std::min<int64_t>({wave / rows, most_useful, static_cast<int64_t>(USHRT_MAX)});
  }
  const int64_t split_cols = ceil_div(ceil_div(valid_cols, splits), kSplitAlignCols) * kSplitAlignCols;
  if (split_cols > 0) splits = ceil_div(valid_cols, split_cols);
  const int64_t widest = std::max(split_cols, cols - (splits - 1) * split_cols);
  return {false, static_cast<int>(splits), static_cast<int>(split_cols), threads_for(widest, vector_size),
          rows * splits};
}

// Resident blocks per SM of each kernel variant on each device at each block size, asked of the driver once
// (`query(&blocks_per_sm)`, which returns a status, 0 for success) and cached. Keyed by the kernel's own address:
// every template instance (dtype, entropy, filter, in place or not) has its own occupancy.
class OccupancyCache {
 public:
  template <typename Query>
  int blocks_per_sm(const void* kernel, int device, int threads, int* blocks, Query&& query) {
    const Key key{kernel, device, threads};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto found = values_.find(key);
      if (found != values_.end()) {
        *blocks = found->second;
        return 0;
      }
    }
    int value = 0;
    const int status = query(&value);
    if (status != 0) return status;
    *blocks = std::max(value, 1);
    std::lock_guard<std::mutex> lock(mutex_);
    values_.emplace(key, *blocks);
    return 0;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.size();
  }

 private:
  using Key = std::tuple<const void*, int, int>;
  std::mutex mutex_;
  std::map<Key, int> values_;
};

}  // namespace launch
}  // namespace megatron_grpo
