// The tiling the SIMD kernels share: which activation rows and weight rows one kernel call covers. Each ISA's file
// supplies its kernels as a struct's static templates, Isa::rows<MR> (one file row) and Isa::columns<MR> (one group
// of 16 rows side by side, layout kColumns16); the loops over a part's rows and a call's activation rows live here.
#pragma once

#include <cstdint>

#include "gguf_kernels.h"

namespace draftsmith {

constexpr int kTile = 4;        // activation rows per pass over a weight row
constexpr int64_t kChunk = 16;  // weight rows kept hot while every tile passes over them

inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

template <class Isa, bool Columns, int MR>
inline void pass(const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y,
                 int64_t ldy) {
  if constexpr (Columns) {
    Isa::template columns<MR>(part, bytes, n, act, m, y, ldy);
  } else {
    Isa::template rows<MR>(part, bytes, n, act, m, y, ldy);
  }
}

template <class Isa, bool Columns>
inline void tile(int64_t mr, const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y,
                 int64_t ldy) {
  switch (mr) {
    case 4: pass<Isa, Columns, 4>(part, bytes, n, act, m, y, ldy); break;
    case 3: pass<Isa, Columns, 3>(part, bytes, n, act, m, y, ldy); break;
    case 2: pass<Isa, Columns, 2>(part, bytes, n, act, m, y, ldy); break;
    default: pass<Isa, Columns, 1>(part, bytes, n, act, m, y, ldy); break;
  }
}

// Kernels::dot for an ISA: outputs n0..n1 of activation rows m0..m1. kColumns16 walks the groups of 16 outputs, each
// read once for every tile of activation rows; kRows takes kChunk rows at a time so they stay in cache while every
// tile passes over them.
template <class Isa>
void tiled_dot(const WeightPart& part, int64_t n0, int64_t n1, const Activations& act, int64_t m0, int64_t m1,
               float* y, int64_t ldy) {
  int elements = 0, bytes = 0;
  block_shape(part.type, &elements, &bytes);
  if (part.layout == kColumns16) {
    for (int64_t n = n0; n < n1; n += kGroup) {
      for (int64_t m = m0; m < m1; m += kTile) tile<Isa, true>(smaller(kTile, m1 - m), part, bytes, n, act, m, y, ldy);
    }
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const int64_t c1 = smaller(n1, c0 + kChunk);
    for (int64_t m = m0; m < m1; m += kTile) {
      const int64_t mr = smaller(kTile, m1 - m);
      for (int64_t n = c0; n < c1; ++n) tile<Isa, false>(mr, part, bytes, n, act, m, y, ldy);
    }
  }
}

}  // namespace draftsmith
