// Paged attention on the CPU, reading K/V in place from the block pool (no gather copy).
//
// One work item per query token (or per (token, KV head) when there are too few tokens to
// keep every thread busy; with fewer items still, per run of whole blocks of its context,
// merged after: run_split). It walks the token's visible context block by block through the
// block table, in two passes: every score first, then a softmax per query head over a
// contiguous row, then the V rows weighted by it. Within a block the rows of all KV heads
// are contiguous, so each pass reads a block as one run of memory (converted to float in a
// small tile: an int8/fp8 code's per-token scale is applied to the score for K and to the
// probability for V), and the next block is prefetched while this one is used.
//
// Measured against the previous kernel (one item per (token, KV head), an online softmax
// with a scalar exp and a rescale per key, the accumulators in memory), both built side by
// side and called in turn over 30 layers' caches: 2.4x faster per call on one thread at
// decode batch 64 over 300 bfloat16 keys with the blocks scattered over the pool (6.9 ms ->
// 2.85 ms), outputs within 5e-7. Layouts are those of pagefleet_kernels' docstring.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename cache_t>
inline void load_row(const cache_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is the top half of a float32: a shift, which vectorizes (the generic cast above
// goes through c10's conversion function).
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// The two inner loops over one block's rows (a tile of n rows, `stride` floats apart):
// the query's scores against the K rows, and the probability-weighted sum of the V rows.
//
// With AVX2 and FMA but no AVX-512, head sizes that are multiples of 8 take AVX2 code: the
// scores of 8 rows at a time, each row's products summed in its own register and the 8
// registers reduced together (one transposing horizontal add), and the weighted sum with
// the accumulator in registers. On an AVX2-only EPYC, 30 layers' calls at decode batch 64
// over 290 float32 keys in scattered blocks took 212 -> 100 ms on two threads (350 -> 144
// ms on one) against the 16-wide vector-type code below, which the compiler can only
// emulate there with pairs of 8-wide registers.
//
// Otherwise, for head sizes that are multiples of 16, GCC/Clang vector types of 16 floats
// (one AVX-512 register), so the query and the accumulator stay in registers across the
// rows; with the accumulator in memory every row's update waited on the last one's store
// (1.2-1.3x slower per call at decode batch 64).
using f32x16 = float __attribute__((vector_size(64)));
using DotsFn = void (*)(const float* q, const float* rows, int64_t stride, int64_t n, int64_t D,
                        float* out);
using WeightedSumFn = void (*)(const float* p, const float* rows, int64_t stride, int64_t n,
                               int64_t D, float* acc);

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGEFLEET_ATTENTION_AVX2 1
// Lane j of the result: the sum of the 8 lanes of a[j].
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);  // a0..a3: low halves' sums | high halves'
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

template <int C>  // D = 8 * C
void dots_avx2(const float* q, const float* rows, int64_t stride, int64_t n, int64_t, float* out) {
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
      for (int i = 0; i < 8; ++i)
        a[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows + (r + i) * stride + 8 * c), a[i]);
    }
    _mm256_storeu_ps(out + r, sum_lanes8(a));
  }
  for (; r < n; ++r) {
    __m256 a = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(rows + r * stride + 8 * c), a);
    out[r] = pagefleet::sum_lanes(a);
  }
}

template <int C>
void weighted_sum_avx2(const float* p, const float* rows, int64_t stride, int64_t n, int64_t,
                       float* acc) {
  __m256 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t r = 0; r < n; ++r) {
    const __m256 pr = _mm256_set1_ps(p[r]);
    for (int c = 0; c < C; ++c)
      a[c] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(rows + r * stride + 8 * c), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#endif

template <int C>  // D = 16 * C
void dots_vec(const float* q, const float* rows, int64_t stride, int64_t n, int64_t, float* out) {
  f32x16 qv[C];
  for (int c = 0; c < C; ++c) std::memcpy(&qv[c], q + 16 * c, sizeof(f32x16));
  for (int64_t r = 0; r < n; ++r) {
    f32x16 s = {};
    for (int c = 0; c < C; ++c) {
      f32x16 k;
      std::memcpy(&k, rows + r * stride + 16 * c, sizeof(f32x16));
      s += qv[c] * k;
    }
    float dot = 0.f;
    for (int j = 0; j < 16; ++j) dot += s[j];
    out[r] = dot;
  }
}

template <int C>
void weighted_sum_vec(const float* p, const float* rows, int64_t stride, int64_t n, int64_t,
                      float* acc) {
  f32x16 a[C];
  for (int c = 0; c < C; ++c) std::memcpy(&a[c], acc + 16 * c, sizeof(f32x16));
  for (int64_t r = 0; r < n; ++r) {
    for (int c = 0; c < C; ++c) {
      f32x16 v;
      std::memcpy(&v, rows + r * stride + 16 * c, sizeof(f32x16));
      a[c] += p[r] * v;
    }
  }
  for (int c = 0; c < C; ++c) std::memcpy(acc + 16 * c, &a[c], sizeof(f32x16));
}

void dots_any(const float* q, const float* rows, int64_t stride, int64_t n, int64_t D,
              float* out) {
  for (int64_t r = 0; r < n; ++r) {
    float dot = 0.f;
#pragma omp simd reduction(+:dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * rows[r * stride + d];
    out[r] = dot;
  }
}

void weighted_sum_any(const float* p, const float* rows, int64_t stride, int64_t n, int64_t D,
                      float* acc) {
  for (int64_t r = 0; r < n; ++r) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += p[r] * rows[r * stride + d];
  }
}

