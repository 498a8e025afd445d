// The elementwise work of a decoder layer around its matmuls, one pass each: RMSNorm (with
// the residual add before it), rotary embedding of q and k together, the gated MLP's
// activation times its up projection, and a decoder layer's work around its attention in two
// calls (DecoderLayer, over the quantized matmuls of quant_matmul_cpu.cpp); the float32
// few-row matmul and the batched LoRA operator. Eager PyTorch runs these as 4-8 ops each (the norm
// alone: cast, square, mean, add, rsqrt, multiply, cast, multiply, plus their dispatch),
// which at decode batch 1 costs more than the arithmetic.
//
// Each op computes in float32 and rounds to the tensor's dtype exactly where the eager ops
// of pagefleet_kernels.layer_ops round, so the results are torch's bits (the norm's sum of
// squares aside, whose order of addition differs). For that the file is built without
// -ffast-math and with -ffp-contract=off: a fused multiply-add would round differently.
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"
#include "layer_ops_cpu.h"

#include <cmath>
#include <vector>

namespace {

using pagefleet::check_rows;
using pagefleet::Elem;
using pagefleet::grain;
using pagefleet::round_to;

// out = weight * rms_norm(float(s)).to(T), or rms_norm(float(s)) * (1 + float(weight)) with
// unit_offset (Gemma), where s is x, or round_T(x + h) stored to `sum` when h is given.
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* h, int64_t h_stride, T* sum,
                   const T* weight, T* out, int64_t rows, int64_t n, float eps,
                   bool unit_offset) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> s(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      if (h) {
        const T* hr = h + r * h_stride;
        T* sr = sum + r * n;
        for (int64_t i = 0; i < n; ++i) {
          sr[i] = Elem<T>::store(Elem<T>::load(xr[i]) + Elem<T>::load(hr[i]));
          s[i] = Elem<T>::load(sr[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) s[i] = Elem<T>::load(xr[i]);
      }
      float squares = 0.f;
      for (int64_t i = 0; i < n; ++i) squares += s[i] * s[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
      T* o = out + r * n;
      if (unit_offset) {
        for (int64_t i = 0; i < n; ++i)
          o[i] = Elem<T>::store((s[i] * inv) * (1.f + Elem<T>::load(weight[i])));
      } else {
        for (int64_t i = 0; i < n; ++i)
          o[i] = Elem<T>::store(Elem<T>::load(weight[i]) * round_to<T>(s[i] * inv));
      }
    }
  });
}

// out (T, H, D) = x * cos + roll(x, D/2) * sin, each product and the sum rounded to T;
// x is (T, H, D) with any token and head strides, cos/sin (T, D) contiguous (sin's first
// half negated, as pagefleet_kernels.layer_ops.rope takes it).
template <typename T>
void rope_rows(const T* x, int64_t token_stride, int64_t head_stride, const T* cos,
               const T* sin, T* out, int64_t tokens, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t hd = 0; hd < heads; ++hd) {
        const T* xr = x + t * token_stride + hd * head_stride;
        T* o = out + (t * heads + hd) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rotated = Elem<T>::load(xr[d < half ? d + half : d - half]);
          const float a = round_to<T>(Elem<T>::load(xr[d]) * Elem<T>::load(c[d]));
          const float b = round_to<T>(rotated * Elem<T>::load(s[d]));
          o[d] = Elem<T>::store(a + b);
        }
      }
    }
  });
}

// silu(g) = g / (1 + exp(-g)) and gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))),
// torch's formulas, with exp of a non-positive argument only (no overflow, vectorizes).
inline float silu(float g) {
  const float e = pagefleet::exp_nonpositive(-std::fabs(g));  // exp(-|g|)
  return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

inline float gelu_tanh(float g) {
  const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const float e = pagefleet::exp_nonpositive(-2.f * std::fabs(y));  // exp(-2|y|)
  // 1 + tanh(y) = 2 / (1 + exp(-2y)): for y < 0 that is 2e / (1 + e), without the
  // cancellation of 1 + tanh(y) near -1.
  return 0.5f * g * (y >= 0.f ? 2.f / (1.f + e) : 2.f * e / (1.f + e));
}

// out (T, I) = act(gate) * up for gate_up (T, 2I) = [gate | up]: the activation rounded to T,
// then the product.
template <typename T, bool GELU>
void act_and_mul_rows(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * stride;
      const T* u = g + I;
      T* o = out + r * I;
      for (int64_t i = 0; i < I; ++i) {
        const float gf = Elem<T>::load(g[i]);
        const float a = round_to<T>(GELU ? gelu_tanh(gf) : silu(gf));
        o[i] = Elem<T>::store(a * Elem<T>::load(u[i]));
      }
    }
  });
}


