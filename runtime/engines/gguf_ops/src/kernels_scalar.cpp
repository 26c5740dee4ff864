// Portable C++ kernels: the semantics every instruction set's kernels follow, and the path for CPUs without AVX2.
#include <cmath>
#include <cstring>

#include <vector>

#include "block_math.h"
#include "gguf_kernels.h"
#include "x16_layout.h"

namespace draftsmith {
namespace {

void quantize_super(const float* x, int64_t k, SuperQ8* out, int /*layout*/) {
  for (int64_t s = 0; s < k / kSuper; ++s) {
    quantize_super_natural(x + s * kSuper, &out[s]);
  }
}

void quantize_32(const float* x, int64_t k, int8_t* q, float* d, float* dsums, int32_t* sums, float* /*wide*/) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    quantize_block32(x + b * kBlock, q + b * kBlock, &d[b], &dsums[b], &sums[b]);
  }
}

float dot_q4_k(const uint8_t* row, int64_t supers, const SuperQ8* a) {
  float acc = 0.0f, acc_min = 0.0f;
  for (int64_t s = 0; s < supers; ++s, row += 144) {
    uint8_t sc[8], mn[8];
    k4_scales_mins(row + 4, sc, mn);
    const uint8_t* qs = row + 16;
    int32_t isum = 0;
    float msum = 0.0f;
    for (int j = 0; j < 8; ++j) {
      int32_t sub = 0;
      for (int i = 0; i < 32; ++i) {
        const int byte = qs[32 * (j / 2) + i];
        sub += ((j % 2) ? (byte >> 4) : (byte & 0x0F)) * a[s].q[32 * j + i];
      }
      isum += sc[j] * sub;
      msum += static_cast<float>(mn[j]) * a[s].dsums32[j];
    }
    acc += half_to_float(load_u16(row)) * a[s].d * static_cast<float>(isum);
    acc_min += half_to_float(load_u16(row + 2)) * msum;
  }
  return acc - acc_min;
}

float dot_q6_k(const uint8_t* row, int64_t supers, const SuperQ8* a) {
  float acc = 0.0f;
  for (int64_t s = 0; s < supers; ++s, row += 210) {
    const uint8_t* ql = row;
    const uint8_t* qh = row + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    int32_t isum = 0;
    for (int e = 0; e < kSuper; ++e) {
      const int half = e / 128, g = (e % 128) / 32, i = e % 32;
      const int low = ql[64 * half + 32 * (g % 2) + i];
      const int q = ((g < 2) ? (low & 0x0F) : (low >> 4)) | (((qh[32 * half + i] >> (2 * g)) & 3) << 4);
      isum += sc[e / 16] * (q - 32) * a[s].q[e];
    }
    acc += half_to_float(load_u16(row + 208)) * a[s].d * static_cast<float>(isum);
  }
  return acc;
}

float dot_block32(int type, const uint8_t* row, int bytes, int64_t blocks, const int8_t* q, const float* d,
                  const float* dsums) {
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b, row += bytes) {
    acc += block32_dot(type, row, q + b * kBlock, d[b], dsums[b], half_to_float(load_u16(row)));
  }
  return acc;
}

// Row n's blocks in the file's layout: the part's own row, or (kColumns16) put back together from its group.
const uint8_t* row_of(const WeightPart& part, int64_t n, int elements, int bytes, int64_t k, std::vector<uint8_t>* buffer) {
  if (part.layout == kRows) return part.data + n * part.row_bytes;
  const int64_t blocks = k / elements;
  buffer->resize(static_cast<size_t>(part.row_bytes));
  const uint8_t* group = part.data + (n / kGroup) * kGroup * part.row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    row_block(part.type, group + b * kGroup * bytes, static_cast<int>(n % kGroup), buffer->data() + b * bytes);
  }
  return buffer->data();
}

void dot(const WeightPart& part, int64_t n0, int64_t n1, const Activations& act, int64_t m0, int64_t m1, float* y,
         int64_t ldy) {
  int elements = 0, bytes = 0;
  block_shape(part.type, &elements, &bytes);
  const int64_t blocks = act.k / elements;
  std::vector<uint8_t> buffer;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = row_of(part, n, elements, bytes, act.k, &buffer);
    for (int64_t m = m0; m < m1; ++m) {
      float value;
      if (part.type == kQ4_K) {
        value = dot_q4_k(row, blocks, act.super + m * blocks);
      } else if (part.type == kQ6_K) {
        value = dot_q6_k(row, blocks, act.super + m * blocks);
      } else {
        const int64_t per_row = act.k / kBlock;
        value = dot_block32(part.type, row, bytes, blocks, act.q32 + m * act.k, act.d32 + m * per_row,
                            act.dsums32 + m * per_row);
      }
      y[m * ldy + n] = value;
    }
  }
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels kernels{"scalar", 0, quantize_super, quantize_32, dot};
  return kernels;
}

}  // namespace draftsmith
