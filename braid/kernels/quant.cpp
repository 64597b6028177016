// Matrix products with GGUF-quantized weights on the CPU, as llama.cpp's ggml-cpu does them:
// each activation row is quantized to int8 blocks (Q8_K: 256 values and one scale, for the
// K-quants Q2_K / Q3_K / Q4_K / Q5_K / Q6_K and IQ4_XS; Q8_0: 32 values and one scale, for the
// 32-value formats Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL), and every output is an integer
// dot product per block, scaled and summed in float.
//
// Batch invariance: output (m, n) is always computed by the same dot routine over row n of the
// weight and row m of the quantized activations, whatever the number of rows, the tile or the
// thread, so a request's logits do not depend on what else is in the batch.
//
// Two implementations of every routine: AVX2 (+FMA, F16C) and portable scalar code; the CPU's
// flags pick one at load. Both give the same integer sums per block; AVX2 scales and sums them
// in 8 float lanes, the scalar code one block at a time, so the two differ in the last bits
// (each is deterministic and batch invariant on its own).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>


#include "formats.h"
#include "ops.h"

namespace {

using namespace braid_kernels;

// ---- scalar dot products: one weight row . one activation row ------------------------------

// Q4_K (in either layout) and Q5_K share their scales, mins and nibbles; Q5_K adds bit 4 of
// each value. The routines below take any of the three block types.

// The (scale, min) pairs of block i.
template <typename B>
inline void q4k_block_scales(const B* w, int64_t i, uint8_t* sc, uint8_t* mn) {
  q4k_scales(w[i].scales, sc, mn);
}
inline void q4k_block_scales(const BlockQ4_KU* w, int64_t i, uint8_t* sc, uint8_t* mn) {
  std::memcpy(sc, w[i].sc, 8);
  std::memcpy(mn, w[i].mn, 8);
}

// Bit 4 of value l of group g (of 32 values) of block b: Q5_K's high bit, 0 for Q4_K.
template <typename B>
inline int high_bit(const B& b, int g, int l) {
  if constexpr (std::is_same_v<B, BlockQ5_K>) return ((b.qh[l] >> g) & 1) << 4;
  else return 0;
}

template <typename B>
float dot_q4_k_scalar(const void* wv, const void* xv, int64_t nb) {
  const auto* w = static_cast<const B*>(wv);
  const auto* x = static_cast<const ActQ8_K*>(xv);
  float acc = 0.f, acc_min = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t sc[8], mn[8];
    q4k_block_scales(w, i, sc, mn);
    int32_t sumi = 0, summ = 0;
    for (int j = 0; j < 4; ++j) {  // 64 values: low nibbles, then high nibbles
      const uint8_t* q = w[i].qs + 32 * j;
      const int8_t* y = x[i].qs + 64 * j;
      int32_t lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        lo += ((q[l] & 0xF) | high_bit(w[i], 2 * j, l)) * y[l];
        hi += ((q[l] >> 4) | high_bit(w[i], 2 * j + 1, l)) * y[l + 32];
      }
      sumi += sc[2 * j] * lo + sc[2 * j + 1] * hi;
    }
    for (int j = 0; j < 8; ++j) summ += mn[j] * (x[i].bsums[2 * j] + x[i].bsums[2 * j + 1]);
    acc += x[i].d * fp16_to_fp32(w[i].d) * (float)sumi;
    acc_min += x[i].d * fp16_to_fp32(w[i].dmin) * (float)summ;
  }
  return acc - acc_min;
}

float dot_q6_k_scalar(const void* wv, const void* xv, int64_t nb) {
  const auto* w = static_cast<const BlockQ6_K*>(wv);
  const auto* x = static_cast<const ActQ8_K*>(xv);
  float acc = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t sumi = 0;
    for (int h = 0; h < 2; ++h) {  // two halves of 128 values
      const uint8_t* ql = w[i].ql + 64 * h;
      const uint8_t* qh = w[i].qh + 32 * h;
      const int8_t* y = x[i].qs + 128 * h;
      const int8_t* sc = w[i].scales + 8 * h;
      for (int part = 0; part < 4; ++part) {  // 32 values each, two scales of 16
        int32_t s[2] = {0, 0};
        for (int l = 0; l < 32; ++l) {
          const uint8_t low = part & 1 ? ql[l + 32] : ql[l];
          const int nib = part < 2 ? (low & 0xF) : (low >> 4);
          const int q = nib | (((qh[l] >> (2 * part)) & 3) << 4);
          s[l / 16] += q * y[32 * part + l];
        }
        sumi += sc[2 * part] * s[0] + sc[2 * part + 1] * s[1];
      }
    }
    int32_t offset = 0;
    for (int g = 0; g < 16; ++g) offset += w[i].scales[g] * x[i].bsums[g];
    acc += x[i].d * fp16_to_fp32(w[i].d) * (float)(sumi - 32 * offset);
  }
  return acc;
}

