// exp(x) for x <= 0 on 8 and 16 float lanes, shared by the softmax (attention.cpp) and the
// SiLU (norm.cpp): 2^n * p(r), |r| <= ln2 / 2, a degree-6 polynomial (relative error ~2e-7);
// underflows to 0 below -87. The constants both vector widths use: the floor, 1 / ln2, ln2 in
// a high and a low part, p's coefficients from the highest power down.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#ifndef BRAID_X86
#define BRAID_X86 1
#endif
#endif

namespace braid_kernels::vexp {

constexpr float EXP_FLOOR = -87.f, LOG2E = 1.44269504f, LN2_HI = 0.693145752f,
                LN2_LO = 1.42860677e-6f;
constexpr float EXP_POLY[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#ifdef BRAID_X86
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx512f,fma"))) inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                       _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

}  // namespace braid_kernels::vexp
