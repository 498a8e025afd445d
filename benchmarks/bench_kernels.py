"""Decode attention micro-benchmark on CUDA (`make bench-kernels`).

The Triton paged attention kernel at a Llama-3-8B shape (32 query heads, 8 KV heads, head
dim 128, bfloat16, 16-token blocks in shuffled order) for batch 1-256 and context 512-32k,
with unquantized, fp8 and int8 caches, next to `torch.nn.functional.
scaled_dot_product_attention` on the same (unquantized) data laid out contiguously. Reports
time per call and achieved memory bandwidth (bytes of K, V, scales, queries and outputs
moved, over time) against the device's peak. Goal: 70% of peak at batch 64, context 4k.
Prints a table and writes JSON.
"""

import argparse
import functools
import json
import sys

import torch
import torch.nn.functional as F
from pagefleet_kernels import triton_attention
from pagefleet_kernels.kv_cache import SCALE_DTYPE, is_quantized, kv_cache_torch_dtype
from triton.testing import do_bench

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
# Nominal HBM bandwidth in GB/s by a substring of torch.cuda.get_device_name().
PEAK_GBPS = {
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,
    "GH200": 4000,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "A10G": 600,
    "RTX 4090": 1008,
}


def nominal_peak_gbps(name: str) -> float | None:
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps
    return None


def copy_bandwidth_gbps() -> float:
    """What a plain device-to-device copy of 2 GiB reaches (read + write)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def paged_inputs(batch: int, context: int, cache: str) -> dict:
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    cache_dtype = kv_cache_torch_dtype(cache, DTYPE)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

    def pool():
        values = torch.randn(shape, dtype=DTYPE, device="cuda")
        if cache == "int8":
            return values.mul_(40).clamp_(-127, 127).to(torch.int8)
        return values.to(cache_dtype)

    scales = {}
    if is_quantized(cache_dtype):
        scales = {
            name: torch.rand(shape[:3], dtype=SCALE_DTYPE, device="cuda") * 0.02
            for name in ("key_scale", "value_scale")
        }
    return dict(
        query=torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda"),
        key_cache=pool(),
        value_cache=pool(),
        block_tables=torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq),
        seq_lens=torch.full((batch,), context, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int64, device="cuda"),
        scale=HEAD_DIM**-0.5,
        query_lens=[1] * batch,
        **scales,
    )


def bytes_moved(inputs: dict) -> int:
    tensors = [
        inputs["key_cache"],
        inputs["value_cache"],
        inputs["query"],
        inputs["query"],
        inputs["block_tables"],
    ]  # the query twice: read it, write the output
    tensors += [inputs[k] for k in ("key_scale", "value_scale") if k in inputs]
    return sum(t.numel() * t.element_size() for t in tensors)


def fits(batch: int, context: int) -> bool:
    # Paged bf16 K/V plus the contiguous copy for SDPA, with headroom.
    need = 2 * 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    free, _ = torch.cuda.mem_get_info()
    return need < 0.8 * free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-kernels.json")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--caches", nargs="+", default=["auto", "fp8", "int8"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench-kernels needs a CUDA device")

    name = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth_gbps()
    peak = nominal_peak_gbps(name) or copy_gbps
    print(
        f"{name}: nominal peak {nominal_peak_gbps(name)} GB/s, measured copy "
        f"{copy_gbps:.0f} GB/s; percentages are of {peak:.0f} GB/s"
    )
    print(
        f"{'batch':>5} {'context':>7} {'cache':>5} {'triton us':>10} {'GB/s':>7} "
        f"{'% peak':>6} {'sdpa us':>9} {'GB/s':>7}"
    )
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            if not fits(batch, context):
                print(f"{batch:>5} {context:>7} skipped: does not fit in device memory")
                continue
            sdpa = None
            for cache in args.caches:
                inputs = paged_inputs(batch, context, cache)
                run = functools.partial(triton_attention.paged_attention, **inputs)
                ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                gbps = bytes_moved(inputs) / (ms * 1e-3) / 1e9
                if sdpa is None:  # SDPA on the same K/V, contiguous (B, H, S, D)
                    q = inputs["query"][:, :, None, :]  # (B, Hq, 1, D)
                    k, v = (
                        inputs[n][inputs["block_tables"]]
                        .view(batch, context, NUM_KV_HEADS, HEAD_DIM)
                        .transpose(1, 2)
                        .contiguous()
                        for n in ("key_cache", "value_cache")
                    )  # (B, Hkv, S, D)
                    run = functools.partial(
                        F.scaled_dot_product_attention, q, k, v, enable_gqa=True
                    )
                    sdpa_ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                    sdpa_bytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
                    sdpa = (sdpa_ms, sdpa_bytes / (sdpa_ms * 1e-3) / 1e9)
                    del q, k, v, run
                row = dict(
                    batch=batch,
                    context=context,
                    cache=cache,
                    triton_us=ms * 1e3,
                    triton_gbps=gbps,
                    percent_of_peak=100 * gbps / peak,
                    sdpa_us=sdpa[0] * 1e3,
                    sdpa_gbps=sdpa[1],
                )
                rows.append(row)
                print(
                    f"{batch:>5} {context:>7} {cache:>5} {row['triton_us']:>10.1f} "
                    f"{gbps:>7.0f} {row['percent_of_peak']:>6.1f} {row['sdpa_us']:>9.1f} "
                    f"{sdpa[1]:>7.0f}"
                )
                del inputs, run
                torch.cuda.empty_cache()

    goal = [r for r in rows if (r["batch"], r["context"], r["cache"]) == (64, 4096, "auto")]
    if goal:
        verdict = "met" if goal[0]["percent_of_peak"] >= 70 else "missed"
        print(
            f"goal (70% of peak at batch 64, context 4k, bf16 cache): "
            f"{goal[0]['percent_of_peak']:.1f}%, {verdict}"
        )
    with open(args.output, "w") as f:
        json.dump(
            {
                "device": name,
                "nominal_peak_gbps": nominal_peak_gbps(name),
                "copy_gbps": copy_gbps,
                "shape": {
                    "num_q_heads": NUM_Q_HEADS,
                    "num_kv_heads": NUM_KV_HEADS,
                    "head_dim": HEAD_DIM,
                    "block_size": BLOCK_SIZE,
                    "dtype": "bfloat16",
                },
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
