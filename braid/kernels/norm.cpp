// The small per-token ops of a decoder layer, one pass each (torch runs each as several small
// ops, whose per-op overhead dominates at decode-sized rows; docs/benchmarks.md has timings).
//
// RMSNorm over the rows of a float32 matrix: y = x / sqrt(mean(x^2) + eps) * w. Each row is
// reduced in the same order whatever the number of rows (eight partial sums, then those in
// order), so the result never depends on the batch.
//
// Rotary embedding (neox style, rotate_half) in place: the same products and sums as
// qwen2.py's `rotate`, so the results are identical to it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

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

// x [T, H] float32, w [H] float32 -> [T, H].
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.dtype() == torch::kFloat32 && w_in.dtype() == torch::kFloat32,
              "rms_norm wants float32 inputs");
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  const int64_t h = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h, "weight must be [", h, "]");
  auto out = torch::empty_like(x);
  const int64_t rows = h ? x.numel() / h : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * h, wp, (float)eps, h, op + r * h);
  });
  return out;
}

// x [T, heads, D] float32 contiguous, rotated in place by cos, sin [T, D/2] (row t: token t).
void rotate_(torch::Tensor& x, const torch::Tensor& cos_in, const torch::Tensor& sin_in) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && x.is_contiguous(),
              "x must be a contiguous float32 [T, heads, D] tensor");
  const auto cos = cos_in.to(torch::kFloat32).contiguous();
  const auto sin = sin_in.to(torch::kFloat32).contiguous();
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.numel() == t * half && sin.numel() == t * half,
              "cos and sin must hold [T, D/2] values");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * half;
      const float* s = sp + i * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + (i * heads + h) * d;
        float* x2 = x1 + half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = x1[j], b = x2[j];
          x1[j] = a * c[j] - b * s[j];
          x2[j] = b * c[j] + a * s[j];
        }
      }
    }
  });
}

}  // namespace

void register_norm(pybind11::module& m) {
  m.def("rms_norm", &rms_norm);
  m.def("rotate_", &rotate_);
}
