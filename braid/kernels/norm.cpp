// The small per-token ops of a decoder layer, one pass each (torch runs each as several small
// ops, whose per-op overhead dominates at decode-sized rows; docs/benchmarks.md has timings).
//
// RMSNorm over the rows of a float32 matrix: y = x / sqrt(mean(x^2) + eps) * w. Each row is
// reduced in the same order whatever the number of rows (eight partial sums, then those in
// order), so the result never depends on the batch.
//
// SiLU-gated MLP activation: silu(gate) * up from the gate/up projection's output, one pass
// (torch's chunk, silu and mul cost ~30 us a layer at decode sizes, most of it per-op
// overhead). silu(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|) (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) below. Elementwise, so rows never depend on the batch.
//
// Rotary embedding (neox style, rotate_half): the same products and sums as qwen2.py's
// `rotate`, so the results are identical to it; alone in place, or fused with the split of the
// q/k/v projection and the write of k and v into the paged cache.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vexp.h"

namespace braid_kernels {
namespace {

int64_t rows_of(const torch::Tensor& x) { return x.size(-1) ? x.numel() / x.size(-1) : 0; }

void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += x[i + l] * x[i + l];
  for (; i < n; ++i) lanes[0] += x[i] * x[i];
  float ss = 0.f;
  for (int l = 0; l < 8; ++l) ss += lanes[l];
  const float inv = 1.f / std::sqrt(ss / (float)n + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * inv * w[j];
}

// The gate's activation g * sigmoid(a): SiLU with a = g; GELU's tanh form with
// a = 2 sqrt(2 / pi) (g + 0.044715 g^3), as 0.5 (1 + tanh(z)) = sigmoid(2 z).
constexpr float kGeluA = 1.5957691216057308f, kGeluB = 0.044715f;

template <bool Gelu>
float gate_scalar(float g) {
  const float a = Gelu ? kGeluA * (g + kGeluB * g * g * g) : g;
  const float e = std::exp(-std::fabs(a));
  return g * (a >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
}

template <bool Gelu>
void gate_mul_scalar(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = gate_scalar<Gelu>(g[i]) * u[i];
}

#ifdef BRAID_X86
template <bool Gelu>
__attribute__((target("avx2,fma"))) void gate_mul_avx2(const float* g, const float* u, float* y,
                                                        int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    __m256 a = x;
    if constexpr (Gelu) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      a = _mm256_mul_ps(_mm256_set1_ps(kGeluA),
                        _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(kGeluB), cube)));
    }
    const __m256 e = vexp::exp_avx2(_mm256_or_ps(a, sign));  // exp(-|a|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 neg = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
  }
  gate_mul_scalar<Gelu>(g + i, u + i, y + i, n - i);
}

template <bool Gelu>
__attribute__((target("avx512f,fma"))) void gate_mul_avx512(const float* g, const float* u,
                                                              float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    __m512 a = x;
    if constexpr (Gelu) {
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      a = _mm512_mul_ps(_mm512_set1_ps(kGeluA),
                        _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kGeluB), cube)));
    }
    const __m512 e = vexp::exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
    const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_mask_mul_ps(inv, neg, e, inv);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(u + i)));
  }
  gate_mul_scalar<Gelu>(g + i, u + i, y + i, n - i);
}
#endif

template <bool Gelu>
torch::Tensor gate_mul(const torch::Tensor& gate_up_in, const Isa& isa) {
  TORCH_CHECK(gate_up_in.dtype() == torch::kFloat32 && gate_up_in.dim() == 2 &&
                  gate_up_in.size(1) % 2 == 0,
              "silu_mul / gelu_mul want a float32 [T, 2I] tensor");
  const auto gu = gate_up_in.contiguous();
  const int64_t t = gu.size(0), i = gu.size(1) / 2;
  auto out = torch::empty({t, i}, torch::kFloat32);
  auto fn = gate_mul_scalar<Gelu>;
#ifdef BRAID_X86
  if (isa.avx512) fn = gate_mul_avx512<Gelu>;
  else if (isa.avx2) fn = gate_mul_avx2<Gelu>;
#endif
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(gp + r * 2 * i, gp + r * 2 * i + i, op + r * i, i);
  });
  return out;
}

}  // namespace

// gate_up [T, 2I] float32 (gate in the first I columns, up in the rest) -> [T, I]:
// silu(gate) * up, or (gelu_mul) gelu_tanh(gate) * up (Gemma's GeGLU).
torch::Tensor silu_mul(const torch::Tensor& gate_up_in, const Isa& isa) {
  return gate_mul<false>(gate_up_in, isa);
}

torch::Tensor gelu_mul(const torch::Tensor& gate_up_in, const Isa& isa) {
  return gate_mul<true>(gate_up_in, isa);
}

// x [T, H] float32, w [H] float32 -> [T, H].
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.dtype() == torch::kFloat32 && w_in.dtype() == torch::kFloat32,
              "rms_norm wants float32 inputs");
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  const int64_t h = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h, "weight must be [", h, "]");
  auto out = torch::empty_like(x);
  const int64_t rows = rows_of(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * h, wp, (float)eps, h, op + r * h);
  });
  return out;
}

