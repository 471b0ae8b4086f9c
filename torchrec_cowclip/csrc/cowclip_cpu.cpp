// Native CPU kernels of the fused CowClip update: torch custom ops in the namespace
// `torchrec_cowclip`, built on first use by torch.utils.cpp_extension
// (torchrec_cowclip/embedding/native.py loads them and documents the Python side).
//
// The math is optim/functional.py's (docs/algorithm.md, steps 2-5); that module stays the
// reference the tests hold these kernels to. What the kernels add is the memory access
// pattern: one pass over the distinct rows of a batch that, per row, sums the bag
// gradients of its positions, checks finiteness, clips, adds L2, takes the optimizer
// step and writes the weight and state back, with the rows of the next iterations
// prefetched. Why a hand-written kernel: docs/performance.md, "The native CPU update".
//
// Ops (schemas in TORCH_LIBRARY below):
//   group_rows      stable radix sort of the looked-up row ids and the distinct rows,
//                   their counts and position segments: embedding/row_gradients.py's
//                   RowGrouping, identical to torch.sort(stable=True) + unique_consecutive.
//                   Given each feature's positions and row range, the features of each
//                   table sort on their own (in parallel, in cache, with digits as wide
//                   as the table needs); one large range uses FBGEMM's radix_sort_parallel
//                   where libtorch_cpu carries it (COWCLIP_FBGEMM_RADIX_SORT=1, set by
//                   embedding/native.py from torchrec_cowclip/compat.py's check), else
//                   the same radix sort as the tables'.
//   fused_update_   the per-row update above, in place; returns a status per row
//                   (0 updated, 1 updated and clipped, 2 skipped: non-finite) and per
//                   table counts of the three.
//   pooled_lookup   sum / mean pooled lookup with float32 output for float32, float16 and
//                   bfloat16 tables (the half tables' forward).
//   stochastic_round, rounding_row_keys
//                   the rounding of updated float32 rows into float16 / bfloat16 storage,
//                   exposed for the tests that hold it to optim/functional.py bit for bit.
//
// Every index an op reads or writes through is checked first, with one TORCH_CHECK per
// input (offsets start at 0 and ascend, ids and rows lie in their tables, bags in the
// gradient), in one pass over the offsets and rows: a wrong caller gets a one-line error
// and no write outside the tensors.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#ifndef COWCLIP_FBGEMM_RADIX_SORT
#define COWCLIP_FBGEMM_RADIX_SORT 0
#endif
#if COWCLIP_FBGEMM_RADIX_SORT
#include <fbgemm/Utils.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace torchrec_cowclip_native {

using at::Tensor;

// --- stochastic rounding (optim/functional.py: mix32, rounding_row_keys, stochastic_round) ---

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x2c1b3c6dU;
  x ^= x >> 16;
  return x;
}

constexpr uint32_t kRowSalt = 0x9E3779B9U;
constexpr uint32_t kColumnSalt = 0x85EBCA6BU;

inline uint32_t row_key(int64_t seed, int64_t step, int64_t global_row) {
  const uint64_t row = static_cast<uint64_t>(global_row);
  uint32_t h = mix32(static_cast<uint32_t>(row >> 32) + kRowSalt);
  h = mix32(static_cast<uint32_t>(row) ^ h);
  h = mix32(static_cast<uint32_t>(static_cast<uint64_t>(step)) ^ h);
  return mix32(static_cast<uint32_t>(static_cast<uint64_t>(seed)) ^ h);
}

inline uint32_t element_bits(uint32_t key, int64_t column) {
  return mix32(key ^ mix32(static_cast<uint32_t>(static_cast<uint64_t>(column)) + kColumnSalt));
}

inline uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

inline float bits_float(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

// bfloat16: add 16 random bits below the kept ones, then truncate.
inline c10::BFloat16 round_bf16(float x, uint32_t random) {
  if (std::isnan(x)) {  // truncated, kept quiet
    return c10::BFloat16(static_cast<uint16_t>((float_bits(x) >> 16) | 0x40U),
                         c10::BFloat16::from_bits());
  }
  const uint32_t b = (float_bits(x) + (random >> 16)) & 0xFFFF0000U;
  return c10::BFloat16(bits_float(b));
}

// float16: the two float16 neighbours of |x| and a uniform draw against the distance.
inline c10::Half round_fp16(float x, uint32_t random) {
  const float ax = std::fabs(x);
  if (!(ax < INFINITY)) {
    return c10::Half(x);
  }
  uint16_t h = c10::Half(ax).x;  // round to nearest even
  if (static_cast<float>(c10::Half(h, c10::Half::from_bits())) > ax) {
    h -= 1;  // towards zero
  }
  const float lo = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  const float hi = static_cast<float>(c10::Half(static_cast<uint16_t>(h + 1), c10::Half::from_bits()));
  const float p = (ax - lo) / (hi - lo);
  const float u = static_cast<float>(random >> 8) * (1.0f / 16777216.0f);
  if (u < p) {
    h += 1;
  }
  if (std::signbit(x)) {
    h |= 0x8000U;
  }
  return c10::Half(h, c10::Half::from_bits());
}

template <typename W>
inline W store_value(float x, uint32_t key, int64_t column);

template <>
inline float store_value<float>(float x, uint32_t, int64_t) {
  return x;
}

template <>
inline c10::Half store_value<c10::Half>(float x, uint32_t key, int64_t column) {
  return round_fp16(x, element_bits(key, column));
}

template <>
inline c10::BFloat16 store_value<c10::BFloat16>(float x, uint32_t key, int64_t column) {
  return round_bf16(x, element_bits(key, column));
}

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(c + off, 1, 1);
  }
}

