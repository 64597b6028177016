// Products with GGUF weights in panels: sixteen weight rows interleaved block by block, so one
// AVX512-VNNI instruction (vpdpbusd) multiplies four activation values, broadcast, with four
// values of each of the sixteen rows and adds them to sixteen int32 lanes, one per output. A
// lane is one output from the first block to the last: no horizontal sums, one float rounding
// sequence per output. That is llama.cpp's repack idea (interleaved rows, int8 activations)
// on 512-bit vectors; the activations are the same Q8_K / Q8_0 blocks quant.cpp uses.
//
// Batch invariance: output (m, n) is the same integer sums and the same float operations in
// the same order whatever the number of rows, the panel or the thread. The scalar reference
// below does those same operations one output at a time, so the two paths agree bit for bit.
//
// A panel block (sixteen rows' block i, the bytes of sixteen GGUF blocks) holds, per format
// (offsets in bytes; n = row in the panel; "pairs" = operand g in the low nibble, g + 4 in the
// high one, where operand g is values 4g .. 4g + 3 of a 32-value group):
//   Q4_0 / Q5_0: d[16] fp16 | 4 x [16][4] nibble pairs | Q5_0: 8 x u64 bit masks of bit 4
//   Q4_1 / Q5_1: d[16], m[16] fp16 | the same
//   IQ4_NL:      d[16] fp16 | 4 x [16][4] nibble pairs (indices into IQ4_NL_VALUES)
//   Q8_0:        d[16] fp16 | 8 x [16][4] values + 128
//   Q4_K:        d[16], dmin[16] fp16 | scales[8][16] | mins[8][16] | 8 groups x 4 x [16][4] pairs
//   Q5_K:        Q4_K's, each group followed by its 8 x u64 bit masks of bit 4
//   Q6_K:        d[16] fp16 | scales [8][16][2] int8 | 8 groups x (4 x [16][4] pairs of the
//                low nibbles, 2 x [16][4] bytes of four 2-bit high parts)
//   IQ4_XS:      d[16] fp16 | scales[8][16] int8 (minus 32 applied) | 8 groups x 4 x [16][4]
//                pairs (indices into IQ4_NL_VALUES)
//   Q2_K:        d[16], dmin[16] fp16 | 8 groups x (scales [16][2], mins [16][2], 2 x [16][4]
//                bytes of four 2-bit values)
//   Q3_K:        d[16] fp16 | 8 groups x (scales [16][2] int8 (minus 32 applied), 2 x [16][4]
//                bytes of four 2-bit low parts, 8 x u64 bit masks of bit 2)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <utility>

#include "formats.h"