struct RowKernels {
  DotsFn dots;
  WeightedSumFn weighted_sum;
};

RowKernels row_kernels(int64_t D) {
#ifdef PAGEFLEET_ATTENTION_AVX2
  switch (D) {
    case 64: return {dots_avx2<8>, weighted_sum_avx2<8>};
    case 80: return {dots_avx2<10>, weighted_sum_avx2<10>};
    case 96: return {dots_avx2<12>, weighted_sum_avx2<12>};
    case 128: return {dots_avx2<16>, weighted_sum_avx2<16>};
    case 256: return {dots_avx2<32>, weighted_sum_avx2<32>};
    default: return {dots_any, weighted_sum_any};
  }
#else
  switch (D) {
    case 64: return {dots_vec<4>, weighted_sum_vec<4>};
    case 80: return {dots_vec<5>, weighted_sum_vec<5>};
    case 96: return {dots_vec<6>, weighted_sum_vec<6>};
    case 128: return {dots_vec<8>, weighted_sum_vec<8>};
    case 256: return {dots_vec<16>, weighted_sum_vec<16>};
    default: return {dots_any, weighted_sum_any};
  }
#endif
}

struct Scratch {
  std::vector<float> scores;  // (H * G, L): the item's scores, then probabilities
  std::vector<float> tile;    // (block_size, H * D): one block's rows as floats
  std::vector<float> acc;     // (H * G, D): the weighted sum of V rows
};

// Rows [s0, s0 + n) of one block, kv heads [h0, h0 + H), as floats: tile (n, H * D).
template <typename cache_t>
inline void load_tile(const cache_t* cache, int64_t slot0, int64_t n, int64_t h0, int64_t H,
                      int64_t Hkv, int64_t D, float* tile) {
  const cache_t* base = cache + slot0 * Hkv * D;
  if (H == Hkv) {
    load_row(base, tile, n * Hkv * D);  // whole rows are contiguous in the block
  } else {
    for (int64_t r = 0; r < n; ++r) load_row(base + (r * Hkv + h0) * D, tile + r * H * D, H * D);
  }
}

