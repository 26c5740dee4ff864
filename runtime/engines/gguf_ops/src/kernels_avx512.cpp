// AVX-512 kernels with VNNI (vpdpwssd / vpdpbusd), compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni.
//
// One weight row's blocks are unpacked once into 64-byte vectors of unsigned quant values and multiplied with up to
// four activation rows (a tile) before the next row is read: at one row the call streams the file's bytes, and each
// further row costs only its integer dot products. Per activation row and super-block the work is the same
// instruction sequence whatever the tile, so results do not depend on how many rows share a call.
//
// Activations for the K-quants are stored in the order the Q4_K nibbles unpack to (the 32-value groups
// 0, 2, 1, 3, 4, 6, 5, 7: a 64-byte vector of low nibbles holds sub-blocks 2c and 2c + 2); Q6_K's kernel unpacks its
// bits into that same order, so one quantized copy serves a fused projection of both types.
#include <immintrin.h>

#include <cstring>

#include "block_math.h"
#include "gguf_kernels.h"
#include "tiling.h"

namespace draftsmith {
namespace {

constexpr int kSlot[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // the vector slot of each natural 32-value group (an involution)

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

inline float hsum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

inline float fp16(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// --- activations -----------------------------------------------------------------------------------------------

void quantize_super(const float* x, int64_t k, SuperQ8* out, int layout) {
  if (layout == kColumns16) {  // the column kernels read natural order
    for (int64_t s = 0; s < k / kSuper; ++s) quantize_super_natural(x + s * kSuper, &out[s]);
    return;
  }
  for (int64_t s = 0; s < k / kSuper; ++s, x += kSuper) {
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * i)));
    SuperQ8& o = out[s];
    float inverse;
    int8_scale(_mm512_reduce_max_ps(amax), &o.d, &inverse);
    const __m512 scale = _mm512_set1_ps(inverse);
    int sums16[16];
    for (int g = 0; g < 16; ++g) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * g), scale));
      sums16[g] = _mm512_reduce_add_epi32(q);
      _mm_store_si128(reinterpret_cast<__m128i*>(o.q + 32 * kSlot[g / 2] + 16 * (g % 2)), _mm512_cvtsepi32_epi8(q));
    }
    for (int g = 0; g < 16; ++g) {
      o.sums16[g] = static_cast<int16_t>(sums16[g]);
      o.dsums16[g] = o.d * static_cast<float>(sums16[g]);
    }
    for (int j = 0; j < 8; ++j) {
      o.sums32[j] = static_cast<int16_t>(sums16[2 * j] + sums16[2 * j + 1]);
      o.dsums32[j] = o.d * static_cast<float>(o.sums32[j]);
    }
  }
}

// wide: per pair of blocks, [d0 x8, d1 x8] and [d0*sum0, 0 x7, d1*sum1, 0 x7] (the lanes vpdpbusd sums each block in).
constexpr int kWide = 32;

void quantize_32(const float* x, int64_t k, int8_t* q, float* d, float* dsums, int32_t* sums, float* wide) {
  const int64_t blocks = k / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    quantize_block32(x + b * kBlock, q + b * kBlock, &d[b], &dsums[b], &sums[b]);
  }
  for (int64_t p = 0; p < blocks / 2; ++p, wide += kWide) {
    for (int i = 0; i < kWide; ++i) wide[i] = i < 8 ? d[2 * p] : i < 16 ? d[2 * p + 1] : 0.0f;
    wide[16] = dsums[2 * p];
    wide[24] = dsums[2 * p + 1];
  }
}

// --- Q4_K: {fp16 d, dmin; u8 scales[12]; u8 qs[128]}, w = d * sc * q - dmin * mn per 32 ---------------------------

struct Q4KBlock {
  __m512i v[4];       // quant values in the activation order
  __m512i scales[4];  // each value's sub-block scale, one int16 per pair of values
  __m256 mins;        // dmin * mn per sub-block
  float d;
};

inline __m512i words_index(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(a)), _mm256_set1_epi16(static_cast<int16_t>(b)), 1);
}

