// GGUF block formats shared by the quantized kernels (quant.cpp: rows as stored; panels.cpp:
// rows interleaved sixteen to a panel): ggml type ids, block layouts, the activations' int8
// blocks, fp16 decoding.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"

#ifdef BRAID_X86
#include <immintrin.h>
#endif

namespace braid_kernels {

// ---- formats (ggml type ids and block layouts) ----------------------------------------------

enum GgmlType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
  Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23
};
// braid's own layout of Q4_K (not a ggml type): the same values with the 6-bit scales and mins
// unpacked to bytes at load (repack_q4_k), so the kernel does not decode them every block.
constexpr int64_t Q4_K_UNPACKED = 1012;
// braid's panel layouts (panels.cpp): PANEL + a ggml type holds that type's values with sixteen
// rows interleaved per block, for the AVX512-VNNI kernels.
constexpr int64_t PANEL = 2000;
constexpr int64_t PANEL_ROWS = 16;

inline bool is_panel(int64_t type) { return type > PANEL; }
// The ggml type whose values a layout holds.
inline int64_t value_type(int64_t type) {
  return is_panel(type) ? type - PANEL : type == Q4_K_UNPACKED ? Q4_K : type;
}

constexpr int QK = 32;    // Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL block
constexpr int QK_K = 256; // K-quant super-block

// The 32-value formats: d first; Q4_1 / Q5_1 then a min m; Q5_0 / Q5_1 then bit 4 of each value
// (qh); the nibbles last (value j < 16: low nibble of byte j, else high nibble of byte j - 16).
// A value is d * q (Q4_0: q - 8, Q5_0: q - 16, IQ4_NL: IQ4_NL_VALUES[q]) or d * q + m.
struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[QK / 2]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ5_1 { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockIQ4_NL { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};
struct BlockQ4_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct BlockQ4_KU { uint16_t d; uint16_t dmin; uint8_t sc[8]; uint8_t mn[8]; uint8_t qs[QK_K / 2]; };
// Q5_K: Q4_K's scales and nibbles plus bit 4 of every value (bit j of qh[l]: value l of the
// j-th group of 32).
struct BlockQ5_K {
  uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2];
};
// Q2_K: value v (0..255) is d * (scale & 15) * q - dmin * (scale >> 4), q its two bits (bits
// 2 (v / 32 % 4) of qs[v / 128 * 32 + v % 32]), scale the byte of its sixteen values.
struct BlockQ2_K { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d; uint16_t dmin; };
// Q3_K: value v (0..255) is its two low bits (bits 2 (v / 32 % 4) of qs[v / 128 * 32 + v % 32])
// plus 4 times bit v / 32 of hmask[v % 32], minus 4; sixteen 6-bit scales (minus 32) packed into
// 12 bytes, one per 16 values.
struct BlockQ3_K { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; };
// IQ4_XS: IQ4_NL's grid in 256-value blocks, a 6-bit scale (minus 32) per 32 values: value v is
// d * scale * IQ4_NL_VALUES[nibble], the nibble as IQ4_NL's within its 32 (qs + 16 (v / 32)).
struct BlockIQ4_XS { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[QK_K / 2]; };
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ8_0) == 34 &&
                  sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_1) == 24 && sizeof(BlockIQ4_NL) == 18,
              "ggml block size");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 &&
                  sizeof(BlockQ6_K) == 210 && sizeof(BlockIQ4_XS) == 136,
              "ggml block size");
static_assert(sizeof(BlockQ4_KU) == 148, "unpacked Q4_K block size");

// Quantized activations.
struct ActQ8_0 { float d; int32_t sum; int8_t qs[QK]; };                   // sum = sum(qs)
struct ActQ8_K { float d; int16_t bsums[QK_K / 16]; int8_t qs[QK_K]; };    // bsums per 16
static_assert(sizeof(ActQ8_0) == 40 && sizeof(ActQ8_K) == 292, "activation block size");

inline bool is_k_quant(int64_t type) {
  const int64_t vt = value_type(type);
  return vt == Q2_K || vt == Q3_K || vt == Q4_K || vt == Q5_K || vt == Q6_K || vt == IQ4_XS;
}

