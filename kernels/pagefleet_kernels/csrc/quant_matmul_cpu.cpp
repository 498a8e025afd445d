// The quantized matmuls of the CPU layer ops: weights kept as GGUF stores them (4-bit parts
// and Q8_0 codes in the layouts linear_methods.Int4Linear keeps, and every GGUF block type
// as the file holds it: gguf_blocks.h), multiplied by float32 or int8-rounded activations.
// A decode step's few rows are bound by reading the weights: each group of 32 weights is
// decoded into registers once for up to ROWS rows. A wide batch is bound by arithmetic:
// from the caller's `gemm_rows` rows on each tile of weights is dequantized once into L2
// and every row meets it there (tiled_gemm). The caller (the linear layer) chooses that
// crossover once, from a measurement; 0 keeps the few-row kernels at any batch, whose sums
// a row gets the same alone or among others.
//
// Built with -ffp-contract=off (as layer_ops_cpu.cpp): dequantize_blocks gives the bits of
// gguf's two roundings (scale * q, then + offset), which a fused multiply-add would not.
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"
#include "gguf_blocks.h"
#include "layer_ops_cpu.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace pagefleet {
namespace {

// out (N, K) = sum over parts of (code - 8) * scale + zero, one group of `group` inputs per
// scale and zero, in float32, rounded to T once. A part's codes are nibbles (N, K / 2): in
// each group, byte j holds input j in its low nibble and input j + group / 2 in its high one
// (GGUF's own order), so both halves of a group are written as contiguous runs. Its scales
// and zeros are (K / group, N, 2), as PyTorch's int4 matmul takes them.
// HALF: group / 2 known at compile time (16 for GGUF's groups of 32), which lets the
// compiler turn each half-group into one vector operation; 0: read from `group`.
template <typename T, int64_t HALF>
void dequantize_int4_rows(const std::vector<const uint8_t*>& nibbles,
                          const std::vector<const T*>& scales_and_zeros, T* out, int64_t N,
                          int64_t K, int64_t group) {
  const int64_t half = HALF > 0 ? HALF : group / 2;
  at::parallel_for(0, N, grain(K), [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(row.begin(), row.end(), 0.f);
      for (size_t p = 0; p < nibbles.size(); ++p) {
        for (int64_t g = 0; g < K / group; ++g) {
          // restrict: a byte pointer may alias anything, and without it the loop stays
          // scalar (the stores to `low` could change `codes`).
          const uint8_t* __restrict__ codes = nibbles[p] + n * (K / 2) + g * half;
          const T* sz = scales_and_zeros[p] + (g * N + n) * 2;
          const float scale = Elem<T>::load(sz[0]), zero = Elem<T>::load(sz[1]);
          float* __restrict__ low = row.data() + g * group;
          float* __restrict__ high = low + half;
          for (int64_t j = 0; j < half; ++j) {
            low[j] += (static_cast<float>(codes[j] & 0x0F) - 8.f) * scale + zero;
            high[j] += (static_cast<float>(codes[j] >> 4) - 8.f) * scale + zero;
          }
        }
      }
      T* o = out + n * K;
      for (int64_t i = 0; i < K; ++i) o[i] = Elem<T>::store(row[i]);
    }
  });
}

// y (M, N) = x (M, K) W^T for a 4-bit W of one or more parts (the Q8_0 head is two), in
// float32 whatever T is: w = q * scale + shift (shift = zero - 8 * scale), so per group of
// 32 inputs y += sum((q * scale) x) + shift * sum(x). Each output row's (scale, shift)
// pairs lie side by side, (N, K / 32, 2): read in PyTorch's (K / 32, N, 2) order, a row's
// scales were K / 32 strided streams, and a step's 4-bit matmuls at one row took 1.4x
// longer (all of SmolLM2's, int8 activations, one process). For float32 (and float16) activations,
// where torch's int4 kernel takes a scalar path 10-40x slower than its bfloat16 one.
// With AVX2 and FMA each group's 32 weights are unpacked into four vectors once and used
// for up to ROWS rows of x, whose sums stay in registers (two accumulators a row, so
// that the fused multiply-adds do not wait on each other); a plain loop otherwise.
constexpr int64_t INT4_GROUP = 32;
constexpr int64_t ROWS = 4;

struct Int4Part {
  const uint8_t* nibbles;  // (N, K / 2): in each group, byte j = input j low, j + 16 high
  const float* scales_and_shifts;  // (N, K / 32, 2), float32
};

#if defined(__AVX2__) && defined(__FMA__)
template <int64_t R>
void int4_rows_block(const float* x, const float* xsum, const std::vector<Int4Part>& parts,
                     float* out, int64_t N, int64_t K, int64_t n) {
  const int64_t groups = K / INT4_GROUP;
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256 even[R], odd[R];
  float zeros[R];
  for (int64_t r = 0; r < R; ++r) {
    even[r] = odd[r] = _mm256_setzero_ps();
    zeros[r] = 0.f;
  }
  for (const Int4Part& part : parts) {
    const uint8_t* row = part.nibbles + n * (K / 2);
    const float* sz = part.scales_and_shifts + n * groups * 2;
    for (int64_t g = 0; g < groups; ++g, sz += 2) {
      const __m256 scale = _mm256_set1_ps(sz[0]);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
      const __m128i low = _mm_and_si128(bytes, mask);
      const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      auto weights = [&](__m128i codes) {  // 8 codes -> q * scale
        return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
      };
      const __m256 w0 = weights(low), w1 = weights(_mm_srli_si128(low, 8));
      const __m256 w2 = weights(high), w3 = weights(_mm_srli_si128(high, 8));
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + r * K + g * INT4_GROUP;
        even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, even[r]);
        odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, odd[r]);
        even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, even[r]);
        odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, odd[r]);
        zeros[r] += sz[1] * xsum[r * groups + g];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(even[r], odd[r]));
    float sum = zeros[r];
    for (float lane : lanes) sum += lane;
    out[r * N + n] = sum;
  }
}
#endif