inline void unpack_q4k(const uint8_t* w, Q4KBlock* out) {
  const uint32_t a = load_u32(w + 4), b = load_u32(w + 8), c = load_u32(w + 12);
  const __m128i packed = _mm_set_epi32(static_cast<int>(((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)),
                                       static_cast<int>(b & 0x3F3F3F3Fu),
                                       static_cast<int>((c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)),
                                       static_cast<int>(a & 0x3F3F3F3Fu));
  const __m512i words = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(packed));  // scales 0-7, mins 8-15
  out->scales[0] = _mm512_permutexvar_epi16(words_index(0, 2), words);
  out->scales[1] = _mm512_permutexvar_epi16(words_index(1, 3), words);
  out->scales[2] = _mm512_permutexvar_epi16(words_index(4, 6), words);
  out->scales[3] = _mm512_permutexvar_epi16(words_index(5, 7), words);
  out->mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
                            _mm256_set1_ps(fp16(w + 2)));
  out->d = fp16(w);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i q0 = _mm512_loadu_si512(w + 16), q1 = _mm512_loadu_si512(w + 80);
  out->v[0] = _mm512_and_si512(q0, nibble);
  out->v[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), nibble);
  out->v[2] = _mm512_and_si512(q1, nibble);
  out->v[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), nibble);
}

template <int MR>
void q4k_rows(const uint8_t* w, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m512 acc[MR];
  __m256 acc_min[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    acc_min[r] = _mm256_setzero_ps();
  }
  Q4KBlock block;
  for (int64_t s = 0; s < supers; ++s, w += 144) {
    unpack_q4k(w, &block);
    const __m512 d = _mm512_set1_ps(block.d);
    for (int r = 0; r < MR; ++r) {
      const SuperQ8& x = a[r * supers + s];
      __m512i dot = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i xq = _mm512_load_si512(x.q + 64 * v);
        dot = _mm512_dpwssd_epi32(dot, _mm512_maddubs_epi16(block.v[v], xq), block.scales[v]);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.d)), acc[r]);
      acc_min[r] = _mm256_fmadd_ps(block.mins, _mm256_load_ps(x.dsums32), acc_min[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum(acc[r]) - hsum(acc_min[r]);
}

// --- Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}, w = d * sc * (q - 32) per 16 -----------------------------

struct Q6KBlock {
  __m512i v[4];
  __m512i scales[4];
  __m512 offsets;  // 32 * d * sc per 16 values, natural order
  float d;
};

inline void unpack_q6k(const uint8_t* w, Q6KBlock* out) {
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
  const __m512i words = _mm512_castsi256_si512(sc16);
  const __m512i groups[4] = {
      _mm512_set_epi64(0x0005000500050005, 0x0005000500050005, 0x0004000400040004, 0x0004000400040004,
                       0x0001000100010001, 0x0001000100010001, 0x0000000000000000, 0x0000000000000000),
      _mm512_set_epi64(0x0007000700070007, 0x0007000700070007, 0x0006000600060006, 0x0006000600060006,
                       0x0003000300030003, 0x0003000300030003, 0x0002000200020002, 0x0002000200020002),
      _mm512_set_epi64(0x000D000D000D000D, 0x000D000D000D000D, 0x000C000C000C000C, 0x000C000C000C000C,
                       0x0009000900090009, 0x0009000900090009, 0x0008000800080008, 0x0008000800080008),
      _mm512_set_epi64(0x000F000F000F000F, 0x000F000F000F000F, 0x000E000E000E000E, 0x000E000E000E000E,
                       0x000B000B000B000B, 0x000B000B000B000B, 0x000A000A000A000A, 0x000A000A000A000A),
  };
  for (int v = 0; v < 4; ++v) out->scales[v] = _mm512_permutexvar_epi16(groups[v], words);
  out->d = fp16(w + 208);
  out->offsets = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(sc16)), _mm512_set1_ps(32.0f * out->d));
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  // lower 256 bits: the group in a byte's low nibble / low qh bits; upper: the group 64 values on
  const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_setzero_si256(), 1);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = w + 64 * half;
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * half)));
    for (int odd = 0; odd < 2; ++odd) {  // groups 0 and 2 (qh bits 0-1, 4-5), then 1 and 3 (bits 2-3, 6-7)
      const __m512i low = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * odd)));
      const __m512i bits = odd ? _mm512_srli_epi16(qh, 2) : qh;
      out->v[2 * half + odd] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(low, right), nibble),
                                               _mm512_and_si512(_mm512_sllv_epi16(bits, left), high));
    }
  }
}

