"""Ahead-of-time compiles of every Triton kernel variant the engine can launch, for the GPUs
it targets, on a machine without one: `triton.compile` with a named `GPUTarget` runs the
whole pipeline down to Triton's bundled ptxas. The kernel tests run this file as a script
(`python -m tests.kernels.triton_aot pairwise|product OUT.json`, from the repository root)
in a child process without TRITON_INTERPRET: under the interpreter, `triton.jit` (Triton's
own library included) yields functions that cannot be compiled.

The variants come from the launchers themselves: each variant's batch goes through the real
`paged_attention` / `write_kv_cache` (or a layer op of `triton_layer_ops`, or the MoE
operator of `triton_moe`: mode `moe`, or the LoRA operator of `triton_lora`: mode `lora`)
with the kernels swapped for recorders, and the recorded arguments become the compile's
signature, constexprs and divisibility hints the way the JIT specialises them. Tile shapes,
segment counts and warps therefore cannot drift from what the launcher picks.
"""

import contextlib
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Iterator

import torch
import triton
from pagefleet_kernels import triton_attention, triton_layer_ops, triton_lora, triton_moe
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tests.kernels.kernel_batches import CACHE_DTYPES, make_batch

# Largest shared memory one block can use (opt-in), CUDA C Programming Guide, "Technical
# Specifications per Compute Capability": A100 163 KiB, L4 / RTX 40xx 99 KiB, H100 227 KiB.
MAX_SHARED_BYTES = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# fp8 e4m3 needs 8.9+ (the launcher refuses it below); the rest runs on 8.0+.
TARGETS = {"fp8": (89, 90)}
DEFAULT_TARGETS = (80, 90)
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int8: "*i8",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
SLIDING_WINDOW = 4096
SOFTCAP = 50.0

AXES = {
    "dtype": (torch.float16, torch.bfloat16, torch.float32),
    "cache": tuple(CACHE_DTYPES),
    "head_dim": (64, 128),
    "group": (1, 4, 8),
    "block_size": (16, 32),
    # decode batches at each segment count the launcher can pick; prefill chunks never split
    "shape": tuple(("decode", n) for n in triton_attention.SEGMENT_COUNTS) + (("prefill", 1),),
    # gpt-oss: sinks with a window on half its layers (the merge kernel adds them too)
    "features": ("plain", "sliding_window", "sliding_window+softcap", "sliding_window+sinks"),
}
NUM_KV_HEADS = 8  # Llama-3-8B's; the strides' divisibility by 16 follows from it
KERNELS = ("_write_kv_cache_kernel", "_paged_attention_kernel", "_merge_segments_kernel")

# The layer ops' launches: each kernel in each dtype, at the sizes of Llama-3-8B (hidden
# 4096, intermediate 14336, 32 q and 8 KV heads of 128) and SmolLM2-135M (576, 1536, 9 and 3
# of 64), Gemma's norms and GeGLU, a per-head q/k norm (Qwen3). Listed, not crossed: their
# kernels have few constexprs, and rows of 1536 and 14336 compile to the same source.
LAYER_OP_VARIANTS = (
    {"op": "add_rms_norm", "dtype": torch.bfloat16, "size": 4096},
    {"op": "add_rms_norm", "dtype": torch.float16, "size": 576, "unit_offset": True},
    {"op": "rms_norm", "dtype": torch.float32, "size": 128, "heads": 32},
    {"op": "rope", "dtype": torch.bfloat16, "size": 128, "heads": 32 + 8},
    {"op": "rope", "dtype": torch.float16, "size": 64, "heads": 9 + 3},
    {"op": "rope", "dtype": torch.float32, "size": 64, "heads": 9 + 3},
    {"op": "act_and_mul", "dtype": torch.bfloat16, "size": 14336},
    {"op": "act_and_mul", "dtype": torch.bfloat16, "size": 1536},
    {"op": "act_and_mul", "dtype": torch.float16, "size": 1536, "gelu": True},
    {"op": "act_and_mul", "dtype": torch.float32, "size": 1536},
)
LAYER_OP_KERNELS = {
    "rms_norm": "_rms_norm_kernel",
    "add_rms_norm": "_rms_norm_kernel",
    "rope": "_rope_kernel",
    "act_and_mul": "_act_and_mul_kernel",
}


# The MoE grouped GEMM's launches (both of one forward: [gate | up], then down with the
# routing weights) in each dtype, at the shapes of Qwen3-30B-A3B (hidden 2048, experts of
# 768, 128 experts, top 8) and Mixtral-8x7B (4096, 14336, 8, top 2): a decode row (tiles of
# 16 rows) and a 512-token prefill chunk (32 and 64), for sm_80, sm_89 and sm_90.
MOE_TARGETS = (80, 89, 90)
MOE_VARIANTS = tuple(
    {"dtype": dtype, "tokens": tokens, **model}
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for tokens in (1, 512)
    for model in (
        {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8},
        {"hidden": 4096, "intermediate": 14336, "experts": 8, "top_k": 2},
    )
)


