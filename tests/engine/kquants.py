"""llama.cpp's Q4_K and Q6_K quantization (the types a Q4_K_M file mixes), written from the
published block layouts, for tests that need K-quant GGUF files: the `gguf` package
dequantizes K-quants but cannot quantize them. Round to nearest with llama.cpp's
per-sub-block scales (not its iterative search): the files are valid K-quant blocks whose
weights `gguf.quants.dequantize` gives, which is all the tests compare against.

`q4_k_m(name, data)` quantizes per tensor as llama.cpp's Q4_K_M chooses for a small model:
the output matrix (or a tied embedding) and every other layer's attn_v and ffn_down Q6_K,
the rest Q4_K.
"""

import gguf
import numpy as np

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _divide(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    safe = np.where(d == 0, 1, d)
    return np.where(d == 0, 0, x / safe)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """(N, K) float32, K a multiple of 256 -> (N, K / 256 * 144) uint8 Q4_K blocks."""
    rows = weight.shape[0]
    x = weight.astype(np.float32).reshape(-1, 8, 32)  # blocks of 8 sub-blocks of 32
    low = np.minimum(x.min(axis=2), 0)
    scale = (x.max(axis=2) - low) / 15
    minimum = -low
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (minimum.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_divide(minimum, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(_divide(x + offset, step)), 0, 15).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)  # six bits each: see k_scales
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2i (low nibbles) and 2i + 1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate((_f16_bytes(d), _f16_bytes(dmin), packed, qs), axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """(N, K) float32, K a multiple of 256 -> (N, K / 256 * 210) uint8 Q6_K blocks."""
    rows = weight.shape[0]
    x = weight.astype(np.float32).reshape(-1, 16, 16)  # blocks of 16 sub-blocks of 16
    scale = np.abs(x).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d[:, None])), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_divide(x, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    # Per 128 weights: ql 64 bytes (weights l and l + 32 low, l + 64 and l + 96 high
    # nibbles), qh 32 bytes (the four weights' top two bits).
    q0, q1, q2, q3 = (q[:, :, 32 * i : 32 * (i + 1)] for i in range(4))
    ql = np.concatenate(((q0 & 0x0F) | ((q2 & 0x0F) << 4), (q1 & 0x0F) | ((q3 & 0x0F) << 4)), 2)
    qh = (q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6)
    blocks = np.concatenate(
        (ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)), axis=1
    )
    return blocks.reshape(rows, -1)


QUANTIZE = {Q4_K: quantize_q4_k, Q6_K: quantize_q6_k}


def quantize(weight: np.ndarray, qtype) -> np.ndarray:
    """`weight` (..., K) as K-quant blocks (..., row bytes), experts stacked alike."""
    flat = weight.reshape(-1, weight.shape[-1])
    return QUANTIZE[qtype](flat).reshape(*weight.shape[:-1], -1)


def q4_k_m(gguf_name: str, data: np.ndarray):
    """(blocks, type) of the matrix `gguf_name` as a Q4_K_M file holds it (None: a vector,
    left float32), for `write_gguf`'s `quantize`."""
    if data.ndim < 2 or data.shape[-1] % 256:
        return None
    parts = gguf_name.split(".")
    v_or_down = len(parts) == 4 and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps")
    table = gguf_name in ("output.weight", "token_embd.weight")
    qtype = Q6_K if table or (v_or_down and int(parts[1]) % 2 == 0) else Q4_K
    return quantize(data, qtype), qtype