void int4_row(const float* x, const float* xsum, const std::vector<Int4Part>& parts,
              float* out, int64_t K, int64_t N, int64_t n) {
  const int64_t groups = K / INT4_GROUP;
  float sum = 0.f;
  for (const Int4Part& part : parts) {
    const uint8_t* row = part.nibbles + n * (K / 2);
    const float* sz = part.scales_and_shifts + n * groups * 2;
    for (int64_t g = 0; g < groups; ++g, sz += 2) {
      const float* xg = x + g * INT4_GROUP;
      float dot = 0.f;
      for (int64_t j = 0; j < INT4_GROUP / 2; ++j) {
        const uint8_t code = row[g * INT4_GROUP / 2 + j];
        dot += static_cast<float>(code & 0x0F) * xg[j];
        dot += static_cast<float>(code >> 4) * xg[INT4_GROUP / 2 + j];
      }
      sum += sz[0] * dot + sz[1] * xsum[g];
    }
  }
  *out = sum;
}

void int4_matmul_rows(const float* x, const std::vector<Int4Part>& parts, float* out,
                      int64_t M, int64_t N, int64_t K) {
  const int64_t groups = K / INT4_GROUP;
  std::vector<float> xsum(M * groups);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t j = 0; j < INT4_GROUP; ++j) sum += x[m * K + g * INT4_GROUP + j];
      xsum[m * groups + g] = sum;
    }
  }
  // Tiles of TILE outputs: each block of ROWS rows of x (L1-sized) meets a tile's weights
  // (a few KB) while they are in cache, instead of every output streaming all of x.
  constexpr int64_t TILE = 64;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / (K * M)), [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += TILE) {
      for (int64_t m = 0; m < M; m += ROWS) {
        const float* xm = x + m * K;
        const float* xs = xsum.data() + m * groups;
        float* o = out + m * N;
        for (int64_t n = tile; n < std::min(tile + TILE, end); ++n) {
#if defined(__AVX2__) && defined(__FMA__)
          switch (std::min(ROWS, M - m)) {
            case 1: int4_rows_block<1>(xm, xs, parts, o, N, K, n); break;
            case 2: int4_rows_block<2>(xm, xs, parts, o, N, K, n); break;
            case 3: int4_rows_block<3>(xm, xs, parts, o, N, K, n); break;
            default: int4_rows_block<4>(xm, xs, parts, o, N, K, n); break;
          }
#else
          for (int64_t r = 0; r < std::min(ROWS, M - m); ++r) {
            int4_row(xm + r * K, xs + r * groups, parts, o + r * N + n, K, N, n);
          }
#endif
        }
      }
    }
  });
}

// Activations rounded to int8, one scale per group of 32 inputs (llama.cpp's Q8 activations):
// d = max |x| / 127, code = nearbyint(x * (1 / d)) (0 where d is 0), x^ = code * d. `sum`
// holds d * (the group's codes summed), for the zero-point term. The same float32
// operations as pagefleet_kernels.layer_ops.quantize_int8_groups, so the same codes.
void quantize_int8_groups(const float* x, int64_t M, int64_t K, int8_t* codes, float* scale,
                          float* sum) {
  const int64_t groups = K / INT4_GROUP;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* __restrict__ xg = x + m * K + g * INT4_GROUP;
      int8_t* __restrict__ cg = codes + m * K + g * INT4_GROUP;
      float amax = 0.f;
      for (int64_t j = 0; j < INT4_GROUP; ++j) amax = std::max(amax, std::fabs(xg[j]));
      const float d = amax / 127.f;
      const float inverse = d != 0.f ? 1.f / d : 0.f;
      int32_t total = 0;
      for (int64_t j = 0; j < INT4_GROUP; ++j) {
        const int32_t c = static_cast<int32_t>(std::nearbyint(xg[j] * inverse));
        cg[j] = static_cast<int8_t>(c);
        total += c;
      }
      scale[m * groups + g] = d;
      sum[m * groups + g] = d * static_cast<float>(total);
    }
  }
}

// y (M, N) = x^ (M, K) W^T with x^ the int8-rounded activations above and W 4-bit
// (w = q * scale + shift, as int4_matmul_rows reads it): per group of 32,
// y += scale * d * sum(q * code) + shift * d * sum(code), the first an integer dot product
// (32 unsigned codes times 32 signed ones: two AVX2 instructions), as llama.cpp computes its
// Q4 x Q8 products. Each group's 32 weight codes are unpacked once for up to ROWS rows.
#if defined(__AVX2__) && defined(__FMA__)
template <int64_t R>
void int4_int8_rows_block(const int8_t* codes, const float* scale, const float* sum,
                          const std::vector<Int4Part>& parts, float* out, int64_t N, int64_t K,
                          int64_t n) {
  const int64_t groups = K / INT4_GROUP;
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  float shifts[R];
  for (int64_t r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    shifts[r] = 0.f;
  }
  for (const Int4Part& part : parts) {
    const uint8_t* row = part.nibbles + n * (K / 2);
    const float* sz = part.scales_and_shifts + n * groups * 2;
    for (int64_t g = 0; g < groups; ++g, sz += 2) {
      const float w_scale = sz[0], w_shift = sz[1];
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
      const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                                         _mm_and_si128(bytes, mask));
      for (int64_t r = 0; r < R; ++r) {
        const __m256i xq = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(codes + r * K + g * INT4_GROUP));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), ones);
        const float d = scale[r * groups + g];
        acc[r][g & 1] = _mm256_fmadd_ps(_mm256_set1_ps(w_scale * d), _mm256_cvtepi32_ps(dot),
                                        acc[r][g & 1]);
        shifts[r] += w_shift * sum[r * groups + g];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    out[r * N + n] = sum_lanes(_mm256_add_ps(acc[r][0], acc[r][1])) + shifts[r];
  }
}
#endif