# The LoRA operator's two launches (shrink, expand) in each dtype, for a decode row and the
# most rows it takes, at SmolLM2-135M's fused q/k/v (576 -> 960, three parts of rank 16) and
# Llama-3-8B's gate/up (4096 -> 28672, two of 16) and down (14336 -> 4096, one of 64),
# four slots: `python -m tests.kernels.triton_aot lora OUT.json`.
LORA_VARIANTS = tuple(
    {"dtype": dtype, "rows": rows, "fan_in": fan_in, "fan_out": fan_out, "rank": rank}
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for rows in (1, triton_lora.MAX_ROWS)
    for fan_in, fan_out, rank in ((576, 960, 48), (4096, 28672, 32), (14336, 4096, 64))
)


def pairwise(axes: dict[str, tuple]) -> list[dict]:
    """A covering array of strength two, built greedily: each row starts from the first
    pair of values still uncovered and fills every other axis with the value that covers
    the most new pairs. Values are handled by their index in the axis."""
    names = list(axes)
    sizes = [len(axes[name]) for name in names]

    def pair(a, i, b, j):
        return (a, i, b, j) if a < b else (b, j, a, i)

    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(range(len(names)), 2)
        for i in range(sizes[a])
        for j in range(sizes[b])
    }
    rows = []
    while uncovered:
        a, i, b, j = min(uncovered)
        row = {a: i, b: j}
        for axis in range(len(names)):
            if axis not in row:
                row[axis] = max(
                    range(sizes[axis]),
                    key=lambda value, axis=axis: sum(
                        pair(axis, value, other, row[other]) in uncovered for other in row
                    ),
                )
        uncovered -= {
            pair(a, row[a], b, row[b]) for a, b in itertools.combinations(range(len(names)), 2)
        }
        rows.append({name: axes[name][row[axis]] for axis, name in enumerate(names)})
    return rows


def product(axes: dict[str, tuple]) -> list[dict]:
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def variant_id(variant: dict) -> str:
    kind, segments = variant["shape"]
    return (
        f"{str(variant['dtype']).removeprefix('torch.')}-kv_{variant['cache']}"
        f"-d{variant['head_dim']}-g{variant['group']}-bs{variant['block_size']}"
        f"-{kind}{segments if kind == 'decode' else ''}-{variant['features']}"
    )


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the
    launch instead of running it."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def record_launches(module, kernel_names, launch) -> list[tuple]:
    """(kernel, args, kwargs) of every Triton launch `launch()` makes of `module`'s kernels."""
    recorders = {name: LaunchRecorder(getattr(module, name)) for name in kernel_names}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        launch()
    finally:
        for name, recorder in recorders.items():
            setattr(module, name, recorder.kernel)
    return [
        (recorder.kernel, args, kwargs)
        for recorder in recorders.values()
        for args, kwargs in recorder.launches
    ]


def record_step(variant: dict) -> list[tuple]:
    """The launches of one engine step of this attention variant: the K/V write, then the
    attention (and the segment merge when the decode is split)."""
    return record_launches(triton_attention, KERNELS, lambda: launch_variant(variant))


def launch_variant(variant: dict) -> None:
    kind, num_segments = variant["shape"]
    query_lens, context_lens = ([1, 1], [40, 7]) if kind == "decode" else ([5, 3], [9, 3])
    batch = make_batch(
        query_lens,
        context_lens,
        NUM_KV_HEADS * variant["group"],
        NUM_KV_HEADS,
        head_dim=variant["head_dim"],
        block_size=variant["block_size"],
        dtype=variant["dtype"],
        cache=variant["cache"],
    )
    triton_attention.write_kv_cache(
        batch.key,
        batch.value,
        batch.key_cache,
        batch.value_cache,
        batch.slot_mapping,
        batch.key_scale,
        batch.value_scale,
    )
    features = variant["features"]
    batch.attention(
        triton_attention,
        num_segments=num_segments if kind == "decode" else None,
        sliding_window=SLIDING_WINDOW if "sliding_window" in features else None,
        softcap=SOFTCAP if "softcap" in features else None,
        sinks=(
            torch.zeros(batch.query.shape[1], dtype=variant["dtype"])
            if "sinks" in features
            else None
        ),
    )


def layer_op_id(variant: dict) -> str:
    flags = [name for name in ("unit_offset", "gelu") if variant.get(name)]
    heads = f"-h{variant['heads']}" if "heads" in variant else ""
    return (
        "-".join(
            [variant["op"], str(variant["dtype"]).removeprefix("torch."), f"n{variant['size']}"]
            + flags
        )
        + heads
    )