float dot_q2_k_scalar(const void* wv, const void* xv, int64_t nb) {
  const auto* w = static_cast<const BlockQ2_K*>(wv);
  const auto* x = static_cast<const ActQ8_K*>(xv);
  float acc = 0.f, acc_min = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t sumi = 0, summ = 0;
    for (int g = 0; g < 16; ++g) {
      int32_t s = 0;
      for (int v = 16 * g; v < 16 * g + 16; ++v) s += low_pair(w[i].qs, v) * x[i].qs[v];
      sumi += (w[i].scales[g] & 0xF) * s;
      summ += (w[i].scales[g] >> 4) * x[i].bsums[g];
    }
    acc += x[i].d * fp16_to_fp32(w[i].d) * (float)sumi;
    acc_min += x[i].d * fp16_to_fp32(w[i].dmin) * (float)summ;
  }
  return acc - acc_min;
}

float dot_iq4_xs_scalar(const void* wv, const void* xv, int64_t nb) {
  const auto* w = static_cast<const BlockIQ4_XS*>(wv);
  const auto* x = static_cast<const ActQ8_K*>(xv);
  float acc = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    int8_t sc[8];
    iq4xs_scales(w[i], sc);
    int32_t sumi = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t s = 0;
      for (int v = 32 * j; v < 32 * j + 32; ++v)
        s += IQ4_NL_VALUES[iq4xs_index(w[i], v)] * x[i].qs[v];
      sumi += sc[j] * s;
    }
    acc += x[i].d * fp16_to_fp32(w[i].d) * (float)sumi;
  }
  return acc;
}

float dot_q3_k_scalar(const void* wv, const void* xv, int64_t nb) {
  const auto* w = static_cast<const BlockQ3_K*>(wv);
  const auto* x = static_cast<const ActQ8_K*>(xv);
  float acc = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    int8_t sc[16];
    q3k_scales(w[i].scales, sc);
    int32_t sumi = 0, offset = 0;  // values as 0..7: minus 4 x (scale . group sum) after
    for (int g = 0; g < 16; ++g) {
      int32_t s = 0;
      for (int v = 16 * g; v < 16 * g + 16; ++v) s += q3k_value(w[i], v) * x[i].qs[v];
      sumi += sc[g] * s;
      offset += sc[g] * x[i].bsums[g];
    }
    acc += x[i].d * fp16_to_fp32(w[i].d) * (float)(sumi - 4 * offset);
  }
  return acc;
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL (TYPE): blocks of 32 values.
template <int64_t TYPE>
float dot_32_scalar(const void* wv, const void* xv, int64_t nb) {
  const auto* w = static_cast<const uint8_t*>(wv);
  const auto* x = static_cast<const ActQ8_0*>(xv);
  const int64_t bytes = block_bytes(TYPE);
  float acc = 0.f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * bytes;
    int q[QK];
    values32(TYPE, b, q);
    int32_t sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += q[j] * x[i].qs[j];
    acc += fp16_to_fp32(half_at(b)) * x[i].d * (float)(sumi - offset32(TYPE) * x[i].sum);
    if (has_min32(TYPE)) acc += fp16_to_fp32(half_at(b + 2)) * x[i].d * (float)x[i].sum;
  }
  return acc;
}

// ---- AVX2 dot products: one weight row . R activation rows ----------------------------------
// The weight is unpacked once per block for all R rows; each row's arithmetic is the same
// sequence whatever R is, so results do not depend on how rows are grouped.

#ifdef BRAID_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

AVX2 inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

AVX2 inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// Int16 element e of each 128-bit half, broadcast over the half.
AVX2 inline __m256i pick16(__m256i v, int lo, int hi) {
  const __m256i mask = _mm256_set_m128i(_mm_set1_epi16((int16_t)(((2 * hi + 1) << 8) | (2 * hi))),
                                        _mm_set1_epi16((int16_t)(((2 * lo + 1) << 8) | (2 * lo))));
  return _mm256_shuffle_epi8(v, mask);
}

// Q4_K's eight 6-bit scales (int16 0..7) and mins (int16 8..15), unpacked 4 at a time.
AVX2 inline __m256i q4k_scales_mins(const uint8_t* s) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t sc_lo = u[0] & low6, mn_lo = u[1] & low6;
  const uint32_t sc_hi = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  const uint32_t mn_hi = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  return _mm256_cvtepu8_epi16(_mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo));
}

AVX2 inline __m256i q4k_scales_mins(const BlockQ4_K& b) { return q4k_scales_mins(b.scales); }
AVX2 inline __m256i q4k_scales_mins(const BlockQ5_K& b) { return q4k_scales_mins(b.scales); }

// The unpacked layout holds the same 16 bytes already in order: one load.
AVX2 inline __m256i q4k_scales_mins(const BlockQ4_KU& b) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)b.sc));
}

