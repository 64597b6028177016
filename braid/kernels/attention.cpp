// Paged attention, one query row at a time, over the keys that row may see, in position order.
// On AVX512 a task is one row and one KV head: the query heads that share that KV head (GQA)
// read its keys and values while they are in L1, and each head's output accumulates in
// registers; elsewhere a task is one row and one head (AVX2, or portable scalar code).
//
// Batch invariance: a row's output depends only on its query and its keys and values (read in
// order 0..len-1, the same arithmetic every time), never on the other rows of the step, on
// padding or on how a prompt was split into chunks. With int8-quantized activations a last-bit
// difference in attention can flip an activation's rounding and grow into a visible logit
// difference, so greedy speculation is only lossless if a verification window's rows equal the
// decodes they stand for, bit for bit.
//
// The caches hold float32, float16 or bfloat16 (--kv-cache-dtype). A 16-bit element widens to
// float32 exactly (F16C / AVX512 conversion, or a shift for bfloat16, the same values as the
// scalar c10 conversion), and every sum is float32, so the rules above hold for each cache type.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops.h"
#include "vexp.h"

namespace {

using namespace braid_kernels::vexp;

// A cache element as float32 (exact for each cache type).
inline float widen(float x) { return x; }
inline float widen(at::Half x) { return static_cast<float>(x); }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

template <typename KV>
float dot_scalar(const float* a, const KV* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * widen(b[i + l]);
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += lanes[l];
  for (; i < n; ++i) s += a[i] * widen(b[i]);
  return s;
}

float softmax_exp_scalar(float* scores, int64_t n, float mx) {
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  return sum;
}

template <typename KV>
void axpy_scalar(float a, const KV* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * widen(x[i]);
}

#ifdef BRAID_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// Eight cache elements as float32.
AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AVX2 __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <typename KV>
AVX2 float dot_avx2(const float* a, const KV* b, int64_t n) {
  // Four independent accumulators (the FMA latency), combined in a fixed order.
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * u), load8(b + i + 8 * u), acc[u]);
  for (; i + 8 <= n; i += 8)
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc[0]);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += a[i] * widen(b[i]);
  return r;
}

// Scores of four keys at once (the query is loaded once for the four); d % 8 == 0.
template <typename KV>
AVX2 void dot4_avx2(const float* q, const KV* const* k, int64_t d, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int u = 0; u < 4; ++u) acc[u] = _mm256_fmadd_ps(qv, load8(k[u] + i), acc[u]);
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

// scores[j] = exp(scores[j] - mx); returns their sum (lanes summed in a fixed order).
AVX2 float softmax_exp_avx2(float* scores, int64_t n, float mx) {
  __m256 acc = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(mx);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
    _mm256_storeu_ps(scores + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float sum = 0.f;
  for (int l = 0; l < 8; ++l) sum += lanes[l];
  for (; j < n; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  return sum;
}

template <typename KV>
AVX2 void axpy_avx2(float a, const KV* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * widen(x[i]);
}

#define AVX512 __attribute__((target("avx512f,fma")))

// Sixteen cache elements as float32.
AVX512 __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512 __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
AVX512 __m512 load16(const at::BFloat16* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// scores[0..n) = softmax numerators exp(s * scale - max); returns their sum (one vector of
// lane sums, added up in a fixed order at the end).
AVX512 float scaled_softmax_exp_avx512(float* scores, int64_t n, float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scores + j), sc);
    _mm512_storeu_ps(scores + j, s);
    mx = _mm512_max_ps(mx, s);
  }
  const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
  if (tail) {
    const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, scores + j), sc);
    _mm512_mask_storeu_ps(scores + j, tail, s);
    mx = _mm512_mask_max_ps(mx, tail, mx, s);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 acc = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(scores + j), m));
    _mm512_storeu_ps(scores + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (tail) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + j), m));
    _mm512_mask_storeu_ps(scores + j, tail, e);
    acc = _mm512_mask_add_ps(acc, tail, acc, e);
  }
  float lanes[16];
  _mm512_storeu_ps(lanes, acc);
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum;
}

