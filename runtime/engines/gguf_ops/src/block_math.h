// What every instruction set's kernels share: unaligned little-endian loads, Q4_K's packed scales, and the
// activation quantization (whose values are the same on every CPU: one multiply and round-to-nearest-even per value).
// Everything here has internal linkage: each kernel file is compiled for its own instruction set, and a shared inline
// copy picked by the linker could run AVX-512 code on a CPU without it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gguf_kernels.h"

namespace draftsmith {
namespace {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Q4_K's 8 six-bit scales and mins from its 12 packed bytes (ggml-quants.c get_scale_min_k4's layout): sub-blocks
// 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 (low: scale, high:
// min) with their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins).
inline void k4_scales_mins(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  const uint32_t a = load_u32(packed), b = load_u32(packed + 4), c = load_u32(packed + 8);
  const uint32_t words[4] = {
      a & 0x3F3F3F3Fu,                                 // scales 0-3
      (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u),    // scales 4-7
      b & 0x3F3F3F3Fu,                                 // mins 0-3
      ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u),  // mins 4-7
  };
  std::memcpy(scales, words, 8);
  std::memcpy(mins, words + 2, 8);
}

// The scale of a span of values: amax / 127, with its inverse for quantizing (0 for an all-zero span).
inline void int8_scale(float amax, float* d, float* inverse) {
  *d = amax / 127.0f;
  *inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
}

inline int8_t to_int8(float x, float inverse) { return static_cast<int8_t>(std::nearbyint(x * inverse)); }

// dsums16 / dsums32 of a block whose q are in natural order.
inline void super_sums(SuperQ8* out) {
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += out->q[16 * g + i];
    out->sums16[g] = static_cast<int16_t>(sum);
    out->dsums16[g] = out->d * static_cast<float>(sum);
  }
  for (int j = 0; j < 8; ++j) {
    out->sums32[j] = static_cast<int16_t>(out->sums16[2 * j] + out->sums16[2 * j + 1]);
    out->dsums32[j] = out->d * static_cast<float>(out->sums32[j]);
  }
}

// 256 values in natural order; sums over each 16 and each 32.
inline void quantize_super_natural(const float* x, SuperQ8* out) {
  float amax = 0.0f;
  for (int i = 0; i < kSuper; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  float inverse;
  int8_scale(amax, &out->d, &inverse);
  for (int i = 0; i < kSuper; ++i) out->q[i] = to_int8(x[i], inverse);
  super_sums(out);
}

inline void quantize_block32(const float* x, int8_t* q, float* d, float* dsum, int32_t* sum) {
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  float inverse;
  int8_scale(amax, d, &inverse);
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = to_int8(x[i], inverse);
    total += q[i];
  }
  *dsum = *d * static_cast<float>(total);
  *sum = total;
}

}  // namespace
}  // namespace draftsmith

namespace draftsmith {
namespace {

// A 32-wide block's value i as the integer the block stores (q - offset for the offset types; Q4_1's m apart).
inline int block32_value(int type, const uint8_t* block, int i) {
  switch (type) {
    case kQ8_0: return static_cast<int8_t>(block[2 + i]);
    case kQ4_0: return ((i < 16) ? (block[2 + i] & 0x0F) : (block[2 + i - 16] >> 4)) - 8;
    case kQ4_1: return (i < 16) ? (block[4 + i] & 0x0F) : (block[4 + i - 16] >> 4);
    default: {  // kQ5_0
      const uint32_t high = load_u32(block + 2);
      const int low = (i < 16) ? (block[6 + i] & 0x0F) : (block[6 + i - 16] >> 4);
      return (low | static_cast<int>(((high >> i) & 1) << 4)) - 16;
    }
  }
}

// One 32-wide block's contribution to a dot product: d * xd * sum(value * q) [+ m * xd * sum(q) for Q4_1].
inline float block32_dot(int type, const uint8_t* block, const int8_t* q, float xd, float xdsum, float d) {
  int32_t isum = 0;
  for (int i = 0; i < kBlock; ++i) isum += block32_value(type, block, i) * q[i];
  float out = d * xd * static_cast<float>(isum);
  if (type == kQ4_1) out += half_to_float(load_u16(block + 2)) * xdsum;
  return out;
}

}  // namespace
}  // namespace draftsmith