template <typename cache_t>
inline void prefetch_block(const cache_t* cache, int64_t slot0, int64_t n, int64_t Hkv, int64_t D) {
  const char* p = reinterpret_cast<const char*>(cache + slot0 * Hkv * D);
  const int64_t bytes = n * Hkv * D * sizeof(cache_t);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// One query token over KV heads [h0, h1) (G query heads each), keys [first, end).
template <typename cache_t>
void attend(const float* q,            // (Hq, D) this token's query
            const cache_t* kc, const cache_t* vc,  // (num_blocks, block_size, Hkv, D)
            const float* ksc, const float* vsc,    // (num_blocks, block_size, Hkv) or nullptr
            const int64_t* table,      // (max_blocks,) this sequence's blocks
            int64_t first, int64_t end, int64_t h0, int64_t h1, int64_t Hkv, int64_t bs,
            int64_t G, int64_t D, float scale, float softcap,
            const float* sinks,        // (Hq,) or nullptr: each head's sink logit
            float* out,                // (Hq, D) this token's output
            RowKernels kernels, Scratch& w,
            float* max_out = nullptr,  // (Hq,) when given: each query head's largest score
            float* sum_out = nullptr) {  // and the sum of exp(score - largest)
  const int64_t L = end - first, H = h1 - h0, W = H * D;
  w.scores.resize(H * G * L);
  w.tile.resize(bs * W);
  w.acc.assign(H * G * D, 0.f);
  float* sc = w.scores.data();
  float* tile = w.tile.data();
  const int64_t b_first = first / bs, b_last = (end - 1) / bs;
  // Block b of the sequence holds the visible keys [s0, s0 + n), at pool slots from slot0.
  auto span = [&](int64_t b, int64_t& slot0, int64_t& s0, int64_t& n) {
    s0 = std::max(first, b * bs);
    n = std::min(end, (b + 1) * bs) - s0;
    slot0 = table[b] * bs + s0 % bs;
  };
  auto prefetch_after = [&](const cache_t* cache, int64_t b) {
    if (b == b_last) return;
    int64_t slot0, s0, n;
    span(b + 1, slot0, s0, n);
    prefetch_block(cache, slot0, n, Hkv, D);
  };
  for (int64_t b = b_first; b <= b_last; ++b) {
    int64_t slot0, s0, n;
    span(b, slot0, s0, n);
    prefetch_after(kc, b);
    load_tile(kc, slot0, n, h0, H, Hkv, D, tile);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        float* out_s = sc + (h * G + g) * L + (s0 - first);
        kernels.dots(q + ((h0 + h) * G + g) * D, tile + h * D, W, n, D, out_s);
        for (int64_t r = 0; r < n; ++r) {
          float score = out_s[r] * scale * (ksc ? ksc[(slot0 + r) * Hkv + h0 + h] : 1.f);
          if (softcap > 0.f) score = std::tanh(score / softcap) * softcap;
          out_s[r] = score;
        }
      }
    }
  }
  for (int64_t j = 0; j < H * G; ++j) {
    float* sj = sc + j * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < L; ++i) m = std::max(m, sj[i]);
    // A sink is one more logit in the denominator, with no value row.
    const float sink = sinks ? sinks[h0 * G + j] : -std::numeric_limits<float>::infinity();
    m = std::max(m, sink);
    float sum = sinks ? pagefleet::exp_nonpositive(sink - m) : 0.f;
#pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < L; ++i) { sj[i] = pagefleet::exp_nonpositive(sj[i] - m); sum += sj[i]; }
    if (max_out) {
      max_out[h0 * G + j] = m;
      sum_out[h0 * G + j] = sum;
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
    for (int64_t i = 0; i < L; ++i) sj[i] *= inv;
  }
  float* acc = w.acc.data();
  for (int64_t b = b_first; b <= b_last; ++b) {
    int64_t slot0, s0, n;
    span(b, slot0, s0, n);
    prefetch_after(vc, b);
    load_tile(vc, slot0, n, h0, H, Hkv, D, tile);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        float* p = sc + (h * G + g) * L + (s0 - first);
        if (vsc) {  // each row's scale goes on its probability (used once, so in place)
          for (int64_t r = 0; r < n; ++r) p[r] *= vsc[(slot0 + r) * Hkv + h0 + h];
        }
        kernels.weighted_sum(p, tile + h * D, W, n, D, acc + (h * G + g) * D);
      }
    }
  }
  std::memcpy(out + h0 * G * D, acc, sizeof(float) * H * G * D);
}

// A query row as floats, and an output row back in the query's dtype (bfloat16/float16:
// rounded to nearest even, what `.to()` of the float32 output gave).
template <typename q_t>
inline const float* query_row(const q_t* q, int64_t n, std::vector<float>& buffer) {
  buffer.resize(n);
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(q[i]);
  return buffer.data();
}

template <>
inline const float* query_row<float>(const float* q, int64_t, std::vector<float>&) {
  return q;
}

