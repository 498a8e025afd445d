// Paged attention on the CPU, reading K/V in place from the block pool (no gather copy).
//
// One work item per (query token, KV head): the G query heads sharing that KV head walk
// the token's visible context once, block by block through the block table, with an online
// softmax (running max and sum), so each K/V row is read once per item and an int8/fp8
// code is turned into a float in registers (its per-token scale applied to the score for K
// and to the probability for V). Layouts are those of pagefleet_kernels' docstring.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename cache_t>
void attend_item(
    const float* q,             // (G, D) this token's query heads of one KV head
    const cache_t* key_cache,   // (num_blocks, block_size, Hkv, D)
    const cache_t* value_cache, // (num_blocks, block_size, Hkv, D)
    const float* key_scale,     // (num_blocks, block_size, Hkv) or nullptr
    const float* value_scale,   // (num_blocks, block_size, Hkv) or nullptr
    const int64_t* block_table, // (max_blocks,) this sequence's blocks
    int64_t first_key, int64_t end_key,  // keys [first_key, end_key) are visible
    int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t G, int64_t D,
    float scale, float softcap,
    float* out,                 // (G, D), rows G apart by out_row_stride
    int64_t out_row_stride,
    float* acc, float* scores)  // scratch: (G, D), (G,)
{
  std::vector<float> max_score(G, -std::numeric_limits<float>::infinity());
  std::vector<float> sum(G, 0.f);
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t s = first_key; s < end_key; ++s) {
    const int64_t slot = block_table[s / block_size] * block_size + s % block_size;
    const int64_t row = slot * num_kv_heads + kv_head;
    const cache_t* k = key_cache + row * D;
    const cache_t* v = value_cache + row * D;
    const float ks = key_scale ? key_scale[row] : 1.f;
    const float vs = value_scale ? value_scale[row] : 1.f;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
      float score = dot * ks * scale;
      if (softcap > 0.f) score = std::tanh(score / softcap) * softcap;
      scores[g] = score;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* ag = acc + g * D;
      float p;
      if (scores[g] > max_score[g]) {
        const float correction = std::exp(max_score[g] - scores[g]);
        for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
        sum[g] *= correction;
        max_score[g] = scores[g];
        p = 1.f;
      } else {
        p = std::exp(scores[g] - max_score[g]);
      }
      sum[g] += p;
      const float pv = p * vs;
      for (int64_t d = 0; d < D; ++d) ag[d] += pv * static_cast<float>(v[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * out_row_stride + d] = acc[g * D + d] * inv;
  }
}

template <typename cache_t>
void run(const torch::Tensor& query, const torch::Tensor& key_cache,
         const torch::Tensor& value_cache, const float* key_scale, const float* value_scale,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
         const torch::Tensor& query_start_loc, double scale, int64_t sliding_window,
         double softcap, torch::Tensor& out) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t G = num_heads / num_kv_heads, num_seqs = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  // token -> its sequence (the batch is flattened)
  std::vector<int64_t> seq_of(num_tokens);
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t t = starts[i]; t < starts[i + 1]; ++t) seq_of[t] = i;
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const cache_t* kc = key_cache.data_ptr<cache_t>();
  const cache_t* vc = value_cache.data_ptr<cache_t>();
  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), scores(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads, i = seq_of[t];
      const int64_t q_len = starts[i + 1] - starts[i];
      const int64_t pos = lens[i] - q_len + (t - starts[i]);  // the query's position
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(pos - sliding_window + 1, 0) : 0;
      attend_item<cache_t>(q + (t * num_heads + h * G) * D, kc, vc, key_scale, value_scale,
                           tables + i * max_blocks, first, pos + 1, h, num_kv_heads,
                           block_size, G, D, static_cast<float>(scale),
                           static_cast<float>(softcap), o + (t * num_heads + h * G) * D, D,
                           acc.data(), scores.data());
    }
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache,
                              torch::Tensor value_cache, c10::optional<torch::Tensor> key_scale,
                              c10::optional<torch::Tensor> value_scale, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale,
                              int64_t sliding_window, double softcap) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && query.is_contiguous(),
              "query must be contiguous float32 (T, Hq, D)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache and value_cache must be contiguous (num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "query (T, Hq, D) does not fit the cache (num_blocks, block_size, Hkv, D)");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto starts = query_start_loc.to(torch::kInt64).contiguous();
  const float* ks = key_scale ? key_scale->data_ptr<float>() : nullptr;
  const float* vs = value_scale ? value_scale->data_ptr<float>() : nullptr;
  auto out = torch::empty_like(query);
  switch (key_cache.scalar_type()) {
    case torch::kFloat32:
      run<float>(query, key_cache, value_cache, ks, vs, tables, lens, starts, scale,
                 sliding_window, softcap, out);
      break;
    case torch::kBFloat16:
      run<c10::BFloat16>(query, key_cache, value_cache, ks, vs, tables, lens, starts, scale,
                         sliding_window, softcap, out);
      break;
    case torch::kFloat16:
      run<c10::Half>(query, key_cache, value_cache, ks, vs, tables, lens, starts, scale,
                     sliding_window, softcap, out);
      break;
    case torch::kInt8:
      run<int8_t>(query, key_cache, value_cache, ks, vs, tables, lens, starts, scale,
                  sliding_window, softcap, out);
      break;
    case torch::kFloat8_e4m3fn:
      run<c10::Float8_e4m3fn>(query, key_cache, value_cache, ks, vs, tables, lens, starts,
                              scale, sliding_window, softcap, out);
      break;
    default:
      TORCH_CHECK(false, "cache dtype ", key_cache.scalar_type(),
                  " is not float32, bfloat16, float16, int8 or float8_e4m3fn");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the block pool (CPU)");
}
