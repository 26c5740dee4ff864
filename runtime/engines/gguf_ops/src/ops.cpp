// The ONNX Runtime operators ai.draftsmith.GgufMatMul and GgufGather (below). GgufMatMul: Y = A @ W^T where W is one or more parts of GGUF blocks side by
// side (a fused q|k|v whose parts have different types), each part a uint8 tensor [rows, row_bytes] holding the
// file's blocks for those output rows. Attributes: K (input width), types (ggml type id per part), rows (outputs per
// part). A float [..., K] -> Y float [..., sum(rows)].
//
// Built for pip onnxruntime without its source tree: only the C/C++ API headers (API version 21), no link against
// libonnxruntime; Python loads it with SessionOptions.register_custom_ops_library. The work is split over output rows
// on ONNX Runtime's own intra-op pool (KernelContext_ParallelFor), so it shares the session's threads.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "attention.h"
#include "attributes.h"
#include "gguf_kernels.h"

namespace draftsmith {
namespace {

constexpr const char* kDomain = "ai.draftsmith";
constexpr int64_t kUnitsPerThread = 8;    // work items per pool thread (balance against per-item overhead)
constexpr int64_t kMinRowsPerUnit = 16;
constexpr int64_t kParallelQuantizeValues = 1 << 16;  // quantize activations on the pool from this many values
// Caps on what a node's attributes may describe, far past any model's (a hidden size of 8k-16k, a vocabulary of
// 256k): within them every size below fits an int64 with room, and a graph past them is refused at session creation
// instead of wrapping to a small number or asking for ~2^58 work items. Python's check (onnx_checks) applies the same.
constexpr int64_t kMaxK = int64_t{1} << 20;     // input width
constexpr int64_t kMaxRows = int64_t{1} << 24;  // output rows of one node, all parts together

// a * b and a + b, or invalid_argument naming `what` where the result leaves int64
int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) throw std::invalid_argument(what + " overflows");
  return out;
}

int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) throw std::invalid_argument(what + " overflows");
  return out;
}

// A ggml type id this library knows (the id an int64 attribute holds, never narrowed to int before it is checked).
bool known_type(int64_t type, int* elements, int* bytes) {
  return type >= 0 && type <= 255 && block_shape(static_cast<int>(type), elements, bytes);
}

}  // namespace

// Whether the node has attribute `name` of any type ONNX Runtime can read for a custom op: the typed getters fail
// alike for an absent attribute and a mistyped one, so an attribute is present where any of them succeeds.
bool has_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  float value = 0;
  OrtStatus* probes[] = {
      api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &size),
      api.KernelInfoGetAttributeArray_float(info, name, nullptr, &size),
      api.KernelInfoGetAttribute_float(info, name, &value),
      api.KernelInfoGetAttribute_string(info, name, nullptr, &size),
  };
  bool present = false;
  for (OrtStatus* status : probes) {
    present = present || status == nullptr;
    if (status != nullptr) api.ReleaseStatus(status);
  }
  return present;
}

// An int attribute of `op`'s node: `fallback` where absent (a required one has none), an error where it is there but
// not an int (a float layout 1.0 is not read as 0, nor taken for 1).
int64_t int_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name,
                      const int64_t* fallback) {
  int64_t value = 0;
  OrtStatus* status = api.KernelInfoGetAttribute_int64(info, name, &value);
  if (status == nullptr) return value;
  api.ReleaseStatus(status);
  const bool present = has_attribute(api, info, name);
  if (present || fallback == nullptr) {
    throw std::invalid_argument(std::string(op) + ": attribute '" + name + "' must be " +
                                (present ? "an int" : "given (an int)"));
  }
  return *fallback;
}

// A float attribute of `op`'s node: `fallback` where absent, an error where it is there but not a float.
float float_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name, float fallback) {
  float value = 0.0f;
  OrtStatus* status = api.KernelInfoGetAttribute_float(info, name, &value);
  if (status == nullptr) return value;
  api.ReleaseStatus(status);
  int64_t ignored = 0;
  OrtStatus* as_int = api.KernelInfoGetAttribute_int64(info, name, &ignored);
  size_t size = 0;
  OrtStatus* as_list = api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  const bool present = as_int == nullptr || as_list == nullptr;
  if (as_int != nullptr) api.ReleaseStatus(as_int);
  if (as_list != nullptr) api.ReleaseStatus(as_list);
  if (present) throw std::invalid_argument(std::string(op) + ": attribute '" + name + "' must be a float");
  return fallback;
}