inline void prefetch_read(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(c + off, 0, 1);
  }
}

// --- group_rows ------------------------------------------------------------------------

// One unit of the grouping: the positions of the features that look up one row range
// (a table of the batch), in input order; units of disjoint ranges sort independently,
// in parallel and in cache, and their outputs concatenate in row order.
struct SortUnit {
  int64_t row_start;
  int64_t num_rows;
  std::vector<std::pair<int64_t, int64_t>> segments;  // position ranges, in input order
  int64_t size = 0;
  int64_t out = 0;  // where its sorted positions start in the output
};

// Stable LSD radix sort of (key, value) pairs, keys in [0, num_keys), digits of at most
// 11 bits; the result ends in (keys, values).
void radix_sort_pairs(std::vector<int32_t>& keys, std::vector<int32_t>& values,
                      std::vector<int32_t>& tmp_keys, std::vector<int32_t>& tmp_values,
                      int64_t num_keys) {
  const int64_t n = static_cast<int64_t>(keys.size());
  int bits = 0;
  while ((int64_t{1} << bits) < num_keys) ++bits;
  if (n <= 1 || bits == 0) return;
  const int passes = (bits + 10) / 11;
  const int digit = (bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit;
  std::vector<int64_t> count(buckets);
  tmp_keys.resize(n);
  tmp_values.resize(n);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * digit;
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[(keys[i] >> shift) & (buckets - 1)];
    int64_t total = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      const int64_t c = count[d];
      count[d] = total;
      total += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t o = count[(keys[i] >> shift) & (buckets - 1)]++;
      tmp_keys[o] = keys[i];
      tmp_values[o] = values[i];
    }
    keys.swap(tmp_keys);
    values.swap(tmp_values);
  }
}