template <typename B, int R>
AVX2 void dot_q4_k_avx2(const void* wv, const uint8_t* x, int64_t xs, int64_t nb, float* out) {
  const auto* w = static_cast<const B*>(wv);
  constexpr bool q5 = std::is_same_v<B, BlockQ5_K>;
  const __m256i low4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  __m256 acc[R];
  __m128 acc_m[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm_setzero_ps(); }
  for (int64_t i = 0; i < nb; ++i) {
    prefetch_ahead<sizeof(B)>(w + i);
    const __m256i sm = q4k_scales_mins(w[i]);
    const __m128i mins = _mm256_extracti128_si256(sm, 1);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
    const float dw = h2f(w[i].d), dmw = h2f(w[i].dmin);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) {
      const ActQ8_K* y = act<ActQ8_K>(x, xs, r, i);
      const __m256i bs = _mm256_loadu_si256((const __m256i*)y->bsums);
      const __m128i group_sums = _mm_hadd_epi16(_mm256_castsi256_si128(bs),
                                                _mm256_extracti128_si256(bs, 1));
      const __m128i prod = _mm_madd_epi16(mins, group_sums);
      acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(y->d * dmw), _mm_cvtepi32_ps(prod), acc_m[r]);
      sumi[r] = _mm256_setzero_si256();
    }
    __m256i qh = _mm256_setzero_si256();  // Q5_K: group 2j's high bits at bit 0, 2j + 1's at 1
    if constexpr (q5) qh = _mm256_loadu_si256((const __m256i*)w[i].qh);
    for (int j = 0; j < 4; ++j) {
      const __m256i sc_lo = pick16(scales, 2 * j, 2 * j);
      const __m256i sc_hi = pick16(scales, 2 * j + 1, 2 * j + 1);
      const __m256i q4 = _mm256_loadu_si256((const __m256i*)(w[i].qs + 32 * j));
      __m256i lo = _mm256_and_si256(q4, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
      if constexpr (q5) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
        qh = _mm256_srli_epi16(qh, 2);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* q8 = act<ActQ8_K>(x, xs, r, i)->qs + 64 * j;
        const __m256i p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)q8)), sc_lo);
        const __m256i p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(q8 + 32))), sc_hi);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d = act<ActQ8_K>(x, xs, r, i)->d * dw;
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - hsum128(acc_m[r]);
}

// Q6_K and Q3_K (TYPE): a signed scale per 16 values, the values stored plus 32 (six bits: low
// nibbles and two high bits) or plus 4 (three bits: two low bits and one high bit).
template <int64_t TYPE, int R>
AVX2 void dot_q6_k_avx2(const void* wv, const uint8_t* x, int64_t xs, int64_t nb, float* out) {
  constexpr bool q3 = TYPE == Q3_K;
  using B = std::conditional_t<q3, BlockQ3_K, BlockQ6_K>;
  constexpr int SHIFT = q3 ? 2 : 5;  // times the offset, 4 or 32
  const auto* w = static_cast<const B*>(wv);
  const __m256i low4 = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
  const __m256i one = _mm256_set1_epi8(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    prefetch_ahead<sizeof(B)>(w + i);
    int8_t sc8[16];
    if constexpr (q3) q3k_scales(w[i].scales, sc8);
    else std::memcpy(sc8, w[i].scales, 16);
    const __m256i scl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc8));
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) {  // the offset: 32 (4) x sum of scale x group sum
      const __m256i bs = _mm256_loadu_si256((const __m256i*)act<ActQ8_K>(x, xs, r, i)->bsums);
      sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(bs, scl), SHIFT));
    }
    __m256i hm = _mm256_setzero_si256();  // Q3_K: group j's high bits at bit 0
    if constexpr (q3) hm = _mm256_loadu_si256((const __m256i*)w[i].hmask);
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = _mm256_broadcastsi128_si256(
          h ? _mm256_extracti128_si256(scl, 1) : _mm256_castsi256_si128(scl));
      __m256i q[4];  // group 4h + part: 32 values, two scales of 16
      if constexpr (q3) {
        const __m256i ql = _mm256_loadu_si256((const __m256i*)(w[i].qs + 32 * h));
        for (int part = 0; part < 4; ++part) {
          q[part] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 2 * part), three),
                                    _mm256_slli_epi16(_mm256_and_si256(hm, one), 2));
          hm = _mm256_srli_epi16(hm, 1);
        }
      } else {
        const uint8_t* ql = w[i].ql + 64 * h;
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(w[i].qh + 32 * h));
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)ql);
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                               _mm256_slli_epi16(_mm256_and_si256(qh, three), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4));
      }
      for (int part = 0; part < 4; ++part) {
        const __m256i s = pick16(sc, 2 * part, 2 * part + 1);
        for (int r = 0; r < R; ++r) {
          const int8_t* y = act<ActQ8_K>(x, xs, r, i)->qs + 128 * h + 32 * part;
          const __m256i p = _mm256_maddubs_epi16(q[part], _mm256_loadu_si256((const __m256i*)y));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d = act<ActQ8_K>(x, xs, r, i)->d * h2f(w[i].d);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// 32 values from 16 bytes of nibbles (value j < 16: low nibble of byte j, else high of j - 16).
AVX2 inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i low4 = _mm_set1_epi8(0xF), b = _mm_loadu_si128((const __m128i*)qs);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
}

// IQ4_NL's grid values (signed) for the indices in q.
AVX2 inline __m256i iq4_grid(__m256i q) {
  return _mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)IQ4_NL_VALUES)), q);
}