template <int MR>
void q6k_rows(const uint8_t* w, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m512 acc[MR], acc_offset[MR];
  for (int r = 0; r < MR; ++r) acc[r] = acc_offset[r] = _mm512_setzero_ps();
  Q6KBlock block;
  for (int64_t s = 0; s < supers; ++s, w += 210) {
    unpack_q6k(w, &block);
    const __m512 d = _mm512_set1_ps(block.d);
    for (int r = 0; r < MR; ++r) {
      const SuperQ8& x = a[r * supers + s];
      __m512i dot = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i xq = _mm512_load_si512(x.q + 64 * v);
        dot = _mm512_dpwssd_epi32(dot, _mm512_maddubs_epi16(block.v[v], xq), block.scales[v]);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.d)), acc[r]);
      acc_offset[r] = _mm512_fmadd_ps(block.offsets, _mm512_load_ps(x.dsums16), acc_offset[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum(acc[r]) - hsum(acc_offset[r]);
}

// --- 32-wide types, two blocks a vector ----------------------------------------------------------------------

struct PairBlock {
  __m512i v;       // 64 unsigned values (stored q, offset added), blocks side by side in natural order
  __m512 d;        // [d0 x8, d1 x8]
  __m512 offset;   // what multiplies the blocks' d * sum(q) lanes: -offset * d, or Q4_1's m
};

inline __m512 two_scales(float first, float second) {
  return _mm512_insertf32x8(_mm512_set1_ps(first), _mm256_set1_ps(second), 1);
}

// [lo(q0), hi(q0), lo(q1), hi(q1)] from the 16 nibble bytes of each block
inline __m512i nibble_pair(const uint8_t* first, const uint8_t* second) {
  const __m256i bytes = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(second)), 1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nibble)),
                                          _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), 1);
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

inline void unpack_pair(int type, const uint8_t* b0, int bytes, PairBlock* out) {
  const uint8_t* b1 = b0 + bytes;
  const float d0 = fp16(b0), d1 = fp16(b1);
  out->d = two_scales(d0, d1);
  switch (type) {
    case kQ8_0: {
      const __m512i q = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
      out->v = _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
      out->offset = _mm512_mul_ps(out->d, _mm512_set1_ps(-128.0f));
      break;
    }
    case kQ4_0:
      out->v = nibble_pair(b0 + 2, b1 + 2);
      out->offset = _mm512_mul_ps(out->d, _mm512_set1_ps(-8.0f));
      break;
    case kQ4_1:
      out->v = nibble_pair(b0 + 4, b1 + 4);
      out->offset = two_scales(fp16(b0 + 2), fp16(b1 + 2));
      break;
    default: {  // kQ5_0
      const uint64_t high = static_cast<uint64_t>(load_u32(b0 + 2)) | (static_cast<uint64_t>(load_u32(b1 + 2)) << 32);
      out->v = _mm512_or_si512(nibble_pair(b0 + 6, b1 + 6),
                               _mm512_maskz_mov_epi8(_cvtu64_mask64(high), _mm512_set1_epi8(0x10)));
      out->offset = _mm512_mul_ps(out->d, _mm512_set1_ps(-16.0f));
      break;
    }
  }
}

template <int MR>
void pair_rows(int type, int bytes, const uint8_t* w, int64_t blocks, const Activations& act, int64_t m, float* y,
               int64_t ldy) {
  __m512 acc[MR];
  float tail[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_setzero_ps();
    tail[r] = 0.0f;
  }
  const int64_t pairs = blocks / 2;
  PairBlock block;
  for (int64_t p = 0; p < pairs; ++p) {
    unpack_pair(type, w + 2 * p * bytes, bytes, &block);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = act.q32 + (m + r) * act.k + 64 * p;
      const float* wide = act.wide32 + ((m + r) * pairs + p) * kWide;
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), block.v, _mm512_loadu_si512(xq));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(block.d, _mm512_loadu_ps(wide)), acc[r]);
      acc[r] = _mm512_fmadd_ps(block.offset, _mm512_loadu_ps(wide + 16), acc[r]);
    }
  }
  if (blocks % 2) {  // an odd last block, the portable way (the same for every row)
    const uint8_t* last = w + (blocks - 1) * bytes;
    for (int r = 0; r < MR; ++r) {
      const int64_t row = m + r, b = blocks - 1;
      tail[r] = block32_dot(type, last, act.q32 + row * act.k + b * kBlock, act.d32[row * blocks + b],
                            act.dsums32[row * blocks + b], fp16(last));
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum(acc[r]) + tail[r];
}

// --- kColumns16: 16 output rows a vector, activations broadcast four bytes at a time -------------------------------
//
// One vpdpbusd multiplies 16 rows by 4 activations; a block's integer sums land per row in its lane, so nothing is
// summed across lanes and the 16 outputs are stored as they are. Per activation row and super-block the work is
// 64 vpdpbusd plus the block scales: a few times cheaper per row than the row kernels, which is what keeps a call
// of several tokens close to the cost of one.

inline __m512i quad(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm512_set1_epi32(four);
}

inline __m512 halves(const uint8_t* p) {  // 16 fp16 values as floats
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }

template <int K>
inline __m512i byte_of(__m512i v) {  // byte K of each dword, zero-extended
  if constexpr (K == 3) return _mm512_srli_epi32(v, 24);
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * K), _mm512_set1_epi32(0xFF));
}