// A unit's keys (row id - its first row) and positions, in input order; flags ids outside.
void gather_unit(const SortUnit& u, const int64_t* id, std::vector<int32_t>& keys,
                 std::vector<int32_t>& values, std::atomic<bool>& outside) {
  keys.resize(u.size);
  values.resize(u.size);
  int64_t i = 0;
  for (const auto& [lo, hi] : u.segments) {
    for (int64_t p = lo; p < hi; ++p, ++i) {
      const int64_t key = id[p] - u.row_start;
      if (key < 0 || key >= u.num_rows) outside = true;
      keys[i] = static_cast<int32_t>(key);
      values[i] = static_cast<int32_t>(p);
    }
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> group_rows(
    const Tensor& row_ids, const Tensor& bag_of_position, int64_t num_rows,
    const std::optional<Tensor>& feature_starts, const std::optional<Tensor>& feature_rows) {
  TORCH_CHECK(row_ids.dim() == 1 && row_ids.scalar_type() == at::kLong, "row_ids: [L] int64");
  TORCH_CHECK(bag_of_position.sizes() == row_ids.sizes() &&
                  bag_of_position.scalar_type() == at::kLong,
              "bag_of_position: [L] int64 like row_ids");
  TORCH_CHECK(num_rows >= 1 && num_rows <= INT32_MAX, "num_rows must be in [1, 2**31)");
  const int64_t n = row_ids.numel();
  TORCH_CHECK(n <= INT32_MAX, "at most 2**31 - 1 positions");
  const auto long_opts = row_ids.options().dtype(at::kLong);
  const Tensor ids = row_ids.contiguous();
  const Tensor bags = bag_of_position.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // The units: one per distinct row range of the features, or one for everything.
  std::vector<SortUnit> units;
  if (feature_starts.has_value()) {
    TORCH_CHECK(feature_rows.has_value(), "feature_starts and feature_rows come together");
    const Tensor fs = feature_starts->contiguous(), fr = feature_rows->contiguous();
    const int64_t F = fs.numel() - 1;
    TORCH_CHECK(fs.scalar_type() == at::kLong && fr.scalar_type() == at::kLong &&
                    fr.numel() == 2 * F && F >= 1,
                "feature_starts: [F + 1], feature_rows: [F, 2] int64");
    const int64_t* fsp = fs.data_ptr<int64_t>();
    const int64_t* frp = fr.data_ptr<int64_t>();
    TORCH_CHECK(fsp[0] == 0 && fsp[F] == n, "feature_starts must span the positions");
    bool rows_inside = true;
    for (int64_t f = 0; f < F; ++f) {
      rows_inside &= frp[2 * f] >= 0 && frp[2 * f + 1] >= 0 && frp[2 * f] + frp[2 * f + 1] <= num_rows;
    }
    TORCH_CHECK(rows_inside, "group_rows: feature_rows must lie in [0, num_rows = ", num_rows, ")");
    for (int64_t f = 0; f < F; ++f) {
      TORCH_CHECK(fsp[f] <= fsp[f + 1], "feature_starts must be ascending");
      auto it = std::find_if(units.begin(), units.end(), [&](const SortUnit& u) {
        return u.row_start == frp[2 * f] && u.num_rows == frp[2 * f + 1];
      });
      if (it == units.end()) {
        units.push_back(SortUnit{frp[2 * f], frp[2 * f + 1], {}});
        it = units.end() - 1;
      }
      it->segments.emplace_back(fsp[f], fsp[f + 1]);
      it->size += fsp[f + 1] - fsp[f];
    }
    std::stable_sort(units.begin(), units.end(), [](const SortUnit& x, const SortUnit& y) {
      return x.row_start < y.row_start;
    });
    for (size_t k = 0; k + 1 < units.size(); ++k) {
      TORCH_CHECK(units[k].row_start + units[k].num_rows <= units[k + 1].row_start,
                  "the features' row ranges overlap without being equal");
    }
  } else {
    units.push_back(SortUnit{0, num_rows, {{0, n}}, n});
  }
  int64_t offset = 0;
  for (auto& u : units) {
    u.out = offset;
    offset += u.size;
  }
  std::vector<int32_t> sorted_keys_v(n), sorted_values_v(n);
  int32_t* sorted_keys = sorted_keys_v.data();
  int32_t* sorted_values = sorted_values_v.data();
  std::atomic<bool> outside{false};
  if (COWCLIP_FBGEMM_RADIX_SORT && units.size() == 1 && n > 65536) {
#if COWCLIP_FBGEMM_RADIX_SORT
    // One range (a single table, or rows of no known layout): FBGEMM's parallel radix sort.
    const SortUnit& u = units[0];
    std::vector<int32_t> keys, values, tmp_keys(n), tmp_values(n);
    gather_unit(u, id, keys, values, outside);
    TORCH_CHECK(!outside.load(), "group_rows: a row id outside its feature's rows");
    auto [sk, sv] = fbgemm::radix_sort_parallel<int32_t, int32_t>(
        keys.data(), values.data(), tmp_keys.data(), tmp_values.data(), n, u.num_rows - 1, false);
    for (int64_t j = 0; j < n; ++j) {
      sorted_keys[j] = static_cast<int32_t>(sk[j] + u.row_start);
      sorted_values[j] = sv[j];
    }
#endif
  } else {
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t ub, int64_t ue) {
      std::vector<int32_t> keys, values, tmp_keys, tmp_values;
      for (int64_t k = ub; k < ue; ++k) {
        const SortUnit& u = units[k];
        gather_unit(u, id, keys, values, outside);
        radix_sort_pairs(keys, values, tmp_keys, tmp_values, u.num_rows);
        for (int64_t j = 0; j < u.size; ++j) {
          sorted_keys[u.out + j] = static_cast<int32_t>(keys[j] + u.row_start);
          sorted_values[u.out + j] = values[j];
        }
      }
    });
    TORCH_CHECK(!outside.load(), "group_rows: a row id outside its feature's rows");
  }

  // Distinct rows: chunks count their segment heads, then write them at their prefix.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 4096));
  std::vector<int64_t> heads(chunks + 1, 0);
  auto chunk_range = [&](int64_t c) {
    return std::make_pair(n * c / chunks, n * (c + 1) / chunks);
  };
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      auto [lo, hi] = chunk_range(c);
      int64_t count = 0;
      for (int64_t i = lo; i < hi; ++i) {
        count += (i == 0 || sorted_keys[i] != sorted_keys[i - 1]);
      }
      heads[c + 1] = count;
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    heads[c + 1] += heads[c];
  }
  const int64_t unique = heads[chunks];
  Tensor rows = at::empty({unique}, long_opts);
  Tensor counts = at::empty({unique}, long_opts);
  Tensor segment_offsets = at::empty({unique + 1}, long_opts);
  Tensor order = at::empty({n}, long_opts);
  Tensor sorted_bags = at::empty({n}, long_opts);
  int64_t* rows_p = rows.data_ptr<int64_t>();
  int64_t* seg_p = segment_offsets.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      auto [lo, hi] = chunk_range(c);
      int64_t j = heads[c];
      for (int64_t i = lo; i < hi; ++i) {
        if (i == 0 || sorted_keys[i] != sorted_keys[i - 1]) {
          rows_p[j] = sorted_keys[i];
          seg_p[j] = i;
          ++j;
        }
      }
    }
  });
  seg_p[unique] = n;
  int64_t* counts_p = counts.data_ptr<int64_t>();
  at::parallel_for(0, unique, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      counts_p[j] = seg_p[j + 1] - seg_p[j];
    }
  });
  int64_t* order_p = order.data_ptr<int64_t>();
  int64_t* sorted_bags_p = sorted_bags.data_ptr<int64_t>();
  const int64_t* bag_p = bags.data_ptr<int64_t>();
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t position = sorted_values[i];
      order_p[i] = position;
      sorted_bags_p[i] = bag_p[position];
    }
  });
  return {rows, counts, segment_offsets, order, sorted_bags};
}

// --- fused_update_ ---------------------------------------------------------------------

enum Optimizer : int64_t { kAdam = 0, kRowwiseAdagrad = 1, kSgd = 2, kAdagrad = 3, kAdamW = 4 };

constexpr int8_t kUpdated = 0;
constexpr int8_t kClipped = 1;
constexpr int8_t kSkipped = 2;

// Rows ahead whose weight and state are prefetched, and positions ahead whose bag
// gradient is prefetched.
#ifndef COWCLIP_ROW_PREFETCH
#define COWCLIP_ROW_PREFETCH 32
#endif
#ifndef COWCLIP_POSITION_PREFETCH
#define COWCLIP_POSITION_PREFETCH 64
#endif
constexpr int64_t kRowPrefetch = COWCLIP_ROW_PREFETCH;
constexpr int64_t kPositionPrefetch = COWCLIP_POSITION_PREFETCH;

