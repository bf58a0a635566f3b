// CPU kernels of the top-p threshold search (see top_p_cpu.h): OpenMP over rows; a pass over a row reads it a block
// of logits at a time, their z, z - shift and value bins on at::vec float vectors, and the value histogram's float64
// exponentials on at::vec double vectors (Sleef's exp, 1 ulp); the sums into bins and buckets are scalar.
//
// Compiled once per instruction set (setup.py), with CPU_CAPABILITY naming both at::vec's implementation and this
// file's namespace; top_p_cpu.cpp picks one at run time (cpu_isa.h).
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include "top_p_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_dtypes.h"
#include "top_p.h"

namespace megatron_grpo {
namespace top_p {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kMinElementsPerTask = 1 << 15;

using Vec = at::vec::Vectorized<float>;
using DoubleVec = at::vec::Vectorized<double>;
constexpr int64_t kBlock = 2 * Vec::size();  // logits per block: one vector of 16-bit logits
constexpr int kCopies = 4;  // interleaved copies of the value histogram: a run of logits in one bin adds to 4 sums

// A block's logits as two float vectors (a short last block: `count` of them, the rest 0).
template <typename T>
inline std::tuple<Vec, Vec> load_block(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    const Vec lo = Vec::loadu(p, static_cast<int>(std::min<int64_t>(count, Vec::size())));
    return {lo, count > Vec::size() ? Vec::loadu(p + Vec::size(), static_cast<int>(count - Vec::size())) : Vec(0.0f)};
  } else {
    return at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, static_cast<int>(count)));
  }
}

// value_bin (top_p.h) on a vector, select for select.
inline Vec value_bins(const Vec& centered) {
  const Vec position = centered * Vec(-kValueBinsPerNat);
  const Vec low = Vec::blendv(Vec(0.0f), position, position > Vec(0.0f));
  const Vec last(static_cast<float>(kValueBins - 1));
  const Vec clamped = Vec::blendv(last, low, low < last);
  return Vec::blendv(clamped, last, position.isnan());
}

// A block of a row's logits as the search sees them (element_of, on float vectors): z, z - shift (-inf where the
// top-k floor drops the logit, so that its mass is 0) and the value bin; `count` of them are logits.
struct Block {
  alignas(64) float z[kBlock];
  alignas(64) float centered[kBlock];
  alignas(64) int32_t bins[kBlock];
  int64_t count;
};

struct RowConstants {
  Vec scale, shift, floor;
};

template <typename T>
inline void load_elements(const T* x, int64_t count, const RowConstants& row, Block& block) {
  block.count = count;
  const auto [lo, hi] = load_block(x, count);
  const Vec dropped(-std::numeric_limits<float>::infinity());
  const auto store = [&](const Vec& logits, int64_t at) {
    const Vec z = logits * row.scale;
    const Vec centered = z - row.shift;
    z.store(block.z + at);
    at::vec::convert_to_int_of_same_size(value_bins(centered)).store(block.bins + at);
    Vec::blendv(centered, dropped, z < row.floor).store(block.centered + at);
  };
  store(lo, 0);
  store(hi, Vec::size());
}

// Calls fn(block) for each block of the row.
template <typename T, typename Fn>
inline void for_each_block(const T* x, int64_t cols, float scale, float shift, float floor, Fn&& fn) {
  const RowConstants row{Vec(scale), Vec(shift), Vec(floor)};
  Block block;
  for (int64_t begin = 0; begin < cols; begin += kBlock) {
    load_elements(x + begin, std::min<int64_t>(kBlock, cols - begin), row, block);
    fn(block);
  }
}

