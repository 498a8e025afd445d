"""Weight quantization quality on the built-in model (`python benchmarks/bench_weight_quant.py`).

Perplexity of SmolLM2-135M-Instruct over /usr/share/common-licenses/GPL-3 (the corpus and
the windowed, chunked scoring of bench_kvquant.py) with its Q4_1 weights expanded to
float32 (`--quantization none`), kept as int4 (`auto`, the GGUF's own quantization) and
requantized to int8 per output row (`int8`); activations float32 throughout, and for `auto`
also rounded to int8 per 32 inputs before every 4-bit matmul (`--activation-quantization
int8`, llama.cpp's arithmetic). `auto` computes with exactly the expanded weights, so its
perplexity must equal `none`'s up to float32 summation order. Prints a table and writes
JSON.

`--matmul`: per GGUF format instead, the quantized layer's product (`quantized_linear` on
the C++ CPU backend, float32 rows) against the float32 GEMM of the same shape (the layer
a float model has: oneDNN's prepacked weight), at batch sizes 1 to 256, A/B interleaved
in one process (the median of `--repeats`); and, to place the crossover of the layers'
`NATIVE_GEMM_ROWS`, the C++ kernel with its few-row kernels at every batch size against
its GEMM, and the old wide-batch path (the matrix dequantized, then the float GEMM).
"""

import argparse
import functools
import json
import statistics
import time

import numpy as np
import torch
from bench_kvquant import MODEL, TEXT, perplexity
from pagefleet_kernels import cpu_layer_ops
from pagefleet_kernels.backend import cpu_backend
from pagefleet_kernels.gguf_blocks import GGUF_BLOCK_TYPES
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.model.block_weight import BlockWeight
from pagefleet_serve.model.layers.linear_methods import PrepackedLinear, quantized_linear
from pagefleet_serve.model.quant import from_gguf

# name: (--quantization, --activation-quantization)
SETTINGS = {
    "none": ("none", "none"),
    "auto": ("auto", "none"),
    "auto+int8-activations": ("auto", "int8"),
    "int8": ("int8", "none"),
}


MATMUL_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The float16 fields of each format's block (d, and m or dmin), set to small finite values.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2)}
F16_FIELDS |= {"Q6_K": (208,), "IQ4_XS": (0,)}


class _FloatLayer(torch.nn.Module):
    """What PrepackedLinear reads of a float layer."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias_term = None


def random_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    kind = GGUF_BLOCK_TYPES[type_name]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (rows, cols // kind.weights, kind.bytes), dtype=np.uint8)
    for start in F16_FIELDS[type_name]:
        halves = rng.normal(0, 0.01, blocks.shape[:-1]).astype(np.float16)
        blocks[..., start : start + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _median_ms(fn, x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _blocks_kernel(x: torch.Tensor, parts, gemm_rows: int) -> torch.Tensor:
    """The C++ block kernel (the one the K-quant layers call; the Q4_0/Q4_1/Q8_0 layers'
    int4/int8 kernels share its few-row and GEMM tiling)."""
    return cpu_layer_ops.blocks_matmul(x, *parts, False, gemm_rows)


def _dequantize_then_gemm(x: torch.Tensor, parts) -> torch.Tensor:
    """The wide-batch path the 4-bit layers took before: the whole matrix, then a GEMM."""
    (blocks,), (ggml_type,) = parts
    return torch.nn.functional.linear(x, cpu_layer_ops.dequantize_blocks(blocks, ggml_type))


def matmul_sweep(rows: int, cols: int, repeats: int) -> dict:
    """Per format and batch size: ms of the quantized layer, of the float32 GEMM, and of
    the C++ kernel's two paths and the dequantize-then-GEMM one."""
    backend = cpu_backend()
    results = {}
    for type_name in MATMUL_FORMATS:
        blocks = random_blocks(type_name, rows, cols)
        if type_name in ("Q4_0", "Q4_1", "Q8_0"):
            weight = from_gguf(blocks, type_name)
        else:
            weight = BlockWeight.from_gguf(blocks, type_name)
        layer = quantized_linear(weight, None, backend)
        matrix = weight.dequantize()
        dense = PrepackedLinear(_FloatLayer(matrix), backend)
        parts = ([torch.from_numpy(blocks)], [GGUF_BLOCK_TYPES[type_name].ggml_type])
        variants = {
            "layer": layer,
            "float32": dense,
            "few_rows": functools.partial(_blocks_kernel, parts=parts, gemm_rows=0),
            "gemm": functools.partial(_blocks_kernel, parts=parts, gemm_rows=1),
            "dequantize+gemm": functools.partial(_dequantize_then_gemm, parts=parts),
        }
        entry = {}
        for batch in BATCHES:
            x = torch.randn(batch, cols)
            for fn in variants.values():  # warm-up: caches, oneDNN's primitives
                fn(x)
            ms = {name: [] for name in variants}
            for _ in range(3):  # interleaved: each variant sees the same load
                for name, fn in variants.items():
                    ms[name].append(_median_ms(fn, x, repeats))
            entry[batch] = {name: round(min(v), 4) for name, v in ms.items()}
            row = entry[batch]
            print(
                f"{type_name:>7} {batch:>4} rows: layer {row['layer']:8.3f} ms, float32 "
                f"{row['float32']:8.3f} ({row['float32'] / row['layer']:.2f}x); kernel few-row "
                f"{row['few_rows']:8.3f}, gemm {row['gemm']:8.3f}, dequantize+gemm "
                f"{row['dequantize+gemm']:8.3f}",
                flush=True,
            )
        results[type_name] = entry
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--output", default="bench-weight-quant.json")
    parser.add_argument("--matmul", action="store_true", help="the matmul sweep (see above)")
    parser.add_argument("--shape", type=int, nargs=2, default=(2048, 1024), help="N K")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.matmul:
        rows, cols = args.shape
        results = {
            "shape": [rows, cols],
            "threads": torch.get_num_threads(),
            "formats": matmul_sweep(rows, cols, args.repeats),
        }
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
        print(f"written to {args.output}")
        return
    with open(TEXT, encoding="utf-8") as f:
        token_ids = load_tokenizer(MODEL).encode(f.read(), add_special_tokens=False)
    results = {"model": MODEL, "text": TEXT, "text_tokens": len(token_ids), "weights": {}}
    for name, (quantization, activations) in SETTINGS.items():
        started = time.monotonic()
        entry = perplexity("auto", token_ids, args.window, args.chunk, quantization, activations)
        entry["seconds"] = round(time.monotonic() - started, 1)
        results["weights"][name] = entry
        print(f"{name}: perplexity {entry['perplexity']:.4f} ({entry['seconds']}s)")
    base = results["weights"]["none"]["perplexity"]
    print(f"{MODEL} over {TEXT}: {len(token_ids)} tokens, windows of {args.window}")
    print(f"{'weights':>34} {'perplexity':>11} {'vs float32':>11}")
    labels = {
        "none": "float32 (expanded Q4_1)",
        "auto": "Q4_1 kept as int4",
        "auto+int8-activations": "int4, activations int8/32",
        "int8": "int8 per row (requantized)",
    }
    for name, entry in results["weights"].items():
        entry["relative_to_none"] = entry["perplexity"] / base - 1
        print(
            f"{labels[name]:>34} {entry['perplexity']:>11.4f} {entry['relative_to_none']:>+11.3%}"
        )
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