struct UpdateArgs {
  int64_t dim;
  int64_t num_rows_touched;
  int64_t num_tables;
  const int64_t* rows;
  const int64_t* counts;
  const float* grad;  // [U, D] row gradients, or [M, D] bag gradients with segments
  const int64_t* segment_offsets;  // [U + 1] or null
  const int64_t* sorted_bags;  // [L] or null
  const float* sorted_weights;  // [L] or null
  const int64_t* row_offsets;  // [T + 1]
  const bool* clip_enabled;  // [T] or null (all clipped)
  const float* bias1;  // [T] (Adam)
  const float* bias2;
  const float* row_sums;  // [U, 5]: nonfinite, grad_sq, weight_sq, grad_dot_weight, dim; or null
  const int64_t* rounding;  // [T, 4]: seed, step, row base, column base; or null
  float* state0;  // Adam / AdamW exp_avg [R, D]; row-wise Adagrad sum [R]; Adagrad sum [R, D]
  float* state1;  // Adam / AdamW exp_avg_sq [R, D]
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  bool clip;
  float r, zeta;
  bool count_lr;
  float count_lr_power, count_lr_cap;
  int8_t* status;
  int64_t* per_table;  // [3, T]: updated, clipped, skipped
};

inline float pow_like_torch(float base, float exponent) {
  // ATen's pow(tensor, scalar) special-cases these exponents.
  if (exponent == 0.5f) return std::sqrt(base);
  if (exponent == 1.0f) return base;
  if (exponent == 2.0f) return base * base;
  if (exponent == 3.0f) return base * base * base;
  if (exponent == -0.5f) return 1.0f / std::sqrt(base);
  if (exponent == -1.0f) return 1.0f / base;
  if (exponent == -2.0f) return 1.0f / (base * base);
  return std::pow(base, exponent);
}