// One row's value histogram: per block the masses as float64 vector exponentials (Sleef's, 1 ulp, as torch's
// float64 exp), then each mass added to its bin in one of `kCopies` copies in turn (so that consecutive logits of
// one bin do not wait on each other's sum), the copies summed at the end of the row.
template <typename T>
void value_histogram_row(const T* x, int64_t cols, float scale, float shift, float floor, double* row_hist) {
  double copies[kCopies][kValueBins] = {};
  alignas(64) double centered[kBlock];
  alignas(64) double mass[kBlock];
  for_each_block(x, cols, scale, shift, floor, [&](const Block& block) {
    for (int64_t i = 0; i < kBlock; ++i) centered[i] = static_cast<double>(block.centered[i]);
    for (int64_t i = 0; i < kBlock; i += DoubleVec::size()) DoubleVec::loadu(centered + i).exp().store(mass + i);
    for (int64_t i = 0; i < block.count; ++i) copies[i % kCopies][block.bins[i]] += mass[i];
  });
  for (int bin = 0; bin < kValueBins; ++bin) {
    row_hist[bin] = (copies[0][bin] + copies[1][bin]) + (copies[2][bin] + copies[3][bin]);
  }
}

// Calls row_fn(r, x, shift, floor) for each row, rows in parallel.
template <typename T, typename RowFn>
void for_each_row_of(const void* logits, int64_t rows, int64_t cols, int64_t row_stride, const float* shift,
                     const float* floor, RowFn&& row_fn) {
  const T* base = static_cast<const T*>(logits);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float row_floor = floor != nullptr ? floor[r] : -std::numeric_limits<float>::infinity();
      row_fn(r, base + r * row_stride, shift[r], row_floor);
    }
  });
}

// The largest logit of a row (NaN if any is NaN; -inf for an empty row), as torch's amax.
template <typename T>
float row_max(const T* x, int64_t cols) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  Vec best(kLowest);
  int64_t i = 0;
  for (; i + kBlock <= cols; i += kBlock) {
    const auto [lo, hi] = load_block(x + i, kBlock);
    best = at::vec::maximum(best, at::vec::maximum(lo, hi));  // (NaN propagates)
  }
  alignas(64) float lanes[Vec::size()];
  best.store(lanes);
  float m = kLowest;
  const auto take = [&m](float v) { m = (m != m || !(v != v || v > m)) ? m : v; };
  for (int lane = 0; lane < Vec::size(); ++lane) take(lanes[lane]);
  for (; i < cols; ++i) take(static_cast<float>(x[i]));
  return m;
}

// A row's candidates (its kept logits in the boundary `bin`): their count, and the keys of the first `capacity`.
template <typename T>
int64_t row_candidates(const T* x, int64_t cols, float scale, float shift, float floor, int64_t bin,
                       int64_t capacity, int32_t* keys) {
  int64_t count = 0;
  for_each_block(x, cols, scale, shift, floor, [&](const Block& block) {
    for (int64_t i = 0; i < block.count; ++i) {
      if (block.bins[i] != bin || block.z[i] < floor) continue;  // (kept: not below the top-k floor)
      if (count < capacity) keys[count] = static_cast<int32_t>(ordered_key(block.z[i]));
      ++count;
    }
  });
  return count;
}

// One radix pass over a row's `count` candidates: `masses` ([kBucketSlots], overwritten) by bucket_slot; from the
// keys where they all fit in `capacity`, else read again from the logits.
template <typename T>
void row_bucket_masses(const T* x, int64_t cols, float scale, float shift, float floor, int64_t bin,
                       int64_t capacity, const int32_t* keys, int64_t count, int64_t prefix, int low_bit,
                       double* masses) {
  std::fill(masses, masses + kBucketSlots, 0.0);
  if (count <= capacity) {  // the compact candidates; the row is not read
    for (int64_t i = 0; i < count; ++i) {
      const auto key = static_cast<uint32_t>(keys[i]);
      masses[bucket_slot(key, low_bit, prefix)] += mass_of_key(key, shift);
    }
    return;
  }
  for_each_block(x, cols, scale, shift, floor, [&](const Block& block) {
    for (int64_t i = 0; i < block.count; ++i) {
      if (block.bins[i] != bin || block.z[i] < floor) continue;
      const auto key = ordered_key(block.z[i]);
      masses[bucket_slot(key, low_bit, prefix)] += mass_of_key(key, shift);
    }
  });
}