// The `group` query heads of one row that share KV head `kv_head` (q: their [group, 16 * C]
// values), over the row's n keys -> out [group, 16 * C]; scores has room for group * (n + 1).
// Each head is the same operations in the same order whatever else the step holds: scores
// four keys at a time (one accumulator per key, summed across lanes), the softmax above,
// then the values weighted and added up key by key in C registers, divided by the sum at
// the end. Keys and values are visited in blocks of KEY_BLOCK, every head of the group per
// block, so each block is read from memory once and then from L1 (a head's arithmetic does
// not depend on the blocking: its partial sums pass through `out` unchanged).
constexpr int64_t KEY_BLOCK = 32;

template <int C, typename KV>
AVX512 void attend_group_avx512(const float* q, int64_t group, const KV* kp, const KV* vp,
                                const int64_t* pos_slots, int64_t n, int64_t kvh,
                                int64_t kv_head, float scale, float* scores, float* out) {
  constexpr int64_t d = 16 * C;
  const auto key = [&](int64_t j) { return kp + (pos_slots[j] * kvh + kv_head) * d; };
  const auto value = [&](int64_t j) { return vp + (pos_slots[j] * kvh + kv_head) * d; };
  const auto prefetch = [&](const KV* row) {  // each 64-byte line of the row
    for (int64_t b = 0; b < d * (int64_t)sizeof(KV); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
  };
  for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(n, j0 + KEY_BLOCK);
    for (int64_t j = j1; j < std::min(n, j1 + KEY_BLOCK); ++j) prefetch(key(j));
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * n;
      __m512 qz[C];
      for (int c = 0; c < C; ++c) qz[c] = _mm512_loadu_ps(q + g * d + 16 * c);
      int64_t j = j0;
      for (; j + 4 <= j1; j += 4) {
        const KV* k[4] = {key(j), key(j + 1), key(j + 2), key(j + 3)};
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int c = 0; c < C; ++c)
          for (int u = 0; u < 4; ++u)
            acc[u] = _mm512_fmadd_ps(qz[c], load16(k[u] + 16 * c), acc[u]);
        for (int u = 0; u < 4; ++u) s[j + u] = _mm512_reduce_add_ps(acc[u]);
      }
      for (; j < j1; ++j) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
          acc = _mm512_fmadd_ps(qz[c], load16(key(j) + 16 * c), acc);
        s[j] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  float* sums = scores + group * n;
  for (int64_t g = 0; g < group; ++g) sums[g] = scaled_softmax_exp_avx512(scores + g * n, n, scale);
  for (int64_t i = 0; i < group * d; ++i) out[i] = 0.f;
  for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(n, j0 + KEY_BLOCK);
    for (int64_t j = j1; j < std::min(n, j1 + KEY_BLOCK); ++j) prefetch(value(j));
    int64_t g = 0;
    for (; g + 2 <= group; g += 2) {  // two heads at a time: 2C independent sums
      const float* s0 = scores + g * n;
      const float* s1 = s0 + n;
      __m512 o0[C], o1[C];
      for (int c = 0; c < C; ++c) {
        o0[c] = _mm512_loadu_ps(out + g * d + 16 * c);
        o1[c] = _mm512_loadu_ps(out + (g + 1) * d + 16 * c);
      }
      for (int64_t j = j0; j < j1; ++j) {
        const __m512 p0 = _mm512_set1_ps(s0[j]), p1 = _mm512_set1_ps(s1[j]);
        const KV* v = value(j);
        for (int c = 0; c < C; ++c) {
          const __m512 vz = load16(v + 16 * c);
          o0[c] = _mm512_fmadd_ps(p0, vz, o0[c]);
          o1[c] = _mm512_fmadd_ps(p1, vz, o1[c]);
        }
      }
      for (int c = 0; c < C; ++c) {
        _mm512_storeu_ps(out + g * d + 16 * c, o0[c]);
        _mm512_storeu_ps(out + (g + 1) * d + 16 * c, o1[c]);
      }
    }
    for (; g < group; ++g) {
      const float* s0 = scores + g * n;
      __m512 o0[C];
      for (int c = 0; c < C; ++c) o0[c] = _mm512_loadu_ps(out + g * d + 16 * c);
      for (int64_t j = j0; j < j1; ++j) {
        const __m512 p0 = _mm512_set1_ps(s0[j]);
        const KV* v = value(j);
        for (int c = 0; c < C; ++c) o0[c] = _mm512_fmadd_ps(p0, load16(v + 16 * c), o0[c]);
      }
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * d + 16 * c, o0[c]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[g]);
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out + g * d + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(out + g * d + 16 * c), inv));
  }
}

