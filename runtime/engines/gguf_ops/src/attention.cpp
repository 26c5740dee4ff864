// ai.draftsmith.CausalAttention: causal self-attention over a fixed-capacity KV buffer, written in place, whose
// result for a query does not depend on the call it comes in. It replaces onnxruntime's GroupQueryAttention in graphs
// whose matrix products are GgufMatMul (builder/graph.py), so that every operator of such a graph computes a token
// the same way whatever else the call holds: one token alone, the first of a verify call, or one row of a batch.
// GroupQueryAttention on CPU scores a lone query by another SGEMM path than several (logits apart by up to ~0.5 after
// 30 layers), which made exact decoding pad every one-token call to two tokens — and, at batch > 1, double the rows
// of every target step (the 1.5B preset: 0.66x plain batch-4 decoding before any draft ran).
//
// Inputs (as GroupQueryAttention's, packed q|k|v only):
//   0 qkv            float [B, S, (H + 2 H_kv) * D]
//   1 past_key       float [B, H_kv, T, D]   T slots; the new tokens' keys are written at [past, past + q)
//   2 past_value     float [B, H_kv, T, D]
//   3 seqlens_k      int32 [B]               live tokens of each row after this call, minus 1
//   4 total_sequence_length int32 []        (unused; the rows' own lengths say it)
//   5 cos_cache      float [P, R / 2]        rotary tables by position (R: rotary dims, R <= D); optional
//   6 sin_cache      float [P, R / 2]
//   7 query_lengths  int32 [B]               each row's new tokens (its first ones; the rest of S is padding)
// Outputs: 0 float [B, S, H * D] (padding positions 0), 1 present_key, 2 present_value: the same buffers as the
// past ones (bound to them by the caller; where they are not, the past is copied first).
// Attributes: num_heads, kv_num_heads, scale (0: D^-1/2), local_window_size (-1: none; else keys > position -
// window), do_rotary (rotate q and k by position, halves: x1 cos - x2 sin, x2 cos + x1 sin).
//
// Each query's scores, softmax and weighted sum run in a fixed order (16 partial sums, then summed by a fixed tree),
// with no fused multiply-add (the library is built with -ffp-contract=off) and an exp of its own, so results are
// also the same on every instruction set. Work is split over (row, kv head, chunk of queries) on ONNX Runtime's
// pool. Within a unit, keys and values go in tiles that stay in L1 while every query and head uses them, 16 scores
// are summed by one shuffled tree, and the weighted sums stay in registers across a tile (1.7-1.9x the first
// version's speed at 1-64 queries, 300-1,500 cached tokens, one thread).
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention.h"
#include "attributes.h"

namespace draftsmith {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMaxHeads = 1024;

#if defined(DRAFTSMITH_X86)
#define DRAFTSMITH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DRAFTSMITH_CLONES
#endif

// 16 floats as one value: GCC lowers its arithmetic to the widths the instruction set has (one AVX-512 register,
// two AVX2, four SSE), each lane's operations unchanged.
typedef float Lanes __attribute__((vector_size(sizeof(float) * kLanes)));
typedef float Half __attribute__((vector_size(sizeof(float) * kLanes / 2)));
typedef float Quarter __attribute__((vector_size(sizeof(float) * kLanes / 4)));

inline __attribute__((always_inline)) Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

// The lanes summed by a fixed tree: lane l += lane l + 8 (l < 8), then l += l + 4, l += l + 2, l += l + 1 — the order
// the scalar tree had, in vector halves (a tree of scalars through the stack was a quarter of a verify call's
// attention).
inline __attribute__((always_inline)) float lane_sum(Lanes e) {
  Half low, high;
  std::memcpy(&low, &e, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&e) + sizeof low, sizeof high);
  const Half eight = low + high;
  Quarter low4, high4;
  std::memcpy(&low4, &eight, sizeof low4);
  std::memcpy(&high4, reinterpret_cast<const char*>(&eight) + sizeof low4, sizeof high4);
  const Quarter four = low4 + high4;
  const float zero = four[0] + four[2], one = four[1] + four[3];
  return zero + one;
}