template <typename q_t>
inline void store_row(const float* src, q_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<q_t>(src[i]);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Too few items to keep every thread busy (a decode batch of one: one item per KV head,
// three of them for SmolLM2 on two threads): each item's context is cut into `splits`
// runs of whole blocks, attended on their own (attend's softmax over its run, with its
// largest score and sum kept), then merged: out = sum_s w_s out_s / sum_s w_s with w_s =
// sum_s exp(max_s - max). Each thread then reads an equal share of the cache, which at
// batch 1 is read from memory (the weights streamed since evicted it).
template <typename cache_t, typename q_t>
void run_split(const q_t* q, const cache_t* kc, const cache_t* vc, const float* ksc,
               const float* vsc, const int64_t* tables, const int64_t* lens,
               const int64_t* starts, const std::vector<int64_t>& seq_of, int64_t T, int64_t Hq,
               int64_t D, int64_t bs, int64_t Hkv, int64_t G, int64_t max_blocks, int64_t parts,
               int64_t splits, float scale, int64_t sliding_window, float softcap,
               const float* sinks, q_t* o, RowKernels kernels) {
  const int64_t per = Hkv / parts, items = T * parts * splits;
  // Per (token, split): the output rows (Hq, D), each query head's largest score and sum.
  std::vector<float> partial(T * splits * Hq * D), largest(T * splits * Hq), sums(T * splits * Hq);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    std::vector<float> q_buffer;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / (parts * splits), part = item / splits % parts, s = item % splits;
      const int64_t i = seq_of[t];
      const int64_t pos = lens[i] - (starts[i + 1] - starts[i]) + (t - starts[i]);
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(pos - sliding_window + 1, 0) : 0;
      // Whole blocks per run, the runs over [first, pos]; a run past the end is empty.
      const int64_t run_blocks = ceil_div(pos / bs - first / bs + 1, splits);
      const int64_t k0 = std::max(first, (first / bs + s * run_blocks) * bs);
      const int64_t k1 = std::min(pos + 1, (first / bs + (s + 1) * run_blocks) * bs);
      const int64_t h0 = part * per, h1 = (part + 1) * per, row = t * splits + s;
      float* m = largest.data() + row * Hq;
      float* sum = sums.data() + row * Hq;
      if (k0 >= k1) {
        std::fill(sum + h0 * G, sum + h1 * G, 0.f);
        std::fill(m + h0 * G, m + h1 * G, -std::numeric_limits<float>::infinity());
        continue;
      }
      attend<cache_t>(query_row(q + t * Hq * D, Hq * D, q_buffer), kc, vc, ksc, vsc,
                      tables + i * max_blocks, k0, k1, h0, h1, Hkv, bs, G, D, scale, softcap,
                      nullptr, partial.data() + row * Hq * D, kernels, w, m, sum);
    }
  });
  std::vector<float> merged(Hq * D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < Hq; ++j) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s)
        if (sums[(t * splits + s) * Hq + j] > 0.f) top = std::max(top, largest[(t * splits + s) * Hq + j]);
      // The sink joins the merge (the runs' softmaxes know none): one more term of the sum.
      if (sinks) top = std::max(top, sinks[j]);
      float total = sinks ? pagefleet::exp_nonpositive(sinks[j] - top) : 0.f;
      float* acc = merged.data() + j * D;
      std::fill(acc, acc + D, 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t row = (t * splits + s) * Hq + j;
        if (!(sums[row] > 0.f)) continue;
        const float weight = sums[row] * pagefleet::exp_nonpositive(largest[row] - top);
        const float* part_out = partial.data() + row * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += weight * part_out[d];
        total += weight;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
    }
    store_row(merged.data(), o + t * Hq * D, Hq * D);
  }
}

template <typename cache_t, typename q_t>
void run(const torch::Tensor& query, const torch::Tensor& key_cache,
         const torch::Tensor& value_cache, const float* key_scale, const float* value_scale,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
         const torch::Tensor& query_start_loc, double scale, int64_t sliding_window,
         double softcap, const float* sinks, torch::Tensor& out) {
  const int64_t T = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = Hq / Hkv, num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<int64_t> seq_of(T);
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t t = starts[i]; t < starts[i + 1]; ++t) seq_of[t] = i;
  // Whole rows (all kv heads of a key, contiguous in the pool) when there are enough tokens
  // to keep every thread busy; one kv head per item otherwise.
  const int64_t parts = T >= 4 * at::get_num_threads() ? 1 : Hkv;
  const int64_t per = Hkv / parts;
  const q_t* q = query.data_ptr<q_t>();
  q_t* o = out.data_ptr<q_t>();
  const cache_t* kc = key_cache.data_ptr<cache_t>();
  const cache_t* vc = value_cache.data_ptr<cache_t>();
  const RowKernels kernels = row_kernels(D);
  const int64_t threads = at::get_num_threads();
  if (T * parts < 2 * threads) {
    run_split(q, kc, vc, key_scale, value_scale, tables, lens, starts, seq_of, T, Hq, D, bs,
              Hkv, G, max_blocks, parts, ceil_div(2 * threads, T * parts),
              static_cast<float>(scale), sliding_window, static_cast<float>(softcap), sinks, o,
              kernels);
    return;
  }
  at::parallel_for(0, T * parts, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    std::vector<float> q_buffer, o_buffer(Hq * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / parts, part = item % parts, i = seq_of[t];
      const int64_t pos = lens[i] - (starts[i + 1] - starts[i]) + (t - starts[i]);
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(pos - sliding_window + 1, 0) : 0;
      const int64_t h0 = part * per, h1 = (part + 1) * per;
      float* o_row = std::is_same<q_t, float>::value ? reinterpret_cast<float*>(o + t * Hq * D)
                                                     : o_buffer.data();
      attend<cache_t>(query_row(q + t * Hq * D, Hq * D, q_buffer), kc, vc, key_scale,
                      value_scale, tables + i * max_blocks, first, pos + 1, h0, h1, Hkv, bs, G,
                      D, static_cast<float>(scale), static_cast<float>(softcap), sinks, o_row,
                      kernels, w);
      if (!std::is_same<q_t, float>::value)
        store_row(o_row + h0 * G * D, o + t * Hq * D + h0 * G * D, (h1 - h0) * G * D);
    }
  });
}

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>{}) for the C++ type T of a query dtype, then of a cache dtype.
template <typename F>
void with_query_type(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case torch::kFloat32: return f(Tag<float>{});
    case torch::kBFloat16: return f(Tag<c10::BFloat16>{});
    case torch::kFloat16: return f(Tag<c10::Half>{});
    default:
      TORCH_CHECK(false, "query dtype ", dtype, " is not float32, bfloat16 or float16");
  }
}