// y (M, N) = x (M, K) W^T for a float32 W (N, K) and a few rows of x (a decode step's):
// bound by reading W, which oneDNN's prepacked matmul read at 10-12 GB/s at one row (half
// what this machine streams). Outputs in tiles of TILE weight rows; within a tile, blocks of
// up to 4 rows of x meet NC weight rows at a time, 8 inputs per step into R * NC
// accumulators. A tile (TILE * K floats) stays in L2 for the tile's next row block.
#if defined(__AVX2__) && defined(__FMA__)
template <int64_t R, int64_t NC>
void linear_block(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t n) {
  __m256 acc[R][NC];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* wn = w + n * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int64_t r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int64_t c = 0; c < NC; ++c) {
      const __m256 wv = _mm256_loadu_ps(wn + c * K + k);
      for (int64_t r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
      // The next block's weight rows, a cache line per 16 inputs: more reads in flight than
      // NC streams give (a prefetch past W's end is harmless).
      if ((k & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(wn + (NC + c) * K + k), _MM_HINT_T0);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < NC; ++c) {
      float sum = pagefleet::sum_lanes(acc[r][c]);
      for (int64_t j = k; j < K; ++j) sum += x[r * K + j] * wn[c * K + j];
      y[r * N + n + c] = sum;
    }
  }
}

template <int64_t R, int64_t NC>
void linear_tile(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t n0,
                 int64_t n1) {
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) linear_block<R, NC>(x, w, y, N, K, n);
  for (; n < n1; ++n) linear_block<R, 1>(x, w, y, N, K, n);
}
#endif

void linear_rows(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t TILE = 32;
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE, n1 = std::min(N, n0 + TILE);
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = x + m * K;
        float* ym = y + m * N;
#if defined(__AVX2__) && defined(__FMA__)
        switch (std::min<int64_t>(4, M - m)) {
          case 1: linear_tile<1, 8>(xm, w, ym, N, K, n0, n1); break;
          case 2: linear_tile<2, 4>(xm, w, ym, N, K, n0, n1); break;
          case 3: linear_tile<3, 3>(xm, w, ym, N, K, n0, n1); break;
          default: linear_tile<4, 2>(xm, w, ym, N, K, n0, n1); break;
        }
#else
        for (int64_t r = 0; r < std::min<int64_t>(4, M - m); ++r) {
          for (int64_t n = n0; n < n1; ++n) {
            float sum = 0.f;
            for (int64_t k = 0; k < K; ++k) sum += xm[r * K + k] * w[n * K + k];
            ym[r * N + n] = sum;
          }
        }
#endif
      }
    }
  });
}

// The dot product of n floats, in two vector accumulators (the LoRA operator's rows: a few
// hundred inputs for the shrink, the rank of one part for the expand).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t k = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
  }
  for (; k + 8 <= n; k += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
  sum = pagefleet::sum_lanes(_mm256_add_ps(acc0, acc1));
#endif
  for (; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// The lane sums of v[0..7], as one vector (lane j: the sum of v[j]'s lanes).
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

// y (T, N) += lora_b[s] (lora_a[s] x[t]) for each row t of each slot s in `slot_rows`.
// The shrink reads each rank row of a slot's A once for all of the slot's rows. The expand
// takes the outputs in tiles of up to 8 within one part (`tiles`: first output, end, the
// part's first rank): each of the tile's B rows (`width` ranks from the part's first) meets
// each of the slot's rows, and the tile's 8 sums are reduced together, not one at a time.
struct LoRATile {
  int64_t n0, n1, first;
};

void add_lora_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride,
                   const float* a, const float* b, const std::vector<std::vector<int64_t>>& slot_rows,
                   const std::vector<int64_t>& slots, const std::vector<LoRATile>& tiles,
                   int64_t width, int64_t T, int64_t N, int64_t K, int64_t R) {
  std::vector<float> shrunk(T * R);
  const int64_t S = static_cast<int64_t>(slots.size());
  at::parallel_for(0, S * R, grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = slots[i / R], r = i % R;
      const float* ar = a + (s * R + r) * K;
      for (int64_t t : slot_rows[s]) shrunk[t * R + r] = dot(ar, x + t * x_stride, K);
    }
  });
  const int64_t tiles_n = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, tiles_n, grain(8 * width * S), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const LoRATile tile = tiles[i];
      for (int64_t s : slots) {
        const float* bs = b + s * N * R + tile.first;
        for (int64_t t : slot_rows[s]) {
          const float* sh = &shrunk[t * R + tile.first];
          float* yt = y + t * y_stride;
#if defined(__AVX2__) && defined(__FMA__)
          if (tile.n1 - tile.n0 == 8 && width % 8 == 0) {
            __m256 acc[8];
            for (int64_t j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < width; k += 8) {
              const __m256 shv = _mm256_loadu_ps(sh + k);
              for (int64_t j = 0; j < 8; ++j)
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(bs + (tile.n0 + j) * R + k), shv, acc[j]);
            }
            _mm256_storeu_ps(yt + tile.n0, _mm256_add_ps(_mm256_loadu_ps(yt + tile.n0), sum_lanes8(acc)));
            continue;
          }
#endif
          for (int64_t n = tile.n0; n < tile.n1; ++n) yt[n] += dot(bs + n * R, sh, width);
        }
      }
    }
  });
}


}  // namespace