namespace braid_kernels {

namespace {

constexpr int MAX_R = 8;  // activation rows per pass over a panel block

// One block of one row as integers (the values unsigned: Q8_0's plus 128).
struct Ints {
  uint16_t d = 0, dmin = 0;  // fp16 bits (Q4_1 / Q5_1: dmin holds the min m)
  int8_t sc[16] = {};        // Q4_K / Q5_K: 8 6-bit scales; IQ4_XS: 8 signed; Q2_K: 16 4-bit;
                             // Q3_K / Q6_K: 16 signed
  uint8_t mn[16] = {};       // Q4_K / Q5_K: 8 6-bit mins; Q2_K: 16 4-bit ones
  uint8_t q[QK_K] = {};      // as stored: unsigned (Q8_0: plus 128; IQ4_NL / IQ4_XS: grid
                             // indices)
};

int values_per_block(int64_t vt) { return (int)block_elems(vt); }

int64_t panel_block_bytes(int64_t vt) { return PANEL_ROWS * block_bytes(PANEL + vt); }

// Q4_K / Q5_K: values in groups of 32 with a 6-bit scale and min each; Q2_K: groups of 16
// with a 4-bit scale and min.
bool has_mins(int64_t vt) { return vt == Q4_K || vt == Q5_K || vt == Q2_K; }

// Values per scale.
int scale_group(int64_t vt) { return vt == Q4_K || vt == Q5_K || vt == IQ4_XS ? 32 : 16; }

// Where group `grp` (32 values) of a panel block starts: its nibble pairs, then any high bits.
int64_t group_offset(int64_t vt, int grp) {
  switch (vt) {
    case Q4_K: return 320 + 256 * grp;
    case Q5_K: return 320 + 320 * grp;
    case Q6_K: return 64 + 416 * grp;
    case Q3_K: return 64 + 224 * grp;  // after the group's scales
    case Q2_K: return 128 + 192 * grp;  // after the group's scales and mins
    case IQ4_XS: return 160 + 256 * grp;
  }
  return has_min32(vt) ? 64 : 32;
}

// Where a value's bits sit in a panel block.
struct Field {
  int64_t byte;
  int shift, bits;
};

// The low four bits of value v of row n (all eight for Q8_0, two for Q3_K).
Field low_field(int64_t vt, int n, int v) {
  const int g = (v % 32) / 4, b = v % 4;
  switch (vt) {
    case Q2_K: case Q3_K:
      return {group_offset(vt, v / 32) + ((g / 4) * 16 + n) * 4 + b, 2 * (g % 4), 2};
    case Q8_0: return {32 + (g * 16 + n) * 4 + b, 0, 8};
    case Q4_0: case Q5_0: case Q4_1: case Q5_1: case IQ4_NL: case Q4_K: case Q5_K: case Q6_K:
    case IQ4_XS:
      return {group_offset(vt, v / 32) + ((g % 4) * 16 + n) * 4 + b, 4 * (g / 4), 4};
  }
  TORCH_CHECK(false, "no panel layout for GGML type ", vt);
}

// The bits above the low ones: Q5_0's, Q5_1's and Q5_K's bit 4, Q6_K's bits 4-5, Q3_K's bit 2
// (none for the others).
Field high_field(int64_t vt, int n, int v) {
  const int g = (v % 32) / 4, b = v % 4;
  if (vt == Q3_K) return {group_offset(vt, v / 32) + 128 + g * 8 + (n * 4 + b) / 8, (n * 4 + b) % 8, 1};
  const int64_t base = group_offset(vt, v / 32) + 256;
  if (vt == Q5_0 || vt == Q5_1 || vt == Q5_K)
    return {base + g * 8 + (n * 4 + b) / 8, (n * 4 + b) % 8, 1};
  if (vt == Q6_K) return {base + ((g / 4) * 16 + n) * 4 + b, 2 * (g % 4), 2};
  return {0, 0, 0};
}

int get(const uint8_t* p, Field f) { return (p[f.byte] >> f.shift) & ((1 << f.bits) - 1); }

void decode_plain(int64_t vt, const uint8_t* block, Ints& o) {
  if (vt == Q8_0) {
    const auto* w = reinterpret_cast<const BlockQ8_0*>(block);
    o.d = w->d;
    for (int v = 0; v < QK; ++v) o.q[v] = (uint8_t)(w->qs[v] + 128);
  } else if (vt == Q4_0 || vt == Q5_0 || vt == Q4_1 || vt == Q5_1 || vt == IQ4_NL) {
    o.d = half_at(block);
    if (has_min32(vt)) o.dmin = half_at(block + 2);  // m: the min itself
    int q[QK];
    stored32(vt, block, q);
    for (int j = 0; j < QK; ++j) o.q[j] = (uint8_t)q[j];
  } else if (vt == Q4_K || vt == Q5_K) {
    const auto* w = reinterpret_cast<const BlockQ4_K*>(block);  // Q5_K: the same up to qh
    const uint8_t* qs = vt == Q4_K ? w->qs : reinterpret_cast<const BlockQ5_K*>(block)->qs;
    const uint8_t* qh = vt == Q5_K ? reinterpret_cast<const BlockQ5_K*>(block)->qh : nullptr;
    o.d = w->d;
    o.dmin = w->dmin;
    q4k_scales(w->scales, reinterpret_cast<uint8_t*>(o.sc), o.mn);
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) {
        const int h0 = qh ? ((qh[l] >> (2 * j)) & 1) << 4 : 0;
        const int h1 = qh ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0;
        o.q[64 * j + l] = (uint8_t)((qs[32 * j + l] & 0xF) | h0);
        o.q[64 * j + 32 + l] = (uint8_t)((qs[32 * j + l] >> 4) | h1);
      }
  } else if (vt == IQ4_XS) {
    const auto* w = reinterpret_cast<const BlockIQ4_XS*>(block);
    o.d = w->d;
    iq4xs_scales(*w, o.sc);
    for (int v = 0; v < QK_K; ++v) o.q[v] = (uint8_t)iq4xs_index(*w, v);
  } else if (vt == Q2_K) {
    const auto* w = reinterpret_cast<const BlockQ2_K*>(block);
    o.d = w->d;
    o.dmin = w->dmin;
    for (int g = 0; g < 16; ++g) {
      o.sc[g] = (int8_t)(w->scales[g] & 0xF);
      o.mn[g] = (uint8_t)(w->scales[g] >> 4);
    }
    for (int v = 0; v < QK_K; ++v) o.q[v] = (uint8_t)low_pair(w->qs, v);
  } else if (vt == Q3_K) {
    const auto* w = reinterpret_cast<const BlockQ3_K*>(block);
    o.d = w->d;
    q3k_scales(w->scales, o.sc);
    for (int v = 0; v < QK_K; ++v) o.q[v] = (uint8_t)q3k_value(*w, v);
  } else if (vt == Q6_K) {
    const auto* w = reinterpret_cast<const BlockQ6_K*>(block);
    o.d = w->d;
    std::memcpy(o.sc, w->scales, 16);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* ql = w->ql + 64 * h;
        const int qh = w->qh[32 * h + l];
        uint8_t* q = o.q + 128 * h;
        q[l] = (uint8_t)((ql[l] & 0xF) | ((qh & 3) << 4));
        q[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh >> 2) & 3) << 4));
        q[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh >> 4) & 3) << 4));
        q[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh >> 6) & 3) << 4));
      }
  } else {
    TORCH_CHECK(false, "no panel layout for GGML type ", vt);
  }
}

