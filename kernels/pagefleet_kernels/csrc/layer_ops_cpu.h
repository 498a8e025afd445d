// What the layer-ops extension's two files share: the parallel grain, the row check and the
// dtype dispatch of their ops, and the quantized matmuls (quant_matmul_cpu.cpp) that the
// fused decoder layer and the bindings (layer_ops_cpu.cpp) call.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace pagefleet {

// Rows per parallel chunk: enough elements (~16K) that forking threads pays off; a decode
// step's few rows run on the calling thread.
inline int64_t grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1));
}

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

#define PAGEFLEET_DISPATCH(dtype, ...)                                            \
  switch (dtype) {                                                                \
    case torch::kFloat32: { using T = float; __VA_ARGS__; break; }               \
    case torch::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; }       \
    case torch::kFloat16: { using T = c10::Half; __VA_ARGS__; break; }            \
    default: TORCH_CHECK(false, "dtype ", dtype, " is not float32, bfloat16 or float16"); \
  }

// -- quant_matmul_cpu.cpp -------------------------------------------------------------------
torch::Tensor dequantize_int4(std::vector<torch::Tensor> nibbles,
                              std::vector<torch::Tensor> scales_and_zeros, int64_t group);
torch::Tensor int4_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& nibbles,
                          const std::vector<torch::Tensor>& scales_and_shifts, int64_t group,
                          bool int8_activations, int64_t gemm_rows);
torch::Tensor quantize_activations_int8(torch::Tensor x);
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales, int64_t group, bool int8_activations,
                          int64_t gemm_rows);
torch::Tensor dequantize_blocks(const torch::Tensor& blocks, int64_t type,
                                c10::ScalarType dtype);
torch::Tensor blocks_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                            const std::vector<int64_t>& types, bool int8_activations,
                            int64_t gemm_rows);

}  // namespace pagefleet
