// GGUF's block-quantized weight types as the file stores them (pagefleet_kernels/gguf_blocks.py
// is the PyTorch twin and says what each type holds). A block decodes into small integer
// codes q (int8), one float32 scale per 16 weights and, for the types with a minimum, one
// float32 offset per 32: w = scale * q (+ offset), the float32 products and sums of
// gguf.quants.dequantize, so built without floating-point contraction the same bits.
//
// The decoders are plain loops over a block's bytes, which the compiler turns into vector
// code (IQ4's table lookups aside); the matmuls read the codes back from L1.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pagefleet::gguf {

// The file's type ids (gguf.GGMLQuantizationType).
enum Type : int64_t {
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  IQ4_NL = 20,
  IQ4_XS = 23,
};

constexpr int64_t GROUP = 32;  // weights per offset; two scales each

struct Decoded {
  alignas(32) int8_t q[256];
  float scale[16];   // per 16 weights
  float offset[8];   // per 32 weights (types with OFFSET)
};

inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// d (and m) for a 32-weight block: both halves one scale.
inline void one_scale(Decoded& out, float d) { out.scale[0] = out.scale[1] = d; }

// Low nibbles of 16 bytes are weights 0-15, high ones 16-31 (Q4_0, Q5_0, IQ4_NL, ...).
inline void nibbles32(const uint8_t* __restrict__ qs, int8_t* __restrict__ q, int8_t minus) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 0x0F) - minus);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - minus);
  }
}

// 32 weights' fifth bits from a little-endian uint32 (Q5_0, Q5_1).
inline void fifth_bits32(const uint8_t* __restrict__ qh_bytes, const uint8_t* __restrict__ qs,
                         int8_t* __restrict__ q, int8_t minus) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, sizeof(qh));
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - minus);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - minus);
  }
}

// Q4_K's and Q5_K's scales and minima: eight 6-bit pairs in 12 bytes; scale = d * sc,
// offset = -(dmin * m).
inline void k_scales(const uint8_t* b, Decoded& out) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    out.scale[2 * j] = out.scale[2 * j + 1] = d * static_cast<float>(sc);
    out.offset[j] = -(dmin * static_cast<float>(mn));
  }
}

template <int64_t TYPE>
struct Block;

template <>
struct Block<Q4_0> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 18;
  static constexpr bool OFFSET = false;
  static void decode(const uint8_t* b, Decoded& out) {
    one_scale(out, f16_at(b));
    nibbles32(b + 2, out.q, 8);
  }
};

template <>
struct Block<Q4_1> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 20;
  static constexpr bool OFFSET = true;
  static void decode(const uint8_t* b, Decoded& out) {
    one_scale(out, f16_at(b));
    out.offset[0] = f16_at(b + 2);
    nibbles32(b + 4, out.q, 0);
  }
};

template <>
struct Block<Q5_0> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 22;
  static constexpr bool OFFSET = false;
  static void decode(const uint8_t* b, Decoded& out) {
    one_scale(out, f16_at(b));
    fifth_bits32(b + 2, b + 6, out.q, 16);
  }
};

template <>
struct Block<Q5_1> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 24;
  static constexpr bool OFFSET = true;
  static void decode(const uint8_t* b, Decoded& out) {
    one_scale(out, f16_at(b));
    out.offset[0] = f16_at(b + 2);
    fifth_bits32(b + 4, b + 8, out.q, 0);
  }
};

template <>
struct Block<Q8_0> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 34;
  static constexpr bool OFFSET = false;
  static void decode(const uint8_t* b, Decoded& out) {
    one_scale(out, f16_at(b));
    std::memcpy(out.q, b + 2, 32);
  }
};

template <>
struct Block<Q4_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 144;
  static constexpr bool OFFSET = true;
  static void decode(const uint8_t* b, Decoded& out) {
    k_scales(b, out);
    const uint8_t* __restrict__ qs = b + 16;
    int8_t* __restrict__ q = out.q;
    for (int i = 0; i < 4; ++i) {  // 32 bytes: sub-block 2i in the low nibbles, 2i + 1 high
      for (int l = 0; l < 32; ++l) {
        q[64 * i + l] = static_cast<int8_t>(qs[32 * i + l] & 0x0F);
        q[64 * i + 32 + l] = static_cast<int8_t>(qs[32 * i + l] >> 4);
      }
    }
  }
};