// Block `o` as row n of panel block p (zeroed before its first row), and back.
void encode_panel(int64_t vt, const Ints& o, uint8_t* p, int n) {
  std::memcpy(p + 2 * n, &o.d, 2);
  if (has_mins(vt) || has_min32(vt)) std::memcpy(p + 32 + 2 * n, &o.dmin, 2);
  if (vt == Q4_K || vt == Q5_K) {
    for (int j = 0; j < 8; ++j) {
      p[64 + 16 * j + n] = (uint8_t)o.sc[j];
      p[192 + 16 * j + n] = o.mn[j];
    }
  } else if (vt == IQ4_XS) {
    for (int j = 0; j < 8; ++j) p[32 + 16 * j + n] = (uint8_t)o.sc[j];
  } else if (vt == Q2_K) {  // each group's scales, then its mins, just before its values
    for (int s = 0; s < 16; ++s) {
      p[group_offset(vt, s / 2) - 64 + n * 2 + s % 2] = (uint8_t)o.sc[s];
      p[group_offset(vt, s / 2) - 32 + n * 2 + s % 2] = o.mn[s];
    }
  } else if (vt == Q6_K || vt == Q3_K) {  // each group's two scales just before its values
    for (int s = 0; s < 16; ++s)
      p[group_offset(vt, s / 2) - 32 + n * 2 + s % 2] = (uint8_t)o.sc[s];
  }
  // Row n's bytes of each 32-value group, written whole (decode_panel reads them back through
  // low_field / high_field; the tests check the two agree).
  for (int grp = 0; grp < values_per_block(vt) / 32; ++grp) {
    const uint8_t* q = o.q + 32 * grp;
    uint8_t* base = p + group_offset(vt, grp);
    for (int b = 0; b < 4; ++b) {
      if (vt == Q2_K || vt == Q3_K) {  // operand 4h + t at bits 2t of byte h; Q3_K: bit 2 in
        // mask g
        for (int h = 0; h < 2; ++h) {
          int bits = 0;
          for (int t = 0; t < 4; ++t) bits |= (q[4 * (4 * h + t) + b] & 3) << (2 * t);
          base[(h * 16 + n) * 4 + b] = (uint8_t)bits;
        }
        for (int g = 0; g < 8 && vt == Q3_K; ++g)
          base[128 + 8 * g + n / 2] |= (uint8_t)(((q[4 * g + b] >> 2) & 1) << ((n % 2) * 4 + b));
        continue;
      }
      if (vt == Q8_0) {
        for (int g = 0; g < 8; ++g) base[(g * 16 + n) * 4 + b] = q[4 * g + b];
        continue;
      }
      for (int g = 0; g < 4; ++g)
        base[(g * 16 + n) * 4 + b] = (uint8_t)((q[4 * g + b] & 0xF) | (q[4 * g + 16 + b] & 0xF) << 4);
      if (vt == Q6_K) {
        for (int h = 0; h < 2; ++h) {
          int bits = 0;
          for (int t = 0; t < 4; ++t) bits |= ((q[4 * (4 * h + t) + b] >> 4) & 3) << (2 * t);
          base[256 + (h * 16 + n) * 4 + b] = (uint8_t)bits;
        }
      } else if (vt == Q5_0 || vt == Q5_1 || vt == Q5_K) {  // bit n * 4 + b of mask g (the
        // panel starts zeroed)
        for (int g = 0; g < 8; ++g)
          base[256 + 8 * g + n / 2] |= (uint8_t)(((q[4 * g + b] >> 4) & 1) << ((n % 2) * 4 + b));
      }
    }
  }
}