void int4_int8_row(const int8_t* codes, const float* scale, const float* sum,
                   const std::vector<Int4Part>& parts, float* out, int64_t K, int64_t N,
                   int64_t n) {
  const int64_t groups = K / INT4_GROUP;
  float total = 0.f;
  for (const Int4Part& part : parts) {
    const uint8_t* row = part.nibbles + n * (K / 2);
    const float* sz = part.scales_and_shifts + n * groups * 2;
    for (int64_t g = 0; g < groups; ++g, sz += 2) {
      const int8_t* cg = codes + g * INT4_GROUP;
      int32_t dot = 0;
      for (int64_t j = 0; j < INT4_GROUP / 2; ++j) {
        const uint8_t code = row[g * INT4_GROUP / 2 + j];
        dot += (code & 0x0F) * cg[j] + (code >> 4) * cg[INT4_GROUP / 2 + j];
      }
      total += sz[0] * scale[g] * static_cast<float>(dot) + sz[1] * sum[g];
    }
  }
  *out = total;
}

void int4_int8_matmul_rows(const float* x, const std::vector<Int4Part>& parts, float* out,
                           int64_t M, int64_t N, int64_t K) {
  const int64_t groups = K / INT4_GROUP;
  std::vector<int8_t> codes(M * K);
  std::vector<float> scale(M * groups), sum(M * groups);
  quantize_int8_groups(x, M, K, codes.data(), scale.data(), sum.data());
  constexpr int64_t TILE = 64;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / (K * M)), [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += TILE) {
      for (int64_t m = 0; m < M; m += ROWS) {
        const int8_t* cm = codes.data() + m * K;
        const float* dm = scale.data() + m * groups;
        const float* sm = sum.data() + m * groups;
        float* o = out + m * N;
        for (int64_t n = tile; n < std::min(tile + TILE, end); ++n) {
#if defined(__AVX2__) && defined(__FMA__)
          switch (std::min(ROWS, M - m)) {
            case 1: int4_int8_rows_block<1>(cm, dm, sm, parts, o, N, K, n); break;
            case 2: int4_int8_rows_block<2>(cm, dm, sm, parts, o, N, K, n); break;
            case 3: int4_int8_rows_block<3>(cm, dm, sm, parts, o, N, K, n); break;
            default: int4_int8_rows_block<4>(cm, dm, sm, parts, o, N, K, n); break;
          }
#else
          for (int64_t r = 0; r < std::min(ROWS, M - m); ++r) {
            int4_int8_row(cm + r * K, dm + r * groups, sm + r * groups, parts, o + r * N + n,
                          K, N, n);
          }
#endif
        }
      }
    }
  });
}

// y (M, N) = x (M, K) W^T for W given as int8 codes (N, K) with one scale per group of 32
// inputs (GGUF's Q8_0: w = code * scale), in float32. Float x: each group's codes converted
// once for up to ROWS rows, y += scale * sum(code * x). int8_activations: x rounded as
// above, y += scale * d * sum(code * x code), the integer dot product as llama.cpp's Q8 x Q8
// (maddubs takes one unsigned operand: |code| against x code carrying code's sign).
#if defined(__AVX2__) && defined(__FMA__)
template <int64_t R>
void int8_rows_block(const float* x, const int8_t* w, const float* w_scale, float* out,
                     int64_t N, int64_t K, int64_t n) {
  const int64_t groups = K / INT4_GROUP;
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int8_t* row = w + n * K;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 wf[4];
    for (int64_t i = 0; i < 4; ++i) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + g * 32 + i * 8));
      wf[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    }
    const __m256 scale = _mm256_set1_ps(w_scale[n * groups + g]);
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * K + g * INT4_GROUP;
      __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(xr), wf[0]);
      dot = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), wf[1], dot);
      dot = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), wf[2], dot);
      dot = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), wf[3], dot);
      acc[r][g & 1] = _mm256_fmadd_ps(scale, dot, acc[r][g & 1]);
    }
  }
  for (int64_t r = 0; r < R; ++r) out[r * N + n] = sum_lanes(_mm256_add_ps(acc[r][0], acc[r][1]));
}

template <int64_t R>
void int8_int8_rows_block(const int8_t* codes, const float* scale, const int8_t* w,
                          const float* w_scale, float* out, int64_t N, int64_t K, int64_t n) {
  const int64_t groups = K / INT4_GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int8_t* row = w + n * K;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 32));
    const __m256i magnitude = _mm256_sign_epi8(wq, wq);
    const float ws = w_scale[n * groups + g];
    for (int64_t r = 0; r < R; ++r) {
      const __m256i xq = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(codes + r * K + g * INT4_GROUP));
      const __m256i dot =
          _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, wq)), ones);
      acc[r][g & 1] = _mm256_fmadd_ps(_mm256_set1_ps(ws * scale[r * groups + g]),
                                      _mm256_cvtepi32_ps(dot), acc[r][g & 1]);
    }
  }
  for (int64_t r = 0; r < R; ++r) out[r * N + n] = sum_lanes(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#endif

// One output of one row, without AVX2/FMA: x_codes null for float x.
float int8_dot(const float* x, const int8_t* x_codes, const float* x_scale, const int8_t* w,
               const float* w_scale, int64_t K) {
  float total = 0.f;
  for (int64_t g = 0; g < K / INT4_GROUP; ++g) {
    float dot = 0.f;
    int32_t idot = 0;
    for (int64_t j = g * INT4_GROUP; j < (g + 1) * INT4_GROUP; ++j) {
      if (x_codes) idot += static_cast<int32_t>(w[j]) * x_codes[j];
      else dot += static_cast<float>(w[j]) * x[j];
    }
    total += x_codes ? w_scale[g] * x_scale[g] * static_cast<float>(idot) : w_scale[g] * dot;
  }
  return total;
}

void int8_matmul_rows(const float* x, const int8_t* w, const float* w_scale, float* out,
                      int64_t M, int64_t N, int64_t K, bool int8_activations) {
  const int64_t groups = K / INT4_GROUP;
  std::vector<int8_t> codes(int8_activations ? M * K : 0);
  std::vector<float> scale(int8_activations ? M * groups : 0), sum(scale.size());
  if (int8_activations) quantize_int8_groups(x, M, K, codes.data(), scale.data(), sum.data());
  constexpr int64_t TILE = 64;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / (K * M)), [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += TILE) {
      for (int64_t m = 0; m < M; m += ROWS) {
        const int64_t rows = std::min(ROWS, M - m);
        const float* xm = x + m * K;
        const int8_t* cm = int8_activations ? codes.data() + m * K : nullptr;
        const float* dm = int8_activations ? scale.data() + m * groups : nullptr;
        float* o = out + m * N;
        for (int64_t n = tile; n < std::min(tile + TILE, end); ++n) {
#if defined(__AVX2__) && defined(__FMA__)
          if (int8_activations) {
            switch (rows) {
              case 1: int8_int8_rows_block<1>(cm, dm, w, w_scale, o, N, K, n); break;
              case 2: int8_int8_rows_block<2>(cm, dm, w, w_scale, o, N, K, n); break;
              case 3: int8_int8_rows_block<3>(cm, dm, w, w_scale, o, N, K, n); break;
              default: int8_int8_rows_block<4>(cm, dm, w, w_scale, o, N, K, n); break;
            }
          } else {
            switch (rows) {
              case 1: int8_rows_block<1>(xm, w, w_scale, o, N, K, n); break;
              case 2: int8_rows_block<2>(xm, w, w_scale, o, N, K, n); break;
              case 3: int8_rows_block<3>(xm, w, w_scale, o, N, K, n); break;
              default: int8_rows_block<4>(xm, w, w_scale, o, N, K, n); break;
            }
          }
#else
          for (int64_t r = 0; r < rows; ++r) {
            o[r * N + n] = int8_dot(xm + r * K, cm ? cm + r * K : nullptr,
                                    dm ? dm + r * groups : nullptr, w + n * K,
                                    w_scale + n * groups, K);
          }
#endif
        }
      }
    }
  });
}

