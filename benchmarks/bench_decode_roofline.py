"""The model runner's decode step against the byte roofline
(`python -m benchmarks.bench_decode_roofline`).

A Llama-architecture model of Llama-3-8B's shape (32 layers, hidden 4096, 32 query and 8
KV heads of 128, intermediate 14336, vocabulary 128256) with random weights made on the
device (nothing is downloaded or written to disk), in bfloat16. For each batch size (1, 8,
64 by default) every sequence holds `--context` tokens of KV cache in blocks spread over
the pool, and one decode step runs as the engine runs it: the step's inputs built and
copied (`StepBuffers.build`), the forward pass (`ModelRunner.run`), the LM head over the
last rows and a greedy pick. The step time (the median of `--steps` timed steps after
warm-up, the device synchronized around each) is compared with the byte roofline: the bytes
one step must read (every weight matrix once, the norms, the LM head, and each sequence's
K/V) over the device's memory bandwidth, nominal where its name is known and measured by a
plain copy otherwise.

On CUDA this is the figure the GPU targets are set against (decode within 1.3x of the
roofline at batch 1). `--shape tiny` runs the same code on any device in seconds (the
test runs it on the CPU); on the CPU the bandwidth is the measured copy's. Prints a table
and writes JSON.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from pagefleet_serve.attention import get_kernel_backend
from pagefleet_serve.engine.device import RunnerConfig, resolve_device
from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.context import ModelContext
from pagefleet_serve.model.loader.model_loader import TINY_CONFIG, from_weights, random_weights

SHAPES = {
    "8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    "tiny": TINY_CONFIG,  # builtin://tiny-random's shape
}
BLOCK_SIZE = 16


def step_bytes(c: ModelConfig, batch: int, context: int, element: int) -> dict[str, int]:
    """What one decode step must read: every layer's matrices and norms, the final norm
    and the LM head (the embedding table only at the batch's rows), and the K/V of every
    sequence's context."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size + 2 * h
    weights = c.num_layers * per_layer + h + c.vocab_size * h + batch * h
    kv_cache = 2 * c.num_layers * batch * context * kv
    return {"weights": weights * element, "kv_cache": kv_cache * element}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """A plain copy's bytes read and written per second (the best of five)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best / 1e9


def peak_gbps(device: torch.device, measured: float) -> tuple[float, str]:
    if device.type == "cuda":
        from benchmarks.bench_kernels import nominal_peak_gbps

        nominal = nominal_peak_gbps(torch.cuda.get_device_name(device))
        if nominal is not None:
            return float(nominal), "nominal"
    return measured, "measured copy"


@torch.inference_mode()
def time_decode(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """The median seconds of one decode step over `batch` sequences of `context` tokens."""
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    runner.allocate_kv_cache(batch * per_seq)
    # Sequence i's blocks interleave with the others' (block j of i is j * batch + i), as
    # a pool that served many requests hands them out.
    tables = [[j * batch + i for j in range(per_seq)] for i in range(batch)]
    ids, starts, lens = [1] * batch, [context] * batch, [1] * batch
    rows = list(range(batch))
    device = runner.device
    times = []
    for step in range(steps + 3):
        synchronize(device)
        started = time.perf_counter()
        inputs = runner.buffers.build(ids, starts, lens, tables, rows, rows)
        hidden = runner.run(inputs)
        logits = runner.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        logits.argmax(dim=-1)
        synchronize(device)
        if step >= 3:  # warm-up: first calls, compiles, allocator growth
            times.append(time.perf_counter() - started)
    runner.free_kv_cache()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default="benchmarks/results/decode_roofline.json")
    args = parser.parse_args()

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    config = SHAPES[args.shape]
    runner_config = RunnerConfig(
        device=device,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        attention_backend=args.attention_backend,
        kv_cache_dtype="auto",
    )
    weights = random_weights(config, dtype, device)
    with torch.device(device):  # the parameters where the weights are made
        backend = get_kernel_backend(args.attention_backend, device)
        loaded = from_weights(
            args.shape, config, weights.items(), ModelContext(backend, dtype=dtype)
        )
    runner = ModelRunner(loaded, runner_config)
    del weights
    backend = runner.model.backend.name
    measured = copy_bandwidth_gbps(device, (1 << 31) if device.type == "cuda" else (1 << 27))
    peak, source = peak_gbps(device, measured)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}, {args.shape} shape, {args.dtype}, {backend} attention, context "
        f"{args.context}: bandwidth {peak:.0f} GB/s ({source}; copy measured {measured:.0f})"
    )
    print(f"{'batch':>5} {'step ms':>9} {'roofline ms':>11} {'x roofline':>10} {'GB/s':>7}")
    element = torch.empty((), dtype=dtype).element_size()
    rows = []
    for batch in args.batches:
        seconds = time_decode(runner, batch, args.context, args.steps)
        moved = step_bytes(config, batch, args.context, element)
        total = sum(moved.values())
        roofline = total / (peak * 1e9)
        row = dict(
            batch=batch,
            context=args.context,
            step_ms=seconds * 1e3,
            roofline_ms=roofline * 1e3,
            times_roofline=seconds / roofline,
            achieved_gbps=total / seconds / 1e9,
            weight_bytes=moved["weights"],
            kv_bytes=moved["kv_cache"],
        )
        rows.append(row)
        print(
            f"{batch:>5} {row['step_ms']:>9.3f} {row['roofline_ms']:>11.3f} "
            f"{row['times_roofline']:>10.2f} {row['achieved_gbps']:>7.0f}"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(
        device=name,
        shape=args.shape,
        dtype=args.dtype,
        attention_backend=backend,
        bandwidth_gbps=peak,
        bandwidth_source=source,
        copy_gbps=measured,
        cuda_graphs=False,  # not built yet: every step runs eagerly
        rows=rows,
    )
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