inline int64_t block_elems(int64_t type) { return is_k_quant(type) ? QK_K : QK; }

// Each layout's bytes per block (llama.cpp's type_traits: type_size). A panel layout holds
// sixteen rows' blocks: per row, the bytes of the GGUF block (Q4_K / Q5_K: of the unpacked
// one, whose scales are bytes), or more where its scales are unpacked to bytes too.
struct LayoutSize {
  int64_t type, bytes;
};
constexpr LayoutSize LAYOUT_SIZES[] = {
    {Q4_0, sizeof(BlockQ4_0)},     {Q4_1, sizeof(BlockQ4_1)},
    {Q5_0, sizeof(BlockQ5_0)},     {Q5_1, sizeof(BlockQ5_1)},
    {Q8_0, sizeof(BlockQ8_0)},     {IQ4_NL, sizeof(BlockIQ4_NL)},
    {Q2_K, sizeof(BlockQ2_K)},     {Q3_K, sizeof(BlockQ3_K)},
    {Q4_K, sizeof(BlockQ4_K)},     {Q5_K, sizeof(BlockQ5_K)},
    {Q6_K, sizeof(BlockQ6_K)},     {IQ4_XS, sizeof(BlockIQ4_XS)},
    {Q4_K_UNPACKED, sizeof(BlockQ4_KU)},
    {PANEL + Q4_0, sizeof(BlockQ4_0)},   {PANEL + Q4_1, sizeof(BlockQ4_1)},
    {PANEL + Q5_0, sizeof(BlockQ5_0)},   {PANEL + Q5_1, sizeof(BlockQ5_1)},
    {PANEL + Q8_0, sizeof(BlockQ8_0)},   {PANEL + IQ4_NL, sizeof(BlockIQ4_NL)},
    {PANEL + Q6_K, sizeof(BlockQ6_K)},
    {PANEL + Q3_K, sizeof(BlockQ3_K) + 4},     // sixteen scales as bytes, not twelve
    {PANEL + Q2_K, sizeof(BlockQ2_K) + 16},    // scales and mins in bytes of their own
    {PANEL + IQ4_XS, sizeof(BlockIQ4_XS) + 2}, // eight scales as bytes, not six
    {PANEL + Q4_K, sizeof(BlockQ4_KU)},
    {PANEL + Q5_K, sizeof(BlockQ4_KU) + QK_K / 8},  // and the high bits
};

// Bytes of a block of `type`; 0 for a layout without kernels. Kernels size their blocks with
// it at compile time.
constexpr int64_t block_size(int64_t type) {
  for (const LayoutSize& layout : LAYOUT_SIZES)
    if (layout.type == type) return layout.bytes;
  return 0;
}

inline int64_t block_bytes(int64_t type) {
  const int64_t bytes = block_size(type);
  TORCH_CHECK(bytes > 0, "unsupported GGML type ", type);
  return bytes;
}

// ---- the 32-value formats' values ----

inline bool has_min32(int64_t type) { return type == Q4_1 || type == Q5_1; }

// What each value of a 32-value format has stored above its value: Q4_0 8, Q5_0 16.
inline int offset32(int64_t type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0; }