void decode_panel(int64_t vt, const uint8_t* p, int n, Ints& o) {
  std::memcpy(&o.d, p + 2 * n, 2);
  if (has_mins(vt) || has_min32(vt)) std::memcpy(&o.dmin, p + 32 + 2 * n, 2);
  if (vt == Q4_K || vt == Q5_K) {
    for (int j = 0; j < 8; ++j) {
      o.sc[j] = (int8_t)p[64 + 16 * j + n];
      o.mn[j] = p[192 + 16 * j + n];
    }
  } else if (vt == IQ4_XS) {
    for (int j = 0; j < 8; ++j) o.sc[j] = (int8_t)p[32 + 16 * j + n];
  } else if (vt == Q2_K) {
    for (int s = 0; s < 16; ++s) {
      o.sc[s] = (int8_t)p[group_offset(vt, s / 2) - 64 + n * 2 + s % 2];
      o.mn[s] = p[group_offset(vt, s / 2) - 32 + n * 2 + s % 2];
    }
  } else if (vt == Q6_K || vt == Q3_K) {
    for (int s = 0; s < 16; ++s)
      o.sc[s] = (int8_t)p[group_offset(vt, s / 2) - 32 + n * 2 + s % 2];
  }
  for (int v = 0; v < values_per_block(vt); ++v) {
    const Field low = low_field(vt, n, v), high = high_field(vt, n, v);
    o.q[v] = (uint8_t)(get(p, low) | (high.bits ? get(p, high) << low.bits : 0));
  }
}

// The block's values as float32, with dequantize_row's expressions (the same floats).
void ints_to_floats(int64_t vt, const Ints& o, float* y) {
  const float d = fp16_to_fp32(o.d);
  for (int v = 0; v < values_per_block(vt); ++v) {
    const int q = o.q[v];
    switch (vt) {
      case Q8_0: y[v] = d * (int8_t)(q - 128); break;
      case Q4_0: y[v] = d * (q - 8); break;
      case Q5_0: y[v] = d * (q - 16); break;
      case Q4_1: case Q5_1: y[v] = d * q + fp16_to_fp32(o.dmin); break;
      case IQ4_NL: y[v] = d * IQ4_NL_VALUES[q]; break;
      case IQ4_XS: y[v] = d * o.sc[v / 32] * IQ4_NL_VALUES[q]; break;
      case Q4_K: case Q5_K:
        y[v] = d * (uint8_t)o.sc[v / 32] * q - fp16_to_fp32(o.dmin) * o.mn[v / 32];
        break;
      case Q6_K: y[v] = d * o.sc[v / 16] * (q - 32); break;
      case Q3_K: y[v] = d * o.sc[v / 16] * (q - 4); break;
      case Q2_K: y[v] = d * o.sc[v / 16] * q - fp16_to_fp32(o.dmin) * o.mn[v / 16]; break;
    }
  }
}

// ---- scalar reference: one output at a time, the vector kernel's operations in its order ----

// acc after block `o` times activation block `xb`.
float dot_block(int64_t vt, const Ints& o, const uint8_t* xb, float acc) {
  if (is_k_quant(vt)) {
    const auto* y = reinterpret_cast<const ActQ8_K*>(xb);
    const int group = scale_group(vt);
    int32_t sumi = 0, summ = 0;
    for (int s = 0; s < QK_K / group; ++s) {
      int32_t isum = 0;
      for (int v = s * group; v < (s + 1) * group; ++v)
        isum += (vt == IQ4_XS ? IQ4_NL_VALUES[o.q[v]] : o.q[v]) * y->qs[v];
      sumi += o.sc[s] * isum;
    }
    if (has_mins(vt)) {
      for (int j = 0; j < QK_K / group; ++j)
        for (int k = j * group / 16; k < (j + 1) * group / 16; ++k) summ += o.mn[j] * y->bsums[k];
    } else {  // Q6_K's values are stored plus 32, Q3_K's plus 4
      int32_t offset = 0;
      for (int s = 0; s < 16; ++s) offset += o.sc[s] * y->bsums[s];
      sumi -= (vt == Q3_K ? 4 : vt == Q6_K ? 32 : 0) * offset;  // IQ4_XS: signed values
    }
    acc = std::fma(y->d * fp16_to_fp32(o.d), (float)sumi, acc);
    if (has_mins(vt)) acc = std::fma(-(y->d * fp16_to_fp32(o.dmin)), (float)summ, acc);
    return acc;
  }
  const auto* y = reinterpret_cast<const ActQ8_0*>(xb);
  const int offset = vt == Q8_0 ? 128 : offset32(vt);  // IQ4_NL: the grid's signed values
  int32_t isum = 0;
  for (int v = 0; v < QK; ++v) isum += (vt == IQ4_NL ? IQ4_NL_VALUES[o.q[v]] : o.q[v]) * y->qs[v];
  acc = std::fma(y->d * fp16_to_fp32(o.d), (float)(isum - offset * y->sum), acc);
  if (has_min32(vt)) acc = std::fma(y->d * fp16_to_fp32(o.dmin), (float)y->sum, acc);
  return acc;
}