// -- the wide batch: a GEMM over weight tiles dequantized once ------------------------------
// The kernels above read each weight once per block of ROWS rows: right for a decode step's
// few rows, where reading the weights is the cost, but a wide batch (a prefill chunk, decode
// at c=64) re-decodes every weight M / ROWS times, and dequantizing the whole matrix for
// a float matmul instead writes and reads it back through memory at 4 bytes a weight (the
// 4-bit layers lost 3.3x to bfloat16 at c=64 that way). From `gemm_rows` rows on, a thread
// dequantizes a tile of TILE_N weight rows by CHUNK_K inputs (128 KiB of float32: it stays
// in L2) once, and every row of x meets it there, in blocks of up to 4 rows by 3 outputs
// whose 12 sums stay in registers over the chunk. The crossover is measured
// (benchmarks/bench_weight_quant.py): below it the few-row kernels win.
constexpr int64_t TILE_N = 32;
constexpr int64_t CHUNK_K = 1024;  // a multiple of every block's weights (32, 256)

// y[r, c] (+)= x[r, :kc] . w[c, :kc] for R rows of x (stride K) and C rows of the tile
// (stride kc), kc a multiple of 8; `first`: the chunk at input 0 (y is written, not added to).
template <int64_t R, int64_t C>
void tile_block(const float* x, int64_t K, const float* w, int64_t kc, float* y, int64_t y_stride,
                bool first) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += 8) {
    __m256 xv[R];
    for (int64_t r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int64_t c = 0; c < C; ++c) {
      const __m256 wv = _mm256_loadu_ps(w + c * kc + k);
      for (int64_t r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const float sum = sum_lanes(acc[r][c]);
      y[r * y_stride + c] = first ? sum : y[r * y_stride + c] + sum;
    }
  }
#else
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      float sum = 0.f;
      for (int64_t k = 0; k < kc; ++k) sum += x[r * K + k] * w[c * kc + k];
      y[r * y_stride + c] = first ? sum : y[r * y_stride + c] + sum;
    }
  }
#endif
}

template <int64_t R>
void tile_rows(const float* x, int64_t K, const float* tile, int64_t kc, float* y,
               int64_t y_stride, int64_t outputs, bool first) {
  int64_t c = 0;
  for (; c + 3 <= outputs; c += 3) tile_block<R, 3>(x, K, tile + c * kc, kc, y + c, y_stride, first);
  for (; c < outputs; ++c) tile_block<R, 1>(x, K, tile + c * kc, kc, y + c, y_stride, first);
}

// y (M, N; row stride y_stride) = x (M, K) W^T, W given by `decode(n, k0, kc, out)`: weight
// row n's inputs [k0, k0 + kc) as float32 into out. `chunk`: CHUNK_K, or less for a format
// whose blocks do not divide it.
template <class Decode>
void tiled_gemm(const float* x, int64_t M, int64_t N, int64_t K, float* y, int64_t y_stride,
                const Decode& decode) {
  const int64_t chunk = std::min(CHUNK_K, K);
  at::parallel_for(0, (N + TILE_N - 1) / TILE_N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(TILE_N * chunk);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE_N, outputs = std::min(TILE_N, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = std::min(chunk, K - k0);
        for (int64_t n = 0; n < outputs; ++n) decode(n0 + n, k0, kc, tile.data() + n * kc);
        for (int64_t m = 0; m < M; m += 4) {
          const float* xm = x + m * K + k0;
          float* ym = y + m * y_stride + n0;
          switch (std::min<int64_t>(4, M - m)) {
            case 1: tile_rows<1>(xm, K, tile.data(), kc, ym, y_stride, outputs, k0 == 0); break;
            case 2: tile_rows<2>(xm, K, tile.data(), kc, ym, y_stride, outputs, k0 == 0); break;
            case 3: tile_rows<3>(xm, K, tile.data(), kc, ym, y_stride, outputs, k0 == 0); break;
            default: tile_rows<4>(xm, K, tile.data(), kc, ym, y_stride, outputs, k0 == 0); break;
          }
        }
      }
    }
  });
}