template <typename W, int64_t OPT, int64_t DS>
void update_rows(const UpdateArgs& a, W* weight, int64_t begin, int64_t end) {
  const int64_t D = DS > 0 ? DS : a.dim;
  const int64_t T = a.num_tables;
  std::vector<float> buffers(2 * D);
  float* g = buffers.data();
  float* w = buffers.data() + D;
  std::vector<int64_t> local(3 * T, 0);
  // Rows are ascending and tables are ascending row ranges: find the first row's table,
  // then walk.
  int64_t t = std::upper_bound(a.row_offsets, a.row_offsets + T + 1, a.rows[begin]) -
      a.row_offsets - 1;
  const bool segments = a.segment_offsets != nullptr;
  const int64_t last_position = segments ? a.segment_offsets[a.num_rows_touched] : 0;
  for (int64_t u = begin; u < end; ++u) {
    if (u + kRowPrefetch < end) {
      const int64_t ahead = a.rows[u + kRowPrefetch];
      prefetch_bytes(weight + ahead * D, D * static_cast<int64_t>(sizeof(W)));
      if (OPT == kAdam || OPT == kAdamW) {
        prefetch_bytes(a.state0 + ahead * D, D * 4);
        prefetch_bytes(a.state1 + ahead * D, D * 4);
      } else if (OPT == kAdagrad) {
        prefetch_bytes(a.state0 + ahead * D, D * 4);
      } else if (OPT == kRowwiseAdagrad) {
        __builtin_prefetch(a.state0 + ahead, 1, 1);
      }
    }
    const int64_t row = a.rows[u];
    while (row >= a.row_offsets[t + 1]) {
      ++t;
    }
    // Step 2: the row's gradient, its positions summed in input order.
    if (segments) {
      for (int64_t d = 0; d < D; ++d) g[d] = 0.0f;
      const int64_t p1 = a.segment_offsets[u + 1];
      for (int64_t p = a.segment_offsets[u]; p < p1; ++p) {
        if (p + kPositionPrefetch < last_position) {
          prefetch_read(a.grad + a.sorted_bags[p + kPositionPrefetch] * D, D * 4);
        }
        const float* bag = a.grad + a.sorted_bags[p] * D;
        if (a.sorted_weights != nullptr) {
          const float pw = a.sorted_weights[p];
          for (int64_t d = 0; d < D; ++d) g[d] += pw * bag[d];
        } else {
          for (int64_t d = 0; d < D; ++d) g[d] += bag[d];
        }
      }
    } else {
      const float* src = a.grad + u * D;
      for (int64_t d = 0; d < D; ++d) g[d] = src[d];
    }
    const float* sums = a.row_sums != nullptr ? a.row_sums + u * 5 : nullptr;
    bool finite;
    if (sums != nullptr) {
      finite = sums[0] == 0.0f;
    } else {
      float total = 0.0f;
      for (int64_t d = 0; d < D; ++d) total += g[d];
      finite = std::isfinite(total);
    }
    if (!finite) {
      a.status[u] = kSkipped;
      local[2 * T + t] += 1;
      continue;
    }
    W* wp = weight + row * D;
    for (int64_t d = 0; d < D; ++d) w[d] = static_cast<float>(wp[d]);
    const float count = static_cast<float>(a.counts[u]);
    // Step 3: the CowClip clip.
    float scale = 1.0f;
    bool clipped = false;
    if (a.clip && (a.clip_enabled == nullptr || a.clip_enabled[t])) {
      float grad_norm, weight_norm;
      if (sums != nullptr) {
        grad_norm = std::sqrt(sums[1]);
        weight_norm = std::sqrt(sums[2]);
      } else {
        float gg = 0.0f, ww = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          gg += g[d] * g[d];
          ww += w[d] * w[d];
        }
        grad_norm = std::sqrt(gg);
        weight_norm = std::sqrt(ww);
      }
      const float threshold = count * std::max(a.r * weight_norm, a.zeta);
      if (grad_norm > threshold) {
        clipped = true;
        scale = threshold / std::max(grad_norm, FLT_MIN);
        for (int64_t d = 0; d < D; ++d) g[d] = g[d] * scale;
      }
    }
    // Step 4: coupled L2 (AdamW decays the weight instead, in its step).
    if (OPT != kAdamW && a.weight_decay != 0.0f) {
      for (int64_t d = 0; d < D; ++d) g[d] = g[d] + a.weight_decay * w[d];
    }
    float lr = a.lr;
    if (a.count_lr) {
      lr = a.lr * pow_like_torch(std::min(count, a.count_lr_cap), a.count_lr_power);
    }
    // Step 5: the optimizer.
    if (OPT == kAdam || OPT == kAdamW) {
      float* m = a.state0 + row * D;
      float* v = a.state1 + row * D;
      const float b1 = a.bias1[t], b2 = a.bias2[t];
      if (OPT == kAdamW && a.weight_decay != 0.0f) {
        // Decoupled weight decay (optim/functional.py: decay_weight_).
        const float keep = 1.0f - lr * a.weight_decay;
        for (int64_t d = 0; d < D; ++d) w[d] = w[d] * keep;
      }
      for (int64_t d = 0; d < D; ++d) {
        const float md = m[d] * a.beta1 + a.one_minus_beta1 * g[d];
        const float vd = v[d] * a.beta2 + a.one_minus_beta2 * g[d] * g[d];
        m[d] = md;
        v[d] = vd;
        const float denom = std::sqrt(vd / b2) + a.eps;
        w[d] = w[d] - lr * (md / b1) / denom;
      }
    } else if (OPT == kAdagrad) {
      float* s = a.state0 + row * D;
      for (int64_t d = 0; d < D; ++d) {
        const float sd = s[d] + g[d] * g[d];
        s[d] = sd;
        w[d] = w[d] - lr * g[d] / (std::sqrt(sd) + a.eps);
      }
    } else if (OPT == kRowwiseAdagrad) {
      float mean_square;
      if (sums != nullptr) {
        const float wd = a.weight_decay;
        const float total = scale * scale * sums[1] + (2.0f * wd) * scale * sums[3] +
            (wd * wd) * sums[2];
        mean_square = std::max(total, 0.0f) / sums[4];
      } else {
        float gg = 0.0f;
        for (int64_t d = 0; d < D; ++d) gg += g[d] * g[d];
        mean_square = gg / static_cast<float>(D);
      }
      const float s = a.state0[row] + mean_square;
      a.state0[row] = s;
      const float denom = std::sqrt(s) + a.eps;
      for (int64_t d = 0; d < D; ++d) w[d] = w[d] - lr * g[d] / denom;
    } else {
      for (int64_t d = 0; d < D; ++d) w[d] = w[d] - lr * g[d];
    }
    if (a.rounding != nullptr) {
      const int64_t* k = a.rounding + 4 * t;
      const uint32_t key = row_key(k[0], k[1], row - a.row_offsets[t] + k[2]);
      const int64_t column_base = k[3];
      for (int64_t d = 0; d < D; ++d) wp[d] = store_value<W>(w[d], key, column_base + d);
    } else {
      // float32, or a half table with stochastic_rounding=False: round to nearest even.
      for (int64_t d = 0; d < D; ++d) wp[d] = static_cast<W>(w[d]);
    }
    a.status[u] = clipped ? kClipped : kUpdated;
    local[t] += 1;
    local[T + t] += clipped;
  }
  for (int64_t i = 0; i < 3 * T; ++i) {
    if (local[i] != 0) {
      __atomic_fetch_add(a.per_table + i, local[i], __ATOMIC_RELAXED);
    }
  }
}

template <typename W, int64_t OPT>
void update_dispatch_dim(const UpdateArgs& a, W* weight) {
  // Fixed-width inner loops for the common dims (DeepFM's 10 and 1, the benchmarks' 16).
  at::parallel_for(0, a.num_rows_touched, 1024, [&](int64_t begin, int64_t end) {
    switch (a.dim) {
      case 1: update_rows<W, OPT, 1>(a, weight, begin, end); break;
      case 8: update_rows<W, OPT, 8>(a, weight, begin, end); break;
      case 10: update_rows<W, OPT, 10>(a, weight, begin, end); break;
      case 16: update_rows<W, OPT, 16>(a, weight, begin, end); break;
      case 32: update_rows<W, OPT, 32>(a, weight, begin, end); break;
      case 64: update_rows<W, OPT, 64>(a, weight, begin, end); break;
      case 128: update_rows<W, OPT, 128>(a, weight, begin, end); break;
      default: update_rows<W, OPT, 0>(a, weight, begin, end); break;
    }
  });
}

template <typename W>
void update_dispatch_optimizer(const UpdateArgs& a, W* weight, int64_t optimizer) {
  switch (optimizer) {
    case kAdam: update_dispatch_dim<W, kAdam>(a, weight); break;
    case kRowwiseAdagrad: update_dispatch_dim<W, kRowwiseAdagrad>(a, weight); break;
    case kSgd: update_dispatch_dim<W, kSgd>(a, weight); break;
    case kAdagrad: update_dispatch_dim<W, kAdagrad>(a, weight); break;
    case kAdamW: update_dispatch_dim<W, kAdamW>(a, weight); break;
    default: TORCH_CHECK(false, "unknown optimizer code ", optimizer);
  }
}