// One panel (w: its first block) times R activation rows -> out[r * ld + n], n < 16.
using PanelFn = void (*)(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                         int64_t ld);

template <int64_t VT, int R>
void panel_scalar(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                  int64_t ld) {
  const int64_t pbytes = panel_block_bytes(VT);
  const int64_t abytes = is_k_quant(VT) ? sizeof(ActQ8_K) : sizeof(ActQ8_0);
  Ints o;
  for (int n = 0; n < PANEL_ROWS; ++n) {
    float acc[R] = {};
    for (int64_t i = 0; i < nb; ++i) {
      decode_panel(VT, w + i * pbytes, n, o);
      for (int r = 0; r < R; ++r) acc[r] = dot_block(VT, o, x + r * xs + i * abytes, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r * ld + n] = acc[r];
  }
}

// ---- AVX512-VNNI ---------------------------------------------------------------------------

#ifdef BRAID_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,fma,f16c")))

VNNI inline __m512i bcast4(const void* y) {
  int32_t v;
  std::memcpy(&v, y, 4);
  return _mm512_set1_epi32(v);
}

// Operands 0..7 (four values of each of 16 rows) from four 64-byte loads of nibble pairs.
VNNI inline void nibble_pairs(const uint8_t* p, __m512i* q) {
  const __m512i low4 = _mm512_set1_epi8(0xF);
  for (int g = 0; g < 4; ++g) {
    const __m512i v = _mm512_loadu_si512(p + 64 * g);
    q[g] = _mm512_and_si512(v, low4);
    q[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
}

// Operands 0..7 from two 64-byte loads of four 2-bit parts (operand 4h + t: bits 2t of load h).
VNNI inline void bit_pairs(const uint8_t* p, __m512i* q) {
  const __m512i three = _mm512_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(p + 64 * h);
    for (int t = 0; t < 4; ++t) q[4 * h + t] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * t), three);
  }
}

// s + operand q . the four activations at y, in each row lane: vpdpbusd with the four bytes
// broadcast from memory inside the instruction (compilers issue a separate broadcast for
// _mm512_set1_epi32, one more instruction per four values and row).
VNNI inline __m512i dpbusd_bcast(__m512i s, __m512i q, const int8_t* y) {
  asm("vpdpbusd %[y]%{1to16%}, %[q], %[s]" : [s] "+v"(s) : [q] "v"(q), [y] "m"(*(const int32_t*)y));
  return s;
}

// Sum over operands [0, N) of operand . activations y[4g .. 4g + 3], per row lane (two chains).
template <int N>
VNNI inline __m512i dot_ops(const __m512i* q, const int8_t* y) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int g = 0; g < N; g += 2) {
    s0 = dpbusd_bcast(s0, q[g], y + 4 * g);
    s1 = dpbusd_bcast(s1, q[g + 1], y + 4 * g + 4);
  }
  return _mm512_add_epi32(s0, s1);
}

VNNI inline __m512 half_floats(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Two int8 scales per row ([16][2] at p: 32 values' two groups of 16), as int16 pairs and each
// as int32.
struct ScalePairs {
  __m512i pair, first, second;
};

VNNI inline ScalePairs scale_pairs(const uint8_t* p) {
  const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
  return {pair, _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), _mm512_srai_epi32(pair, 16)};
}

// Per row lane: operands 0-3 . y times the first scale, plus operands 4-7 . y + 16 times the
// second (a group of 32 values with a scale per 16).
VNNI inline __m512i dot_scaled_halves(const __m512i* q, const int8_t* y, const ScalePairs& sc) {
  return _mm512_add_epi32(_mm512_mullo_epi32(dot_ops<4>(q, y), sc.first),
                          _mm512_mullo_epi32(dot_ops<4>(q + 4, y + 16), sc.second));
}

// The end of a K-quant panel block (p): acc[r] += dx dw sumi[r], dw the rows' d at p; with
// `mins` (per 32 values, int16 pairs of the mins of its two groups of 16; dmin at p + 32),
// then acc[r] -= dx dmin (mins . the activations' 16-sums).
template <int R>
VNNI inline void finish_k_block(__m512* acc, const __m512i* sumi, const uint8_t* p,
                                const __m512i* mins, const uint8_t* x, int64_t xs, int64_t i) {
  const __m512 dw = half_floats(p);
  const __m512 dmin = mins != nullptr ? half_floats(p + 32) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const ActQ8_K* y = act<ActQ8_K>(x, xs, r, i);
    const __m512 dx = _mm512_set1_ps(y->d);
    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
    if (mins != nullptr) {
      __m512i summ = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) summ = _mm512_dpwssd_epi32(summ, mins[c], bcast4(y->bsums + 2 * c));
      acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dx, dmin), _mm512_cvtepi32_ps(summ), acc[r]);
    }
  }
}

