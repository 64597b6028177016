// A quantized decoder layer's forward in one call: the operations of qwen2.py's DecoderLayer
// with QuantLinear projections on the compiled path, in the same order and with the same
// kernels, so the results are bit-identical to it (tested). What it saves is the ~40 Python
// and small torch calls a layer costs around its four products (~3-4 ms of a ~35 ms decode
// step of the 1.5B target).

#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "formats.h"
#include "ops.h"

namespace braid_kernels {
namespace {

// (first output row, blocks [rows, bytes per row], kernel layout, values per row, GGML type)
using Segment = std::tuple<int64_t, torch::Tensor, int64_t, int64_t, int64_t>;

// QuantLinear.forward for full outputs: activations quantized once per format kind (K-quant
// or not), each segment's product written into its columns, then the bias.
struct Linear {
  std::vector<Segment> segments;
  int64_t out_features = 0;
  std::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x, const Isa& isa) const {
    auto out = torch::empty({x.size(0), out_features}, torch::kFloat32);
    torch::Tensor acts[2];
    for (const auto& [offset, data, layout, cols, qtype] : segments) {
      auto& act = acts[is_k_quant(qtype) ? 1 : 0];
      if (!act.defined()) act = quantize_activations(x, qtype, isa);
      qgemm_into(act, data, layout, cols, out, offset, isa);
    }
    if (bias) out.add_(*bias);
    return out;
  }
};

Linear linear_of(std::vector<Segment> segments, int64_t out_features,
                 std::optional<torch::Tensor> bias) {
  TORCH_CHECK(!segments.empty(), "a projection needs its weights");
  return Linear{std::move(segments), out_features, std::move(bias)};
}

// Each q and k head of qkv [T, (H + 2 KVH) D] RMS-normalised with its weights, in place
// (Qwen3, Gemma 3: qwen2.py's Attention._norm_heads on the compiled path).
void norm_heads(torch::Tensor& qkv, int64_t heads, int64_t kv_heads, const torch::Tensor& q_norm,
                const torch::Tensor& k_norm, double eps) {
  const int64_t t = qkv.size(0), d = q_norm.size(0);
  auto q = qkv.narrow(1, 0, heads * d), k = qkv.narrow(1, heads * d, kv_heads * d);
  q.copy_(rms_norm(q.reshape({t * heads, d}), q_norm, eps).view({t, heads * d}));
  k.copy_(rms_norm(k.reshape({t * kv_heads, d}), k_norm, eps).view({t, kv_heads * d}));
}

// The half of a layer every compiled layer shares (qwen2.py's input norm and Attention): the
// norm, q/k/v (a bias, per-head norms where the model has them), RoPE and this step's K/V
// into the cache, attention over the cache (scores times `scale`), the output projection.
struct AttentionHalf {
  torch::Tensor input_norm;
  double eps;
  int64_t heads, kv_heads;
  double scale;
  Linear qkv, o;
  std::optional<torch::Tensor> q_norm, k_norm;  // Qwen3's and Gemma's per-head norms
  Isa isa;

  // x [T, hidden] float32; cos, sin [T, 1, D/2]; the caches and the attention metadata as
  // paged_attention_rows takes them (row_start: a windowed layer's). Returns [T, hidden].
  torch::Tensor operator()(const torch::Tensor& x, torch::Tensor k_cache, torch::Tensor v_cache,
                           const torch::Tensor& cos, const torch::Tensor& sin,
                           const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots,
                           const torch::Tensor& row_seq, const torch::Tensor& row_len,
                           const std::optional<torch::Tensor>& row_start) const {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
                "x must be a contiguous float32 [T, hidden] tensor");
    auto h = qkv(rms_norm(x, input_norm, eps), isa);
    if (q_norm) norm_heads(h, heads, kv_heads, *q_norm, *k_norm, eps);
    const auto q = rope_qkv_to_cache(h, cos, sin, k_cache, v_cache, slot_mapping, heads);
    const auto attn = paged_attention_rows(q, k_cache, v_cache, kv_slots, row_seq, row_len, scale,
                                           isa, row_start);
    return o(attn.flatten(1), isa);
  }
};

AttentionHalf attention_half(torch::Tensor input_norm, double eps, int64_t heads,
                             int64_t kv_heads, double scale, std::vector<Segment> qkv,
                             std::optional<torch::Tensor> qkv_bias, int64_t qkv_out,
                             std::vector<Segment> o, int64_t hidden,
                             std::optional<torch::Tensor> q_norm,
                             std::optional<torch::Tensor> k_norm, Isa isa) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k head norms go together");
  return AttentionHalf{std::move(input_norm), eps, heads, kv_heads, scale,
                       linear_of(std::move(qkv), qkv_out, std::move(qkv_bias)),
                       linear_of(std::move(o), hidden, std::nullopt), std::move(q_norm),
                       std::move(k_norm), isa};
}