typedef int32_t LaneInts __attribute__((vector_size(sizeof(int32_t) * kLanes)));

// e^x for x <= 0, lane by lane: Cephes' single-precision method (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
// polynomial in r, times 2^n; within 2 ulp), written without fused operations, so every lane of every instruction
// set gets the same bits — libm's expf has an FMA variant chosen at run time, whose last bits may differ. Lanes
// under -87 (2^n past the normal range) give 0.
inline __attribute__((always_inline)) Lanes exp_nonpositive(Lanes x) {
  const LaneInts underflow = x < -87.0f;
  const LaneInts n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, LaneInts);  // round, x <= 0
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  Lanes p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Lanes y = (p * (r * r) + r) + 1.0f;
  const LaneInts scale_bits = (n + 127) << 23;
  Lanes scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  const Lanes scaled = y * scale;
  LaneInts bits;
  std::memcpy(&bits, &scaled, sizeof bits);
  bits &= ~underflow;
  Lanes out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// row[t] = e^(row[t] - top) for t in [first, last], returning their sum (added in t order); each value through
// exp_nonpositive (the last few via a padded vector), so a value's bits do not depend on where it falls.
inline __attribute__((always_inline)) float exp_shifted(float* row, int64_t first, int64_t last, float top) {
  float total = 0.0f;
  int64_t t = first;
  for (; t + kLanes <= last + 1; t += kLanes) {
    const Lanes e = exp_nonpositive(load(row + t) - top);
    store(row + t, e);
    for (int l = 0; l < kLanes; ++l) total += e[l];
  }
  if (t <= last) {
    float rest[kLanes] = {};
    std::memcpy(rest, row + t, sizeof(float) * (last + 1 - t));
    const Lanes e = exp_nonpositive(load(rest) - top);
    for (int l = 0; t <= last; ++t, ++l) {
      row[t] = e[l];
      total += e[l];
    }
  }
  return total;
}

// x . y over n values, before its last sum: 2 x kLanes partial sums (values i with i % 32 < 16 in the first), the
// second added into the first — the same float operations in the same order on any ISA, few of them dependent (a
// 16-lane chain of scalar adds per dot made the scores latency-bound).
inline __attribute__((always_inline)) Lanes dot_lanes(const float* x, const float* y, int64_t n) {
  Lanes even = {}, odd = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    even += load(x + i) * load(y + i);
    odd += load(x + i + kLanes) * load(y + i + kLanes);
  }
  if (i < n) {  // a head dimension that is not a multiple of 32: the rest round the lanes of `even`, in order
    float rest[kLanes];
    std::memcpy(rest, &even, sizeof rest);
    for (int l = 0; i < n; ++i, l = (l + 1) % kLanes) rest[l] += x[i] * y[i];
    std::memcpy(&even, rest, sizeof rest);
  }
  return even + odd;
}

// x . y: dot_lanes summed by lane_sum's tree.
inline __attribute__((always_inline)) float dot(const float* x, const float* y, int64_t n) {
  return lane_sum(dot_lanes(x, y, n));
}

// The lane sums of 16 vectors at once, lane k of the result v[k]'s: lane_sum's tree (the same additions of the same
// pairs, in the same order) with each level's halves of two vectors shuffled side by side, so one vector addition
// does a level of several trees (45 vector operations for 16 sums instead of ~130).
inline __attribute__((always_inline)) Lanes lane_sums(const Lanes (&v)[kLanes]) {
  const LaneInts low8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const LaneInts high8 = low8 + 8;
  const LaneInts low4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const LaneInts high4 = low4 + 4;
  const LaneInts low2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const LaneInts high2 = low2 + 2;
  const LaneInts low1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const LaneInts high1 = low1 + 1;
  Lanes eight[8], four[4], two[2];
  for (int m = 0; m < 8; ++m) {  // lanes 0-7: v[2m]'s l + (l + 8); 8-15: v[2m + 1]'s
    eight[m] = __builtin_shuffle(v[2 * m], v[2 * m + 1], low8) + __builtin_shuffle(v[2 * m], v[2 * m + 1], high8);
  }
  for (int m = 0; m < 4; ++m) {  // lanes 4q..4q+3: sum q of 4m + q, its l + (l + 4)
    four[m] = __builtin_shuffle(eight[2 * m], eight[2 * m + 1], low4) +
              __builtin_shuffle(eight[2 * m], eight[2 * m + 1], high4);
  }
  for (int m = 0; m < 2; ++m) {  // lanes 2d, 2d+1: sum 8m + d's 0 + 2 and 1 + 3
    two[m] = __builtin_shuffle(four[2 * m], four[2 * m + 1], low2) +
             __builtin_shuffle(four[2 * m], four[2 * m + 1], high2);
  }
  return __builtin_shuffle(two[0], two[1], low1) + __builtin_shuffle(two[0], two[1], high1);
}