namespace {

// An ints attribute of `op`'s node, non-empty (what a mistyped one reads as, or an error).
std::vector<int64_t> ints_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name) {
  size_t size = 0;
  OrtStatus* status = api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  std::vector<int64_t> values(size);
  if (status == nullptr && size > 0) status = api.KernelInfoGetAttributeArray_int64(info, name, values.data(), &size);
  if (status != nullptr) api.ReleaseStatus(status);
  if (status != nullptr || values.empty()) {
    throw std::invalid_argument(std::string(op) + ": attribute '" + name + "' must be a non-empty list of ints");
  }
  return values;
}

struct WorkUnit {
  int part;
  int64_t n0, n1;
};

// Everything one call needs, shared with the pool's threads.
struct Call {
  const Kernels* kernels;
  const std::vector<WeightPart>* parts;
  const std::vector<int64_t>* column;  // each part's first output column
  const std::vector<WorkUnit>* units;
  const float* a;
  Activations act;
  SuperQ8* super;
  int8_t* q32;
  float* d32;
  float* dsums32;
  int32_t* sums32;
  float* wide32;
  bool need_super, need_32;
  int layout;
  float* y;
  int64_t ldy;
};

void quantize_row(const Call& call, int64_t m) {
  const int64_t k = call.act.k;
  const float* x = call.a + m * k;
  if (call.need_super) call.kernels->quantize_super(x, k, call.super + m * (k / kSuper), call.layout);
  if (call.need_32) {
    const int64_t blocks = k / kBlock;
    float* wide = call.wide32 ? call.wide32 + m * (blocks / 2) * call.kernels->wide32_floats : nullptr;
    call.kernels->quantize_32(x, k, call.q32 + m * k, call.d32 + m * blocks, call.dsums32 + m * blocks,
                              call.sums32 + m * blocks, wide);
  }
}

void quantize_task(void* data, size_t m) { quantize_row(*static_cast<Call*>(data), static_cast<int64_t>(m)); }

void dot_task(void* data, size_t index) {
  const Call& call = *static_cast<Call*>(data);
  const WorkUnit& unit = (*call.units)[index];
  call.kernels->dot((*call.parts)[unit.part], unit.n0, unit.n1, call.act, 0, call.act.m,
                    call.y + (*call.column)[unit.part], call.ldy);
}

// Scratch buffers of the calling thread, grown as needed and reused (no allocation per call once warm).
struct Scratch {
  std::vector<SuperQ8> super;
  std::vector<int8_t> q32;
  std::vector<float> d32, dsums32, wide32;
  std::vector<int32_t> sums32;
};

thread_local Scratch scratch;

struct GgufMatMulKernel {
  GgufMatMulKernel(const OrtApi& api, const OrtKernelInfo* info) : kernels_(&best_kernels()) {
    static constexpr int64_t kDefaultLayout = kRows;
    k_ = int_attribute(api, info, "GgufMatMul", "K");
    types_ = ints_attribute(api, info, "GgufMatMul", "types");
    rows_ = ints_attribute(api, info, "GgufMatMul", "rows");
    const int64_t layout = int_attribute(api, info, "GgufMatMul", "layout", &kDefaultLayout);
    if (layout != kRows && layout != kColumns16) throw std::invalid_argument("GgufMatMul: layout must be 0 or 1");
    layout_ = static_cast<int>(layout);
    if (types_.size() != rows_.size()) {
      throw std::invalid_argument("GgufMatMul: 'types' and 'rows' must name the same, non-zero number of parts");
    }
    if (k_ <= 0 || k_ % kBlock || k_ > kMaxK) {
      throw std::invalid_argument("GgufMatMul: K must be a positive multiple of 32, at most " + std::to_string(kMaxK));
    }
    for (size_t p = 0; p < types_.size(); ++p) add_part(p);
    plan_units();
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    return compute_status([&] { Compute(raw); });
  }