// A llama-shaped layer (qwen2.py's DecoderLayer): attention, the residual add and the norm
// after it, the SiLU-gated MLP; each sub-layer's output times Granite's residual multiplier.
class FusedLayer {
 public:
  FusedLayer(torch::Tensor input_norm, torch::Tensor post_norm, double eps, int64_t heads,
             std::vector<Segment> qkv, std::optional<torch::Tensor> qkv_bias, int64_t qkv_out,
             std::vector<Segment> o, std::vector<Segment> gate_up, int64_t gate_up_out,
             std::vector<Segment> down, int64_t hidden, std::optional<torch::Tensor> q_norm,
             std::optional<torch::Tensor> k_norm, int64_t kv_heads, double scale,
             double residual_scale, Isa isa)
      : attn_(attention_half(std::move(input_norm), eps, heads, kv_heads, scale, std::move(qkv),
                             std::move(qkv_bias), qkv_out, std::move(o), hidden,
                             std::move(q_norm), std::move(k_norm), isa)),
        post_norm_(std::move(post_norm)), residual_scale_(residual_scale),
        gate_up_(linear_of(std::move(gate_up), gate_up_out, std::nullopt)),
        down_(linear_of(std::move(down), hidden, std::nullopt)) {}

  // x [T, hidden] (the residual stream, updated in place by the attention's add) and the
  // rest as AttentionHalf takes them. Returns the layer's output [T, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache,
                        const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots,
                        const torch::Tensor& row_seq, const torch::Tensor& row_len,
                        const std::optional<torch::Tensor>& row_start) const {
    const auto a = attn_(x, k_cache, v_cache, cos, sin, slot_mapping, kv_slots, row_seq,
                         row_len, row_start);
    const auto h = add_rms_norm_(x, scaled(a), post_norm_, attn_.eps);
    const Isa& isa = attn_.isa;
    return scaled(down_(silu_mul(gate_up_(h, isa), isa), isa)).add_(x);
  }

 private:
  // a sub-layer's output times Granite's residual multiplier (1: as it is)
  torch::Tensor scaled(torch::Tensor delta) const {
    return residual_scale_ == 1.0 ? delta : delta.mul_(residual_scale_);
  }

  AttentionHalf attn_;
  torch::Tensor post_norm_;
  double residual_scale_;
  Linear gate_up_, down_;
};

// Gemma 3's layer (gemma3.py's Gemma3DecoderLayer on the compiled path, the same operations
// in the same order): the attention half with per-head norms, then norms after attention and
// around the GELU-gated MLP. The caller passes a windowed layer the windowed metadata.
class GemmaLayer {
 public:
  GemmaLayer(std::vector<torch::Tensor> norms, double eps, int64_t heads, int64_t kv_heads,
             double scale, std::vector<Segment> qkv, int64_t qkv_out, std::vector<Segment> o,
             std::vector<Segment> gate_up, int64_t gate_up_out, std::vector<Segment> down,
             int64_t hidden, Isa isa)
      : attn_(attention_half(norms.at(0), eps, heads, kv_heads, scale, std::move(qkv),
                             std::nullopt, qkv_out, std::move(o), hidden, norms.at(4),
                             norms.at(5), isa)),
        gate_up_(linear_of(std::move(gate_up), gate_up_out, std::nullopt)),
        down_(linear_of(std::move(down), hidden, std::nullopt)) {
    // input, post-attention, pre-feedforward, post-feedforward, q heads, k heads
    TORCH_CHECK(norms.size() == 6, "a Gemma layer has six norms");
    post_attn_norm_ = norms[1], pre_ffw_norm_ = norms[2], post_ffw_norm_ = norms[3];
  }

  torch::Tensor forward(torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache,
                        const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots,
                        const torch::Tensor& row_seq, const torch::Tensor& row_len,
                        const std::optional<torch::Tensor>& row_start) const {
    const double eps = attn_.eps;
    const Isa& isa = attn_.isa;
    const auto a = attn_(x, k_cache, v_cache, cos, sin, slot_mapping, kv_slots, row_seq,
                         row_len, row_start);
    const auto h = add_rms_norm_(x, rms_norm(a, post_attn_norm_, eps), pre_ffw_norm_, eps);
    return x.add_(rms_norm(down_(gelu_mul(gate_up_(h, isa), isa), isa), post_ffw_norm_, eps));
  }

 private:
  AttentionHalf attn_;
  torch::Tensor post_attn_norm_, pre_ffw_norm_, post_ffw_norm_;
  Linear gate_up_, down_;
};

}  // namespace

void register_layer(pybind11::module& m) {
  pybind11::class_<GemmaLayer>(m, "GemmaLayer")
      .def(pybind11::init<std::vector<torch::Tensor>, double, int64_t, int64_t, double,
                          std::vector<Segment>, int64_t, std::vector<Segment>,
                          std::vector<Segment>, int64_t, std::vector<Segment>, int64_t, Isa>())
      .def("forward", &GemmaLayer::forward);
  pybind11::class_<FusedLayer>(m, "FusedLayer")
      .def(pybind11::init<torch::Tensor, torch::Tensor, double, int64_t, std::vector<Segment>,
                          std::optional<torch::Tensor>, int64_t, std::vector<Segment>,
                          std::vector<Segment>, int64_t, std::vector<Segment>, int64_t,
                          std::optional<torch::Tensor>, std::optional<torch::Tensor>, int64_t,
                          double, double, Isa>())
      .def("forward", &FusedLayer::forward);
}

}  // namespace braid_kernels
