// AVX2 kernels (with FMA and F16C), compiled with -mavx2 -mfma -mf16c: the same tiling as the AVX-512 ones, 32-byte
// vectors, and vpmaddubsw + vpmaddwd in place of VNNI. Activations are in natural order (a 32-byte load of Q4_K
// nibbles is one sub-block's low and the next one's high halves); they are quantized by the portable code, whose
// values are the same on every CPU.
#include <immintrin.h>

#include <cstring>

#include "block_math.h"
#include "gguf_kernels.h"
#include "tiling.h"

namespace draftsmith {
namespace {


inline float hsum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

inline float fp16(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

inline __m256i load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// sum over pairs of (unsigned a * signed b) products, then over pairs of those times `scale`: 8 int32 lanes
inline __m256i scaled_dot(__m256i a, __m256i b, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), scale);
}

void quantize_super(const float* x, int64_t k, SuperQ8* out, int /*layout*/) {
  for (int64_t s = 0; s < k / kSuper; ++s) quantize_super_natural(x + s * kSuper, &out[s]);
}

void quantize_32(const float* x, int64_t k, int8_t* q, float* d, float* dsums, int32_t* sums, float* /*wide*/) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    quantize_block32(x + b * kBlock, q + b * kBlock, &d[b], &dsums[b], &sums[b]);
  }
}

// --- Q4_K ----------------------------------------------------------------------------------------------------------

template <int MR>
void q4k_rows(const uint8_t* w, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m256 acc[MR], acc_min[MR];
  for (int r = 0; r < MR; ++r) acc[r] = acc_min[r] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < supers; ++s, w += 144) {
    uint8_t scales[8], mins[8];
    k4_scales_mins(w + 4, scales, mins);
    const __m256 min_scale = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins)))),
        _mm256_set1_ps(fp16(w + 2)));
    __m256i dot[MR];
    for (int r = 0; r < MR; ++r) dot[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      const __m256i bytes = load(w + 16 + 32 * c);
      const __m256i low = _mm256_and_si256(bytes, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      const __m256i low_scale = _mm256_set1_epi16(scales[2 * c]), high_scale = _mm256_set1_epi16(scales[2 * c + 1]);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a[r * supers + s].q + 64 * c;
        dot[r] = _mm256_add_epi32(dot[r], scaled_dot(low, load(xq), low_scale));
        dot[r] = _mm256_add_epi32(dot[r], scaled_dot(high, load(xq + 32), high_scale));
      }
    }
    const __m256 d = _mm256_set1_ps(fp16(w));
    for (int r = 0; r < MR; ++r) {
      const SuperQ8& x = a[r * supers + s];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.d)), acc[r]);
      acc_min[r] = _mm256_fmadd_ps(min_scale, _mm256_load_ps(x.dsums32), acc_min[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum(acc[r]) - hsum(acc_min[r]);
}

// --- Q6_K ----------------------------------------------------------------------------------------------------------

template <int MR>
void q6k_rows(const uint8_t* w, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m256 acc[MR], acc_offset[MR];
  for (int r = 0; r < MR; ++r) acc[r] = acc_offset[r] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(0x03);
  // word pairs of a dword: the low word's scale in the first 8 words of a 128-bit lane, the high word's in the next
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                          2, 3, 2, 3, 2, 3);
  for (int64_t s = 0; s < supers; ++s, w += 210) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
    const float d_value = fp16(w + 208);
    const __m256 offset_scale = _mm256_set1_ps(32.0f * d_value);
    const __m256 offsets[2] = {
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sc16))), offset_scale),
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(sc16, 1))), offset_scale),
    };
    __m256i dot[MR];
    for (int r = 0; r < MR; ++r) dot[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const __m256i ql0 = load(w + 64 * half), ql1 = load(w + 64 * half + 32), qh = load(w + 128 + 32 * half);
      for (int g = 0; g < 4; ++g) {  // 32 values each: low bits from ql0/ql1's low then high nibbles
        const __m256i ql = (g % 2) ? ql1 : ql0;
        const __m256i low = g < 2 ? _mm256_and_si256(ql, nibble) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), nibble);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), two_bits);
        const __m256i v = _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
        const __m256i scale =
            _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(4 * half + g)), spread);
        for (int r = 0; r < MR; ++r) {
          const int8_t* xq = a[r * supers + s].q + 128 * half + 32 * g;
          dot[r] = _mm256_add_epi32(dot[r], scaled_dot(v, load(xq), scale));
        }
      }
    }
    const __m256 d = _mm256_set1_ps(d_value);
    for (int r = 0; r < MR; ++r) {
      const SuperQ8& x = a[r * supers + s];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.d)), acc[r]);
      acc_offset[r] = _mm256_fmadd_ps(offsets[0], _mm256_load_ps(x.dsums16), acc_offset[r]);
      acc_offset[r] = _mm256_fmadd_ps(offsets[1], _mm256_load_ps(x.dsums16 + 8), acc_offset[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum(acc[r]) - hsum(acc_offset[r]);
}

// --- 32-wide types ---------------------------------------------------------------------------------------------------

inline __m256i nibbles(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
}

// 0x10 in byte j where bit j of the 32-bit word is set
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

template <int MR>
void block32_rows(int type, int bytes, const uint8_t* w, int64_t blocks, const Activations& act, int64_t m, float* y,
                  int64_t ldy) {
  __m256 acc[MR];
  float acc_offset[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_setzero_ps();
    acc_offset[r] = 0.0f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b, w += bytes) {
    const float d = fp16(w);
    float offset;  // what multiplies d_x * sum(x_q): -offset * d, or Q4_1's m
    __m256i v;
    switch (type) {
      case kQ8_0: v = load(w + 2); offset = 0.0f; break;  // signed: multiplied through the sign trick below
      case kQ4_0: v = nibbles(w + 2); offset = -8.0f * d; break;
      case kQ4_1: v = nibbles(w + 4); offset = fp16(w + 2); break;
      default: v = _mm256_or_si256(nibbles(w + 6), fifth_bits(load_u32(w + 2))); offset = -16.0f * d; break;
    }
    const __m256i magnitude = type == kQ8_0 ? _mm256_sign_epi8(v, v) : v;
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (m + r) * blocks + b;
      __m256i x = load(act.q32 + (m + r) * act.k + b * kBlock);
      if (type == kQ8_0) x = _mm256_sign_epi8(x, v);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * act.d32[at]), acc[r]);
      acc_offset[r] += offset * act.dsums32[at];
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum(acc[r]) + acc_offset[r];
}