// IQ4_NL's grid values plus 128 (unsigned, as vpdpbusd takes them) for the indices in q[0..8).
VNNI inline void grid_values(__m512i* q) {
  alignas(16) static constexpr uint8_t grid[16] = {  // IQ4_NL_VALUES + 128
      1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)grid));
  for (int g = 0; g < 8; ++g) q[g] = _mm512_shuffle_epi8(table, q[g]);
}

// Adds `high` to the bytes of operand q[g] whose bit is set in mask g (the value's top bit).
VNNI inline void add_high_bits(const uint8_t* masks, __m512i* q, char high = 16) {
  for (int g = 0; g < 8; ++g) {
    uint64_t bits;
    std::memcpy(&bits, masks + 8 * g, 8);
    q[g] = _mm512_mask_add_epi8(q[g], _cvtu64_mask64(bits), q[g], _mm512_set1_epi8(high));
  }
}

// Q4_K and Q5_K (VT): the same but for Q5_K's high bits.
template <int64_t VT, int R>
VNNI void panel_q4_k(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                     int64_t ld) {
  constexpr int64_t PB = PANEL_ROWS * block_size(PANEL + VT);
  constexpr int64_t GROUP = VT == Q5_K ? 320 : 256;  // bytes of a group of 32 values
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* p = w + i * PB;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {  // 32 values each, one 6-bit scale and min per row
      prefetch_ahead<PB / 8>(p + j * (PB / 8));
      __m512i q[8];
      nibble_pairs(p + 320 + GROUP * j, q);
      if constexpr (VT == Q5_K) add_high_bits(p + 320 + GROUP * j + 256, q);
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 64 + 16 * j)));
      for (int r = 0; r < R; ++r) {
        const int8_t* y = act<ActQ8_K>(x, xs, r, i)->qs + 32 * j;
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(dot_ops<8>(q, y), sc));
      }
    }
    __m512i mins[8];  // int16 pairs (min, min): one min for both 16-sums
    for (int j = 0; j < 8; ++j) {
      const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 192 + 16 * j)));
      mins[j] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
    }
    finish_k_block<R>(acc, sumi, p, mins, x, xs, i);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ld, acc[r]);
}

// Q6_K's high parts: bits 2t..2t+1 of each byte moved to bits 4..5.
VNNI inline __m512i high_part(__m512i qh, int t) {
  const __m512i mask = _mm512_set1_epi8(0x30);
  switch (t) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(qh, 4), mask);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(qh, 2), mask);
    case 2: return _mm512_and_si512(qh, mask);
    default: return _mm512_and_si512(_mm512_srli_epi16(qh, 2), mask);
  }
}

// Q6_K and Q3_K (VT): a signed scale per 16 values, the values stored plus 32 (six bits: the
// low nibbles and two high bits) or plus 4 (three bits: two low bits and one high bit).
template <int64_t VT, int R>
VNNI void panel_q6_k(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                     int64_t ld) {
  constexpr bool q3 = VT == Q3_K;
  constexpr int64_t PB = PANEL_ROWS * block_size(PANEL + VT);
  constexpr int64_t GROUP = q3 ? 224 : 416;  // a group's scales and values
  constexpr int SHIFT = q3 ? 2 : 5;          // times the offset, 4 or 32
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* p = w + i * PB;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {  // 32 values: scale groups 2c (operands 0-3) and 2c + 1
      prefetch_ahead<PB / 8>(p + c * (PB / 8));
      __m512i q[8];
      const uint8_t* chunk = p + 32 + GROUP * c;
      if constexpr (q3) {
        bit_pairs(chunk + 32, q);
        add_high_bits(chunk + 160, q, 4);
      } else {
        nibble_pairs(chunk + 32, q);
        for (int h = 0; h < 2; ++h) {
          const __m512i qh = _mm512_loadu_si512(chunk + 288 + 64 * h);
          for (int t = 0; t < 4; ++t)
            q[4 * h + t] = _mm512_or_si512(q[4 * h + t], high_part(qh, t));
        }
      }
      const ScalePairs sc = scale_pairs(chunk);  // scales 2c and 2c + 1
      for (int r = 0; r < R; ++r) {
        const ActQ8_K* y = act<ActQ8_K>(x, xs, r, i);
        // values stored plus 32 (4): subtract 32 (4) x scale . (sum of the 16 activations)
        const __m512i offset = _mm512_dpwssd_epi32(_mm512_setzero_si512(), sc.pair,
                                                   bcast4(y->bsums + 2 * c));
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_sub_epi32(dot_scaled_halves(q, y->qs + 32 * c, sc),
                                                             _mm512_slli_epi32(offset, SHIFT)));
      }
    }
    finish_k_block<R>(acc, sumi, p, nullptr, x, xs, i);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ld, acc[r]);
}

