// The torch-level ops the source files share (layer.cpp runs a decoder layer with them).
#pragma once

#include <torch/extension.h>

#include <optional>

#include "isa.h"

namespace braid_kernels {

// quant.cpp: int8-quantized activations for weights of GGML `type`, and products with them.
torch::Tensor quantize_activations(const torch::Tensor& x_in, int64_t type, const Isa& isa);
void qgemm_into(const torch::Tensor& xq, const torch::Tensor& w, int64_t type, int64_t k,
                torch::Tensor& out, int64_t col0, const Isa& isa);

// KV caches hold float32, float16 or bfloat16 (--kv-cache-dtype).
inline bool is_kv_type(c10::ScalarType type) {
  return type == torch::kFloat32 || type == torch::kHalf || type == torch::kBFloat16;
}

// fn(value) with a value of the C++ type a KV cache of `type` holds (one of is_kv_type's).
template <typename Fn>
void dispatch_kv_type(c10::ScalarType type, Fn&& fn) {
  if (type == torch::kHalf) fn(at::Half());
  else if (type == torch::kBFloat16) fn(at::BFloat16());
  else fn(float());
}

// norm.cpp
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps);
torch::Tensor add_rms_norm_(torch::Tensor& residual, const torch::Tensor& x_in,
                            const torch::Tensor& w_in, double eps);
torch::Tensor rope_qkv_to_cache(const torch::Tensor& qkv_in, const torch::Tensor& cos_in,
                                const torch::Tensor& sin_in, torch::Tensor& k_cache,
                                torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                int64_t heads);
torch::Tensor silu_mul(const torch::Tensor& gate_up_in, const Isa& isa);
torch::Tensor gelu_mul(const torch::Tensor& gate_up_in, const Isa& isa);

// attention.cpp
torch::Tensor paged_attention_rows(const torch::Tensor& q_in, const torch::Tensor& k_cache,
                                   const torch::Tensor& v_cache, const torch::Tensor& kv_slots_in,
                                   const torch::Tensor& row_seq_in, const torch::Tensor& row_len_in,
                                   double scale, const Isa& isa,
                                   const std::optional<torch::Tensor>& row_start_in = std::nullopt);

}  // namespace braid_kernels
