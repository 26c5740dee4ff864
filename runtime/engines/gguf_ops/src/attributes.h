// What the library's operators share (the functions defined in ops.cpp): reading a node's attributes — ONNX
// Runtime's typed getters fail alike for an absent attribute and a mistyped one, so these tell the two apart, and a
// mistyped attribute is an error, never read as its default — and turning a kernel's exceptions into ONNX Runtime
// statuses (an exception never crosses the C API).
#pragma once

#include <cstdint>
#include <exception>

#include "onnxruntime_cxx_api.h"

namespace draftsmith {

bool has_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* name);
int64_t int_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name,
                      const int64_t* fallback = nullptr);
float float_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name, float fallback);

// A kernel made from a node's attributes; a bad attribute is an error status for ONNX Runtime to report at session
// creation.
template <typename Kernel>
OrtStatusPtr create_kernel(const OrtApi& api, const OrtKernelInfo* info, void** kernel) {
  try {
    *kernel = new Kernel(api, info);
    return nullptr;
  } catch (const std::exception& error) {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, error.what());
  }
}

// One call of a kernel's work (`compute()`), a thrown error as ONNX Runtime's status.
template <typename Work>
OrtStatusPtr compute_status(Work&& compute) {
  try {
    compute();
    return nullptr;
  } catch (const std::exception& error) {
    return Ort::GetApi().CreateStatus(ORT_RUNTIME_EXCEPTION, error.what());
  }
}

}  // namespace draftsmith