const float* optional_float(const std::optional<Tensor>& t, int64_t numel, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, name,
              ": contiguous float32 with ", numel, " elements");
  return t->data_ptr<float>();
}

std::tuple<Tensor, Tensor> fused_update(
    Tensor& weight,
    const std::optional<Tensor>& state0,
    const std::optional<Tensor>& state1,
    const Tensor& rows,
    const Tensor& counts,
    const Tensor& grad,
    const std::optional<Tensor>& segment_offsets,
    const std::optional<Tensor>& sorted_bags,
    const std::optional<Tensor>& sorted_weights,
    const Tensor& row_offsets,
    const std::optional<Tensor>& clip_enabled,
    const std::optional<Tensor>& bias1,
    const std::optional<Tensor>& bias2,
    const std::optional<Tensor>& row_sums,
    const std::optional<Tensor>& rounding,
    int64_t optimizer,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool clip,
    double r,
    double zeta,
    double count_lr_power,
    double count_lr_cap) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: contiguous [R, D]");
  const int64_t R = weight.size(0), D = weight.size(1);
  const int64_t U = rows.numel();
  const int64_t T = row_offsets.numel() - 1;
  TORCH_CHECK(T >= 1 && row_offsets.scalar_type() == at::kLong && row_offsets.is_contiguous(),
              "row_offsets: [T + 1] int64");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows: [U] int64");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.numel() == U,
              "counts: [U] int64");
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.is_contiguous() && grad.dim() == 2 &&
                  grad.size(1) == D,
              "grad: contiguous float32 [*, D]");
  {
    const int64_t* ro = row_offsets.data_ptr<int64_t>();
    bool ascending = ro[0] == 0 && ro[T] == R;
    for (int64_t t = 0; t < T; ++t) ascending &= ro[t] <= ro[t + 1];
    TORCH_CHECK(ascending, "fused_update_: row_offsets must start at 0, ascend and end at the "
                "weight's ", R, " rows");
  }
  const bool segments = segment_offsets.has_value();
  TORCH_CHECK(segments == sorted_bags.has_value(),
              "segment_offsets and sorted_bags come together");
  if (!segments) {
    TORCH_CHECK(grad.size(0) == U, "grad: one row per touched row without segments");
    TORCH_CHECK(!sorted_weights.has_value(), "sorted_weights need segments");
  }
  const bool adam = optimizer == kAdam || optimizer == kAdamW;
  TORCH_CHECK(!adam || (state0.has_value() && state1.has_value() && bias1.has_value() &&
                        bias2.has_value()),
              "Adam needs both moments and both bias corrections");
  TORCH_CHECK((optimizer != kRowwiseAdagrad && optimizer != kAdagrad) || state0.has_value(),
              "Adagrad needs its sum");

  UpdateArgs a{};
  a.dim = D;
  a.num_rows_touched = U;
  a.num_tables = T;
  a.rows = rows.data_ptr<int64_t>();
  a.counts = counts.data_ptr<int64_t>();
  a.grad = grad.data_ptr<float>();
  if (segments) {
    TORCH_CHECK(segment_offsets->scalar_type() == at::kLong && segment_offsets->is_contiguous() &&
                    segment_offsets->numel() == U + 1,
                "segment_offsets: [U + 1] int64");
    a.segment_offsets = segment_offsets->data_ptr<int64_t>();
    TORCH_CHECK(sorted_bags->scalar_type() == at::kLong && sorted_bags->is_contiguous(),
                "sorted_bags: [L] int64");
    a.sorted_bags = sorted_bags->data_ptr<int64_t>();
    const int64_t L = sorted_bags->numel();
    // The ends here; that the offsets ascend, and the bags, in the one pass over the rows
    // below.
    TORCH_CHECK(a.segment_offsets[0] == 0 && a.segment_offsets[U] == L,
                "fused_update_: segment_offsets must start at 0, ascend and end at the ", L,
                " positions of sorted_bags");
    a.sorted_weights = optional_float(sorted_weights, L, "sorted_weights");
  }
  a.row_offsets = row_offsets.data_ptr<int64_t>();
  if (clip_enabled.has_value()) {
    TORCH_CHECK(clip_enabled->scalar_type() == at::kBool && clip_enabled->numel() == T &&
                    clip_enabled->is_contiguous(),
                "clip_enabled: [T] bool");
    a.clip_enabled = clip_enabled->data_ptr<bool>();
  }
  a.bias1 = optional_float(bias1, T, "bias1");
  a.bias2 = optional_float(bias2, T, "bias2");
  a.row_sums = optional_float(row_sums, U * 5, "row_sums");
  if (rounding.has_value()) {
    TORCH_CHECK(rounding->scalar_type() == at::kLong && rounding->is_contiguous() &&
                    rounding->numel() == 4 * T,
                "rounding: [T, 4] int64");
    a.rounding = rounding->data_ptr<int64_t>();
  }
  const int64_t state_rows = adam || optimizer == kAdagrad ? R * D : R;
  if (optimizer != kSgd) {
    TORCH_CHECK(state0->scalar_type() == at::kFloat && state0->is_contiguous() &&
                    state0->numel() == state_rows,
                "state0: contiguous float32 over every row");
    a.state0 = state0->data_ptr<float>();
  }
  if (adam) {
    TORCH_CHECK(state1->scalar_type() == at::kFloat && state1->is_contiguous() &&
                    state1->numel() == state_rows,
                "state1: contiguous float32 over every row");
    a.state1 = state1->data_ptr<float>();
  }
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.clip = clip;
  a.r = static_cast<float>(r);
  a.zeta = static_cast<float>(zeta);
  a.count_lr = count_lr_power != 0.0;
  a.count_lr_power = static_cast<float>(count_lr_power);
  a.count_lr_cap = static_cast<float>(count_lr_cap);

  Tensor status = at::empty({U}, rows.options().dtype(at::kChar));
  Tensor per_table = at::zeros({3, T}, rows.options().dtype(at::kLong));
  a.status = status.data_ptr<int8_t>();
  a.per_table = per_table.data_ptr<int64_t>();
  if (U == 0) {
    return {status, per_table};
  }
  // Every row must lie in the weight (the callers' ids are checked in forward; this keeps a
  // wrong caller from writing outside the tables).
  // And their positions: the segment offsets ascend, and every position's bag is a row of
  // the bag gradients. Before any write, in branch-free loops the compiler vectorises
  // (an OR of the conditions per chunk): two streaming passes, rows then positions.
  {
    const int64_t* rp = a.rows;
    const int64_t* so = a.segment_offsets;
    std::atomic<bool> bad_rows{false}, bad_segments{false};
    at::parallel_for(0, U, 65536, [&](int64_t begin, int64_t end) {
      uint64_t rows_bad = 0, segments_bad = 0;
      for (int64_t u = begin; u < end; ++u) {
        rows_bad |= static_cast<uint64_t>(rp[u]) >= static_cast<uint64_t>(R);
        rows_bad |= u > 0 && rp[u] <= rp[u - 1];
      }
      if (so != nullptr) {
        for (int64_t u = begin; u < end; ++u) segments_bad |= so[u] > so[u + 1];
      }
      if (rows_bad) bad_rows = true;
      if (segments_bad) bad_segments = true;
    });
    TORCH_CHECK(!bad_rows.load(), "rows must be distinct, ascending and inside the weight");
    TORCH_CHECK(!bad_segments.load(), "fused_update_: segment_offsets must start at 0, ascend "
                "and end at the ", so[U], " positions of sorted_bags");
    if (so != nullptr) {
      const int64_t* sb = a.sorted_bags;
      const uint64_t bags = static_cast<uint64_t>(grad.size(0));
      std::atomic<bool> bad_bags{false};
      at::parallel_for(0, so[U], 65536, [&](int64_t begin, int64_t end) {
        uint64_t outside = 0;
        for (int64_t p = begin; p < end; ++p) outside |= static_cast<uint64_t>(sb[p]) >= bags;
        if (outside) bad_bags = true;
      });
      TORCH_CHECK(!bad_bags.load(), "fused_update_: sorted_bags must index the ", bags,
                  " rows of the bag gradients");
    }
  }
  switch (weight.scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(rounding.has_value() == false, "float32 tables take no rounding keys");
      update_dispatch_optimizer<float>(a, weight.data_ptr<float>(), optimizer);
      break;
    case at::kHalf:
      // Without rounding keys a half table rounds to nearest (stochastic_rounding=False).
      update_dispatch_optimizer<c10::Half>(a, weight.data_ptr<c10::Half>(), optimizer);
      break;
    case at::kBFloat16:
      update_dispatch_optimizer<c10::BFloat16>(a, weight.data_ptr<c10::BFloat16>(), optimizer);
      break;
    default:
      TORCH_CHECK(false, "weight must be float32, float16 or bfloat16, got ", weight.scalar_type());
  }
  return {status, per_table};
}