 private:
  // Part p's bytes a row and first output column, after checking its type, its rows and the running total.
  void add_part(size_t p) {
    int elements = 0, bytes = 0;
    if (!known_type(types_[p], &elements, &bytes)) {
      throw std::invalid_argument("GgufMatMul: unsupported ggml type " + std::to_string(types_[p]));
    }
    if (k_ % elements || rows_[p] <= 0 || rows_[p] > kMaxRows || (layout_ == kColumns16 && rows_[p] % kGroup)) {
      throw std::invalid_argument("GgufMatMul: part " + std::to_string(p) + " has K not a whole number of blocks, "
                                  "no rows, over " + std::to_string(kMaxRows) +
                                  " rows, or (layout 1) rows not a multiple of 16");
    }
    const int type = static_cast<int>(types_[p]);
    need_super_ = need_super_ || is_k_quant(type);
    need_32_ = need_32_ || !is_k_quant(type);
    row_bytes_.push_back(checked_mul(k_ / elements, bytes, "GgufMatMul: bytes per row"));
    columns_.push_back(n_);
    n_ = checked_add(n_, rows_[p], "GgufMatMul: the parts' total rows");
    if (n_ > kMaxRows) {
      throw std::invalid_argument("GgufMatMul: the parts' rows total over " + std::to_string(kMaxRows));
    }
  }

  // The work items: each part's rows in runs of whole 16-row groups, about kUnitsPerThread a pool thread.
  void plan_units() {
    const int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
    int64_t per_unit = std::max(kMinRowsPerUnit, (n_ + threads * kUnitsPerThread - 1) / (threads * kUnitsPerThread));
    per_unit = (per_unit + kGroup - 1) / kGroup * kGroup;  // whole groups of 16 rows
    for (size_t p = 0; p < types_.size(); ++p) {
      for (int64_t n0 = 0; n0 < rows_[p]; n0 += per_unit) {
        units_.push_back({static_cast<int>(p), n0, std::min(rows_[p], n0 + per_unit)});
      }
    }
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    if (context.GetInputCount() != types_.size() + 1) {
      throw std::invalid_argument("GgufMatMul: expected " + std::to_string(types_.size() + 1) + " inputs");
    }
    Ort::ConstValue input = context.GetInput(0);
    std::vector<int64_t> shape = input.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != k_) throw std::invalid_argument("GgufMatMul: A's last dimension is not K");
    std::vector<WeightPart> parts;
    for (size_t p = 0; p < types_.size(); ++p) parts.push_back(weight_part(context, p));
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    shape.back() = n_;
    Ort::UnownedValue output = context.GetOutput(0, shape);
    if (m == 0) return;
    Call call = prepare(input.GetTensorData<float>(), m, output.GetTensorMutableData<float>());
    call.parts = &parts;
    if (m * k_ >= kParallelQuantizeValues) {
      context.ParallelFor(quantize_task, static_cast<size_t>(m), 0, &call);
    } else {
      for (int64_t row = 0; row < m; ++row) quantize_row(call, row);
    }
    context.ParallelFor(dot_task, units_.size(), 0, &call);
  }

  WeightPart weight_part(Ort::KernelContext& context, size_t p) const {
    Ort::ConstValue weight = context.GetInput(p + 1);
    const auto info = weight.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> shape = info.GetShape();
    if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || shape.size() != 2 || shape[0] != rows_[p] ||
        shape[1] != row_bytes_[p]) {
      throw std::invalid_argument("GgufMatMul: weight part " + std::to_string(p) + " must be uint8 [" +
                                  std::to_string(rows_[p]) + ", " + std::to_string(row_bytes_[p]) + "]");
    }
    return {static_cast<int>(types_[p]), rows_[p], row_bytes_[p], weight.GetTensorData<uint8_t>(), layout_};
  }

  Call prepare(const float* a, int64_t m, float* y) const {
    Call call{};
    call.kernels = kernels_;
    call.column = &columns_;
    call.units = &units_;
    call.a = a;
    call.y = y;
    call.ldy = n_;
    call.need_super = need_super_;
    call.need_32 = need_32_;
    call.layout = layout_;
    call.act.m = m;
    call.act.k = k_;
    if (need_super_) {
      scratch.super.resize(std::max(scratch.super.size(), static_cast<size_t>(m * (k_ / kSuper))));
      call.super = scratch.super.data();
      call.act.super = call.super;
    }
    if (need_32_) {
      const int64_t blocks = m * (k_ / kBlock);
      grow(scratch.q32, m * k_);
      grow(scratch.d32, blocks);
      grow(scratch.dsums32, blocks);
      grow(scratch.sums32, blocks);
      call.q32 = scratch.q32.data();
      call.d32 = scratch.d32.data();
      call.dsums32 = scratch.dsums32.data();
      call.sums32 = scratch.sums32.data();
      call.act.q32 = call.q32;
      call.act.d32 = call.d32;
      call.act.dsums32 = call.dsums32;
      call.act.sums32 = call.sums32;
      if (kernels_->wide32_floats) {
        grow(scratch.wide32, m * (k_ / kBlock / 2) * kernels_->wide32_floats);
        call.wide32 = scratch.wide32.data();
        call.act.wide32 = call.wide32;
      }
    }
    return call;
  }

  template <typename T>
  static void grow(std::vector<T>& buffer, int64_t size) {
    if (buffer.size() < static_cast<size_t>(size)) buffer.resize(static_cast<size_t>(size));
  }

  const Kernels* kernels_;
  int64_t k_ = 0, n_ = 0;
  int layout_ = kRows;
  std::vector<int64_t> types_, rows_, row_bytes_, columns_;
  std::vector<WorkUnit> units_;
  bool need_super_ = false, need_32_ = false;
};

