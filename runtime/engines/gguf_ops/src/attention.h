// ai.draftsmith.CausalAttention (attention.cpp): registered beside GgufMatMul and GgufGather by ops.cpp.
#pragma once

#include "onnxruntime_c_api.h"

namespace draftsmith {

const OrtCustomOp* causal_attention_op();

}  // namespace draftsmith