// --- pooled_lookup ---------------------------------------------------------------------

template <typename W>
void pool_bags(const W* weight, int64_t D, int64_t R, const int64_t* ids, int64_t num_ids,
               const int64_t* offsets, const float* psw, bool mean, float* out, int64_t begin,
               int64_t end) {
  const int64_t last = std::min(offsets[end], num_ids);  // prefetch inside the ids
  for (int64_t b = begin; b < end; ++b) {
    float* o = out + b * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    const int64_t p0 = offsets[b], p1 = offsets[b + 1];
    TORCH_CHECK(0 <= p0 && p0 <= p1 && p1 <= num_ids, "pooled_lookup: offsets must start at 0, "
                "ascend and end at the ", num_ids, " ids");
    for (int64_t p = p0; p < p1; ++p) {
      if (p + kPositionPrefetch < last) {
        prefetch_read(weight + ids[p + kPositionPrefetch] * D, D * static_cast<int64_t>(sizeof(W)));
      }
      const int64_t id = ids[p];
      TORCH_CHECK(id >= 0 && id < R, "pooled_lookup: id ", id, " outside [0, ", R, ")");
      const W* row = weight + id * D;
      if (psw != nullptr) {
        const float pw = psw[p];
        for (int64_t d = 0; d < D; ++d) o[d] += pw * static_cast<float>(row[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) o[d] += static_cast<float>(row[d]);
      }
    }
    if (mean && p1 > p0) {
      const float inv = 1.0f / static_cast<float>(p1 - p0);
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

Tensor pooled_lookup(const Tensor& weight, const Tensor& ids, const Tensor& offsets,
                     const std::optional<Tensor>& per_sample_weights, bool mean) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: contiguous [R, D]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids: [L] int64");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() >= 1,
              "offsets: [bags + 1] int64");
  const int64_t D = weight.size(1), R = weight.size(0);
  const int64_t bags = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  // The ends here, that they ascend per bag as the bags are pooled (into a new tensor).
  TORCH_CHECK(off[0] == 0 && off[bags] == ids.numel(),
              "pooled_lookup: offsets must start at 0, ascend and end at the ", ids.numel(), " ids");
  TORCH_CHECK(!(mean && per_sample_weights.has_value()), "mean pooling takes no weights");
  const float* psw = optional_float(per_sample_weights, ids.numel(), "per_sample_weights");
  Tensor out = at::empty({bags, D}, weight.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t* id = ids.data_ptr<int64_t>();
  auto run = [&](auto* w) {
    at::parallel_for(0, bags, 2048, [&](int64_t begin, int64_t end) {
      pool_bags(w, D, R, id, ids.numel(), off, psw, mean, o, begin, end);
    });
  };
  switch (weight.scalar_type()) {
    case at::kFloat: run(weight.data_ptr<float>()); break;
    case at::kHalf: run(weight.data_ptr<c10::Half>()); break;
    case at::kBFloat16: run(weight.data_ptr<c10::BFloat16>()); break;
    default: TORCH_CHECK(false, "weight must be float32, float16 or bfloat16");
  }
  return out;
}

// --- rounding, exposed for the tests ---------------------------------------------------

Tensor rounding_row_keys(const Tensor& seed, const Tensor& step, const Tensor& global_row) {
  TORCH_CHECK(seed.scalar_type() == at::kLong && step.scalar_type() == at::kLong &&
                  global_row.scalar_type() == at::kLong,
              "seed, step, global_row: int64");
  TORCH_CHECK(seed.sizes() == global_row.sizes() && step.sizes() == global_row.sizes(),
              "seed, step, global_row: one per row");
  const Tensor s = seed.contiguous(), t = step.contiguous(), g = global_row.contiguous();
  Tensor out = at::empty(global_row.sizes(), global_row.options());
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) {
    out.data_ptr<int64_t>()[i] =
        row_key(s.data_ptr<int64_t>()[i], t.data_ptr<int64_t>()[i], g.data_ptr<int64_t>()[i]);
  }
  return out;
}

Tensor stochastic_round(const Tensor& values, const Tensor& row_keys, const Tensor& column_base,
                        at::ScalarType dtype) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat, "values: [U, D] float32");
  TORCH_CHECK(row_keys.scalar_type() == at::kLong && row_keys.numel() == values.size(0),
              "row_keys: [U] int64");
  TORCH_CHECK(column_base.scalar_type() == at::kLong && column_base.numel() == values.size(0),
              "column_base: [U] int64");
  const Tensor v = values.contiguous(), k = row_keys.contiguous(), c = column_base.contiguous();
  const int64_t U = v.size(0), D = v.size(1);
  Tensor out = at::empty({U, D}, values.options().dtype(dtype));
  for (int64_t u = 0; u < U; ++u) {
    const uint32_t key = static_cast<uint32_t>(k.data_ptr<int64_t>()[u]);
    const int64_t base = c.data_ptr<int64_t>()[u];
    for (int64_t d = 0; d < D; ++d) {
      const float x = v.data_ptr<float>()[u * D + d];
      if (dtype == at::kHalf) {
        out.data_ptr<c10::Half>()[u * D + d] = store_value<c10::Half>(x, key, base + d);
      } else if (dtype == at::kBFloat16) {
        out.data_ptr<c10::BFloat16>()[u * D + d] = store_value<c10::BFloat16>(x, key, base + d);
      } else {
        TORCH_CHECK(false, "stochastic_round: dtype must be float16 or bfloat16");
      }
    }
  }
  return out;
}

}  // namespace torchrec_cowclip_native