// (x (rows, n), weight (n,)) -> the normed rows.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       bool unit_offset) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous, of x's dtype and row size");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  PAGEFLEET_DISPATCH(x.scalar_type(),
                     rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), nullptr, 0, nullptr,
                                      weight.data_ptr<T>(), out.data_ptr<T>(), x.size(0),
                                      x.size(1), static_cast<float>(eps), unit_offset));
  return out;
}

// (x, h (rows, n), weight) -> (x + h, the normed rows of x + h).
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& h,
                                        const torch::Tensor& weight, double eps,
                                        bool unit_offset) {
  check_rows(x, "x");
  check_rows(h, "h");
  TORCH_CHECK(x.sizes() == h.sizes() && x.scalar_type() == h.scalar_type(),
              "x and h must have the same shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous, of x's dtype and row size");
  auto sum = torch::empty({x.size(0), x.size(1)}, x.options());
  auto out = torch::empty_like(sum);
  PAGEFLEET_DISPATCH(x.scalar_type(),
                     rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), h.data_ptr<T>(), h.stride(0),
                                      sum.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(),
                                      x.size(0), x.size(1), static_cast<float>(eps),
                                      unit_offset));
  return {sum, out};
}

// (x (T, H, D), cos, sin (T, D)) -> rotated (T, H, D), contiguous.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be (T, H, D) with contiguous, even-sized heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "cos and sin must be contiguous (T, D)");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must have x's dtype");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  PAGEFLEET_DISPATCH(x.scalar_type(),
                     rope_rows<T>(x.data_ptr<T>(), x.stride(0), x.stride(1), cos.data_ptr<T>(),
                                  sin.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1),
                                  x.size(2)));
  return out;
}

// (gate_up (T, 2I)) -> act(gate) * up (T, I); act is silu, or gelu (tanh) when `gelu`.
torch::Tensor act_and_mul(const torch::Tensor& gate_up, bool gelu) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even row size");
  const int64_t I = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), I}, gate_up.options());
  PAGEFLEET_DISPATCH(gate_up.scalar_type(),
                     if (gelu) act_and_mul_rows<T, true>(gate_up.data_ptr<T>(), gate_up.stride(0),
                                                         out.data_ptr<T>(), gate_up.size(0), I);
                     else act_and_mul_rows<T, false>(gate_up.data_ptr<T>(), gate_up.stride(0),
                                                     out.data_ptr<T>(), gate_up.size(0), I));
  return out;
}


// A linear layer kept quantized, as QuantizedLinear binds it for the matmuls of
// quant_matmul_cpu.cpp: 4-bit parts, Q8_0's codes with their scales (`codes` defined), or GGUF
// blocks of one or more types (`blocks`); a bias added after, as QuantizedLinear adds it.
struct QuantizedLinear {
  std::vector<torch::Tensor> nibbles, scales_and_shifts;
  torch::Tensor codes, scales;
  std::vector<torch::Tensor> blocks;
  std::vector<int64_t> types;
  c10::optional<torch::Tensor> bias;
  int64_t group;
  bool int8_activations;

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y =
        !blocks.empty() ? pagefleet::blocks_matmul(x, blocks, types, int8_activations, 0)
        : codes.defined()
            ? pagefleet::int8_matmul(x, codes, scales, group, int8_activations, 0)
            : pagefleet::int4_matmul(x, nibbles, scales_and_shifts, group, int8_activations, 0);
    return bias ? y + *bias : y;
  }
};