template <>
struct Block<Q5_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 176;
  static constexpr bool OFFSET = true;
  static void decode(const uint8_t* b, Decoded& out) {
    k_scales(b, out);
    const uint8_t* __restrict__ qh = b + 16;  // bit j of byte l: sub-block j's weight l
    const uint8_t* __restrict__ qs = b + 48;
    int8_t* __restrict__ q = out.q;
    for (int i = 0; i < 4; ++i) {
      for (int l = 0; l < 32; ++l) {
        q[64 * i + l] =
            static_cast<int8_t>((qs[32 * i + l] & 0x0F) | (((qh[l] >> (2 * i)) & 1) << 4));
        q[64 * i + 32 + l] =
            static_cast<int8_t>((qs[32 * i + l] >> 4) | (((qh[l] >> (2 * i + 1)) & 1) << 4));
      }
    }
  }
};

template <>
struct Block<Q6_K> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 210;
  static constexpr bool OFFSET = false;
  static void decode(const uint8_t* b, Decoded& out) {
    const float d = f16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) out.scale[i] = d * static_cast<float>(sc[i]);
    int8_t* __restrict__ q = out.q;
    for (int h = 0; h < 2; ++h) {  // each 128 weights: 64 bytes of low nibbles, 32 of pairs
      const uint8_t* __restrict__ ql = b + 64 * h;
      const uint8_t* __restrict__ qh = b + 128 + 32 * h;
      int8_t* __restrict__ qo = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        qo[l] = static_cast<int8_t>(((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
        qo[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
        qo[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        qo[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
};

template <>
struct Block<IQ4_NL> {
  static constexpr int64_t WEIGHTS = 32, BYTES = 18;
  static constexpr bool OFFSET = false;
  static void decode(const uint8_t* b, Decoded& out) {
    one_scale(out, f16_at(b));
    for (int j = 0; j < 16; ++j) {
      out.q[j] = IQ4_VALUES[b[2 + j] & 0x0F];
      out.q[j + 16] = IQ4_VALUES[b[2 + j] >> 4];
    }
  }
};

template <>
struct Block<IQ4_XS> {
  static constexpr int64_t WEIGHTS = 256, BYTES = 136;
  static constexpr bool OFFSET = false;
  static void decode(const uint8_t* b, Decoded& out) {
    const float d = f16_at(b);
    uint16_t high;
    std::memcpy(&high, b + 2, sizeof(high));
    for (int j = 0; j < 8; ++j) {
      const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
      const int scale = (low | (((high >> (2 * j)) & 3) << 4)) - 32;
      out.scale[2 * j] = out.scale[2 * j + 1] = d * static_cast<float>(scale);
      const uint8_t* qs = b + 8 + 16 * j;
      for (int l = 0; l < 16; ++l) {
        out.q[32 * j + l] = IQ4_VALUES[qs[l] & 0x0F];
        out.q[32 * j + 16 + l] = IQ4_VALUES[qs[l] >> 4];
      }
    }
  }
};

// Calls f(Block<TYPE>{}) for the runtime type id, the block traits as a compile-time type.
template <class F>
void dispatch(int64_t type, F&& f) {
  switch (type) {
    case Q4_0: f(Block<Q4_0>{}); return;
    case Q4_1: f(Block<Q4_1>{}); return;
    case Q5_0: f(Block<Q5_0>{}); return;
    case Q5_1: f(Block<Q5_1>{}); return;
    case Q8_0: f(Block<Q8_0>{}); return;
    case Q4_K: f(Block<Q4_K>{}); return;
    case Q5_K: f(Block<Q5_K>{}); return;
    case Q6_K: f(Block<Q6_K>{}); return;
    case IQ4_NL: f(Block<IQ4_NL>{}); return;
    case IQ4_XS: f(Block<IQ4_XS>{}); return;
    default: break;
  }
  TORCH_CHECK(false, "GGUF type id ", type, " is not a block type these kernels take "
              "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)");
}

}  // namespace pagefleet::gguf