def launch_layer_op(variant: dict) -> None:
    """The op on 3 tokens of the variant's sizes, on the CPU: the launcher takes CPU tensors
    while KERNEL_DEVICE says so (nothing runs; the kernels are recorders). Per-head inputs
    are views of wider fused rows, as the model passes them."""
    dtype, size, heads = variant["dtype"], variant["size"], variant.get("heads")
    tokens = 3

    def zeros(*shape):
        return torch.zeros(shape, dtype=dtype)

    def head_rows():  # (tokens, heads, size) of rows holding 8 more heads
        return zeros(tokens, (heads + 8) * size)[:, : heads * size].view(tokens, heads, size)

    op = getattr(triton_layer_ops, variant["op"])
    unit_offset = variant.get("unit_offset", False)
    device, triton_layer_ops.KERNEL_DEVICE = triton_layer_ops.KERNEL_DEVICE, "cpu"
    try:
        if variant["op"] == "rope":
            op(head_rows(), zeros(tokens, size), zeros(tokens, size))
        elif variant["op"] == "act_and_mul":
            op(zeros(tokens, 2 * size), variant.get("gelu", False))
        elif variant["op"] == "add_rms_norm":
            op(zeros(tokens, size), zeros(tokens, size), zeros(size), 1e-5, unit_offset)
        else:
            op(head_rows() if heads else zeros(tokens, size), zeros(size), 1e-5, unit_offset)
    finally:
        triton_layer_ops.KERNEL_DEVICE = device


def record_layer_op(variant: dict) -> list[tuple]:
    return record_launches(
        triton_layer_ops,
        tuple(dict.fromkeys(LAYER_OP_KERNELS.values())),
        lambda: launch_layer_op(variant),
    )


def moe_variant_id(variant: dict) -> str:
    return (
        f"moe-{str(variant['dtype']).removeprefix('torch.')}-t{variant['tokens']}"
        f"-h{variant['hidden']}-i{variant['intermediate']}-e{variant['experts']}"
        f"-k{variant['top_k']}"
    )


def launch_moe(variant: dict) -> None:
    """The operator on CPU tensors of the variant's shapes (nothing runs): each expert's
    weights one matrix broadcast over the experts (a stride of 0 has the real strides'
    divisibility, without gigabytes of zeros), pair j of token t on expert (t k + j) mod E."""
    dtype, hidden, intermediate = variant["dtype"], variant["hidden"], variant["intermediate"]
    experts, top_k, tokens = variant["experts"], variant["top_k"], variant["tokens"]
    gate_up = torch.zeros(1, 2 * intermediate, hidden, dtype=dtype).expand(experts, -1, -1)
    down = torch.zeros(1, hidden, intermediate, dtype=dtype).expand(experts, -1, -1)
    ids = (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    weights = torch.zeros(tokens, top_k, dtype=dtype)
    device, triton_layer_ops.KERNEL_DEVICE = triton_layer_ops.KERNEL_DEVICE, "cpu"
    try:
        triton_moe.fused_moe(torch.zeros(tokens, hidden, dtype=dtype), gate_up, down, weights, ids)
    finally:
        triton_layer_ops.KERNEL_DEVICE = device


def record_moe(variant: dict) -> list[tuple]:
    """The grouped GEMM's launches (the activation between them, a layer op compiled on its
    own, is recorded and left out)."""

    def launch() -> None:
        record_launches(triton_layer_ops, ("_act_and_mul_kernel",), lambda: launch_moe(variant))

    return record_launches(triton_moe, ("_grouped_gemm_kernel",), launch)


def lora_variant_id(variant: dict) -> str:
    return (
        f"lora-{str(variant['dtype']).removeprefix('torch.')}-r{variant['rows']}"
        f"-{variant['fan_in']}x{variant['fan_out']}-rank{variant['rank']}"
    )


def record_lora(variant: dict) -> list[tuple]:
    """The shrink's and the expand's launches for CPU tensors of the variant's shapes."""
    dtype, rows, rank = variant["dtype"], variant["rows"], variant["rank"]
    fan_in, fan_out, slots = variant["fan_in"], variant["fan_out"], 4
    y = torch.zeros(rows, fan_out, dtype=dtype)
    x = torch.zeros(rows, fan_in, dtype=dtype)
    lora_a = torch.zeros(slots, rank, fan_in, dtype=dtype)
    lora_b = torch.zeros(slots, fan_out, rank, dtype=dtype)
    token_slots = torch.arange(rows) % slots
    mapping = triton_lora.LoRAMapping(token_slots, [])

    def launch() -> None:
        device, triton_lora.KERNEL_DEVICE = triton_lora.KERNEL_DEVICE, "cpu"
        try:
            triton_lora.add_lora(y, x, lora_a, lora_b, mapping)
        finally:
            triton_lora.KERNEL_DEVICE = device

    return record_launches(triton_lora, ("_lora_shrink_kernel", "_lora_expand_kernel"), launch)


def compile_source(kernel, args: tuple, kwargs: dict) -> tuple[ASTSource, dict]:
    """The source the JIT would compile for this launch, and its compile options: tensors
    become typed pointers, constexprs their values; pointers aligned to 16 bytes and
    integers divisible by 16 get Triton's divisibility hint."""
    option_names = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")
    options = {key: kwargs[key] for key in option_names if key in kwargs}
    bound = dict(zip(kernel.arg_names[: len(args)], args, strict=True)) | {
        key: value for key, value in kwargs.items() if key not in options
    }
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            signature[param.name] = "fp32"
            divisible = False
        else:
            assert param.annotation in ("i32", "i64"), (
                f"{kernel.__name__}: integer argument {param.name} needs a tl.int32 / tl.int64 "
                f"annotation, or the JIT turns a value of 1 into a constexpr"
            )
            signature[param.name] = param.annotation
            divisible = value % 16 == 0
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constexprs, attrs), options