// row[t] = q . keys[t] * scale for t in [lo, hi): 16 keys at a time through lane_sums, the rest one by one through
// dot — the same bits either way.
inline __attribute__((always_inline)) void scores_of(const float* q, const float* keys, int64_t lo, int64_t hi,
                                                     int64_t dim, float scale, float* row) {
  int64_t t = lo;
  for (; t + kLanes <= hi; t += kLanes) {
    Lanes sums[kLanes];
    for (int k = 0; k < kLanes; ++k) sums[k] = dot_lanes(q, keys + (t + k) * dim, dim);
    store(row + t, lane_sums(sums) * scale);
  }
  for (; t < hi; ++t) row[t] = dot(q, keys + t * dim, dim) * scale;
}

// out += sum over t in [lo, hi) of weights[t] * rows[t] (rows `dim` apart), each value's terms added in t order —
// what an axpy per t computes, with the sums held in registers across t instead of stored and reloaded every t.
inline __attribute__((always_inline)) void weighted_sum(const float* weights, const float* rows, int64_t lo,
                                                        int64_t hi, int64_t dim, float* out) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= dim; d += 4 * kLanes) {
    Lanes a = load(out + d), b = load(out + d + kLanes), c = load(out + d + 2 * kLanes),
          e = load(out + d + 3 * kLanes);
    for (int64_t t = lo; t < hi; ++t) {
      const float* row = rows + t * dim + d;
      const float w = weights[t];
      a += w * load(row);
      b += w * load(row + kLanes);
      c += w * load(row + 2 * kLanes);
      e += w * load(row + 3 * kLanes);
    }
    store(out + d, a);
    store(out + d + kLanes, b);
    store(out + d + 2 * kLanes, c);
    store(out + d + 3 * kLanes, e);
  }
  for (; d + kLanes <= dim; d += kLanes) {
    Lanes a = load(out + d);
    for (int64_t t = lo; t < hi; ++t) a += weights[t] * load(rows + t * dim + d);
    store(out + d, a);
  }
  for (; d < dim; ++d) {
    float a = out[d];
    for (int64_t t = lo; t < hi; ++t) a += weights[t] * rows[t * dim + d];
    out[d] = a;
  }
}

struct Shape {
  int64_t batch, new_tokens, heads, kv_heads, dim, slots, rotary_half, positions;
};

struct Call {
  Shape s;
  const float* qkv;
  float* keys;
  float* values;
  float* out;
  const float* cos;
  const float* sin;
  const int32_t* seqlens;
  const int32_t* queries;
  float scale;
  int64_t window;
  std::vector<float>* rotated_q;  // [B, S, H, D]: each query rotated once
};

int64_t queries_of(const Call& c, int64_t b) { return c.queries ? c.queries[b] : c.s.new_tokens; }
int64_t past_of(const Call& c, int64_t b) { return static_cast<int64_t>(c.seqlens[b]) + 1 - queries_of(c, b); }

// x rotated by position `p` (halves of the first 2 * rotary_half values), into `to`.
void rotate(const Call& c, const float* x, int64_t p, float* to) {
  const int64_t half = c.s.rotary_half, dim = c.s.dim;
  std::memcpy(to, x, sizeof(float) * dim);
  if (half == 0) return;
  const float* cs = c.cos + p * half;
  const float* sn = c.sin + p * half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    to[i] = x1 * cs[i] - x2 * sn[i];
    to[i + half] = x2 * cs[i] + x1 * sn[i];
  }
}

