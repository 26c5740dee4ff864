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
// Each query's scores, softmax and weighted sum run in a fixed order (16 partial sums, then summed in order), with
// no fused multiply-add (the library is built with -ffp-contract=off), so results are also the same on every
// instruction set. Work is split over (row, kv head, chunk of queries) on ONNX Runtime's pool.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cmath>
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

// x . y over n values: 2 x kLanes partial sums (values i with i % 32 < 16 in the first), then summed by a fixed
// tree — the same float operations in the same order on any ISA, few of them dependent (a 16-lane chain of scalar
// adds per dot made the scores latency-bound).
inline __attribute__((always_inline)) float dot(const float* x, const float* y, int64_t n) {
  float even[kLanes] = {}, odd[kLanes] = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    for (int l = 0; l < kLanes; ++l) even[l] += x[i + l] * y[i + l];
    for (int l = 0; l < kLanes; ++l) odd[l] += x[i + kLanes + l] * y[i + kLanes + l];
  }
  for (int l = 0; i < n; ++i, l = (l + 1) % kLanes) even[l] += x[i] * y[i];
  for (int l = 0; l < kLanes; ++l) even[l] += odd[l];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) even[l] += even[l + width];
  }
  return even[0];
}

// y += a * x over n values.
inline __attribute__((always_inline)) void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
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
  for (int64_t t = first_slot(c, past + j0); t < span; ++t) {
    const float* key = keys + t * s.dim;
    for (int64_t j = std::max(j0, t - past); j < j1 && first_slot(c, past + j) <= t; ++j) {
      for (int64_t r = 0; r < group; ++r) {
        scores[((j - j0) * group + r) * span + t] = dot(q0 + (j * s.heads + r) * s.dim, key, s.dim) * c.scale;
      }
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t r = 0; r < group; ++r) {
      float* row = scores.data() + ((j - j0) * group + r) * span;
      const int64_t first = first_slot(c, past + j), p = past + j;
      float top = -INFINITY, total = 0.0f;
      for (int64_t t = first; t <= p; ++t) top = std::max(top, row[t]);
      for (int64_t t = first; t <= p; ++t) {
        row[t] = std::exp(row[t] - top);
        total += row[t];
      }
      for (int64_t t = first; t <= p; ++t) row[t] = row[t] / total;
      float* out = c.out + ((b * s.new_tokens + j) * s.heads + g * group + r) * s.dim;
      std::fill(out, out + s.dim, 0.0f);
    }
  }
  for (int64_t t = first_slot(c, past + j0); t < span; ++t) {
    const float* value = values + t * s.dim;
    for (int64_t j = std::max(j0, t - past); j < j1 && first_slot(c, past + j) <= t; ++j) {
      for (int64_t r = 0; r < group; ++r) {
        float* out = c.out + ((b * s.new_tokens + j) * s.heads + g * group + r) * s.dim;
        axpy(scores[((j - j0) * group + r) * span + t], value, out, s.dim);
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