// A decoder layer's work before and after its attention for a few rows whose matmuls are all
// the quantized ones above: the ops LlamaDecoderLayer calls one by one from Python, in the
// same order on the same tensors (so the same bits), in two calls instead of about twelve.
// At decode batch 1 on a 2-core machine each call from Python costs 5-10 us, and a step
// made ~400 of them.
struct DecoderLayer {
  torch::Tensor input_norm, post_attention_norm;
  double eps;
  bool unit_offset;
  QuantizedLinear qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;
  bool gelu;

  // x (T, hidden), cos and sin (T, head_dim) -> q (T, heads, D), k and v (T, kv_heads, D).
  std::vector<torch::Tensor> attention_inputs(const torch::Tensor& x, const torch::Tensor& cos,
                                              const torch::Tensor& sin) const {
    const torch::Tensor projected = qkv(rms_norm(x, input_norm, eps, unit_offset));
    const int64_t qk_size = (heads + kv_heads) * head_dim;
    const torch::Tensor rotated =
        rope(projected.narrow(1, 0, qk_size).view({-1, heads + kv_heads, head_dim}), cos, sin);
    return {rotated.narrow(1, 0, heads), rotated.narrow(1, heads, kv_heads),
            projected.narrow(1, qk_size, kv_heads * head_dim).view({-1, kv_heads, head_dim})};
  }

  // x (T, hidden), the attention's output (T, heads * D) -> the layer's output (T, hidden).
  torch::Tensor attention_outputs(const torch::Tensor& x, const torch::Tensor& attended) const {
    const auto sum_and_normed = add_rms_norm(x, o(attended), post_attention_norm, eps, unit_offset);
    return sum_and_normed[0] + down(act_and_mul(gate_up(sum_and_normed[1]), gelu));
  }
};

// (x (M, K), weight (N, K)), both float32 -> x weight^T (M, N).
torch::Tensor linear(torch::Tensor x, torch::Tensor weight) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "linear takes float32 x and weight");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be contiguous (N, K) with K = x's columns");
  const auto xc = x.contiguous();
  auto out = torch::empty({x.size(0), weight.size(0)}, x.options());
  linear_rows(xc.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
              weight.size(0), x.size(1));
  return out;
}