// --- kColumns16: each group of 16 rows as two halves of 8 rows a vector --------------------------------------------
//
// The AVX-512 kernels' structure with 32-byte vectors: a 64-byte quad vector of the layout is two halves (rows 0-7,
// 8-15), and the four-byte dot products are vpmaddubsw + vpmaddwd (no VNNI). Q8_0's signed bytes go through
// vpsignb (|w| times x with w's sign), the others are unsigned.

inline __m256i quad(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int K>
inline __m256i byte_of(__m256i v) {
  if constexpr (K == 3) return _mm256_srli_epi32(v, 24);
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * K), _mm256_set1_epi32(0xFF));
}

template <int K>
inline __m256i signed_byte_of(__m256i v) {
  return _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * K), 24);
}

template <int MR>
void q4k_x8(const uint8_t* w, int half, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi32(0x3F3F3F3F);
  const __m256i four = _mm256_set1_epi32(0x0F0F0F0F), top = _mm256_set1_epi32(0x30303030);
  const int at = 32 * half;
  for (int64_t s = 0; s < supers; ++s, w += 2304) {
    const __m256i pa = load(w + 64 + at), pb = load(w + 128 + at), pc = load(w + 192 + at);
    const __m256i sc_lo = _mm256_and_si256(pa, six);
    const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(pc, four), _mm256_and_si256(_mm256_srli_epi32(pa, 2), top));
    const __m256i scales[8] = {byte_of<0>(sc_lo), byte_of<1>(sc_lo), byte_of<2>(sc_lo), byte_of<3>(sc_lo),
                               byte_of<0>(sc_hi), byte_of<1>(sc_hi), byte_of<2>(sc_hi), byte_of<3>(sc_hi)};
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i low[MR], high[MR];
      for (int r = 0; r < MR; ++r) low[r] = high[r] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i v = load(w + 256 + 64 * (8 * c + t) + at);
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = a[r * supers + s].q + 64 * c + 4 * t;
          low[r] = dot4(low[r], lo, quad(x));
          high[r] = dot4(high[r], hi, quad(x + 32));
        }
      }
      for (int r = 0; r < MR; ++r) {
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(low[r], scales[2 * c]),
                                                             _mm256_mullo_epi32(high[r], scales[2 * c + 1])));
      }
    }
    const __m256i mn_lo = _mm256_and_si256(pb, six);
    const __m256i mn_hi =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(pc, 4), four), _mm256_and_si256(_mm256_srli_epi32(pb, 2), top));
    const __m256i mins[8] = {byte_of<0>(mn_lo), byte_of<1>(mn_lo), byte_of<2>(mn_lo), byte_of<3>(mn_lo),
                             byte_of<0>(mn_hi), byte_of<1>(mn_hi), byte_of<2>(mn_hi), byte_of<3>(mn_hi)};
    const __m256 d = halves8(w + 16 * half), dmin = halves8(w + 32 + 16 * half);
    for (int r = 0; r < MR; ++r) {
      const SuperQ8& x = a[r * supers + s];
      __m256i min_sum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) min_sum = _mm256_add_epi32(min_sum, _mm256_mullo_epi32(mins[j], _mm256_set1_epi32(x.sums32[j])));
      const __m256 dx = _mm256_set1_ps(x.d);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min_sum), _mm256_mul_ps(dmin, dx), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy + 8 * half, acc[r]);
}