// The 4-bit parts' weights (summed) and Q8_0's codes, for tiled_gemm.
struct Int4Rows {
  const std::vector<Int4Part>& parts;
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t kc, float* out) const {
    const int64_t groups = K / INT4_GROUP;
    for (size_t p = 0; p < parts.size(); ++p) {
      const uint8_t* row = parts[p].nibbles + n * (K / 2);
      const float* sz = parts[p].scales_and_shifts + n * groups * 2;
      for (int64_t g = k0 / INT4_GROUP; g < (k0 + kc) / INT4_GROUP; ++g) {
        const uint8_t* __restrict__ codes = row + g * INT4_GROUP / 2;
        float* __restrict__ o = out + g * INT4_GROUP - k0;
        const float scale = sz[2 * g], shift = sz[2 * g + 1];
        for (int64_t j = 0; j < INT4_GROUP / 2; ++j) {
          const float low = static_cast<float>(codes[j] & 0x0F) * scale + shift;
          const float high = static_cast<float>(codes[j] >> 4) * scale + shift;
          o[j] = p == 0 ? low : o[j] + low;
          o[j + INT4_GROUP / 2] = p == 0 ? high : o[j + INT4_GROUP / 2] + high;
        }
      }
    }
  }
};

struct Int8Rows {
  const int8_t* codes;
  const float* scales;  // (N, K / 32)
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t kc, float* out) const {
    const int8_t* __restrict__ row = codes + n * K + k0;
    const float* scale = scales + n * (K / INT4_GROUP) + k0 / INT4_GROUP;
    for (int64_t j = 0; j < kc; ++j) out[j] = static_cast<float>(row[j]) * scale[j / INT4_GROUP];
  }
};

// x rounded to int8 per 32 inputs, as floats (code * scale): what a wide batch multiplies
// with int8 activations, the rows the few-row kernels multiply as codes.
std::vector<float> rounded_rows(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / INT4_GROUP;
  std::vector<float> out(M * K);
  at::parallel_for(0, M, grain(K), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> codes(K);
    std::vector<float> scale(groups), sum(groups);
    for (int64_t m = begin; m < end; ++m) {
      quantize_int8_groups(x + m * K, 1, K, codes.data(), scale.data(), sum.data());
      for (int64_t j = 0; j < K; ++j) out[m * K + j] = static_cast<float>(codes[j]) * scale[j / INT4_GROUP];
    }
  });
  return out;
}

// -- GGUF blocks as the file stores them (gguf_blocks.h) --------------------------------------
// A decoded block's weights w = scale * q (+ offset) into out, float32, exact (this file is
// built without contraction: a fused multiply-add would round once where gguf rounds twice).
template <class B>
void block_weights(const gguf::Decoded& d, float* __restrict__ out) {
  for (int64_t h = 0; h < B::WEIGHTS / 16; ++h) {
    const float scale = d.scale[h];
    const float offset = B::OFFSET ? d.offset[h / 2] : 0.f;
    for (int64_t j = 0; j < 16; ++j) {
      const float w = scale * static_cast<float>(d.q[16 * h + j]);
      out[16 * h + j] = B::OFFSET ? w + offset : w;
    }
  }
}

template <class B>
struct BlockRows {
  const uint8_t* blocks;  // (N, K / WEIGHTS * BYTES)
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t kc, float* out) const {
    const uint8_t* row = blocks + n * (K / B::WEIGHTS * B::BYTES);
    gguf::Decoded d;
    for (int64_t b = k0 / B::WEIGHTS; b < (k0 + kc) / B::WEIGHTS; ++b) {
      B::decode(row + b * B::BYTES, d);
      block_weights<B>(d, out + b * B::WEIGHTS - k0);
    }
  }
};

// y[r, n] for R rows of float x and output row n of GGUF blocks: per 32 inputs, the codes
// (decoded once into L1 for all R rows) as float times x, scaled per half (Q6_K's scales
// are per 16), plus offset * sum(x); two accumulators a row (one per half) so that the
// fused multiply-adds do not wait on each other.
#if defined(__AVX2__) && defined(__FMA__)
inline void codes_as_floats(const int8_t* q, __m256 f[4]) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

template <class B, int64_t R>
void block_rows_block(const float* x, const float* xsum, const uint8_t* row, float* y,
                      int64_t y_stride, int64_t K) {
  const int64_t groups = K / gguf::GROUP;
  __m256 acc[R][2];
  float offsets[R];
  for (int64_t r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    offsets[r] = 0.f;
  }
  gguf::Decoded d;
  for (int64_t b = 0; b < K / B::WEIGHTS; ++b) {
    B::decode(row + b * B::BYTES, d);
    for (int64_t g = 0; g < B::WEIGHTS / gguf::GROUP; ++g) {
      __m256 f[4];
      codes_as_floats(d.q + g * gguf::GROUP, f);
      const __m256 low_scale = _mm256_set1_ps(d.scale[2 * g]);
      const __m256 high_scale = _mm256_set1_ps(d.scale[2 * g + 1]);
      const int64_t k = b * B::WEIGHTS + g * gguf::GROUP;
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + r * K + k;
        const __m256 low = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), f[1], _mm256_mul_ps(_mm256_loadu_ps(xr), f[0]));
        const __m256 high = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), f[3], _mm256_mul_ps(_mm256_loadu_ps(xr + 16), f[2]));
        acc[r][0] = _mm256_fmadd_ps(low_scale, low, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(high_scale, high, acc[r][1]);
        if (B::OFFSET) offsets[r] += d.offset[g] * xsum[r * groups + k / gguf::GROUP];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    y[r * y_stride] = sum_lanes(_mm256_add_ps(acc[r][0], acc[r][1])) + offsets[r];
}

