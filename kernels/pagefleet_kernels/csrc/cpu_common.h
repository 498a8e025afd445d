// What the package's CPU extensions share: a vectorizable exp, an AVX2 vector's lane sum,
// bfloat16 rounding done as torch does it, and a check that the extension's parallel loops
// really run in parallel.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <set>

namespace pagefleet {

// exp(x) for x <= 0 (a softmax's shifted scores): 2^n * p(r), r in [-ln2/2, ln2/2], with a
// degree-6 polynomial (relative error ~1e-7). Plain arithmetic, so a loop over a row
// vectorizes; std::exp stays a scalar call per element.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below this 2^n underflows the exponent field
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

// A tensor element as float, and a float rounded to the element type the way torch rounds
// an op's result (round to nearest even): an op emulated here in float32 and stored through
// `store` gives torch's bits. bfloat16 is the top half of a float32, so both directions are
// integer arithmetic that vectorizes (c10's conversions are function calls per element).
template <typename T>
struct Elem {
  static float load(T v) { return static_cast<float>(v); }
  static T store(float f) { return static_cast<T>(f); }
};

template <>
struct Elem<c10::BFloat16> {
  static float load(c10::BFloat16 v) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static c10::BFloat16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    // NaN told by its bits (an integer compare, which a vectorized loop can select on).
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    c10::BFloat16 out;
    out.x = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
    return out;
  }
};

// f rounded to T and back: the value an op that produces a T would hand the next op.
template <typename T>
inline float round_to(float f) {
  return Elem<T>::load(Elem<T>::store(f));
}

// How many threads at::parallel_for gives this extension's loops (1 when it was built
// without OpenMP, whatever torch.set_num_threads says).
inline int64_t parallel_threads() {
  std::mutex lock;
  std::set<int> seen;
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> guard(lock);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}

#if defined(__AVX2__)
// The sum of the 8 lanes of a.
inline float sum_lanes(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace pagefleet