template <typename KV>
using GroupFn = void (*)(const float*, int64_t, const KV*, const KV*, const int64_t*, int64_t,
                         int64_t, int64_t, float, float*, float*);

// The routine for head size d (a multiple of 16, up to 256), or null.
template <typename KV>
GroupFn<KV> group_fn(int64_t d) {
  switch (d) {
    case 16: return attend_group_avx512<1, KV>;
    case 32: return attend_group_avx512<2, KV>;
    case 64: return attend_group_avx512<4, KV>;
    case 96: return attend_group_avx512<6, KV>;
    case 128: return attend_group_avx512<8, KV>;
    case 256: return attend_group_avx512<16, KV>;
    default: return nullptr;
  }
}
#endif

// Each row's attention (paged_attention_rows after its checks), over caches of type KV.
template <typename KV>
void attend_rows(const float* qp, const KV* kp, const KV* vp, const int64_t* table,
                 const int64_t* seq, const int64_t* len, const int64_t* first, int64_t t,
                 int64_t h, int64_t d, int64_t kvh, int64_t kv_max, float scale,
                 const braid_kernels::Isa& isa, float* op) {
  const int64_t group = h / kvh;
  int64_t keys = 0;
  for (int64_t i = 0; i < t; ++i) keys += len[i] - first[i];
#ifdef BRAID_X86
  if (const GroupFn<KV> fn = isa.avx512 ? group_fn<KV>(d) : nullptr) {
    // At least ~64K multiply-adds per thread: decode steps of a small model stay on one thread.
    const int64_t grain =
        std::max<int64_t>(1, (1 << 16) * t / std::max<int64_t>(1, keys * d * group));
    at::parallel_for(0, t * kvh, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / kvh, kv_head = task % kvh, n = len[row] - first[row];
        scores.resize(group * (n + 1));
        const int64_t head0 = row * h + kv_head * group;  // the group's first query head
        fn(qp + head0 * d, group, kp, vp, table + seq[row] * kv_max + first[row], n, kvh,
           kv_head, scale, scores.data(), op + head0 * d);
      }
    });
    return;
  }
  const bool avx2 = isa.avx2;  // one row and one head a task
  const auto dot = avx2 ? dot_avx2<KV> : dot_scalar<KV>;
  const auto axpy = avx2 ? axpy_avx2<KV> : axpy_scalar<KV>;
  const auto softmax_exp = avx2 ? softmax_exp_avx2 : softmax_exp_scalar;
#else
  const auto dot = dot_scalar<KV>;
  const auto axpy = axpy_scalar<KV>;
  const auto softmax_exp = softmax_exp_scalar;
#endif
  // At least ~64K multiply-adds per thread: decode steps of a small model stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) * t / std::max<int64_t>(1, keys * d));
  at::parallel_for(0, t * h, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t th = begin; th < end; ++th) {
      const int64_t row = th / h, head = th % h, kv_head = head / group;
      const int64_t n = len[row] - first[row];
      const int64_t* pos_slots = table + seq[row] * kv_max + first[row];
      const float* qv = qp + th * d;
      scores.resize(n);
      int64_t j = 0;
#ifdef BRAID_X86
      if (avx2 && d % 8 == 0) {  // keys 4 at a time, the last n % 4 one by one
        for (; j + 4 <= n; j += 4) {
          const KV* four[4];
          for (int u = 0; u < 4; ++u) four[u] = kp + (pos_slots[j + u] * kvh + kv_head) * d;
          dot4_avx2<KV>(qv, four, d, scores.data() + j);
        }
      }
#endif
      for (; j < n; ++j) scores[j] = dot(qv, kp + (pos_slots[j] * kvh + kv_head) * d, d);
      float mx = -INFINITY;
      for (j = 0; j < n; ++j) {
        scores[j] *= scale;
        mx = std::fmax(mx, scores[j]);
      }
      const float sum = softmax_exp(scores.data(), n, mx);
      float* o = op + th * d;
      std::fill(o, o + d, 0.f);
      const float inv = 1.f / sum;
      for (int64_t j = 0; j < n; ++j)
        axpy(scores[j] * inv, vp + (pos_slots[j] * kvh + kv_head) * d, o, d);
    }
  });
}

}  // namespace

