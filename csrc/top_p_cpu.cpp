// CPU kernels of the top-p threshold search (see top_p_cpu.h): OpenMP over rows, one scalar pass over a row each.
#include "top_p_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <limits>

#include "cpu_dtypes.h"
#include "top_p.h"

namespace megatron_grpo {
namespace top_p {
namespace cpu {
namespace {

constexpr int64_t kMinElementsPerTask = 1 << 15;

// Calls visit(element) for every kept logit of each row's boundary bin (all kept logits with boundary null), rows in
// parallel: f(row, begin_visiting) where begin_visiting(visit) streams the row.
template <typename T, typename Row>
void for_each_row(const void* logits, int64_t rows, int64_t cols, int64_t row_stride, float scale, const float* shift,
                  const float* floor, Row&& row_fn) {
  const T* base = static_cast<const T*>(logits);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = base + r * row_stride;
      const float row_shift = shift[r];
      const float row_floor = floor != nullptr ? floor[r] : -std::numeric_limits<float>::infinity();
      row_fn(r, [&](auto&& visit) {
        for (int64_t i = 0; i < cols; ++i) {
          const Element e = element_of(static_cast<float>(x[i]), scale, row_shift, row_floor);
          if (e.kept) visit(e);
        }
      });
    }
  });
}

}  // namespace

void value_histogram(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                     float scale, const float* shift, const float* floor, double* hist) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row<T>(logits, rows, cols, row_stride, scale, shift, floor, [&](int64_t r, auto&& stream) {
      double* row_hist = hist + r * kValueBins;
      std::fill(row_hist, row_hist + kValueBins, 0.0);
      stream([&](const Element& e) { row_hist[value_bin(e.centered)] += mass_of(e); });
    });
  });
}

void candidates(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride, float scale,
                const float* shift, const float* floor, const int64_t* boundary, int64_t capacity, int32_t* keys,
                int64_t* counts) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row<T>(logits, rows, cols, row_stride, scale, shift, floor, [&](int64_t r, auto&& stream) {
      int64_t count = 0;
      const int bin = static_cast<int>(boundary[r]);
      stream([&](const Element& e) {
        if (value_bin(e.centered) != bin) return;
        if (count < capacity) keys[r * capacity + count] = static_cast<int32_t>(ordered_key(e.z));
        ++count;
      });
      counts[r] = count;
    });
  });
}

void bucket_masses(const void* logits, LogitsDType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                   float scale, const float* shift, const float* floor, const int64_t* boundary, int64_t capacity,
                   const int32_t* keys, const int64_t* counts, const int64_t* prefix, int low_bit, double* out) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row<T>(logits, rows, cols, row_stride, scale, shift, floor, [&](int64_t r, auto&& stream) {
      double* row_out = out + r * kBucketSlots;
      std::fill(row_out, row_out + kBucketSlots, 0.0);
      if (counts[r] <= capacity) {  // the compact candidates; the row is not read
        for (int64_t i = 0; i < counts[r]; ++i) {
          const auto key = static_cast<uint32_t>(keys[r * capacity + i]);
          row_out[bucket_slot(key, low_bit, prefix[r])] += mass_of_key(key, shift[r]);
        }
        return;
      }
      const int bin = static_cast<int>(boundary[r]);
      stream([&](const Element& e) {
        if (value_bin(e.centered) == bin) row_out[bucket_slot(ordered_key(e.z), low_bit, prefix[r])] += mass_of(e);
      });
    });
  });
}

}  // namespace cpu
}  // namespace top_p
}  // namespace megatron_grpo