template <int K>
inline __m512i signed_byte_of(__m512i v) {  // byte K of each dword, sign-extended
  return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * K), 24);
}

// A full tile of four rows is bound by its integer work, and there the hardware prefetcher alone stops keeping the
// weight stream ahead: reading Q4_K groups 4 KB ahead into L1 made a 4-token call of the 1.5B's engine 9% cheaper
// (43.5 -> 38.8 ms, 2 threads; the kernel alone, K = 1536, N = 65,536, one thread: 3.27 -> 2.86 ms at 4 rows,
// 7.65 -> 5.99 at 8; Zen 4, 2026-12-05). Below four rows it bought nothing or cost a little; into L2 instead of L1
// it cost 70%; Q6_K's heavier unpacking keeps ahead on its own (prefetching it cost 10-30%).
constexpr int kPrefetchAhead = 4096;

inline void prefetch_ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
}

// Q4_K: 8 sub-blocks of 32 with 6-bit scales sc and mins mn; y += d * dx * sum_j sc_j isum_j - dmin * dx *
// sum_j mn_j sums_j.
template <int MR>
void q4k_x16(const uint8_t* w, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi32(0x3F3F3F3F);
  const __m512i four = _mm512_set1_epi32(0x0F0F0F0F), top = _mm512_set1_epi32(0x30303030);
  for (int64_t s = 0; s < supers; ++s, w += 2304) {
    const __m512i pa = load64(w + 64), pb = load64(w + 128), pc = load64(w + 192);
    const __m512i sc_lo = _mm512_and_si512(pa, six);
    const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(pc, four), _mm512_and_si512(_mm512_srli_epi32(pa, 2), top));
    const __m512i scales[8] = {byte_of<0>(sc_lo), byte_of<1>(sc_lo), byte_of<2>(sc_lo), byte_of<3>(sc_lo),
                               byte_of<0>(sc_hi), byte_of<1>(sc_hi), byte_of<2>(sc_hi), byte_of<3>(sc_hi)};
    __m512i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i low[MR], high[MR];
      for (int r = 0; r < MR; ++r) low[r] = high[r] = _mm512_setzero_si512();
      for (int t = 0; t < 8; ++t) {
        const __m512i v = load64(w + 256 + 64 * (8 * c + t));
        if constexpr (MR == kTile) prefetch_ahead(w + 256 + 64 * (8 * c + t));
        const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = a[r * supers + s].q + 64 * c + 4 * t;
          low[r] = _mm512_dpbusd_epi32(low[r], lo, quad(x));
          high[r] = _mm512_dpbusd_epi32(high[r], hi, quad(x + 32));
        }
      }
      for (int r = 0; r < MR; ++r) {
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(low[r], scales[2 * c]),
                                                             _mm512_mullo_epi32(high[r], scales[2 * c + 1])));
      }
    }
    const __m512i mn_lo = _mm512_and_si512(pb, six);
    const __m512i mn_hi =
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(pc, 4), four), _mm512_and_si512(_mm512_srli_epi32(pb, 2), top));
    const __m512i low16 = _mm512_set1_epi32(0xFF), high16 = _mm512_set1_epi32(0xFF0000);
    const __m512i min_pairs[4] = {  // (mn_2i | mn_2i+1 << 16) for vpdpwssd
        _mm512_or_si512(_mm512_and_si512(mn_lo, low16), _mm512_and_si512(_mm512_slli_epi32(mn_lo, 8), high16)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(mn_lo, 16), low16), _mm512_and_si512(_mm512_srli_epi32(mn_lo, 8), high16)),
        _mm512_or_si512(_mm512_and_si512(mn_hi, low16), _mm512_and_si512(_mm512_slli_epi32(mn_hi, 8), high16)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(mn_hi, 16), low16), _mm512_and_si512(_mm512_srli_epi32(mn_hi, 8), high16)),
    };
    const __m512 d = halves(w), dmin = halves(w + 32);
    for (int r = 0; r < MR; ++r) {
      const SuperQ8& x = a[r * supers + s];
      __m512i mins = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) mins = _mm512_dpwssd_epi32(mins, min_pairs[p], quad(reinterpret_cast<const int8_t*>(x.sums32 + 2 * p)));
      const __m512 dx = _mm512_set1_ps(x.d);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, dx), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Q6_K: 16 sub-blocks of 16 with int8 scales, q = 4 low bits (ql) | 2 high bits (qh) << 4, w = d * sc * (q - 32).