namespace braid_kernels {

// q [T, H, D] float32; caches [slots, KVH, D] float32, float16 or bfloat16; kv_slots [R, kv_max]
// (the cache slot of each position of request r); row_seq [T] (the request of each row);
// row_len [T] (the keys it attends to: positions 0..len-1); row_start [T] (optional: a
// sliding window's first position, keys start..len-1). Returns [T, H, D] float32.
torch::Tensor paged_attention_rows(const torch::Tensor& q_in, const torch::Tensor& k_cache,
                                   const torch::Tensor& v_cache, const torch::Tensor& kv_slots_in,
                                   const torch::Tensor& row_seq_in, const torch::Tensor& row_len_in,
                                   double scale, const Isa& isa,
                                   const std::optional<torch::Tensor>& row_start_in) {
  const auto q = q_in.contiguous();
  const auto kv_slots = kv_slots_in.to(torch::kInt64).contiguous();
  const auto row_seq = row_seq_in.to(torch::kInt64).contiguous();
  const auto row_len = row_len_in.to(torch::kInt64).contiguous();
  const auto row_start = row_start_in ? row_start_in->to(torch::kInt64).contiguous()
                                      : torch::zeros_like(row_len);
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(q.dtype() == torch::kFloat32 && v_cache.scalar_type() == kv_type &&
                  is_kv_type(kv_type),
              "paged_attention_rows needs a float32 q and float32, float16 or bfloat16 caches "
              "of one type");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), kvh = k_cache.size(1);
  TORCH_CHECK(h % kvh == 0 && k_cache.size(2) == d, "head shapes do not match");
  const int64_t kv_max = kv_slots.size(1), slots = k_cache.size(0);
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* len = row_len.data_ptr<int64_t>();
  const int64_t* first = row_start.data_ptr<int64_t>();
  const int64_t* table = kv_slots.data_ptr<int64_t>();
  TORCH_CHECK(row_start.numel() == t, "row_start needs one position per row");
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(len[i] >= 1 && len[i] <= kv_max && seq[i] >= 0 && seq[i] < kv_slots.size(0) &&
                    first[i] >= 0 && first[i] < len[i],
                "row ", i, " has no valid keys");
  for (int64_t i = 0; i < kv_slots.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < slots, "KV slot out of range");
  auto out = torch::empty({t, h, d}, torch::kFloat32);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  dispatch_kv_type(kv_type, [&](auto tag) {
    using KV = decltype(tag);
    attend_rows<KV>(qp, static_cast<const KV*>(k_cache.data_ptr()),
                    static_cast<const KV*>(v_cache.data_ptr()), table, seq, len, first, t, h,
                    d, kvh, kv_max, (float)scale, isa, op);
  });
  return out;
}

// The routines paged_attention_rows runs for head size d: "avx512", "avx2" or "scalar".
std::string attention_isa(int64_t d, const Isa& isa) {
#ifdef BRAID_X86
  if (isa.avx512 && group_fn<float>(d) != nullptr) return "avx512";
  if (isa.avx2) return "avx2";
#endif
  return "scalar";
}

}  // namespace braid_kernels

void register_attention(pybind11::module& m) {
  m.def("paged_attention_rows", &braid_kernels::paged_attention_rows, pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("kv_slots"),
        pybind11::arg("row_seq"), pybind11::arg("row_len"), pybind11::arg("scale"),
        pybind11::arg("isa"), pybind11::arg("row_start") = pybind11::none());
  m.def("attention_isa", &braid_kernels::attention_isa);
}