template <int R>
AVX2 void dot_iq4_xs_avx2(const void* wv, const uint8_t* x, int64_t xs, int64_t nb, float* out) {
  const auto* w = static_cast<const BlockIQ4_XS*>(wv);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    prefetch_ahead<sizeof(BlockIQ4_XS)>(w + i);
    int8_t sc[8];
    iq4xs_scales(w[i], sc);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {  // 32 values: grid values, signed (|q| and y with q's sign)
      const __m256i q = iq4_grid(nibbles32(w[i].qs + 16 * j));
      const __m256i uq = _mm256_sign_epi8(q, q), s = _mm256_set1_epi32(sc[j]);
      for (int r = 0; r < R; ++r) {
        const __m256i yv = _mm256_sign_epi8(
            _mm256_loadu_si256((const __m256i*)(act<ActQ8_K>(x, xs, r, i)->qs + 32 * j)), q);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(uq, yv), ones);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(p, s));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d = act<ActQ8_K>(x, xs, r, i)->d * h2f(w[i].d);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

template <int R>
AVX2 void dot_q2_k_avx2(const void* wv, const uint8_t* x, int64_t xs, int64_t nb, float* out) {
  const auto* w = static_cast<const BlockQ2_K*>(wv);
  const __m256i three = _mm256_set1_epi8(3);
  const __m128i low4 = _mm_set1_epi8(0xF);
  __m256 acc[R], acc_m[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm256_setzero_ps(); }
  for (int64_t i = 0; i < nb; ++i) {
    prefetch_ahead<sizeof(BlockQ2_K)>(w + i);
    const __m128i bytes = _mm_loadu_si128((const __m128i*)w[i].scales);
    const __m256i scl = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low4));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    const float dw = h2f(w[i].d), dmw = h2f(w[i].dmin);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) {  // the mins: min . group sum, per pair of groups
      const ActQ8_K* y = act<ActQ8_K>(x, xs, r, i);
      const __m256i prod = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i*)y->bsums));
      acc_m[r] = _mm256_fmadd_ps(_mm256_set1_ps(y->d * dmw), _mm256_cvtepi32_ps(prod), acc_m[r]);
      sumi[r] = _mm256_setzero_si256();
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i ql = _mm256_loadu_si256((const __m256i*)(w[i].qs + 32 * h));
      const __m256i sc = _mm256_broadcastsi128_si256(
          h ? _mm256_extracti128_si256(scl, 1) : _mm256_castsi256_si128(scl));
      for (int part = 0; part < 4; ++part) {  // 32 values, two scales of 16
        const __m256i q = _mm256_and_si256(_mm256_srli_epi16(ql, 2 * part), three);
        const __m256i s = pick16(sc, 2 * part, 2 * part + 1);
        for (int r = 0; r < R; ++r) {
          const int8_t* y = act<ActQ8_K>(x, xs, r, i)->qs + 128 * h + 32 * part;
          const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)y));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d = act<ActQ8_K>(x, xs, r, i)->d * dw;
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - hsum(acc_m[r]);
}

// Byte j of the result is 0xFF where bit j of `bits` is set.
AVX2 inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i shuffle = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                             0x0202020202020202, 0x0303030303030303);
  const __m256i mask = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits), shuffle);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
}

// A 32-value block's values as bytes: unsigned (Q4_0 / Q5_0 plus their offset, Q4_1 / Q5_1)
// or signed (Q8_0, IQ4_NL's grid values).
template <int64_t TYPE>
AVX2 inline __m256i unpack32(const uint8_t* block) {
  if constexpr (TYPE == Q8_0) {
    return _mm256_loadu_si256((const __m256i*)reinterpret_cast<const BlockQ8_0*>(block)->qs);
  } else {
    constexpr int64_t bytes = block_size(TYPE);
    __m256i q = nibbles32(block + bytes - QK / 2);
    if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
      uint32_t qh;
      std::memcpy(&qh, block + bytes - QK / 2 - 4, 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
    }
    if constexpr (TYPE == IQ4_NL) q = iq4_grid(q);
    return q;
  }
}