// The batched LoRA operator, float32 (lora_ops.add_lora): y (T, N) += lora_b[s] lora_a[s]
// x[t] in place for each row t whose slot s = token_slots[t] is not -1; lora_a (S, R, K),
// lora_b (S, N, R), contiguous. `parts`: the output sizes of a fused linear's parts (empty:
// one), over which lora_b is block-diagonal (part p's outputs read ranks [p R / P,
// (p + 1) R / P) of the P parts, the rest are zeros), so that the zeros are not read.
void add_lora(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& lora_a,
              const torch::Tensor& lora_b, const torch::Tensor& token_slots,
              const std::vector<int64_t>& parts) {
  check_rows(y, "y");
  check_rows(x, "x");
  for (const torch::Tensor& t : {y, x, lora_a, lora_b})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, "add_lora takes float32 tensors");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_a and lora_b must be contiguous (S, R, K) and (S, N, R)");
  const int64_t T = y.size(0), N = y.size(1), K = x.size(1);
  const int64_t S = lora_a.size(0), R = lora_a.size(1);
  TORCH_CHECK(x.size(0) == T && lora_a.size(2) == K && lora_b.size(0) == S && lora_b.size(1) == N &&
                  lora_b.size(2) == R,
              "add_lora: x, lora_a and lora_b do not fit y");
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == T && token_slots.scalar_type() == torch::kInt64 &&
                  token_slots.is_contiguous(),
              "add_lora: token_slots must be contiguous (T,) int64");
  const int64_t P = parts.empty() ? 1 : static_cast<int64_t>(parts.size());
  TORCH_CHECK(R % P == 0, "add_lora: the rank ", R, " is not a multiple of the ", P, " parts");
  const std::vector<int64_t> sizes = parts.empty() ? std::vector<int64_t>{N} : parts;
  std::vector<LoRATile> tiles;
  int64_t n = 0;
  for (int64_t p = 0; p < static_cast<int64_t>(sizes.size()); ++p) {
    TORCH_CHECK(sizes[p] >= 0 && n + sizes[p] <= N, "add_lora: the parts do not add up to ", N);
    for (int64_t n0 = n; n0 < n + sizes[p]; n0 += 8)
      tiles.push_back({n0, std::min(n0 + 8, n + sizes[p]), p * (R / P)});
    n += sizes[p];
  }
  TORCH_CHECK(n == N, "add_lora: the parts do not add up to ", N);
  const int64_t* slot_of = token_slots.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> slot_rows(S);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < S, "add_lora: row ", t, " reads slot ", slot_of[t], " of ", S);
    if (slot_of[t] >= 0) slot_rows[slot_of[t]].push_back(t);
  }
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < S; ++s)
    if (!slot_rows[s].empty()) slots.push_back(s);
  if (slots.empty()) return;
  add_lora_rows(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0),
                lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), slot_rows, slots, tiles, R / P,
                T, N, K, R);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "y += each row's LoRA delta, float32 (CPU)");
  m.def("linear", &linear, "x times a float32 weight's transpose, for a few rows (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm of the sum (CPU)");
  m.def("rope", &rope, "rotary embedding of (T, H, D) (CPU)");
  m.def("act_and_mul", &act_and_mul, "SiLU or GELU-tanh of the gate times up (CPU)");
  m.def("dequantize_int4", &pagefleet::dequantize_int4,
        "4-bit weights (one or more parts) to a matrix");
  m.def("int4_matmul", &pagefleet::int4_matmul,
        "x times a 4-bit weight (one or more parts), in float32", py::arg("x"),
        py::arg("nibbles"), py::arg("scales_and_shifts"), py::arg("group"),
        py::arg("int8_activations") = false, py::arg("gemm_rows") = 0);
  m.def("int8_matmul", &pagefleet::int8_matmul,
        "x times an int8 weight with a scale per 32 inputs", py::arg("x"), py::arg("codes"),
        py::arg("scales"), py::arg("group"), py::arg("int8_activations") = false,
        py::arg("gemm_rows") = 0);
  m.def("quantize_activations_int8", &pagefleet::quantize_activations_int8,
        "x rounded to int8 per group of 32 inputs, as code * scale (CPU)");
  m.def("dequantize_blocks", &pagefleet::dequantize_blocks,
        "GGUF blocks to their weights, bit for bit gguf's", py::arg("blocks"), py::arg("type"),
        py::arg("dtype"));
  m.def("blocks_matmul", &pagefleet::blocks_matmul,
        "x times GGUF blocks (one or more parts of any block type), in float32", py::arg("x"),
        py::arg("blocks"), py::arg("types"), py::arg("int8_activations") = false,
        py::arg("gemm_rows") = 0);
  py::class_<QuantizedLinear>(m, "QuantizedLinear")
      .def(py::init([](std::vector<torch::Tensor> nibbles,
                       std::vector<torch::Tensor> scales_and_shifts, c10::optional<torch::Tensor> codes,
                       c10::optional<torch::Tensor> scales, std::vector<torch::Tensor> blocks,
                       std::vector<int64_t> types, c10::optional<torch::Tensor> bias,
                       int64_t group, bool int8_activations) {
             const int kinds = !nibbles.empty() + codes.has_value() + !blocks.empty();
             TORCH_CHECK(codes.has_value() == scales.has_value() && kinds == 1 &&
                             blocks.size() == types.size(),
                         "a QuantizedLinear is 4-bit parts, Q8_0 codes with scales, or GGUF "
                         "blocks with their types");
             return QuantizedLinear{std::move(nibbles), std::move(scales_and_shifts),
                                    codes.value_or(torch::Tensor()),
                                    scales.value_or(torch::Tensor()), std::move(blocks),
                                    std::move(types), std::move(bias), group, int8_activations};
           }),
           py::arg("nibbles"), py::arg("scales_and_shifts"), py::arg("codes"), py::arg("scales"),
           py::arg("blocks"), py::arg("types"), py::arg("bias"), py::arg("group"),
           py::arg("int8_activations"))
      .def("__call__", &QuantizedLinear::operator());
  py::class_<DecoderLayer>(m, "DecoderLayer")
      .def(py::init<torch::Tensor, torch::Tensor, double, bool, QuantizedLinear, QuantizedLinear,
                    QuantizedLinear, QuantizedLinear, int64_t, int64_t, int64_t, bool>(),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"),
           py::arg("unit_offset"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("gelu"))
      .def("attention_inputs", &DecoderLayer::attention_inputs,
           "q, k, v of a few rows: input norm, fused q/k/v projection, rotary embedding")
      .def("attention_outputs", &DecoderLayer::attention_outputs,
           "o projection, residual add and norm, gated MLP, residual add");
  m.def("parallel_threads", &pagefleet::parallel_threads,
        "threads at::parallel_for gives this extension's loops");
}