TORCH_LIBRARY(torchrec_cowclip, m) {
  m.def(
      "group_rows(Tensor row_ids, Tensor bag_of_position, int num_rows, "
      "Tensor? feature_starts=None, Tensor? feature_rows=None) -> "
      "(Tensor rows, Tensor counts, Tensor segment_offsets, Tensor order, Tensor sorted_bags)");
  m.def(
      "fused_update_(Tensor(a!) weight, Tensor(b!)? state0, Tensor(c!)? state1, Tensor rows, "
      "Tensor counts, Tensor grad, Tensor? segment_offsets, Tensor? sorted_bags, "
      "Tensor? sorted_weights, Tensor row_offsets, Tensor? clip_enabled, Tensor? bias1, "
      "Tensor? bias2, Tensor? row_sums, Tensor? rounding, int optimizer, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool clip, float r, "
      "float zeta, float count_lr_power, float count_lr_cap) -> (Tensor status, Tensor per_table)");
  m.def(
      "pooled_lookup(Tensor weight, Tensor ids, Tensor offsets, Tensor? per_sample_weights, "
      "bool mean) -> Tensor");
  m.def("rounding_row_keys(Tensor seed, Tensor step, Tensor global_row) -> Tensor");
  m.def(
      "stochastic_round(Tensor values, Tensor row_keys, Tensor column_base, ScalarType dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(torchrec_cowclip, CPU, m) {
  m.impl("group_rows", &torchrec_cowclip_native::group_rows);
  m.impl("fused_update_", &torchrec_cowclip_native::fused_update);
  m.impl("pooled_lookup", &torchrec_cowclip_native::pooled_lookup);
  m.impl("rounding_row_keys", &torchrec_cowclip_native::rounding_row_keys);
  m.impl("stochastic_round", &torchrec_cowclip_native::stochastic_round);
}