template <int64_t TYPE, int R>
AVX2 void dot_32_avx2(const void* wv, const uint8_t* x, int64_t xs, int64_t nb, float* out) {
  constexpr int offset = TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : 0;
  constexpr bool is_signed = TYPE == Q8_0 || TYPE == IQ4_NL, has_min = TYPE == Q4_1 || TYPE == Q5_1;
  constexpr int64_t bytes = block_size(TYPE);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float acc_offset[R];  // offset x sum, less min x sum
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_offset[r] = 0.f; }
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* block = static_cast<const uint8_t*>(wv) + i * bytes;
    prefetch_ahead<1>(block);
    const __m256i q = unpack32<TYPE>(block);
    // maddubs needs one unsigned operand: signed values use |q| and y with q's sign.
    const __m256i uq = is_signed ? _mm256_sign_epi8(q, q) : q;
    const float dw = h2f(half_at(block)), dm = has_min ? h2f(half_at(block + 2)) : 0.f;
    for (int r = 0; r < R; ++r) {
      const ActQ8_0* y = act<ActQ8_0>(x, xs, r, i);
      __m256i yv = _mm256_loadu_si256((const __m256i*)y->qs);
      if (is_signed) yv = _mm256_sign_epi8(yv, q);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(uq, yv), ones);
      const float d = dw * y->d;
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc[r]);
      if (offset) acc_offset[r] += d * (float)(offset * y->sum);
      if (has_min) acc_offset[r] -= dm * y->d * (float)y->sum;
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - acc_offset[r];
}

#endif

// One weight row . R (1..MAX_R) activation rows at x + r * xs -> out[0..R).
using RowsFn = void (*)(const void*, const uint8_t*, int64_t, int64_t, float*);
using DotFn = float (*)(const void*, const void*, int64_t);
constexpr int MAX_R = 8;

template <DotFn F, int R>
void rows_scalar(const void* w, const uint8_t* x, int64_t xs, int64_t nb, float* out) {
  for (int r = 0; r < R; ++r) out[r] = F(w, x + r * xs, nb);
}

template <DotFn F>
std::array<RowsFn, MAX_R> scalar_table() {
  return {rows_scalar<F, 1>, rows_scalar<F, 2>, rows_scalar<F, 3>, rows_scalar<F, 4>,
          rows_scalar<F, 5>, rows_scalar<F, 6>, rows_scalar<F, 7>, rows_scalar<F, 8>};
}

#ifdef BRAID_X86
template <int64_t TYPE, int R>
AVX2 void rows_avx2(const void* w, const uint8_t* x, int64_t xs, int64_t nb, float* out) {
  if constexpr (TYPE == Q4_K) dot_q4_k_avx2<BlockQ4_K, R>(w, x, xs, nb, out);
  else if constexpr (TYPE == Q4_K_UNPACKED) dot_q4_k_avx2<BlockQ4_KU, R>(w, x, xs, nb, out);
  else if constexpr (TYPE == Q5_K) dot_q4_k_avx2<BlockQ5_K, R>(w, x, xs, nb, out);
  else if constexpr (TYPE == Q6_K || TYPE == Q3_K) dot_q6_k_avx2<TYPE, R>(w, x, xs, nb, out);
  else if constexpr (TYPE == Q2_K) dot_q2_k_avx2<R>(w, x, xs, nb, out);
  else if constexpr (TYPE == IQ4_XS) dot_iq4_xs_avx2<R>(w, x, xs, nb, out);
  else dot_32_avx2<TYPE, R>(w, x, xs, nb, out);
}

template <int64_t TYPE, int... R>
std::array<RowsFn, MAX_R> avx2_table_of(std::integer_sequence<int, R...>) {
  return {rows_avx2<TYPE, R + 1>...};
}

template <int64_t TYPE>
std::array<RowsFn, MAX_R> avx2_table() {
  return avx2_table_of<TYPE>(std::make_integer_sequence<int, MAX_R>());
}
#endif

// Each row layout's kernels (llama.cpp's type_traits_cpu): per number of activation rows,
// the scalar routine and the AVX2 one.
struct RowKernels {
  std::array<RowsFn, MAX_R> scalar;
  std::array<RowsFn, MAX_R> avx2;
};

template <int64_t TYPE, DotFn SCALAR>
std::pair<const int64_t, RowKernels> row_kernels() {
#ifdef BRAID_X86
  return {TYPE, {scalar_table<SCALAR>(), avx2_table<TYPE>()}};
#else
  return {TYPE, {scalar_table<SCALAR>(), scalar_table<SCALAR>()}};
#endif
}

const std::map<int64_t, RowKernels>& row_traits() {
  static const std::map<int64_t, RowKernels> table = {
      row_kernels<Q4_K, dot_q4_k_scalar<BlockQ4_K>>(),
      row_kernels<Q4_K_UNPACKED, dot_q4_k_scalar<BlockQ4_KU>>(),
      row_kernels<Q5_K, dot_q4_k_scalar<BlockQ5_K>>(),
      row_kernels<Q6_K, dot_q6_k_scalar>(),
      row_kernels<Q3_K, dot_q3_k_scalar>(),
      row_kernels<Q2_K, dot_q2_k_scalar>(),
      row_kernels<IQ4_XS, dot_iq4_xs_scalar>(),
      row_kernels<Q4_0, dot_32_scalar<Q4_0>>(),
      row_kernels<Q4_1, dot_32_scalar<Q4_1>>(),
      row_kernels<Q5_0, dot_32_scalar<Q5_0>>(),
      row_kernels<Q5_1, dot_32_scalar<Q5_1>>(),
      row_kernels<Q8_0, dot_32_scalar<Q8_0>>(),
      row_kernels<IQ4_NL, dot_32_scalar<IQ4_NL>>(),
  };
  return table;
}