struct GgufMatMulOp : Ort::CustomOpBase<GgufMatMulOp, GgufMatMulKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel<GgufMatMulKernel>(api, info, kernel);
  }
  const char* GetName() const { return "GgufMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_VARIADIC;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// ai.draftsmith.GgufGather: rows of a GGUF weight (an embedding, or a tied head's blocks read by the embedding too)
// as float32: inputs W uint8 [V, row_bytes] (layout 0 or 1, as GgufMatMul's), ids int64 [...]; attributes K, type,
// layout; output float [..., K]. Every id is checked to be a row of W.
struct GgufGatherKernel {
  GgufGatherKernel(const OrtApi& api, const OrtKernelInfo* info) {
    static constexpr int64_t kDefaultLayout = kRows;
    k_ = int_attribute(api, info, "GgufGather", "K");
    const int64_t type = int_attribute(api, info, "GgufGather", "type");
    const int64_t layout = int_attribute(api, info, "GgufGather", "layout", &kDefaultLayout);
    int elements = 0, bytes = 0;
    if (!known_type(type, &elements, &bytes) || k_ <= 0 || k_ > kMaxK || k_ % elements ||
        (layout != kRows && layout != kColumns16)) {
      throw std::invalid_argument("GgufGather: K, type and layout must name whole blocks of a known type (K at most " +
                                  std::to_string(kMaxK) + ")");
    }
    type_ = static_cast<int>(type);
    layout_ = static_cast<int>(layout);
    row_bytes_ = checked_mul(k_ / elements, bytes, "GgufGather: bytes per row");
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    return compute_status([&] { Compute(raw); });
  }

 private:
  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    Ort::ConstValue weight = context.GetInput(0), ids = context.GetInput(1);
    const std::vector<int64_t> wshape = weight.GetTensorTypeAndShapeInfo().GetShape();
    if (wshape.size() != 2 || wshape[1] != row_bytes_ || (layout_ == kColumns16 && wshape[0] % kGroup)) {
      throw std::invalid_argument("GgufGather: W must be uint8 [rows, " + std::to_string(row_bytes_) + "]");
    }
    std::vector<int64_t> shape = ids.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t count = static_cast<int64_t>(ids.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t* id = ids.GetTensorData<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      if (id[i] < 0 || id[i] >= wshape[0]) {
        throw std::invalid_argument("GgufGather: token id " + std::to_string(id[i]) + " is not a row of the table");
      }
    }
    shape.push_back(k_);
    float* out = context.GetOutput(0, shape).GetTensorMutableData<float>();
    const WeightPart part{type_, wshape[0], row_bytes_, weight.GetTensorData<uint8_t>(), layout_};
    for (int64_t i = 0; i < count; ++i) dequantize_row(part, id[i], k_, out + i * k_);
  }

  int64_t k_ = 0, row_bytes_ = 0;
  int type_ = 0, layout_ = kRows;
};