def compile_for(source: ASTSource, options: dict, capability: int) -> dict:
    """Compile for sm_<capability>; its shared memory, registers, spilled bytes and float
    fused multiply-adds."""
    ptxas_log = io.StringIO()
    with contextlib.redirect_stdout(ptxas_log):
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    log = ptxas_log.getvalue()
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    assert spills and registers, f"no ptxas resource report in the compile's output:\n{log}"
    return {
        "shared": compiled.metadata.shared,
        "registers": max(registers),
        "spill_stores": sum(spills),
        "num_warps": compiled.metadata.num_warps,
        "float_fmas": len(re.findall(r"\bfma\.rn\.f(?:16|32)", compiled.asm["ptx"])),
    }


# The distinct compiles of a run, read by the forked workers of compile_every_launch.
_PENDING: list[tuple[ASTSource, dict, int]] = []


def _compile_pending(index: int) -> dict:
    return compile_for(*_PENDING[index])


def compile_every_launch(runs: Iterator[tuple[str, list[tuple], tuple]]) -> dict:
    """(run id, launches, targets) -> {"num_compiles", "variants": {run id: reports}}: every
    launch compiled for each of its targets, a kernel that several variants share compiled
    once, the distinct compiles spread over the machine's CPUs (forked workers; each compile
    is a single-threaded walk down to ptxas). `runs` is consumed one at a time: a variant's
    tensors (hundreds of MB at Mixtral's shapes) are gone before the next is recorded."""
    global _PENDING
    distinct: dict[tuple, tuple[ASTSource, dict, int]] = {}
    plans: dict[str, list[tuple[str, int, tuple]]] = {}
    for run_id, launches, targets in runs:
        plan = plans[run_id] = []
        for kernel, args, kwargs in launches:
            source, options = compile_source(kernel, args, kwargs)
            for capability in targets:
                key = (source.hash(), str(options), capability)
                distinct.setdefault(key, (source, options, capability))
                plan.append((kernel.__name__, capability, key))
    keys = list(distinct)
    _PENDING = [distinct[key] for key in keys]
    workers = min(len(keys), os.cpu_count() or 1)
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            done = pool.map(_compile_pending, range(len(keys)), chunksize=1)
    else:
        done = [_compile_pending(index) for index in range(len(keys))]
    compiled = dict(zip(keys, done, strict=True))
    variants = {
        run_id: [
            {"kernel": kernel, "capability": capability} | compiled[key]
            for kernel, capability, key in plan
        ]
        for run_id, plan in plans.items()
    }
    return {"num_compiles": len(compiled), "variants": variants}


def recorded_runs(mode: str) -> Iterator[tuple[str, list[tuple], tuple]]:
    """(run id, launches, targets) of each variant of `mode`, recorded when asked for."""
    if mode == "moe":
        for variant in MOE_VARIANTS:
            yield moe_variant_id(variant), record_moe(variant), MOE_TARGETS
    elif mode == "lora":
        for variant in LORA_VARIANTS:
            yield lora_variant_id(variant), record_lora(variant), DEFAULT_TARGETS
    else:
        for variant in {"pairwise": pairwise, "product": product}[mode](AXES):
            targets = TARGETS.get(variant["cache"], DEFAULT_TARGETS)
            yield variant_id(variant), record_step(variant), targets
        for variant in LAYER_OP_VARIANTS:
            yield layer_op_id(variant), record_layer_op(variant), DEFAULT_TARGETS


def main(mode: str, out_path: str) -> None:
    with open(out_path, "w") as out:
        json.dump(compile_every_launch(recorded_runs(mode)), out)


if __name__ == "__main__":
    main(*sys.argv[1:])