// One row's whole search (see top_p_cpu.h's threshold); `keys` holds `capacity` candidates.
template <typename T>
float row_threshold(const T* x, int64_t cols, float scale, float floor, bool has_floor, double top_p,
                    int64_t capacity, int zero_bits, int32_t* keys) {
  const float row_top = cols > 0 ? row_max(x, cols) * scale : -std::numeric_limits<float>::infinity();
  const bool finite = std::isfinite(row_top);
  const float shift = finite ? row_top : 0.0f;
  double hist[kValueBins];
  value_histogram_row(x, cols, scale, shift, floor, hist);
  int64_t boundary;
  double target;
  choose_boundary(hist, top_p, &boundary, &target);
  const int64_t count = row_candidates(x, cols, scale, shift, floor, boundary, capacity, keys);
  int64_t prefix = 0;
  const int lowest = zero_bits / kBucketBits * kBucketBits;
  for (int low_bit = kKeyBits - kBucketBits; low_bit >= lowest; low_bit -= kBucketBits) {
    double masses[kBucketSlots];
    row_bucket_masses(x, cols, scale, shift, floor, boundary, capacity, keys, count, prefix, low_bit, masses);
    choose_bucket(masses, &target, &prefix);
  }
  float threshold = finite ? value_of_key(static_cast<uint32_t>(prefix << lowest))
                           : -std::numeric_limits<float>::infinity();
  if (!has_floor) return threshold;
  const bool nan = threshold != threshold || floor != floor;  // torch.maximum propagates NaN
  return nan ? std::numeric_limits<float>::quiet_NaN() : std::max(threshold, floor);
}

}  // namespace

void value_histogram(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                     float scale, const float* shift, const float* floor, double* hist) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row_of<T>(logits, rows, cols, row_stride, shift, floor, [&](int64_t r, const T* x, float s, float f) {
      value_histogram_row(x, cols, scale, s, f, hist + r * kValueBins);
    });
  });
}

void candidates(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride, float scale,
                const float* shift, const float* floor, const int64_t* boundary, int64_t capacity, int32_t* keys,
                int64_t* counts) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row_of<T>(logits, rows, cols, row_stride, shift, floor, [&](int64_t r, const T* x, float s, float f) {
      counts[r] = row_candidates(x, cols, scale, s, f, boundary[r], capacity, keys + r * capacity);
    });
  });
}

void bucket_masses(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                   float scale, const float* shift, const float* floor, const int64_t* boundary, int64_t capacity,
                   const int32_t* keys, const int64_t* counts, const int64_t* prefix, int low_bit, double* out) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row_of<T>(logits, rows, cols, row_stride, shift, floor, [&](int64_t r, const T* x, float s, float f) {
      row_bucket_masses(x, cols, scale, s, f, boundary[r], capacity, keys + r * capacity, counts[r], prefix[r],
                        low_bit, out + r * kBucketSlots);
    });
  });
}

void threshold(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride, float scale,
               const float* floor, double top_p, int64_t capacity, int zero_bits, float* out) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* base = static_cast<const T*>(logits);
    const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(cols, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> keys(static_cast<size_t>(std::max<int64_t>(capacity, 1)));
      for (int64_t r = begin; r < end; ++r) {
        const bool has_floor = floor != nullptr;
        const float row_floor = has_floor ? floor[r] : -std::numeric_limits<float>::infinity();
        out[r] = row_threshold(base + r * row_stride, cols, scale, row_floor, has_floor, top_p, capacity, zero_bits,
                               keys.data());
      }
    });
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace top_p
}  // namespace megatron_grpo
