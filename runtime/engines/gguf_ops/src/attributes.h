// Reading a node's attributes for the library's operators (defined in ops.cpp): ONNX Runtime's typed getters fail
// alike for an absent attribute and a mistyped one, so these tell the two apart — a mistyped attribute is an error,
// never read as its default.
#pragma once

#include <cstdint>

#include "onnxruntime_c_api.h"

namespace draftsmith {

bool has_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* name);
int64_t int_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name,
                      const int64_t* fallback = nullptr);
float float_attribute(const OrtApi& api, const OrtKernelInfo* info, const char* op, const char* name, float fallback);

}  // namespace draftsmith