// residual [T, H] += x (in place); returns rms_norm(residual): the residual stream's add and
// the norm after it in one pass (the same additions and norm as doing them one by one).
torch::Tensor add_rms_norm_(torch::Tensor& residual, const torch::Tensor& x_in,
                            const torch::Tensor& w_in, double eps) {
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  TORCH_CHECK(residual.dtype() == torch::kFloat32 && residual.is_contiguous() &&
                  x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32 &&
                  x.sizes() == residual.sizes(),
              "add_rms_norm_ wants a contiguous float32 residual and x of its shape");
  const int64_t h = residual.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h, "weight must be [", h, "]");
  auto out = torch::empty_like(residual);
  float* rp = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows_of(residual), 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = rp + r * h;
      for (int64_t j = 0; j < h; ++j) row[j] = row[j] + xp[r * h + j];
      rms_norm_row(row, wp, (float)eps, h, op + r * h);
    }
  });
  return out;
}

namespace {

// One head's rotation: dst = src rotated by c, s [D/2] (dst may be src).
void rotate_head(const float* src, float* dst, const float* c, const float* s, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = src[j], b = src[j + half];
    dst[j] = a * c[j] - b * s[j];
    dst[j + half] = b * c[j] + a * s[j];
  }
}

// cos or sin [T, 1, D/2] (any float dtype) as contiguous float32 holding T * D/2 values.
torch::Tensor table_of(const torch::Tensor& t, int64_t tokens, int64_t half) {
  auto out = t.to(torch::kFloat32).contiguous();
  TORCH_CHECK(out.numel() == tokens * half, "cos and sin must hold [T, D/2] values");
  return out;
}

}  // namespace

// x [T, heads, D] float32 contiguous, rotated in place by cos, sin [T, D/2] (row t: token t).
void rotate_(torch::Tensor& x, const torch::Tensor& cos_in, const torch::Tensor& sin_in) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && x.is_contiguous(),
              "x must be a contiguous float32 [T, heads, D] tensor");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "head size must be even");
  const auto cos = table_of(cos_in, t, half);
  const auto sin = table_of(sin_in, t, half);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < heads; ++h) {
        float* head = xp + (i * heads + h) * d;
        rotate_head(head, head, cp + i * half, sp + i * half, half);
      }
  });
}

namespace {

// One head of k or v into its cache row: float32 as it is, 16-bit rounded to nearest even
// (the rounding torch's .to() does, so the module path writes the same values).
void store_head(const float* src, float* dst, int64_t d) { std::copy(src, src + d, dst); }
template <typename KV>
void store_head(const float* src, KV* dst, int64_t d) {
  for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<KV>(src[j]);
}

template <typename KV>
void rope_qkv_rows(const float* src, const float* cp, const float* sp, const int64_t* sl,
                   int64_t t, int64_t heads, int64_t kvh, int64_t d, float* qp, KV* kp, KV* vp) {
  const int64_t half = d / 2;
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(d);
    for (int64_t i = begin; i < end; ++i) {
      const float* row = src + i * (heads + 2 * kvh) * d;
      const float *c = cp + i * half, *s = sp + i * half;
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(row + h * d, qp + (i * heads + h) * d, c, s, half);
      for (int64_t h = 0; h < kvh; ++h) {
        KV* dst = kp + (sl[i] * kvh + h) * d;
        if constexpr (std::is_same_v<KV, float>) {
          rotate_head(row + (heads + h) * d, dst, c, s, half);
        } else {
          rotate_head(row + (heads + h) * d, rotated.data(), c, s, half);
          store_head(rotated.data(), dst, d);
        }
      }
      store_head(row + (heads + kvh) * d, vp + sl[i] * kvh * d, kvh * d);
    }
  });
}

}  // namespace

// qkv [T, (H + 2 KVH) * D] float32, the fused projection's output (bias added): q and k
// rotated by cos, sin [T, 1, D/2], k and v written to the caches [slots, KVH, D] (float32,
// float16 or bfloat16) at slot_mapping [T]. Returns q [T, H, D].
torch::Tensor rope_qkv_to_cache(const torch::Tensor& qkv_in, const torch::Tensor& cos_in,
                                const torch::Tensor& sin_in, torch::Tensor& k_cache,
                                torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                int64_t heads) {
  const auto qkv = qkv_in.contiguous();
  const auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && v_cache.scalar_type() == kv_type &&
                  is_kv_type(kv_type) && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes(),
              "rope_qkv_to_cache wants float32 qkv and contiguous [slots, KVH, D] caches of one "
              "type: float32, float16 or bfloat16");
  const int64_t t = qkv.size(0), kvh = k_cache.size(1), d = k_cache.size(2), half = d / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kvh) * d && d % 2 == 0,
              "qkv must be [T, (heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(slots.numel() == t, "one cache slot per token");
  const auto cos = table_of(cos_in, t, half);
  const auto sin = table_of(sin_in, t, half);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sl[i] >= 0 && sl[i] < k_cache.size(0), "cache slot out of range");
  auto q = torch::empty({t, heads, d}, torch::kFloat32);
  dispatch_kv_type(kv_type, [&](auto tag) {
    using KV = decltype(tag);
    rope_qkv_rows<KV>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), sl,
                      t, heads, kvh, d, q.data_ptr<float>(), static_cast<KV*>(k_cache.data_ptr()),
                      static_cast<KV*>(v_cache.data_ptr()));
  });
  return q;
}

}  // namespace braid_kernels

void register_norm(pybind11::module& m) {
  using namespace braid_kernels;
  m.def("rms_norm", &rms_norm);
  m.def("rotate_", &rotate_);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rope_qkv_to_cache", &rope_qkv_to_cache);
  m.def("silu_mul", &silu_mul);
  m.def("gelu_mul", &gelu_mul);
}