// The same with x^: each group's integer dot products (|q| times x codes carrying q's sign:
// maddubs takes one unsigned operand), lanes 0-3 of the sums the first 16 inputs, 4-7 the
// second, so one vector of the two scales times the row's d multiplies them.
template <class B, int64_t R>
void block_int8_rows_block(const int8_t* codes, const float* x_scale, const float* x_sum,
                           const uint8_t* row, float* y, int64_t y_stride, int64_t K) {
  const int64_t groups = K / gguf::GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  float offsets[R];
  for (int64_t r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    offsets[r] = 0.f;
  }
  gguf::Decoded d;
  for (int64_t b = 0; b < K / B::WEIGHTS; ++b) {
    B::decode(row + b * B::BYTES, d);
    for (int64_t g = 0; g < B::WEIGHTS / gguf::GROUP; ++g) {
      const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(d.q + g * gguf::GROUP));
      const __m256i magnitude = _mm256_sign_epi8(q, q);
      const __m256 scales = _mm256_set_m128(_mm_set1_ps(d.scale[2 * g + 1]), _mm_set1_ps(d.scale[2 * g]));
      const int64_t group = (b * B::WEIGHTS) / gguf::GROUP + g;
      for (int64_t r = 0; r < R; ++r) {
        const __m256i xq = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(codes + r * K + group * gguf::GROUP));
        const __m256i dot =
            _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, q)), ones);
        const __m256 scale = _mm256_mul_ps(scales, _mm256_set1_ps(x_scale[r * groups + group]));
        acc[r][group & 1] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[r][group & 1]);
        if (B::OFFSET) offsets[r] += d.offset[g] * x_sum[r * groups + group];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    y[r * y_stride] = sum_lanes(_mm256_add_ps(acc[r][0], acc[r][1])) + offsets[r];
}
#endif

// One output of one row without AVX2/FMA (x_codes null for float x).
template <class B>
float block_dot(const float* x, const float* xsum, const int8_t* x_codes, const float* x_scale,
                const float* x_sum, const uint8_t* row, int64_t K) {
  float total = 0.f;
  gguf::Decoded d;
  for (int64_t b = 0; b < K / B::WEIGHTS; ++b) {
    B::decode(row + b * B::BYTES, d);
    for (int64_t g = 0; g < B::WEIGHTS / gguf::GROUP; ++g) {
      const int64_t group = (b * B::WEIGHTS) / gguf::GROUP + g;
      for (int64_t h = 0; h < 2; ++h) {
        float dot = 0.f;
        int32_t idot = 0;
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t i = g * gguf::GROUP + 16 * h + j;
          if (x_codes) idot += static_cast<int32_t>(d.q[i]) * x_codes[b * B::WEIGHTS + i];
          else dot += static_cast<float>(d.q[i]) * x[b * B::WEIGHTS + i];
        }
        const float scale = d.scale[2 * g + h];
        total += x_codes ? scale * x_scale[group] * static_cast<float>(idot) : scale * dot;
      }
      if (B::OFFSET) total += d.offset[g] * (x_codes ? x_sum[group] : xsum[group]);
    }
  }
  return total;
}

// The few-row product of one part of GGUF blocks into y's columns (row stride y_stride):
// the float rows x with their per-group sums, or with int8 activations their codes.
struct FewRows {
  const float* x;
  const float* xsum;  // (M, K / 32): each group's sum of x
  const int8_t* codes;  // int8 activations (else null): (M, K), with scale and sum per group
  const float* x_scale;
  const float* x_sum;
  int64_t M, K;
};

template <class B>
void block_matmul_rows(const FewRows& a, const uint8_t* blocks, int64_t N, float* y,
                       int64_t y_stride) {
  const int64_t K = a.K, groups = K / gguf::GROUP, row_bytes = K / B::WEIGHTS * B::BYTES;
  constexpr int64_t TILE = 64;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / (K * a.M)), [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; tile += TILE) {
      for (int64_t m = 0; m < a.M; m += ROWS) {
        const int64_t rows = std::min(ROWS, a.M - m);
        for (int64_t n = tile; n < std::min(tile + TILE, end); ++n) {
          const uint8_t* row = blocks + n * row_bytes;
          float* yn = y + m * y_stride + n;
#if defined(__AVX2__) && defined(__FMA__)
          if (a.codes) {
            const int8_t* c = a.codes + m * K;
            const float* s = a.x_scale + m * groups;
            const float* t = a.x_sum + m * groups;
            switch (rows) {
              case 1: block_int8_rows_block<B, 1>(c, s, t, row, yn, y_stride, K); break;
              case 2: block_int8_rows_block<B, 2>(c, s, t, row, yn, y_stride, K); break;
              case 3: block_int8_rows_block<B, 3>(c, s, t, row, yn, y_stride, K); break;
              default: block_int8_rows_block<B, 4>(c, s, t, row, yn, y_stride, K); break;
            }
            continue;
          }
          const float* xm = a.x + m * K;
          const float* xs = a.xsum + m * groups;
          switch (rows) {
            case 1: block_rows_block<B, 1>(xm, xs, row, yn, y_stride, K); break;
            case 2: block_rows_block<B, 2>(xm, xs, row, yn, y_stride, K); break;
            case 3: block_rows_block<B, 3>(xm, xs, row, yn, y_stride, K); break;
            default: block_rows_block<B, 4>(xm, xs, row, yn, y_stride, K); break;
          }
#else
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = m + r;
            yn[r * y_stride] = block_dot<B>(
                a.x + i * K, a.xsum + i * groups, a.codes ? a.codes + i * K : nullptr,
                a.codes ? a.x_scale + i * groups : nullptr, a.codes ? a.x_sum + i * groups : nullptr,
                row, K);
          }
#endif
        }
      }
    }
  });
}

}  // namespace

