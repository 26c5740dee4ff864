// Block shapes, fp16 conversion and the choice of kernels for this CPU.
#include <cstdlib>
#include <cstring>

#include "gguf_kernels.h"

namespace draftsmith {

bool block_shape(int type, int* elements, int* bytes) {
  switch (type) {
    case kQ4_0: *elements = 32; *bytes = 18; return true;
    case kQ4_1: *elements = 32; *bytes = 20; return true;
    case kQ5_0: *elements = 32; *bytes = 22; return true;
    case kQ8_0: *elements = 32; *bytes = 34; return true;
    case kQ4_K: *elements = 256; *bytes = 144; return true;
    case kQ6_K: *elements = 256; *bytes = 210; return true;
    default: return false;
  }
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf / nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

static bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

static bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const Kernels* kernels_named(const char* isa) {
  if (std::strcmp(isa, "scalar") == 0) return &scalar_kernels();
#ifdef DRAFTSMITH_X86
  if (std::strcmp(isa, "avx2") == 0 && cpu_has_avx2()) return &avx2_kernels();
  if (std::strcmp(isa, "avx512-vnni") == 0 && cpu_has_avx512_vnni()) return &avx512_kernels();
#endif
  return nullptr;
}

const Kernels& best_kernels() {
  static const Kernels* chosen = [] {
    const char* asked = std::getenv("DRAFTSMITH_GGUF_ISA");
    const bool scalar_only = asked && std::strcmp(asked, "scalar") == 0;
    const bool avx2_at_most = asked && std::strcmp(asked, "avx2") == 0;
#ifdef DRAFTSMITH_X86
    if (!scalar_only && !avx2_at_most && cpu_has_avx512_vnni()) return &avx512_kernels();
    if (!scalar_only && cpu_has_avx2()) return &avx2_kernels();
#else
    (void)scalar_only;
    (void)avx2_at_most;
    (void)cpu_has_avx512_vnni;
    (void)cpu_has_avx2;
#endif
    return &scalar_kernels();
  }();
  return *chosen;
}

}  // namespace draftsmith