template <typename F>
void with_cache_type(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case torch::kFloat32: return f(Tag<float>{});
    case torch::kBFloat16: return f(Tag<c10::BFloat16>{});
    case torch::kFloat16: return f(Tag<c10::Half>{});
    case torch::kInt8: return f(Tag<int8_t>{});
    case torch::kFloat8_e4m3fn: return f(Tag<c10::Float8_e4m3fn>{});
    default:
      TORCH_CHECK(false, "cache dtype ", dtype,
                  " is not float32, bfloat16, float16, int8 or float8_e4m3fn");
  }
}

}  // namespace

// The output has the query's dtype (float32, bfloat16 or float16); the kernel computes in
// float32 either way, so a 16-bit query costs no conversion pass outside it.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache,
                              torch::Tensor value_cache, c10::optional<torch::Tensor> key_scale,
                              c10::optional<torch::Tensor> value_scale, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale,
                              int64_t sliding_window, double softcap,
                              c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(query.is_contiguous(), "query must be contiguous (T, Hq, D)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache and value_cache must be contiguous (num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "query (T, Hq, D) does not fit the cache (num_blocks, block_size, Hkv, D)");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto starts = query_start_loc.to(torch::kInt64).contiguous();
  const float* ks = key_scale ? key_scale->data_ptr<float>() : nullptr;
  const float* vs = value_scale ? value_scale->data_ptr<float>() : nullptr;
  torch::Tensor sink_values;
  if (sinks) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == query.size(1),
                "sinks must be (Hq,): one logit per query head");
    sink_values = sinks->to(torch::kFloat32).contiguous();
  }
  const float* sk = sinks ? sink_values.data_ptr<float>() : nullptr;
  auto out = torch::empty_like(query);
  with_query_type(query.scalar_type(), [&](auto q_tag) {
    with_cache_type(key_cache.scalar_type(), [&](auto cache_tag) {
      using q_t = typename decltype(q_tag)::type;
      using cache_t = typename decltype(cache_tag)::type;
      run<cache_t, q_t>(query, key_cache, value_cache, ks, vs, tables, lens, starts, scale,
                        sliding_window, softcap, sk, out);
    });
  });
  return out;
}

// This step's K and V rows (T, Hkv, D), each row's heads contiguous, copied into their
// slots of an unquantized cache of the same dtype: what the torch backend's indexed
// assignment does, without its per-call dispatch (60 of them in a SmolLM2 decode step).
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                    torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache and value_cache must be contiguous (num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t T = slot_mapping.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row = key_cache.size(2) * key_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the cache (",
                num_slots, " slots)");
  for (auto* pair : {&key, &value}) {
    const torch::Tensor& x = *pair;
    TORCH_CHECK(x.dim() == 3 && x.size(0) == T && x.size(1) * x.size(2) == row &&
                    x.stride(2) == 1 && x.stride(1) == x.size(2),
                "key/value must be (T, Hkv, D) with each row's heads contiguous");
  }
  for (int pass = 0; pass < 2; ++pass) {
    const torch::Tensor& x = pass ? value : key;
    torch::Tensor& cache = pass ? value_cache : key_cache;
    TORCH_CHECK(x.scalar_type() == cache.scalar_type(), "key/value dtype ", x.scalar_type(),
                " differs from the cache's ", cache.scalar_type());
    const int64_t item = x.element_size(), stride = x.stride(0) * item;
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(dst + slots[t] * row * item, src + t * stride, row * item);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the block pool (CPU)");
  m.def("write_kv_cache", &write_kv_cache, "K/V rows into their slots of the pool (CPU)");
  m.def("parallel_threads", &pagefleet::parallel_threads,
        "threads at::parallel_for gives this extension's loops");
}