// (nibbles [(N, K / 2) uint8], scales_and_zeros [(K / group, N, 2)], group) -> the
// weight (N, K) in the scales' dtype, the parts summed (a Q8_0 matrix is two int4 parts).
torch::Tensor dequantize_int4(std::vector<torch::Tensor> nibbles,
                              std::vector<torch::Tensor> scales_and_zeros, int64_t group) {
  TORCH_CHECK(!nibbles.empty() && nibbles.size() == scales_and_zeros.size(),
              "one scales_and_zeros tensor per nibbles tensor");
  const int64_t N = nibbles[0].size(0), K = 2 * nibbles[0].size(1);
  TORCH_CHECK(group % 2 == 0 && K % group == 0, "group must be even and divide K");
  const auto dtype = scales_and_zeros[0].scalar_type();
  for (size_t p = 0; p < nibbles.size(); ++p) {
    TORCH_CHECK(nibbles[p].scalar_type() == torch::kUInt8 && nibbles[p].is_contiguous() &&
                    nibbles[p].size(0) == N && nibbles[p].size(1) == K / 2,
                "nibbles must be contiguous uint8 (N, K / 2), alike for every part");
    const auto& sz = scales_and_zeros[p];
    TORCH_CHECK(sz.is_contiguous() && sz.scalar_type() == dtype && sz.dim() == 3 &&
                    sz.size(0) == K / group && sz.size(1) == N && sz.size(2) == 2,
                "scales_and_zeros must be contiguous (K / group, N, 2) of one dtype");
  }
  auto out = torch::empty({N, K}, scales_and_zeros[0].options());
  std::vector<const uint8_t*> codes;
  for (const auto& t : nibbles) codes.push_back(t.data_ptr<uint8_t>());
  PAGEFLEET_DISPATCH(dtype, {
    std::vector<const T*> sz;
    for (const auto& t : scales_and_zeros) sz.push_back(t.data_ptr<T>());
    if (group == 32) {
      dequantize_int4_rows<T, 16>(codes, sz, out.data_ptr<T>(), N, K, group);
    } else {
      dequantize_int4_rows<T, 0>(codes, sz, out.data_ptr<T>(), N, K, group);
    }
  });
  return out;
}

// (x (M, K), 4-bit parts: nibbles as for dequantize_int4 with each output row's float32
// (scale, shift) pairs, (N, K / group, 2), w = q * scale + shift) -> x W^T (M, N) in x's
// dtype, computed in float32; with int8_activations, x^ W^T (x rounded to int8 codes per
// group of 32, integer dot products: int4_int8_matmul_rows). From gemm_rows rows on (0:
// never), the tiled GEMM (of x^ with int8_activations).
torch::Tensor int4_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& nibbles,
                          const std::vector<torch::Tensor>& scales_and_shifts, int64_t group,
                          bool int8_activations, int64_t gemm_rows) {
  check_rows(x, "x");
  TORCH_CHECK(group == INT4_GROUP, "int4_matmul takes groups of 32 inputs (GGUF's), not ", group);
  TORCH_CHECK(!nibbles.empty() && nibbles.size() == scales_and_shifts.size(),
              "one scales_and_shifts tensor per nibbles tensor");
  const int64_t M = x.size(0), N = nibbles[0].size(0), K = 2 * nibbles[0].size(1);
  TORCH_CHECK(x.size(1) == K && K % group == 0, "x has ", x.size(1), " columns, the weight ", K);
  std::vector<Int4Part> parts;
  for (size_t p = 0; p < nibbles.size(); ++p) {
    TORCH_CHECK(nibbles[p].scalar_type() == torch::kUInt8 && nibbles[p].is_contiguous() &&
                    nibbles[p].size(0) == N && nibbles[p].size(1) == K / 2,
                "nibbles must be contiguous uint8 (N, K / 2), alike for every part");
    const auto& sz = scales_and_shifts[p];
    TORCH_CHECK(sz.is_contiguous() && sz.scalar_type() == torch::kFloat32 && sz.dim() == 3 &&
                    sz.size(0) == N && sz.size(1) == K / group && sz.size(2) == 2,
                "scales_and_shifts must be contiguous float32 (N, K / group, 2)");
    parts.push_back({nibbles[p].data_ptr<uint8_t>(), sz.data_ptr<float>()});
  }
  const auto xf = x.to(torch::kFloat32).contiguous();
  auto out = torch::empty({M, N}, xf.options());
  if (gemm_rows > 0 && M >= gemm_rows) {
    const float* xs = xf.data_ptr<float>();
    std::vector<float> rounded;
    if (int8_activations) xs = (rounded = rounded_rows(xs, M, K)).data();
    tiled_gemm(xs, M, N, K, out.data_ptr<float>(), N, Int4Rows{parts, K});
  } else if (int8_activations) {
    int4_int8_matmul_rows(xf.data_ptr<float>(), parts, out.data_ptr<float>(), M, N, K);
  } else {
    int4_matmul_rows(xf.data_ptr<float>(), parts, out.data_ptr<float>(), M, N, K);
  }
  return out.to(x.scalar_type());
}

// x (M, K) float32 -> x^ (M, K): each group of 32 inputs rounded to int8 codes with one
// scale (quantize_int8_groups), returned as code * scale: what int4_matmul multiplies with
// int8_activations, for the products that dequantize the weight instead (wide batches).
torch::Tensor quantize_activations_int8(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quantize_activations_int8 takes float32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % INT4_GROUP == 0, "x has ", K, " columns, not a multiple of ", INT4_GROUP);
  const auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const float* in = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, grain(K), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> codes(K);
    std::vector<float> scale(K / INT4_GROUP), sum(K / INT4_GROUP);
    for (int64_t m = begin; m < end; ++m) {
      quantize_int8_groups(in + m * K, 1, K, codes.data(), scale.data(), sum.data());
      for (int64_t j = 0; j < K; ++j) o[m * K + j] = static_cast<float>(codes[j]) * scale[j / INT4_GROUP];
    }
  });
  return out;
}