struct GgufGatherOp : Ort::CustomOpBase<GgufGatherOp, GgufGatherKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return create_kernel<GgufGatherKernel>(api, info, kernel);
  }
  const char* GetName() const { return "GgufGather"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

GgufMatMulOp the_op;
GgufGatherOp the_gather;
std::mutex domains_lock;
std::vector<Ort::CustomOpDomain> domains;  // kept alive while the library is loaded

}  // namespace
}  // namespace draftsmith

extern "C" {

// Called by SessionOptions.register_custom_ops_library.
DRAFTSMITH_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // an onnxruntime older than API 21 cannot say why; the caller checks the op
  Ort::InitApi(api);
  try {
    Ort::CustomOpDomain domain{draftsmith::kDomain};
    domain.Add(&draftsmith::the_op);
    domain.Add(&draftsmith::the_gather);
    domain.Add(draftsmith::causal_attention_op());
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> guard(draftsmith::domains_lock);
    draftsmith::domains.push_back(std::move(domain));
    return nullptr;
  } catch (const std::exception& error) {
    return api->CreateStatus(ORT_FAIL, error.what());
  }
}

// The kernels this CPU runs ("avx512-vnni", "avx2" or "scalar"): what the runtime reports.
DRAFTSMITH_EXPORT const char* DraftsmithGgufKernels() { return draftsmith::best_kernels().name; }

// Y[m, n] = A[m, :] . W[n, :] for one part of `type` blocks, outside any session: the tests' way to reach each
// instruction set's kernels directly (`isa`: "avx512-vnni", "avx2", "scalar"; returns 0 on success).
DRAFTSMITH_EXPORT int DraftsmithGgufDot(const char* isa, int type, int layout, const uint8_t* weights, int64_t rows,
                                        int64_t k, const float* a, int64_t m, float* y) {
  using namespace draftsmith;
  const Kernels* kernels = kernels_named(isa);
  if (kernels == nullptr) return 2;
  int elements = 0, bytes = 0;
  if (!block_shape(type, &elements, &bytes) || k <= 0 || k > kMaxK || k % elements || k % kBlock) return 1;
  if (m < 0 || rows < 0 || rows > kMaxRows) return 1;
  if (layout != kRows && (layout != kColumns16 || rows % kGroup)) return 1;
  std::vector<SuperQ8> super(static_cast<size_t>(m * (k / kSuper)) + 1);
  std::vector<int8_t> q32(static_cast<size_t>(m * k));
  std::vector<float> d32(static_cast<size_t>(m * (k / kBlock))), dsums32(d32.size());
  std::vector<int32_t> sums32(d32.size());
  std::vector<float> wide(static_cast<size_t>(m * (k / kBlock / 2) * kernels->wide32_floats) + 1);
  Activations act;
  act.m = m;
  act.k = k;
  for (int64_t row = 0; row < m; ++row) {
    if (is_k_quant(type)) {
      kernels->quantize_super(a + row * k, k, super.data() + row * (k / kSuper), layout);
    } else {
      kernels->quantize_32(a + row * k, k, q32.data() + row * k, d32.data() + row * (k / kBlock),
                           dsums32.data() + row * (k / kBlock), sums32.data() + row * (k / kBlock),
                           wide.data() + row * (k / kBlock / 2) * kernels->wide32_floats);
    }
  }
  act.super = super.data();
  act.q32 = q32.data();
  act.d32 = d32.data();
  act.dsums32 = dsums32.data();
  act.sums32 = sums32.data();
  act.wide32 = wide.data();
  const WeightPart part{type, rows, k / elements * bytes, weights, layout};
  kernels->dot(part, 0, rows, act, 0, m, y, rows);
  return 0;
}

}  // extern "C"
