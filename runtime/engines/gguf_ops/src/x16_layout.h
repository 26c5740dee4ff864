// The kColumns16 layout of each type: for every group of 16 output rows and every block along K, the 16 rows'
// block bytes regrouped, same bits and same size as the file's. Offsets in bytes from the start of the group's
// block; "plane p" is 16 little-endian dwords, dword c holding bytes 4p..4p+3 of row c's field; "quad t" is 64
// bytes, bytes 4c..4c+3 holding bytes 4t..4t+3 of row c's quant bytes.
//
//   Q8_0  (544)  d[16] fp16 | qs quads t = 0..7
//   Q4_0  (288)  d[16] | qs quads t = 0..3 (low nibbles: values 4t..4t+3, high: 16+4t..)
//   Q4_1  (320)  d[16] | m[16] | qs quads t = 0..3
//   Q5_0  (352)  d[16] | qh: 8 64-bit words, word e bit 4c+j = row c's high bit of value 4e+j | qs quads t = 0..3
//   Q4_K (2304)  d[16] | dmin[16] | scales planes 0..2 | qs quads (chunk c, t) at 256 + 64 (8c + t), c = 0..3,
//                t = 0..7 (qs bytes 32c + 4t..: low nibbles sub-block 2c, high 2c + 1)
//   Q6_K (3360)  d[16] | scales planes 0..3 | for half h = 0, 1 and t = 0..7, at 288 + 192 (8h + t): the ql quads
//                of bytes 64h + 4t.. and 64h + 32 + 4t.., then the qh quad of bytes 32h + 4t.. (the order the kernels
//                read them: one stream through the block)
//
// builder/gguf/weights.py (interleave16) writes it; the portable kernels read it back through `row_block`.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_kernels.h"

namespace draftsmith {
namespace {

inline void copy_quads(const uint8_t* quads, int count, int c, uint8_t* out) {
  for (int t = 0; t < count; ++t) std::memcpy(out + 4 * t, quads + 64 * t + 4 * c, 4);
}

// Row c's block in the file's own layout, from its group's kColumns16 block.
inline void row_block(int type, const uint8_t* group, int c, uint8_t* out) {
  switch (type) {
    case kQ8_0:
      std::memcpy(out, group + 2 * c, 2);
      copy_quads(group + 32, 8, c, out + 2);
      break;
    case kQ4_0:
      std::memcpy(out, group + 2 * c, 2);
      copy_quads(group + 32, 4, c, out + 2);
      break;
    case kQ4_1:
      std::memcpy(out, group + 2 * c, 2);
      std::memcpy(out + 2, group + 32 + 2 * c, 2);
      copy_quads(group + 64, 4, c, out + 4);
      break;
    case kQ5_0: {
      std::memcpy(out, group + 2 * c, 2);
      uint32_t high = 0;
      for (int e = 0; e < 8; ++e) {
        uint64_t word;
        std::memcpy(&word, group + 32 + 8 * e, 8);
        high |= static_cast<uint32_t>((word >> (4 * c)) & 0xF) << (4 * e);
      }
      std::memcpy(out + 2, &high, 4);
      copy_quads(group + 96, 4, c, out + 6);
      break;
    }
    case kQ4_K:
      std::memcpy(out, group + 2 * c, 2);
      std::memcpy(out + 2, group + 32 + 2 * c, 2);
      copy_quads(group + 64, 3, c, out + 4);
      copy_quads(group + 256, 32, c, out + 16);
      break;
    default:  // kQ6_K
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 8; ++t) {
          const uint8_t* at = group + 288 + 192 * (8 * h + t) + 4 * c;
          std::memcpy(out + 64 * h + 4 * t, at, 4);            // ql
          std::memcpy(out + 64 * h + 32 + 4 * t, at + 64, 4);  // ql, 32 on
          std::memcpy(out + 128 + 32 * h + 4 * t, at + 128, 4);  // qh
        }
      }
      copy_quads(group + 32, 4, c, out + 192);  // scales
      std::memcpy(out + 208, group + 2 * c, 2);  // d
      break;
  }
}

}  // namespace
}  // namespace draftsmith
