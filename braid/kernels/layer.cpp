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

class FusedLayer {
 public:
  FusedLayer(torch::Tensor input_norm, torch::Tensor post_norm, double eps, int64_t heads,
             std::vector<Segment> qkv, std::optional<torch::Tensor> qkv_bias, int64_t qkv_out,
             std::vector<Segment> o, std::vector<Segment> gate_up, int64_t gate_up_out,
             std::vector<Segment> down, int64_t hidden, std::optional<torch::Tensor> q_norm,
             std::optional<torch::Tensor> k_norm, int64_t kv_heads, double scale,
             double residual_scale, Isa isa)
      : input_norm_(std::move(input_norm)), post_norm_(std::move(post_norm)), eps_(eps),
        heads_(heads), kv_heads_(kv_heads), scale_(scale), residual_scale_(residual_scale),
        qkv_(linear_of(std::move(qkv), qkv_out, std::move(qkv_bias))),
        o_(linear_of(std::move(o), hidden, std::nullopt)),
        gate_up_(linear_of(std::move(gate_up), gate_up_out, std::nullopt)),
        down_(linear_of(std::move(down), hidden, std::nullopt)),
        q_norm_(std::move(q_norm)), k_norm_(std::move(k_norm)), isa_(isa) {
    TORCH_CHECK(q_norm_.has_value() == k_norm_.has_value(), "q and k head norms go together");
  }

  // x [T, hidden] float32 (the residual stream, updated in place by the attention's add);
  // cos, sin [T, 1, D/2]; the caches and the attention metadata as paged_attention_rows
  // takes them (row_start: a windowed layer's). Returns the layer's output [T, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache,
                        const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots,
                        const torch::Tensor& row_seq, const torch::Tensor& row_len,
                        const std::optional<torch::Tensor>& row_start) const {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
                "x must be a contiguous float32 [T, hidden] tensor");
    auto qkv = qkv_(rms_norm(x, input_norm_, eps_), isa_);
    if (q_norm_) norm_heads(qkv, heads_, kv_heads_, *q_norm_, *k_norm_, eps_);
    const auto q = rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads_);
    const auto attn =
        paged_attention_rows(q, k_cache, v_cache, kv_slots, row_seq, row_len, scale_, isa_,
                             row_start);
    const auto h = add_rms_norm_(x, scaled(o_(attn.flatten(1), isa_)), post_norm_, eps_);
    return scaled(down_(silu_mul(gate_up_(h, isa_), isa_), isa_)).add_(x);
  }

 private:
  // a sub-layer's output times Granite's residual multiplier (1: as it is)
  torch::Tensor scaled(torch::Tensor delta) const {
    return residual_scale_ == 1.0 ? delta : delta.mul_(residual_scale_);
  }

  torch::Tensor input_norm_, post_norm_;
  double eps_;
  int64_t heads_, kv_heads_;
  double scale_, residual_scale_;  // scores' scale; Granite's residual multiplier
  Linear qkv_, o_, gate_up_, down_;
  std::optional<torch::Tensor> q_norm_, k_norm_;  // Qwen3's per-head norms
  Isa isa_;  // the instruction sets its ops use
};

// Gemma 3's layer (gemma3.py's Gemma3DecoderLayer on the compiled path, the same operations
// in the same order): q and k heads normalised before RoPE, scores scaled by `scale`, norms
// after attention and around the GELU-gated MLP. The caller passes a windowed layer the
// windowed attention metadata.
class GemmaLayer {
 public:
  GemmaLayer(std::vector<torch::Tensor> norms, double eps, int64_t heads, int64_t kv_heads,
             double scale, std::vector<Segment> qkv, int64_t qkv_out, std::vector<Segment> o,
             std::vector<Segment> gate_up, int64_t gate_up_out, std::vector<Segment> down,
             int64_t hidden, Isa isa)
      : eps_(eps), heads_(heads), kv_heads_(kv_heads), scale_(scale),
        qkv_(linear_of(std::move(qkv), qkv_out, std::nullopt)),
        o_(linear_of(std::move(o), hidden, std::nullopt)),
        gate_up_(linear_of(std::move(gate_up), gate_up_out, std::nullopt)),
        down_(linear_of(std::move(down), hidden, std::nullopt)),
        isa_(isa) {
    // input, post-attention, pre-feedforward, post-feedforward, q heads, k heads
    TORCH_CHECK(norms.size() == 6, "a Gemma layer has six norms");
    input_norm_ = norms[0], post_attn_norm_ = norms[1], pre_ffw_norm_ = norms[2];
    post_ffw_norm_ = norms[3], q_norm_ = norms[4], k_norm_ = norms[5];
  }

  torch::Tensor forward(torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache,
                        const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots,
                        const torch::Tensor& row_seq, const torch::Tensor& row_len,
                        const std::optional<torch::Tensor>& row_start) const {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
                "x must be a contiguous float32 [T, hidden] tensor");
    auto qkv = qkv_(rms_norm(x, input_norm_, eps_), isa_);
    norm_heads(qkv, heads_, kv_heads_, q_norm_, k_norm_, eps_);
    const auto rotated = rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads_);
    const auto attn = paged_attention_rows(rotated, k_cache, v_cache, kv_slots, row_seq, row_len,
                                           scale_, isa_, row_start);
    const auto h = add_rms_norm_(x, rms_norm(o_(attn.flatten(1), isa_), post_attn_norm_, eps_),
                                 pre_ffw_norm_, eps_);
    return x.add_(rms_norm(down_(gelu_mul(gate_up_(h, isa_), isa_), isa_), post_ffw_norm_,
                           eps_));
  }

 private:
  torch::Tensor input_norm_, post_attn_norm_, pre_ffw_norm_, post_ffw_norm_, q_norm_, k_norm_;
  double eps_;
  int64_t heads_, kv_heads_;
  double scale_;
  Linear qkv_, o_, gate_up_, down_;
  Isa isa_;
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
