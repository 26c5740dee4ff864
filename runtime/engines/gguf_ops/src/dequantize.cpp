// One weight row of GGUF blocks back to float32 (for GgufGather: an embedding's rows, read from the file's own
// bytes). Each value is the file's: the block scale times the stored integer (plus the block's offset).
#include <vector>

#include "block_math.h"
#include "gguf_kernels.h"
#include "x16_layout.h"

namespace draftsmith {
namespace {

void dequantize_block(int type, const uint8_t* b, float* out) {
  switch (type) {
    case kQ4_K: {
      uint8_t sc[8], mn[8];
      k4_scales_mins(b + 4, sc, mn);
      const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
      for (int j = 0; j < 8; ++j) {
        const float scale = d * static_cast<float>(sc[j]), offset = dmin * static_cast<float>(mn[j]);
        for (int i = 0; i < 32; ++i) {
          const int byte = b[16 + 32 * (j / 2) + i];
          out[32 * j + i] = scale * static_cast<float>((j % 2) ? (byte >> 4) : (byte & 0x0F)) - offset;
        }
      }
      return;
    }
    case kQ6_K: {
      const float d = half_to_float(load_u16(b + 208));
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int e = 0; e < kSuper; ++e) {
        const int half = e / 128, g = (e % 128) / 32, i = e % 32;
        const int low = b[64 * half + 32 * (g % 2) + i];
        const int q = ((g < 2) ? (low & 0x0F) : (low >> 4)) | (((b[128 + 32 * half + i] >> (2 * g)) & 3) << 4);
        out[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(q - 32);
      }
      return;
    }
    default: {
      const float d = half_to_float(load_u16(b));
      const float m = type == kQ4_1 ? half_to_float(load_u16(b + 2)) : 0.0f;
      for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(block32_value(type, b, i)) + m;
      return;
    }
  }
}

}  // namespace

// Row `n` of a part (either layout) as floats: out [k].
void dequantize_row(const WeightPart& part, int64_t n, int64_t k, float* out) {
  int elements = 0, bytes = 0;
  block_shape(part.type, &elements, &bytes);
  std::vector<uint8_t> block(static_cast<size_t>(bytes));
  const uint8_t* group = part.data + (n / kGroup) * kGroup * part.row_bytes;
  for (int64_t b = 0; b < k / elements; ++b) {
    const uint8_t* source = part.data + n * part.row_bytes + b * bytes;
    if (part.layout == kColumns16) {
      row_block(part.type, group + b * kGroup * bytes, static_cast<int>(n % kGroup), block.data());
      source = block.data();
    }
    dequantize_block(part.type, source, out + b * elements);
  }
}

}  // namespace draftsmith