template <int R>
VNNI void panel_iq4_xs(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                       int64_t ld) {
  constexpr int64_t PB = PANEL_ROWS * block_size(PANEL + IQ4_XS);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* p = w + i * PB;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {  // 32 values, one signed scale per row
      prefetch_ahead<PB / 8>(p + j * (PB / 8));
      __m512i q[8];
      nibble_pairs(p + 160 + 256 * j, q);
      grid_values(q);
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * j)));
      for (int r = 0; r < R; ++r) {
        const ActQ8_K* y = act<ActQ8_K>(x, xs, r, i);
        const __m512i offset = _mm512_set1_epi32(128 * (y->bsums[2 * j] + y->bsums[2 * j + 1]));
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(
            _mm512_sub_epi32(dot_ops<8>(q, y->qs + 32 * j), offset), sc));
      }
    }
    finish_k_block<R>(acc, sumi, p, nullptr, x, xs, i);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ld, acc[r]);
}

template <int R>
VNNI void panel_q2_k(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                     int64_t ld) {
  constexpr int64_t PB = PANEL_ROWS * block_size(PANEL + Q2_K);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* p = w + i * PB;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {  // 32 values: scale groups 2c (operands 0-3) and 2c + 1
      prefetch_ahead<PB / 8>(p + c * (PB / 8));
      const uint8_t* chunk = p + 64 + 192 * c;
      __m512i q[8];
      bit_pairs(chunk + 64, q);
      const ScalePairs sc = scale_pairs(chunk);  // 4-bit scales 2c and 2c + 1 (as int8: the same)
      for (int r = 0; r < R; ++r)
        sumi[r] = _mm512_add_epi32(sumi[r],
                                   dot_scaled_halves(q, act<ActQ8_K>(x, xs, r, i)->qs + 32 * c, sc));
    }
    __m512i mins[8];  // int16 pairs (min 2c, min 2c + 1)
    for (int c = 0; c < 8; ++c)
      mins[c] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(p + 96 + 192 * c)));
    finish_k_block<R>(acc, sumi, p, mins, x, xs, i);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ld, acc[r]);
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL: blocks of 32, values unsigned with an offset (8,
// 16, 128, 128 (IQ4_NL's grid values plus 128), or none and a min).
template <int64_t VT, int R>
VNNI void panel_32(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                   int64_t ld) {
  constexpr int64_t PB = PANEL_ROWS * block_size(PANEL + VT);
  constexpr int offset = VT == Q4_0 ? 8 : VT == Q5_0 ? 16 : VT == Q8_0 || VT == IQ4_NL ? 128 : 0;
  constexpr bool has_min = VT == Q4_1 || VT == Q5_1;
  constexpr int64_t values = has_min ? 64 : 32;  // after d (and m)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* p = w + i * PB;
    prefetch_ahead<PB>(p);
    __m512i q[8];
    if constexpr (VT == Q8_0) {
      for (int g = 0; g < 8; ++g) q[g] = _mm512_loadu_si512(p + 32 + 64 * g);
    } else {
      nibble_pairs(p + values, q);
      if constexpr (VT == Q5_0 || VT == Q5_1) add_high_bits(p + values + 256, q);
      if constexpr (VT == IQ4_NL) grid_values(q);
    }
    const __m512 dw = half_floats(p), dm = has_min ? half_floats(p + 32) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const ActQ8_0* y = act<ActQ8_0>(x, xs, r, i);
      const __m512i isum = _mm512_sub_epi32(dot_ops<8>(q, y->qs), _mm512_set1_epi32(offset * y->sum));
      const __m512 dx = _mm512_set1_ps(y->d);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(isum), acc[r]);
      if constexpr (has_min)
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dm), _mm512_cvtepi32_ps(_mm512_set1_epi32(y->sum)),
                                 acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ld, acc[r]);
}

template <int64_t VT, int R>
VNNI void panel_vnni(const uint8_t* w, const uint8_t* x, int64_t xs, int64_t nb, float* out,
                     int64_t ld) {
  if constexpr (VT == Q4_K || VT == Q5_K) panel_q4_k<VT, R>(w, x, xs, nb, out, ld);
  else if constexpr (VT == Q6_K || VT == Q3_K) panel_q6_k<VT, R>(w, x, xs, nb, out, ld);
  else if constexpr (VT == Q2_K) panel_q2_k<R>(w, x, xs, nb, out, ld);
  else if constexpr (VT == IQ4_XS) panel_iq4_xs<R>(w, x, xs, nb, out, ld);
  else panel_32<VT, R>(w, x, xs, nb, out, ld);
}

#endif

