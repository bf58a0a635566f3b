// The per-element maths of the top-p threshold search (megatron_grpo/ops/core/filtering.py has the algorithm and its
// plain-torch twin), shared by the CPU kernels (top_p_cpu.cpp) and the CUDA kernels (top_p_cuda.cu).
//
// A row's threshold is found in two stages, with no host synchronisation:
//   1. a histogram of the kept masses exp(z - M) (M the row max over every rank; float64 sums) by value bin: the
//      distance below M in bins of 1/8 nat, 256 bins (the last one takes every lower logit). Summed over the ranks,
//      it fixes the bin that holds the boundary;
//   2. the boundary bin's logits ("candidates", the ordered keys of at most `capacity` per row kept in a compact
//      buffer) go through an exact radix select over the ordered bit patterns of their fp32 z, 8 bits per pass (4
//      passes, or those of them that read a bit not 0 in every key), each a [rows, 257] histogram of masses by the
//      next 8 bits (bucket 256: off the prefix chosen so far). A candidate's mass is computed again from its key at
//      each pass (the key is z's bits): 4 bytes a candidate, not 12. A row with more candidates than the buffer holds
//      is read again from the logits at each pass instead.
// Logits below the top-k floor are neither kept nor counted. Bins, keys and masses are computed as the torch twin
// computes them (the masses in float64); only the order of the float64 sums differs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "logprob_common.h"

namespace megatron_grpo {
namespace top_p {

constexpr int kValueBins = 256;
constexpr float kValueBinsPerNat = 8.0f;
constexpr int kBucketBits = 8;
constexpr int kBuckets = 1 << kBucketBits;
constexpr int kBucketSlots = kBuckets + 1;  // the last: candidates off the prefix
constexpr int kKeyBits = 32;

// The value bin of a logit `centered = z - shift` (<= 0 below the row max): floor(-8 * centered), in [0, 255]; a NaN
// goes to the last bin, as torch's nan_to_num(nan=255).clamp(0, 255). Selects, no branches (the CPU kernels
// vectorise it).
MGRPO_HD int value_bin(float centered) {
  constexpr float kLast = static_cast<float>(kValueBins - 1);
  const float position = centered * -kValueBinsPerNat;
  const float low = position > 0.0f ? position : 0.0f;  // (NaN: 0, replaced below)
  const float clamped = low < kLast ? low : kLast;
  return position != position ? kValueBins - 1 : static_cast<int>(clamped);
}

// The bits of an fp32 in the order of its value, read as unsigned (NaN aside): the bits with every bit of a
// negative flipped, and the sign bit of a non-negative one.
MGRPO_HD uint32_t ordered_key(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The fp32 whose ordered_key is `key` (bit for bit, NaN included).
MGRPO_HD float value_of_key(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float value;
  memcpy(&value, &bits, sizeof(value));
  return value;
}

// What a logit contributes: its z and value bin, and whether the top-k floor keeps it.
struct Element {
  float z;
  float centered;
  bool kept;
};

MGRPO_HD Element element_of(float x, float scale, float shift, float floor) {
  const float z = x * scale;
  return {z, z - shift, !(z < floor)};  // floor = -inf without top-k
}

// The mass of a kept logit, exp(z - shift) in float64 (the twin's torch.exp of the fp32 difference into float64).
MGRPO_HD double mass_of(const Element& e) { return exp(static_cast<double>(e.centered)); }

// The same mass of a candidate from its key: z is the key's value, z - shift rounded in fp32 as element_of does.
MGRPO_HD double mass_of_key(uint32_t key, float shift) {
  return exp(static_cast<double>(value_of_key(key) - shift));
}

// Stage 1's choice from a row's value histogram (summed over the ranks): the boundary bin, the last non-empty bin
// whose higher bins hold less than p of the row's kept mass (bin 0 where none), and the mass that the boundary bin's
// kept logits must still reach. Sums in bin order (as filtering._boundary_bin's cumsum): the same float64 operations.
MGRPO_HD void choose_boundary(const double* value_masses, double p, int64_t* boundary, double* target) {
  double cumulative = 0.0;
  for (int bin = 0; bin < kValueBins; ++bin) cumulative += value_masses[bin];
  const double wanted = p * cumulative;  // p of the whole kept mass
  int64_t chosen = 0;  // where no bin is open
  double chosen_higher = value_masses[0] - value_masses[0];  // bin 0's higher mass: 0 (NaN for a NaN or inf bin)
  double running = 0.0;
  for (int bin = 0; bin < kValueBins; ++bin) {
    running += value_masses[bin];
    const double higher = running - value_masses[bin];  // the mass of the bins above this one
    if (higher < wanted && value_masses[bin] > 0.0) {
      chosen = bin;
      chosen_higher = higher;
    }
  }
  *boundary = chosen;
  *target = wanted - chosen_higher;
}

// One radix pass's choice from a row's `[kBucketSlots]` bucket masses (summed over the ranks; the last slot, off the
// prefix, is ignored): the highest bucket whose mass, with the buckets above it, reaches `target` (lowered first to
// the prefix's whole mass, fmin), appended to `prefix`; `target` less the mass of the buckets above it. The suffix
// sums run from the top bucket down, as filtering._radix_select's cumsum of the flipped masses.
MGRPO_HD void choose_bucket(const double* masses, double* target, int64_t* prefix) {
  double at_or_above[kBuckets + 1];  // [j]: the mass of the buckets >= kBuckets - j; [0] = 0 (the off-prefix slot)
  at_or_above[0] = 0.0;
  for (int j = 1; j <= kBuckets; ++j) at_or_above[j] = at_or_above[j - 1] + masses[kBuckets - j];
  const double reach = fmin(*target, at_or_above[kBuckets]);
  int reaching = 0;
  for (int j = 1; j <= kBuckets; ++j) reaching += at_or_above[j] >= reach ? 1 : 0;
  const int64_t chosen = reaching > 0 ? reaching - 1 : 0;
  *target = *target - at_or_above[kBuckets - 1 - chosen];
  *prefix = (*prefix << kBucketBits) | chosen;
}

// The slot of a candidate's key in a radix pass over bits [low_bit, low_bit + 8): its next 8 bits when its higher
// bits are the prefix chosen so far (`prefix`, the bits above low_bit + 8), else the slot of the candidates off it.
MGRPO_HD int bucket_slot(uint32_t key, int low_bit, int64_t prefix) {
  const int prefix_bit = low_bit + kBucketBits;
  if (prefix_bit < kKeyBits && static_cast<int64_t>(key >> prefix_bit) != prefix) return kBuckets;
  return static_cast<int>((key >> low_bit) & (kBuckets - 1));
}

}  // namespace top_p
}  // namespace megatron_grpo