template <int MR, int TH>
inline void q6k_quarter(const uint8_t* w, int at, int half, const SuperQ8* a, int64_t supers, int64_t s,
                        const __m256i* planes, __m256i* isum) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), bits = _mm256_set1_epi8(0x30);
  const int sub = 8 * half + TH;
  __m256i acc[MR][4];
  for (int r = 0; r < MR; ++r) {
    const SuperQ8& x = a[r * supers + s];
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm256_set1_epi32(-32 * x.sums16[sub + (g == 1 ? 4 : g == 2 ? 2 : g == 3 ? 6 : 0)]);
  }
  for (int t = 4 * TH; t < 4 * TH + 4; ++t) {
    const uint8_t* p = w + 288 + 192 * (8 * half + t) + at;
    const __m256i ql0 = load(p), ql1 = load(p + 64), qh = load(p + 128);
    const __m256i v[4] = {
        _mm256_or_si256(_mm256_and_si256(ql0, nibble), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), nibble), _mm256_and_si256(qh, bits)),
        _mm256_or_si256(_mm256_and_si256(ql1, nibble), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), nibble),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits)),
    };
    for (int r = 0; r < MR; ++r) {
      const int8_t* x = a[r * supers + s].q + 128 * half + 4 * t;
      acc[r][0] = dot4(acc[r][0], v[0], quad(x));
      acc[r][1] = dot4(acc[r][1], v[1], quad(x + 64));
      acc[r][2] = dot4(acc[r][2], v[2], quad(x + 32));
      acc[r][3] = dot4(acc[r][3], v[3], quad(x + 96));
    }
  }
  const __m256i scales[4] = {signed_byte_of<TH>(planes[2 * half]), signed_byte_of<TH>(planes[2 * half + 1]),
                             signed_byte_of<TH + 2>(planes[2 * half]), signed_byte_of<TH + 2>(planes[2 * half + 1])};
  for (int r = 0; r < MR; ++r) {
    for (int g = 0; g < 4; ++g) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(acc[r][g], scales[g]));
  }
}