// Each panel layout's kernels, by the GGML type of its values (llama.cpp's type_traits_cpu):
// per number of activation rows, the scalar routine and the AVX512-VNNI one.
struct PanelKernels {
  std::array<PanelFn, MAX_R> scalar;
  std::array<PanelFn, MAX_R> vnni;
};

template <int64_t VT, int... R>
std::pair<const int64_t, PanelKernels> panel_kernels_of(std::integer_sequence<int, R...>) {
#ifdef BRAID_X86
  return {VT, {{panel_scalar<VT, R + 1>...}, {panel_vnni<VT, R + 1>...}}};
#else
  return {VT, {{panel_scalar<VT, R + 1>...}, {panel_scalar<VT, R + 1>...}}};
#endif
}

template <int64_t VT>
std::pair<const int64_t, PanelKernels> panel_kernels() {
  return panel_kernels_of<VT>(std::make_integer_sequence<int, MAX_R>());
}

const std::array<PanelFn, MAX_R>& panel_fns(int64_t vt, const Isa& isa) {
  static const std::map<int64_t, PanelKernels> table = {
      panel_kernels<Q4_0>(), panel_kernels<Q5_0>(), panel_kernels<Q4_1>(),
      panel_kernels<Q5_1>(), panel_kernels<IQ4_NL>(), panel_kernels<Q8_0>(),
      panel_kernels<Q4_K>(), panel_kernels<Q5_K>(), panel_kernels<Q6_K>(),
      panel_kernels<Q3_K>(), panel_kernels<Q2_K>(), panel_kernels<IQ4_XS>(),
  };
  const auto found = table.find(vt);
  TORCH_CHECK(found != table.end(), "no panel layout for GGML type ", vt);
  return isa.vnni ? found->second.vnni : found->second.scalar;
}

// Rows [N, K / block * bytes] of GGML type `type` -> the same values as panels (same shape).
torch::Tensor repack_panels(const torch::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "weight must be a contiguous uint8 [rows, bytes per row] tensor");
  TORCH_CHECK(w.size(0) % PANEL_ROWS == 0, "panels need a multiple of 16 rows, got ", w.size(0));
  const int64_t nb = k / block_elems(type), bb = block_bytes(type), pbytes = panel_block_bytes(type);
  TORCH_CHECK(k % block_elems(type) == 0 && w.size(1) == nb * bb, "weight rows hold ", w.size(1),
              " bytes, expected ", nb * bb);
  auto out = torch::zeros({w.size(0), nb * pbytes / PANEL_ROWS}, torch::kUInt8);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t panels = w.size(0) / PANEL_ROWS;
  at::parallel_for(0, panels * nb, 256, [&](int64_t begin, int64_t end) {
    Ints o;
    for (int64_t pi = begin; pi < end; ++pi) {
      const int64_t p = pi / nb, i = pi % nb;
      for (int n = 0; n < PANEL_ROWS; ++n) {
        decode_plain(type, src + (p * PANEL_ROWS + n) * nb * bb + i * bb, o);
        encode_panel(type, o, dst + pi * pbytes, n);
      }
    }
  });
  return out;
}

}  // namespace

void panel_gemm(const uint8_t* x, int64_t m, int64_t xbytes, const uint8_t* w, int64_t n,
                int64_t type, int64_t k, float* out, int64_t ld, const Isa& isa) {
  const int64_t vt = value_type(type), nb = k / block_elems(vt);
  const int64_t pbytes = nb * panel_block_bytes(vt);
  const auto& fns = panel_fns(vt, isa);
  // At least ~256K multiply-adds per thread: a small product is not worth a parallel region.
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, PANEL_ROWS * k * m));
  at::parallel_for(0, n / PANEL_ROWS, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < m; r0 += MAX_R) {
        const int64_t rows = std::min<int64_t>(MAX_R, m - r0);
        fns[rows - 1](w + p * pbytes, x + r0 * xbytes, xbytes, nb, out + r0 * ld + p * PANEL_ROWS,
                      ld);
      }
  });
}

void panel_dequantize_row(const uint8_t* w, int64_t row, int64_t type, int64_t k, float* y) {
  const int64_t vt = value_type(type), nb = k / block_elems(vt), pbytes = panel_block_bytes(vt);
  const uint8_t* panel = w + row / PANEL_ROWS * nb * pbytes;
  Ints o;
  for (int64_t i = 0; i < nb; ++i, y += block_elems(vt)) {
    decode_panel(vt, panel + i * pbytes, (int)(row % PANEL_ROWS), o);
    ints_to_floats(vt, o, y);
  }
}

void register_panels(pybind11::module& m) {
  m.def("repack_panels", &repack_panels);
  m.attr("PANEL") = PANEL;
  m.attr("PANEL_ROWS") = PANEL_ROWS;
}

}  // namespace braid_kernels