// The 32 values of a 4- or 5-bit block as stored: nibbles, plus bit 4 (Q5_0 / Q5_1).
inline void stored32(int64_t type, const uint8_t* block, int* q) {
  const uint8_t* qs = block + block_bytes(type) - QK / 2;
  uint32_t qh = 0;
  if (type == Q5_0 || type == Q5_1) std::memcpy(&qh, qs - 4, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
    q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}

// The 32 values of a block as the integers its products use (plus offset32).
inline void values32(int64_t type, const uint8_t* block, int* q) {
  if (type == Q8_0) {
    for (int j = 0; j < QK; ++j) q[j] = reinterpret_cast<const BlockQ8_0*>(block)->qs[j];
    return;
  }
  stored32(type, block, q);
  if (type == IQ4_NL)
    for (int j = 0; j < QK; ++j) q[j] = IQ4_NL_VALUES[q[j]];
}

inline uint16_t half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K: eight 6-bit (scale, min) pairs packed into 12 bytes.
inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q3_K: the sixteen scales (6 bits, minus 32) packed into 12 bytes: low four bits of scale j in
// byte j % 8 (j < 8: low nibble, else high), its top two in byte 8 + j % 4 at bits 2 (j / 4).
inline void q3k_scales(const uint8_t* s, int8_t* sc) {
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
    sc[j] = (int8_t)((low | ((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32);
  }
}

// IQ4_XS: the eight scales (6 bits, minus 32): low four bits in scales_l (two a byte, low
// nibble first), top two in scales_h (bits 2j).
inline void iq4xs_scales(const BlockIQ4_XS& b, int8_t* sc) {
  for (int j = 0; j < 8; ++j)
    sc[j] = (int8_t)((((b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) |
                      (((b.scales_h >> (2 * j)) & 3) << 4)) - 32);
}

// IQ4_XS: the grid index of value v.
inline int iq4xs_index(const BlockIQ4_XS& b, int v) {
  const uint8_t byte = b.qs[16 * (v / 32) + v % 16];
  return v % 32 < 16 ? byte & 0xF : byte >> 4;
}

// Bits 2 (v / 32 % 4) of qs[v / 128 * 32 + v % 32]: the two low bits of value v of a Q2_K or
// Q3_K block.
inline int low_pair(const uint8_t* qs, int v) {
  return (qs[32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32))) & 3;
}

// Q3_K value v of block b plus 4 (0..7).
inline int q3k_value(const BlockQ3_K& b, int v) {
  return low_pair(b.qs, v) | (((b.hmask[v % 32] >> (v / 32)) & 1) << 2);
}

// Activation quantization (identical on every path: round half to even).

inline void quantize_q8_0(const float* x, ActQ8_0* out, int64_t k) {
  for (int64_t b = 0; b < k / QK; ++b, x += QK) {
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float d = amax / 127.f, id = d > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) {
      const int q = (int)std::nearbyint(x[i] * id);
      out[b].qs[i] = (int8_t)q;
      sum += q;
    }
    out[b].d = d;
    out[b].sum = sum;
  }
}

inline void quantize_q8_k(const float* x, ActQ8_K* out, int64_t k) {
  for (int64_t b = 0; b < k / QK_K; ++b, x += QK_K) {
    float amax = 0.f;
    for (int i = 0; i < QK_K; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float d = amax / 127.f, id = d > 0.f ? 127.f / amax : 0.f;
    for (int g = 0; g < QK_K / 16; ++g) {
      int sum = 0;
      for (int i = g * 16; i < g * 16 + 16; ++i) {
        const int q = (int)std::nearbyint(x[i] * id);
        out[b].qs[i] = (int8_t)q;
        sum += q;
      }
      out[b].bsums[g] = (int16_t)sum;
    }
    out[b].d = d;
  }
}

// Software prefetch of the weight stream, this many bytes ahead of the block being read: with
// the products' arithmetic between loads the hardware prefetcher alone keeps too few misses
// in flight (docs/benchmarks.md, Kernels, has the A/B). Prefetches never fault past the end.
constexpr int64_t PREFETCH_BYTES = 8192;

// Prefetch the cache lines of the block at `p` (of BYTES bytes) PREFETCH_BYTES ahead.
template <int64_t BYTES>
inline void prefetch_ahead(const void* p) {
#ifdef BRAID_X86
  const char* c = static_cast<const char*>(p) + PREFETCH_BYTES;
  for (int64_t off = 0; off < BYTES; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
#else
  (void)p;
#endif
}

// Activation row r of block i.
template <typename A>
inline const A* act(const uint8_t* x, int64_t stride, int r, int64_t i) {
  return reinterpret_cast<const A*>(x + r * stride) + i;
}

// Panel products and lookups (panels.cpp): x [m rows of xbytes] quantized activations times the
// n rows of panel weight `w` -> out[r * ld + c]; row `row` of a panel weight as float32.
void panel_gemm(const uint8_t* x, int64_t m, int64_t xbytes, const uint8_t* w, int64_t n,
                int64_t type, int64_t k, float* out, int64_t ld, const Isa& isa);
void panel_dequantize_row(const uint8_t* w, int64_t row, int64_t type, int64_t k, float* y);

}  // namespace braid_kernels
