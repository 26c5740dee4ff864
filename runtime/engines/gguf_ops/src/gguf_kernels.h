// Matrix products over a GGUF file's own weight blocks (ggml's block layouts, ggml-common.h), for the ONNX Runtime
// operator in ops.cpp. One weight row is one output; its blocks run along K exactly as the file stores them, so the
// engine reads the file's bytes and nothing else.
//
// The activations are quantized to int8 once per call, per row, the way ggml's own CPU kernels do it: per 256 values
// with one float scale for the K-quants (ggml's Q8_K), per 32 for the 32-wide types (Q8_0). Each output is then an
// integer dot product per block times the block's float scales. Every output (row m, column n) is computed by the
// same instruction sequence whatever the number of rows in the call and wherever the row sits in a tile, so a row's
// result does not depend on the call's shape (what speculative verification needs to equal plain decoding).
#pragma once

#include <cstddef>
#include <cstdint>

namespace draftsmith {

// ggml's type ids (ggml.h enum ggml_type) of the types this library multiplies.
enum GgmlType : int {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ6_K = 14,
};

// Elements and bytes of one block (ggml-common.h: block_q4_0 {fp16 d; u8 qs[16]}, block_q4_1 {fp16 d, m; u8 qs[16]},
// block_q5_0 {fp16 d; u8 qh[4]; u8 qs[16]}, block_q8_0 {fp16 d; i8 qs[32]}, block_q4_K {fp16 d, dmin; u8 scales[12];
// u8 qs[128]}, block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}). Returns false for another type.
bool block_shape(int type, int* elements, int* bytes);

inline bool is_k_quant(int type) { return type == kQ4_K || type == kQ6_K; }

constexpr int kSuper = 256;  // a K-quant super-block, and the span of one activation scale for them
constexpr int kBlock = 32;   // a 32-wide block, and the span of one activation scale for them

// One row's activations quantized for the K-quants: per 256 values, int8 q (in the order the kernel of this ISA
// reads them), one scale d (x ~ d * q), and the sums of q over each 16 values (natural order) for the offset terms.
// The offset terms (a K-quant's mins, Q6_K's -32, Q4_1's m) multiply these float sums, d * sum(q).
struct alignas(64) SuperQ8 {
  int8_t q[kSuper];
  float dsums16[16];  // d * sum of q over each 16 values, natural order
  float dsums32[8];   // d * sum of q over each 32 values, natural order
  float d;
  int16_t sums16[16];  // the sums themselves (|sum| <= 32 * 127 fits)
  int16_t sums32[8];
};

// A call's activations: m rows of k values in the forms its parts read (each computed only where a part needs it).
// For the 32-wide types: int8 q [K] in natural order, and per block its scale d and d * sum(q); `wide32` is an
// instruction set's own per-pair expansion of those (Kernels::wide32_floats floats a pair of blocks), or null.
struct Activations {
  int64_t m = 0;
  int64_t k = 0;
  const SuperQ8* super = nullptr;   // [m][k / 256]
  const int8_t* q32 = nullptr;      // [m][k]
  const float* d32 = nullptr;       // [m][k / 32]
  const float* dsums32 = nullptr;   // [m][k / 32]
  const int32_t* sums32 = nullptr;  // [m][k / 32]: the sums themselves
  const float* wide32 = nullptr;    // [m][k / 64][wide32_floats]
};

// How a part's blocks are laid out. kRows: the file's rows as they are (row n's blocks contiguous). kColumns16:
// the same bytes regrouped so that 16 output rows sit side by side: for each group of 16 rows and each block, the
// 16 rows' scales (as planes of 16) and then their quant bytes four at a time, row after row (x16_layout.md and
// builder/gguf/weights.py's interleave16 say where each byte goes). Same bits, same size; one 64-byte load then
// feeds a dot product of 16 outputs with 4 activations broadcast to every lane.
enum Layout : int { kRows = 0, kColumns16 = 1 };
constexpr int kGroup = 16;

// One weight part: rows of `type` blocks, `row_bytes` apart (kRows), or groups of 16 rows, 16 * row_bytes apart
// (kColumns16).
struct WeightPart {
  int type;
  int64_t rows;
  int64_t row_bytes;
  const uint8_t* data;
  int layout = kRows;
};

// What one instruction set provides. `quantize_*` write one row (for parts of `layout`); `dot` computes y[m * ldy + n] for rows m in
// [m0, m1) and weight rows n in [n0, n1) of `part`.
struct Kernels {
  const char* name;
  int wide32_floats;  // floats of `wide` a pair of 32-blocks takes (0: none)
  void (*quantize_super)(const float* x, int64_t k, SuperQ8* out, int layout);
  void (*quantize_32)(const float* x, int64_t k, int8_t* q, float* d, float* dsums, int32_t* sums, float* wide);
  void (*dot)(const WeightPart& part, int64_t n0, int64_t n1, const Activations& act, int64_t m0, int64_t m1,
              float* y, int64_t ldy);
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();
// The fastest kernels this CPU runs (AVX-512 with VNNI, else AVX2 with FMA and F16C, else portable C++);
// DRAFTSMITH_GGUF_ISA=avx2|scalar asks for a lower one (tests compare them).
const Kernels& best_kernels();
// The kernels of one instruction set by name ("avx512-vnni", "avx2", "scalar"); null where this CPU lacks it.
const Kernels* kernels_named(const char* isa);

// Row n of `part` (either layout) as the file's float32 values, out [k] (dequantize.cpp).
void dequantize_row(const WeightPart& part, int64_t n, int64_t k, float* out);

// fp16 bits to float, exactly (subnormals included).
float half_to_float(uint16_t h);

}  // namespace draftsmith