// Each sub-block's sum starts at -32 * sum(x) so that q can be multiplied unsigned. For half h and quads t of one
// quarter th, the four groups of 32 values give the sub-blocks 8h + th (+4, +2, +6).
template <int MR, int TH>
inline void q6k_quarter(const uint8_t* w, int half, const SuperQ8* a, int64_t supers, int64_t s, const __m512i* planes,
                        __m512i* isum) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), bits = _mm512_set1_epi8(0x30);
  const int sub = 8 * half + TH;
  __m512i acc[MR][4];
  for (int r = 0; r < MR; ++r) {
    const SuperQ8& x = a[r * supers + s];
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_set1_epi32(-32 * x.sums16[sub + (g == 1 ? 4 : g == 2 ? 2 : g == 3 ? 6 : 0)]);
  }
  for (int t = 4 * TH; t < 4 * TH + 4; ++t) {
    const uint8_t* at = w + 288 + 192 * (8 * half + t);
    const __m512i ql0 = load64(at), ql1 = load64(at + 64), qh = load64(at + 128);
    const __m512i v[4] = {
        _mm512_or_si512(_mm512_and_si512(ql0, nibble), _mm512_and_si512(_mm512_slli_epi16(qh, 4), bits)),  // +0
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql0, 4), nibble), _mm512_and_si512(qh, bits)),  // +64
        _mm512_or_si512(_mm512_and_si512(ql1, nibble), _mm512_and_si512(_mm512_slli_epi16(qh, 2), bits)),  // +32
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql1, 4), nibble),
                        _mm512_and_si512(_mm512_srli_epi16(qh, 2), bits)),  // +96
    };
    for (int r = 0; r < MR; ++r) {
      const int8_t* x = a[r * supers + s].q + 128 * half + 4 * t;
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], v[0], quad(x));
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], v[1], quad(x + 64));
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], v[2], quad(x + 32));
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], v[3], quad(x + 96));
    }
  }
  // scales of sub-blocks sub, sub + 4, sub + 2, sub + 6: planes 2h, 2h + 1; bytes TH, TH + 2
  const __m512i scales[4] = {signed_byte_of<TH>(planes[2 * half]), signed_byte_of<TH>(planes[2 * half + 1]),
                             signed_byte_of<TH + 2>(planes[2 * half]), signed_byte_of<TH + 2>(planes[2 * half + 1])};
  for (int r = 0; r < MR; ++r) {
    for (int g = 0; g < 4; ++g) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(acc[r][g], scales[g]));
  }
}

template <int MR>
void q6k_x16(const uint8_t* w, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s, w += 3360) {
    const __m512i planes[4] = {load64(w + 32), load64(w + 96), load64(w + 160), load64(w + 224)};
    __m512i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      q6k_quarter<MR, 0>(w, half, a, supers, s, planes, isum);
      q6k_quarter<MR, 1>(w, half, a, supers, s, planes, isum);
    }
    const __m512 d = halves(w);
    for (int r = 0; r < MR; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(a[r * supers + s].d)),
                               acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// The 32-wide types: each block's sum starts at -offset * sum(x) (the stored unsigned q carry the offset), Q4_1