// Writes row b's new keys (rotated) and values into its slots, and its queries (rotated) into rotated_q.
void store_row(const Call& c, int64_t b) {
  const Shape& s = c.s;
  const int64_t width = (s.heads + 2 * s.kv_heads) * s.dim, past = past_of(c, b);
  for (int64_t j = 0; j < queries_of(c, b); ++j) {
    const float* token = c.qkv + (b * s.new_tokens + j) * width;
    const int64_t p = past + j;
    for (int64_t h = 0; h < s.heads; ++h) {
      rotate(c, token + h * s.dim, p, c.rotated_q->data() + ((b * s.new_tokens + j) * s.heads + h) * s.dim);
    }
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t slot = ((b * s.kv_heads + g) * s.slots + p) * s.dim;
      rotate(c, token + (s.heads + g) * s.dim, p, c.keys + slot);
      std::memcpy(c.values + slot, token + (s.heads + s.kv_heads + g) * s.dim, sizeof(float) * s.dim);
    }
  }
}

constexpr int64_t kQueryChunk = 8;  // queries of one row a work unit takes together (each key row read once for all)
constexpr int64_t kKeyTile = 32;  // key rows a unit scores for every query and head before the next ones
constexpr int64_t kValueTile = 16;  // value rows a unit adds to every output before the next ones (8 KB at D 128)

thread_local std::vector<float> scratch_scores;

// The visible slots of the query at position p: [first, p] (a sliding window keeps the last `window`).
int64_t first_slot(const Call& c, int64_t p) { return c.window > 0 ? std::max<int64_t>(0, p - c.window + 1) : 0; }

// Queries [j0, j1) of row b, every head of kv group g: softmax(q . k * scale) over each query's visible slots, times
// the values. Each key and value row is read once for all of them; each (query, head) still gets the same float
// operations in the same order as alone, so the result does not depend on the chunk, the call or the batch. One
// function per instruction set (the dot products and sums inlined into it).
DRAFTSMITH_CLONES void attend_unit(const Call& c, int64_t b, int64_t g, int64_t j0, int64_t j1) {
  const Shape& s = c.s;
  const int64_t group = s.heads / s.kv_heads, past = past_of(c, b), span = past + j1;
  const float* keys = c.keys + (b * s.kv_heads + g) * s.slots * s.dim;
  const float* values = c.values + (b * s.kv_heads + g) * s.slots * s.dim;
  std::vector<float>& scores = scratch_scores;  // [(j - j0) * group + r][t]
  scores.resize(std::max(scores.size(), static_cast<size_t>((j1 - j0) * group * span)));
  const float* q0 = c.rotated_q->data() + (b * s.new_tokens * s.heads + g * group) * s.dim;
  // The keys in tiles of kKeyTile slots (a tile stays in L1 while every query and head of the unit scores it).
  for (int64_t t0 = first_slot(c, past + j0); t0 < span; t0 += kKeyTile) {
    const int64_t t1 = std::min(span, t0 + kKeyTile);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t lo = std::max(t0, first_slot(c, past + j)), hi = std::min(t1, past + j + 1);
      for (int64_t r = 0; r < group && lo < hi; ++r) {
        float* row = scores.data() + ((j - j0) * group + r) * span;
        scores_of(q0 + (j * s.heads + r) * s.dim, keys, lo, hi, s.dim, c.scale, row);
      }
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t r = 0; r < group; ++r) {
      float* row = scores.data() + ((j - j0) * group + r) * span;
      const int64_t first = first_slot(c, past + j), p = past + j;
      float top = -INFINITY;
      for (int64_t t = first; t <= p; ++t) top = std::max(top, row[t]);
      const float total = exp_shifted(row, first, p, top);
      for (int64_t t = first; t <= p; ++t) row[t] = row[t] / total;
      float* out = c.out + ((b * s.new_tokens + j) * s.heads + g * group + r) * s.dim;
      std::fill(out, out + s.dim, 0.0f);
    }
  }
  // The values in tiles of kValueTile slots (a tile stays in L1 while every query and head of the unit adds it).
  for (int64_t t0 = first_slot(c, past + j0); t0 < span; t0 += kValueTile) {
    const int64_t t1 = std::min(span, t0 + kValueTile);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t lo = std::max(t0, first_slot(c, past + j)), hi = std::min(t1, past + j + 1);
      for (int64_t r = 0; r < group && lo < hi; ++r) {
        float* out = c.out + ((b * s.new_tokens + j) * s.heads + g * group + r) * s.dim;
        weighted_sum(scores.data() + ((j - j0) * group + r) * span, values, lo, hi, s.dim, out);
      }
    }
  }
}