const std::array<RowsFn, MAX_R>& rows_fns(int64_t type, const Isa& isa) {
  const auto found = row_traits().find(type);
  TORCH_CHECK(found != row_traits().end(), "unsupported GGML type ", type);
  return isa.avx2 ? found->second.avx2 : found->second.scalar;
}

// ---- dequantization (embedding rows, reference) ---------------------------------------------

template <typename B>
void dequantize_q4_k(const B* w, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t sc[8], mn[8];
    q4k_block_scales(w, i, sc, mn);
    const float d = fp16_to_fp32(w[i].d), dmin = fp16_to_fp32(w[i].dmin);
    for (int j = 0; j < 4; ++j, y += 64) {
      const uint8_t* q = w[i].qs + 32 * j;
      for (int l = 0; l < 32; ++l) {
        y[l] = d * sc[2 * j] * ((q[l] & 0xF) | high_bit(w[i], 2 * j, l)) - dmin * mn[2 * j];
        y[l + 32] = d * sc[2 * j + 1] * ((q[l] >> 4) | high_bit(w[i], 2 * j + 1, l)) -
                    dmin * mn[2 * j + 1];
      }
    }
  }
}

void dequantize_row(const uint8_t* row, int64_t type, int64_t k, float* y) {
  const int64_t nb = k / block_elems(type);
  if (block_elems(type) == QK) {  // gguf's expressions: d * (q - offset), or d * q + m
    const int64_t bytes = block_bytes(type);
    for (int64_t i = 0; i < nb; ++i, y += QK) {
      const uint8_t* b = row + i * bytes;
      const float d = fp16_to_fp32(half_at(b));
      const float m = has_min32(type) ? fp16_to_fp32(half_at(b + 2)) : 0.f;
      int q[QK];
      values32(type, b, q);
      for (int j = 0; j < QK; ++j)
        y[j] = has_min32(type) ? d * q[j] + m : d * (q[j] - offset32(type));
    }
  } else if (type == Q4_K) {
    dequantize_q4_k(reinterpret_cast<const BlockQ4_K*>(row), nb, y);
  } else if (type == Q4_K_UNPACKED) {
    dequantize_q4_k(reinterpret_cast<const BlockQ4_KU*>(row), nb, y);
  } else if (type == Q5_K) {
    dequantize_q4_k(reinterpret_cast<const BlockQ5_K*>(row), nb, y);
  } else if (type == IQ4_XS) {
    const auto* w = reinterpret_cast<const BlockIQ4_XS*>(row);
    for (int64_t i = 0; i < nb; ++i, y += QK_K) {
      int8_t sc[8];
      iq4xs_scales(w[i], sc);
      const float d = fp16_to_fp32(w[i].d);
      for (int v = 0; v < QK_K; ++v) y[v] = d * sc[v / 32] * IQ4_NL_VALUES[iq4xs_index(w[i], v)];
    }
  } else if (type == Q2_K) {
    const auto* w = reinterpret_cast<const BlockQ2_K*>(row);
    for (int64_t i = 0; i < nb; ++i, y += QK_K) {
      const float d = fp16_to_fp32(w[i].d), dmin = fp16_to_fp32(w[i].dmin);
      for (int v = 0; v < QK_K; ++v) {
        const uint8_t s = w[i].scales[v / 16];
        y[v] = d * (s & 0xF) * low_pair(w[i].qs, v) - dmin * (s >> 4);
      }
    }
  } else if (type == Q3_K) {
    const auto* w = reinterpret_cast<const BlockQ3_K*>(row);
    for (int64_t i = 0; i < nb; ++i, y += QK_K) {
      int8_t sc[16];
      q3k_scales(w[i].scales, sc);
      const float d = fp16_to_fp32(w[i].d);
      for (int v = 0; v < QK_K; ++v) y[v] = d * sc[v / 16] * (q3k_value(w[i], v) - 4);
    }
  } else if (type == Q6_K) {
    const auto* w = reinterpret_cast<const BlockQ6_K*>(row);
    for (int64_t i = 0; i < nb; ++i) {
      const float d = fp16_to_fp32(w[i].d);
      for (int h = 0; h < 2; ++h, y += 128) {
        const uint8_t* ql = w[i].ql + 64 * h;
        const uint8_t* qh = w[i].qh + 32 * h;
        const int8_t* sc = w[i].scales + 8 * h;
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          y[l] = d * sc[is] * ((int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
          y[l + 32] = d * sc[is + 2] * ((int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = d * sc[is + 4] * ((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = d * sc[is + 6] * ((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
    }
  } else {
    TORCH_CHECK(false, "unsupported GGML type ", type);
  }
}

void check_weight(const torch::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "weight must be a contiguous uint8 [rows, bytes per row] tensor");
  TORCH_CHECK(k % block_elems(type) == 0, "row length ", k, " is not a multiple of the block");
  TORCH_CHECK(w.size(1) == k / block_elems(type) * block_bytes(type),
              "weight rows hold ", w.size(1), " bytes, expected ",
              k / block_elems(type) * block_bytes(type));
  TORCH_CHECK(!is_panel(type) || w.size(0) % PANEL_ROWS == 0,
              "a panel weight has a multiple of 16 rows, got ", w.size(0));
}

// ---- activation quantization on AVX512: the scalar code's results, 16 values at a time -------
// The same max, the same float products rounded half to even, the same integer sums.

#ifdef BRAID_X86
#define AVX512 __attribute__((target("avx512f,avx512bw")))

AVX512 inline float amax16(const float* x, int n) {
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  return _mm512_reduce_max_ps(m);
}

// x[0..16) * id rounded to int8 at q; returns their sum.
AVX512 inline int32_t round16(const float* x, float id, int8_t* q) {
  const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(v));
  return _mm512_reduce_add_epi32(v);
}

AVX512 void quantize_q8_0_avx512(const float* x, ActQ8_0* out, int64_t k) {
  for (int64_t b = 0; b < k / QK; ++b, x += QK) {
    const float amax = amax16(x, QK);
    const float d = amax / 127.f, id = d > 0.f ? 127.f / amax : 0.f;
    out[b].sum = round16(x, id, out[b].qs) + round16(x + 16, id, out[b].qs + 16);
    out[b].d = d;
  }
}

AVX512 void quantize_q8_k_avx512(const float* x, ActQ8_K* out, int64_t k) {
  for (int64_t b = 0; b < k / QK_K; ++b, x += QK_K) {
    const float amax = amax16(x, QK_K);
    const float d = amax / 127.f, id = d > 0.f ? 127.f / amax : 0.f;
    for (int g = 0; g < QK_K / 16; ++g)
      out[b].bsums[g] = (int16_t)round16(x + 16 * g, id, out[b].qs + 16 * g);
    out[b].d = d;
  }
}

#endif

// One row of k values -> Q8_K blocks (kq) or Q8_0 blocks at out.
void quantize_row(const float* x, uint8_t* out, int64_t k, bool kq, const Isa& isa) {
#ifdef BRAID_X86
  if (isa.avx512) {
    if (kq) quantize_q8_k_avx512(x, reinterpret_cast<ActQ8_K*>(out), k);
    else quantize_q8_0_avx512(x, reinterpret_cast<ActQ8_0*>(out), k);
    return;
  }
#endif
  if (kq) quantize_q8_k(x, reinterpret_cast<ActQ8_K*>(out), k);
  else quantize_q8_0(x, reinterpret_cast<ActQ8_0*>(out), k);
}

}  // namespace

// ---- ops ------------------------------------------------------------------------------------

namespace braid_kernels {

// x [M, K] float32 -> quantized activations [M, bytes] for weights of `type`.
torch::Tensor quantize_activations(const torch::Tensor& x_in, int64_t type, const Isa& isa) {
  block_bytes(type);  // rejects unsupported types
  const auto x = x_in.contiguous();
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const bool kq = is_k_quant(type);
  TORCH_CHECK(k % block_elems(type) == 0, "row length ", k, " is not a multiple of the block");
  const int64_t row_bytes = kq ? k / QK_K * (int64_t)sizeof(ActQ8_K) : k / QK * (int64_t)sizeof(ActQ8_0);
  auto out = torch::empty({m, row_bytes}, torch::kUInt8);
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(src + r * k, dst + r * row_bytes, k, kq, isa);
  });
  return out;
}

// Quantized activations [M, xbytes] (from quantize_activations for the same type) times
// weight rows [N, wbytes] of `type` -> out[:, col0 : col0 + N] of a float32 [M, *] tensor.
void qgemm_into(const torch::Tensor& xq, const torch::Tensor& w, int64_t type, int64_t k,
                torch::Tensor& out, int64_t col0, const Isa& isa) {
  check_weight(w, type, k);
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.is_contiguous(),
              "out must be a contiguous float32 [M, N] tensor");
  const int64_t act_bytes = is_k_quant(type) ? k / QK_K * (int64_t)sizeof(ActQ8_K)
                                             : k / QK * (int64_t)sizeof(ActQ8_0);
  TORCH_CHECK(xq.dtype() == torch::kUInt8 && xq.dim() == 2 && xq.is_contiguous() &&
                  xq.size(1) == act_bytes,
              "activations must be quantize_activations(x, type) for this weight type and K");
  TORCH_CHECK(col0 >= 0, "col0 must be >= 0");
  const int64_t m = xq.size(0), n = w.size(0), ld = out.size(1);
  TORCH_CHECK(out.size(0) == m && col0 + n <= ld, "out is too small");
  const int64_t nb = k / block_elems(type), wbytes = w.size(1), xbytes = xq.size(1);
  if (is_panel(type)) {
    panel_gemm(xq.data_ptr<uint8_t>(), m, xbytes, w.data_ptr<uint8_t>(), n, type, k,
               out.data_ptr<float>() + col0, ld, isa);
    return;
  }
  const auto& fns = rows_fns(type, isa);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>() + col0;
  // Tiles of weight rows (each stays in cache while every activation row passes over it),
  // activation rows MAX_R at a time.
  constexpr int64_t TILE = 16;
  const int64_t tiles = (n + TILE - 1) / TILE;
  // At least ~256K multiply-adds per thread: a small product is not worth a parallel region.
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, TILE * k * m));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float res[MAX_R];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE, n1 = std::min(n, n0 + TILE);
      for (int64_t r0 = 0; r0 < m; r0 += MAX_R) {
        const int64_t rows = std::min<int64_t>(MAX_R, m - r0);
        const RowsFn fn = fns[rows - 1];
        for (int64_t c = n0; c < n1; ++c) {
          fn(wp + c * wbytes, xp + r0 * xbytes, xbytes, nb, res);
          for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * ld + c] = res[r];
        }
      }
    }
  });
}