// (x (M, K), codes (N, K) int8, scales (N, K / group) float32) -> x W^T (M, N) in x's dtype
// for w = code * scale (GGUF's Q8_0), computed in float32; int8_activations as int4_matmul.
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& scales, int64_t group, bool int8_activations,
                          int64_t gemm_rows) {
  check_rows(x, "x");
  TORCH_CHECK(group == INT4_GROUP, "int8_matmul takes groups of 32 inputs (GGUF's), not ", group);
  const int64_t M = x.size(0), N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.dim() == 2,
              "codes must be contiguous int8 (N, K)");
  TORCH_CHECK(x.size(1) == K && K % group == 0, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group,
              "scales must be contiguous float32 (N, K / group)");
  const auto xf = x.to(torch::kFloat32).contiguous();
  auto out = torch::empty({M, N}, xf.options());
  if (gemm_rows > 0 && M >= gemm_rows) {
    const float* xs = xf.data_ptr<float>();
    std::vector<float> rounded;
    if (int8_activations) xs = (rounded = rounded_rows(xs, M, K)).data();
    tiled_gemm(xs, M, N, K, out.data_ptr<float>(), N,
               Int8Rows{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), K});
  } else {
    int8_matmul_rows(xf.data_ptr<float>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                     out.data_ptr<float>(), M, N, K, int8_activations);
  }
  return out.to(x.scalar_type());
}

// (blocks (..., row bytes) uint8 of GGUF type `type`) -> (..., row weights) in dtype: every
// float32 bit gguf.quants.dequantize gives, rounded once.
torch::Tensor dequantize_blocks(const torch::Tensor& blocks, int64_t type, c10::ScalarType dtype) {
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() && blocks.dim() >= 1,
              "blocks must be contiguous uint8 (..., row bytes)");
  torch::Tensor out;
  gguf::dispatch(type, [&](auto block) {
    using B = decltype(block);
    const int64_t row_bytes = blocks.size(-1);
    TORCH_CHECK(row_bytes % B::BYTES == 0, "rows of ", row_bytes, " bytes are not whole blocks of ",
                B::BYTES);
    const int64_t K = row_bytes / B::BYTES * B::WEIGHTS, rows = blocks.numel() / std::max<int64_t>(row_bytes, 1);
    auto sizes = blocks.sizes().vec();
    sizes.back() = K;
    out = torch::empty(sizes, blocks.options().dtype(dtype));
    const uint8_t* data = blocks.data_ptr<uint8_t>();
    PAGEFLEET_DISPATCH(dtype, {
      T* o = out.data_ptr<T>();
      at::parallel_for(0, rows, grain(K), [&](int64_t begin, int64_t end) {
        std::vector<float> row(K);
        for (int64_t n = begin; n < end; ++n) {
          float* target = std::is_same_v<T, float> ? reinterpret_cast<float*>(o + n * K) : row.data();
          BlockRows<B>{data, K}(n, 0, K, target);
          if constexpr (!std::is_same_v<T, float>) {
            for (int64_t i = 0; i < K; ++i) o[n * K + i] = Elem<T>::store(row[i]);
          }
        }
      });
    });
  });
  return out;
}

// (x (M, K), parts: GGUF blocks (N_p, K / weights * bytes) uint8 of GGUF type types[p],
// stacked along the outputs) -> x W^T (M, sum N_p) in x's dtype, computed in float32: the
// few-row kernels below gemm_rows rows (0: at any), the tiled GEMM from there (parts of
// several types are a fused q/k/v or gate/up of a mixed file: Q4_K_M's v is Q6_K on some
// layers).
// int8_activations: x^ (x rounded to int8 per 32 inputs), multiplied as codes by the
// few-row kernels.
torch::Tensor blocks_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                            const std::vector<int64_t>& types, bool int8_activations,
                            int64_t gemm_rows) {
  check_rows(x, "x");
  const bool wide = gemm_rows > 0 && x.size(0) >= gemm_rows;
  TORCH_CHECK(!blocks.empty() && blocks.size() == types.size(), "one GGUF type per part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % INT4_GROUP == 0, "x has ", K, " columns, not a multiple of ", INT4_GROUP);
  int64_t N = 0;
  for (size_t p = 0; p < blocks.size(); ++p) {
    TORCH_CHECK(blocks[p].scalar_type() == torch::kUInt8 && blocks[p].is_contiguous() &&
                    blocks[p].dim() == 2,
                "blocks must be contiguous uint8 (N, row bytes)");
    gguf::dispatch(types[p], [&](auto block) {
      using B = decltype(block);
      TORCH_CHECK(blocks[p].size(1) * B::WEIGHTS == K * B::BYTES, "a part's rows hold ",
                  blocks[p].size(1) / B::BYTES * B::WEIGHTS, " weights, x has ", K, " columns");
    });
    N += blocks[p].size(0);
  }
  const auto xf = x.to(torch::kFloat32).contiguous();
  auto out = torch::empty({M, N}, xf.options());
  const float* xs = xf.data_ptr<float>();
  const int64_t groups = K / INT4_GROUP;
  std::vector<float> rounded, xsum(M * groups), x_scale, x_sum;
  std::vector<int8_t> codes;
  if (wide && int8_activations) {
    xs = (rounded = rounded_rows(xs, M, K)).data();
  } else if (int8_activations) {
    codes.resize(M * K);
    x_scale.resize(M * groups);
    x_sum.resize(M * groups);
    quantize_int8_groups(xs, M, K, codes.data(), x_scale.data(), x_sum.data());
  } else if (!wide) {
    for (int64_t i = 0; i < M * groups; ++i) {
      float sum = 0.f;
      for (int64_t j = 0; j < INT4_GROUP; ++j) sum += xs[i * INT4_GROUP + j];
      xsum[i] = sum;
    }
  }
  const FewRows few{xs, xsum.data(), codes.empty() ? nullptr : codes.data(), x_scale.data(),
                    x_sum.data(), M, K};
  int64_t column = 0;
  for (size_t p = 0; p < blocks.size(); ++p) {
    const uint8_t* data = blocks[p].data_ptr<uint8_t>();
    const int64_t rows = blocks[p].size(0);
    float* y = out.data_ptr<float>() + column;
    gguf::dispatch(types[p], [&](auto block) {
      using B = decltype(block);
      if (wide) {
        tiled_gemm(xs, M, rows, K, y, N, BlockRows<B>{data, K});
      } else {
        block_matmul_rows<B>(few, data, rows, y, N);
      }
    });
    column += rows;
  }
  return out.to(x.scalar_type());
}

}  // namespace pagefleet