// Work unit `index`: (row, kv group, chunk of the row's queries).
void attend(void* data, size_t index) {
  const Call& c = *static_cast<const Call*>(data);
  const int64_t chunks = (c.s.new_tokens + kQueryChunk - 1) / kQueryChunk, unit = static_cast<int64_t>(index);
  const int64_t b = unit / (c.s.kv_heads * chunks), g = unit / chunks % c.s.kv_heads, chunk = unit % chunks;
  const int64_t j0 = chunk * kQueryChunk, j1 = std::min(queries_of(c, b), j0 + kQueryChunk);
  if (j0 < j1) attend_unit(c, b, g, j0, j1);
}

// a * b, refused past `cap` (a shape from a graph is data: never let it wrap)
int64_t checked_product(int64_t a, int64_t b, int64_t cap, const char* what) {
  if (a < 0 || b < 0 || (b != 0 && a > cap / b)) throw std::invalid_argument(std::string("CausalAttention: ") + what);
  return a * b;
}

struct CausalAttentionKernel {
  CausalAttentionKernel(const OrtApi& api, const OrtKernelInfo* info) {
    const char* op = "CausalAttention";
    const int64_t none = -1, off = 0;
    heads_ = int_attribute(api, info, op, "num_heads");
    kv_heads_ = int_attribute(api, info, op, "kv_num_heads");
    window_ = int_attribute(api, info, op, "local_window_size", &none);
    rotary_ = int_attribute(api, info, op, "do_rotary", &off);
    scale_ = float_attribute(api, info, op, "scale", 0.0f);
    if (heads_ <= 0 || kv_heads_ <= 0 || heads_ > kMaxHeads || heads_ % kv_heads_ || (rotary_ != 0 && rotary_ != 1) ||
        !std::isfinite(scale_) || scale_ < 0.0f) {
      throw std::invalid_argument(
          "CausalAttention: num_heads must be a positive multiple of kv_num_heads (at most 1024), do_rotary 0 or 1, "
          "scale finite and >= 0");
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    return compute_status([&] { Compute(raw); });
  }

 private:
  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    Ort::ConstValue qkv = context.GetInput(0), past_key = context.GetInput(1), past_value = context.GetInput(2);
    Ort::ConstValue seqlens = context.GetInput(3);
    const std::vector<int64_t> qshape = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> kshape = past_key.GetTensorTypeAndShapeInfo().GetShape();
    if (qshape.size() != 3 || kshape.size() != 4 || kshape[0] != qshape[0] || kshape[1] != kv_heads_ ||
        past_value.GetTensorTypeAndShapeInfo().GetShape() != kshape) {
      throw std::invalid_argument("CausalAttention: qkv must be [B, S, (H + 2 H_kv) D], past key/value [B, H_kv, T, D]");
    }
    Shape s{qshape[0], qshape[1], heads_, kv_heads_, kshape[3], kshape[2], 0, 0};
    if (s.dim <= 0 || s.dim > kMaxHeadDim || s.dim % 2 ||
        qshape[2] != checked_product(heads_ + 2 * kv_heads_, s.dim, INT64_MAX / 4, "qkv width overflows")) {
      throw std::invalid_argument("CausalAttention: qkv's last dimension is not (num_heads + 2 kv_num_heads) * D");
    }
    checked_product(checked_product(s.batch, s.kv_heads, INT64_MAX / 4, "cache too large"), s.slots * s.dim,
                    INT64_MAX / 8, "cache too large");
    Call c{};
    c.s = s;
    c.scale = scale_ > 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(s.dim));
    c.window = window_;
    c.qkv = qkv.GetTensorData<float>();
    c.seqlens = int_input(seqlens, s.batch, "seqlens_k");
    c.queries = context.GetInputCount() > 7 && context.GetInput(7) ? int_input(context.GetInput(7), s.batch, "query_lengths")
                                                                    : nullptr;
    if (rotary_) rotary_tables(context, &c);
    check_rows(c);
    Ort::UnownedValue out = context.GetOutput(0, {s.batch, s.new_tokens, s.heads * s.dim});
    c.out = out.GetTensorMutableData<float>();
    c.keys = in_place(context, 1, past_key, kshape);
    c.values = in_place(context, 2, past_value, kshape);
    std::fill(c.out, c.out + s.batch * s.new_tokens * s.heads * s.dim, 0.0f);
    std::vector<float> rotated(static_cast<size_t>(s.batch * s.new_tokens * s.heads * s.dim));
    c.rotated_q = &rotated;
    for (int64_t b = 0; b < s.batch; ++b) store_row(c, b);
    const int64_t chunks = (s.new_tokens + kQueryChunk - 1) / kQueryChunk;
    context.ParallelFor(attend, static_cast<size_t>(s.batch * s.kv_heads * chunks), 0, &c);
  }

  static const int32_t* int_input(Ort::ConstValue value, int64_t batch, const char* name) {
    const auto info = value.GetTensorTypeAndShapeInfo();
    if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 ||
        static_cast<int64_t>(info.GetElementCount()) != batch) {
      throw std::invalid_argument(std::string("CausalAttention: ") + name + " must be int32 [B]");
    }
    return value.GetTensorData<int32_t>();
  }

  static void rotary_tables(Ort::KernelContext& context, Call* c) {
    Ort::ConstValue cos = context.GetInput(5), sin = context.GetInput(6);
    if (!cos || !sin) throw std::invalid_argument("CausalAttention: do_rotary needs cos_cache and sin_cache");
    const std::vector<int64_t> shape = cos.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2 || sin.GetTensorTypeAndShapeInfo().GetShape() != shape || shape[1] <= 0 ||
        2 * shape[1] > c->s.dim) {
      throw std::invalid_argument("CausalAttention: cos/sin caches must be [positions, R / 2] with R <= head dim");
    }
    c->s.positions = shape[0];
    c->s.rotary_half = shape[1];
    c->cos = cos.GetTensorData<float>();
    c->sin = sin.GetTensorData<float>();
  }

  // Every row's new tokens fit its call, its slots and the rotary table: checked before anything is written.
  static void check_rows(const Call& c) {
    for (int64_t b = 0; b < c.s.batch; ++b) {
      const int64_t q = queries_of(c, b), total = static_cast<int64_t>(c.seqlens[b]) + 1;
      if (q < 0 || q > c.s.new_tokens || total < q || total > c.s.slots || (c.s.rotary_half && total > c.s.positions)) {
        throw std::invalid_argument("CausalAttention: row " + std::to_string(b) +
                                    " has query_lengths / seqlens_k outside its call, its cache or the rotary table");
      }
    }
  }

  // The present buffer: the past one where the caller bound them together, else a copy of the past.
  static float* in_place(Ort::KernelContext& context, size_t index, Ort::ConstValue past,
                         const std::vector<int64_t>& shape) {
    float* present = context.GetOutput(index, shape).GetTensorMutableData<float>();
    const float* from = past.GetTensorData<float>();
    if (present != from) {
      size_t count = 1;
      for (int64_t d : shape) count *= static_cast<size_t>(d);
      std::memcpy(present, from, count * sizeof(float));
    }
    return present;
  }

  int64_t heads_ = 0, kv_heads_ = 0, window_ = -1, rotary_ = 0;
  float scale_ = 0.0f;
};

struct CausalAttentionOp : Ort::CustomOpBase<CausalAttentionOp, CausalAttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel<CausalAttentionKernel>(api, info, kernel);
  }
  const char* GetName() const { return "CausalAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 3 || index == 4 || index == 7 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
                                                   : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 4 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

CausalAttentionOp the_attention;

}  // namespace

const OrtCustomOp* causal_attention_op() { return &the_attention; }

}  // namespace draftsmith