template <int MR>
void q6k_x8(const uint8_t* w, int half8, int64_t supers, const SuperQ8* a, float* y, int64_t ldy) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const int at = 32 * half8;
  for (int64_t s = 0; s < supers; ++s, w += 3360) {
    const __m256i planes[4] = {load(w + 32 + at), load(w + 96 + at), load(w + 160 + at), load(w + 224 + at)};
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      q6k_quarter<MR, 0>(w, at, half, a, supers, s, planes, isum);
      q6k_quarter<MR, 1>(w, at, half, a, supers, s, planes, isum);
    }
    const __m256 d = halves8(w + 16 * half8);
    for (int r = 0; r < MR; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(a[r * supers + s].d)),
                               acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy + 8 * half8, acc[r]);
}

template <int MR>
void block32_x8(int type, int bytes, const uint8_t* w, int half, int64_t blocks, const Activations& act, int64_t m,
                float* y, int64_t ldy) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int offset = type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : 0;  // Q8_0: signed, through vpsignb
  const int qs_at = type == kQ4_1 ? 64 : type == kQ5_0 ? 96 : 32;
  const int at = 32 * half;
  for (int64_t b = 0; b < blocks; ++b, w += kGroup * bytes) {
    __m256i dot[MR];
    for (int r = 0; r < MR; ++r) dot[r] = _mm256_set1_epi32(-offset * act.sums32[(m + r) * blocks + b]);
    if (type == kQ8_0) {
      for (int t = 0; t < 8; ++t) {
        const __m256i v = load(w + 32 + 64 * t + at), magnitude = _mm256_sign_epi8(v, v);
        for (int r = 0; r < MR; ++r) {
          dot[r] = dot4(dot[r], magnitude, _mm256_sign_epi8(quad(act.q32 + (m + r) * act.k + 32 * b + 4 * t), v));
        }
      }
    } else {
      for (int t = 0; t < 4; ++t) {
        const __m256i v = load(w + qs_at + 64 * t + at);
        __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        if (type == kQ5_0) {
          lo = _mm256_or_si256(lo, fifth_bits(load_u32(w + 32 + 8 * t + 4 * half)));
          hi = _mm256_or_si256(hi, fifth_bits(load_u32(w + 32 + 8 * (t + 4) + 4 * half)));
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = act.q32 + (m + r) * act.k + 32 * b + 4 * t;
          dot[r] = dot4(dot4(dot[r], lo, quad(x)), hi, quad(x + 16));
        }
      }
    }
    const __m256 d = halves8(w + 16 * half);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m + r) * blocks + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, _mm256_set1_ps(act.d32[i])), acc[r]);
      if (type == kQ4_1) acc[r] = _mm256_fmadd_ps(halves8(w + 32 + 16 * half), _mm256_set1_ps(act.dsums32[i]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy + 8 * half, acc[r]);
}

template <int MR>
void columns(const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y, int64_t ldy) {
  const uint8_t* w = part.data + n * part.row_bytes;
  float* out = y + m * ldy + n;
  for (int half = 0; half < 2; ++half) {
    if (part.type == kQ4_K) {
      q4k_x8<MR>(w, half, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
    } else if (part.type == kQ6_K) {
      q6k_x8<MR>(w, half, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
    } else {
      block32_x8<MR>(part.type, bytes, w, half, act.k / kBlock, act, m, out, ldy);
    }
  }
}

template <int MR>
void rows(const WeightPart& part, int bytes, int64_t n, const Activations& act, int64_t m, float* y, int64_t ldy) {
  const uint8_t* w = part.data + n * part.row_bytes;
  float* out = y + m * ldy + n;
  if (part.type == kQ4_K) {
    q4k_rows<MR>(w, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
  } else if (part.type == kQ6_K) {
    q6k_rows<MR>(w, act.k / kSuper, act.super + m * (act.k / kSuper), out, ldy);
  } else {
    block32_rows<MR>(part.type, bytes, w, act.k / kBlock, act, m, out, ldy);
  }
}

struct Avx2 {  // this file's kernels, for tiling.h's loops
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

const Kernels& avx2_kernels() {
  static const Kernels kernels{"avx2", 0, quantize_super, quantize_32, tiled_dot<Avx2>};
  return kernels;
}

}  // namespace draftsmith