// adds m * dx * sum(x).
template <int MR>
void block32_x16(int type, int bytes, const uint8_t* w, int64_t blocks, const Activations& act, int64_t m, float* y,
                 int64_t ldy) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
  const int offset = type == kQ8_0 ? 128 : type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : 0;
  const int qs_at = type == kQ4_1 ? 64 : type == kQ5_0 ? 96 : 32;
  for (int64_t b = 0; b < blocks; ++b, w += kGroup * bytes) {
    // up to two rows, two chains of vpdpbusd a row (a block's low and high halves), summed at its end: one chain of
    // eight waited on its own latency (Q4_0 in cache, one row: 13.6 -> 12.3 ps a weight; three and four rows have
    // the chains they need and lose ~5% to the extra registers)
    __m512i dot[MR], other[MR];
    for (int r = 0; r < MR; ++r) {
      dot[r] = _mm512_set1_epi32(-offset * act.sums32[(m + r) * blocks + b]);
      other[r] = _mm512_setzero_si512();
    }
    if (type == kQ8_0) {
      for (int t = 0; t < 8; ++t) {
        const __m512i v = _mm512_xor_si512(load64(w + 32 + 64 * t), _mm512_set1_epi8(static_cast<char>(0x80)));
        for (int r = 0; r < MR; ++r) {
          __m512i& chain = MR <= 2 && t % 2 ? other[r] : dot[r];
          chain = _mm512_dpbusd_epi32(chain, v, quad(act.q32 + (m + r) * act.k + 32 * b + 4 * t));
        }
      }
    } else {
      for (int t = 0; t < 4; ++t) {
        const __m512i v = load64(w + qs_at + 64 * t);
        __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if (type == kQ5_0) {
          uint64_t low_bits, high_bits;
          std::memcpy(&low_bits, w + 32 + 8 * t, 8);
          std::memcpy(&high_bits, w + 32 + 8 * (t + 4), 8);
          lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_cvtu64_mask64(low_bits), sixteen));
          hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_cvtu64_mask64(high_bits), sixteen));
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = act.q32 + (m + r) * act.k + 32 * b + 4 * t;
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, quad(x));
          __m512i& chain = MR <= 2 ? other[r] : dot[r];
          chain = _mm512_dpbusd_epi32(chain, hi, quad(x + 16));
        }
      }
    }
    const __m512 d = halves(w);
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (m + r) * blocks + b;
      const __m512i sum = _mm512_add_epi32(dot[r], other[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(act.d32[at])), acc[r]);
      if (type == kQ4_1) acc[r] = _mm512_fmadd_ps(halves(w + 32), _mm512_set1_ps(act.dsums32[at]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

template <int MR>
void columns(const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y, int64_t ldy) {
  const uint8_t* w = part.data + n * part.row_bytes;  // n is a group's first row: groups are 16 rows of bytes
  float* out = y + m * ldy + n;
  if (part.type == kQ4_K) {
    q4k_x16<MR>(w, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
  } else if (part.type == kQ6_K) {
    q6k_x16<MR>(w, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
  } else {
    block32_x16<MR>(part.type, bytes, w, act.k / kBlock, act, m, out, ldy);
  }
}

// --- the tiling --------------------------------------------------------------------------------------------------

template <int MR>
void rows(const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y, int64_t ldy) {
  const uint8_t* w = part.data + n * part.row_bytes;
  float* out = y + m * ldy + n;
  if (part.type == kQ4_K) {
    q4k_rows<MR>(w, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
  } else if (part.type == kQ6_K) {
    q6k_rows<MR>(w, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
  } else {
    pair_rows<MR>(part.type, bytes, w, act.k / kBlock, act, m, out, ldy);
  }
}

struct Avx512 {  // this file's kernels, for tiling.h's loops
  template <int MR>
  static void rows(const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y,
                   int64_t ldy) {
    draftsmith::rows<MR>(part, bytes, n, act, m, y, ldy);
  }
  template <int MR>
  static void columns(const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y,
                      int64_t ldy) {
    draftsmith::columns<MR>(part, bytes, n, act, m, y, ldy);
  }
};

}  // namespace

const Kernels& avx512_kernels() {
  static const Kernels kernels{"avx512-vnni", kWide, quantize_super, quantize_32, tiled_dot<Avx512>};
  return kernels;
}

}  // namespace draftsmith