torch::Tensor qgemm(const torch::Tensor& xq, const torch::Tensor& w, int64_t type, int64_t k,
                    const Isa& isa) {
  auto out = torch::empty({xq.size(0), w.size(0)}, torch::kFloat32);
  qgemm_into(xq, w, type, k, out, 0, isa);
  return out;
}

// Rows `ids` of a quantized [V, bytes] matrix as float32 [T, K] (embedding lookups).
torch::Tensor dequantize_rows(const torch::Tensor& w, const torch::Tensor& ids_in, int64_t type,
                              int64_t k) {
  check_weight(w, type, k);
  const auto ids = ids_in.to(torch::kInt64).contiguous();
  const int64_t t = ids.numel(), v = w.size(0), wbytes = w.size(1);
  auto out = torch::empty({t, k}, torch::kFloat32);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < v, "row id out of range");
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* y = out.data_ptr<float>() + i * k;
      if (is_panel(type)) panel_dequantize_row(w.data_ptr<uint8_t>(), idp[i], type, k, y);
      else dequantize_row(w.data_ptr<uint8_t>() + idp[i] * wbytes, type, k, y);
    }
  });
  return out;
}

// Q4_K rows [N, K/256 * 144] -> the same values in the unpacked layout [N, K/256 * 148].
torch::Tensor repack_q4_k(const torch::Tensor& w, int64_t k) {
  check_weight(w, Q4_K, k);
  const int64_t n = w.size(0), nb = k / QK_K;
  auto out = torch::empty({n, nb * (int64_t)sizeof(BlockQ4_KU)}, torch::kUInt8);
  const auto* src = reinterpret_cast<const BlockQ4_K*>(w.data_ptr<uint8_t>());
  auto* dst = reinterpret_cast<BlockQ4_KU*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, n * nb, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      dst[i].d = src[i].d;
      dst[i].dmin = src[i].dmin;
      q4k_scales(src[i].scales, dst[i].sc, dst[i].mn);
      std::memcpy(dst[i].qs, src[i].qs, sizeof(src[i].qs));
    }
  });
  return out;
}

}  // namespace braid_kernels

void register_attention(pybind11::module& m);  // attention.cpp
void register_norm(pybind11::module& m);  // norm.cpp
namespace braid_kernels {
void register_panels(pybind11::module& m);  // panels.cpp
void register_layer(pybind11::module& m);  // layer.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace braid_kernels;
  register_attention(m);
  register_norm(m);
  register_panels(m);
  register_layer(m);
  m.def("quantize_activations", &quantize_activations);
  m.def("qgemm", &qgemm);
  m.def("qgemm_into", &qgemm_into);
  m.def("dequantize_rows", &dequantize_rows);
  m.def("repack_q4_k", &repack_q4_k);
  m.attr("Q4_K_UNPACKED") = Q4_K_UNPACKED;
  pybind11::class_<Isa>(m, "Isa")
      .def(pybind11::init(&isa_named), pybind11::arg("name") = "auto")
      .def_readonly("avx2", &Isa::avx2)
      .def_readonly("avx512", &Isa::avx512)
      .def_readonly("vnni", &Isa::vnni)
      .def_property_readonly("name", &isa_name)
      .def("__repr__", [](const Isa& isa) { return "Isa('" + isa_name(isa) + "')"; });
}
