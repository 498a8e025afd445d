"""A mixture-of-experts decode step against a dense one of the same active parameters
(`python -m benchmarks.bench_moe`).

Two random checkpoints are written side by side: a Qwen3-MoE model (`--experts` experts of
`--expert-size`, `--top-k` a token) and a dense Qwen3 model whose MLP is `--top-k` times
an expert's width, everything else equal, so that one token runs the same number of
weights in both (the router's `--experts` rows aside). For each batch size, that many
requests are prefilled, then pure decode steps are timed on each engine in turn (the same
machine load); the fastest step of each is kept. A decode step of a mixture reads only the
experts its tokens chose: the bytes of weights it reads (attention, router, the distinct
experts each layer's tokens chose, read from the layers' expert load, the LM head) are
reported against the active-parameter bytes of one token. The operator alone is also
timed at the model's sizes: the reference loop over experts (torch backend), the grouped
path with PyTorch's matmuls, and the grouped path as the cpu backend declares it (few rows
through the C++ matmul). Prints tables and writes JSON.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from pagefleet_kernels import moe
from pagefleet_kernels.backend import cpu_backend
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.messages import Request
from pagefleet_serve.model.layers.moe import MoEBlock
from pagefleet_serve.sampling_params import SamplingParams
from safetensors.torch import save_file

from benchmarks.side_by_side.common import cpu_info


def shapes(args, moe: bool) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of the checkpoint (experts stacked, as transformers
    writes them in its own format)."""
    h, d = args.hidden, args.head_dim
    q, kv = args.heads * d, args.kv_heads * d
    out = {
        "model.embed_tokens.weight": (args.vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (args.vocab, h),
    }
    for i in range(args.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        }
        if moe:
            e, size = args.experts, args.expert_size
            out |= {
                p + "mlp.gate.weight": (e, h),
                p + "mlp.experts.gate_up_proj": (e, 2 * size, h),
                p + "mlp.experts.down_proj": (e, h, size),
            }
        else:
            size = args.top_k * args.expert_size
            out |= {
                p + "mlp.gate_proj.weight": (size, h),
                p + "mlp.up_proj.weight": (size, h),
                p + "mlp.down_proj.weight": (h, size),
            }
    return out


def write_checkpoint(path: Path, args, moe: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes(args, moe).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors")
    config = {
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.top_k * args.expert_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_size,
        "norm_topk_prob": True,
    }
    (path / "config.json").write_text(json.dumps(config))


def weight_bytes(args, element: int) -> dict[str, int]:
    """Bytes of one layer's attention, router and expert (or dense MLP), and the head's."""
    h, d = args.hidden, args.head_dim
    attention = (2 * args.heads * d * h + 2 * args.kv_heads * d * h) * element
    return {
        "attention": attention,
        "router": args.experts * h * element,
        "expert": 3 * args.expert_size * h * element,
        "head": args.vocab * h * element,
    }


def start(path: Path, args, batch: int) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype=args.dtype,
            max_num_seqs=batch,
            max_model_len=args.prompt_len + args.steps + 16,
            kv_cache_memory_bytes=256 << 20,
        )
    )
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_len)]
        engine.add(Request(f"moe-{batch}-{i}", prompt, params, time.time()))
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running
    ):
        engine.step()
    engine.step()  # warm-up
    return engine


def measure_batch(moe_path: Path, dense_path: Path, args, batch: int) -> dict:
    engines = {"moe": start(moe_path, args, batch), "dense": start(dense_path, args, batch)}
    blocks = [m for m in engines["moe"].runner.model.modules() if isinstance(m, MoEBlock)]
    for block in blocks:
        block.record_expert_load = True
    times: dict[str, list[float]] = {"moe": [], "dense": []}
    distinct_experts = []
    for _ in range(args.steps):
        for name, engine in engines.items():
            started = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - started)
        distinct_experts.append(
            sum(
                int((block.expert_load > 0).sum())
                for block in blocks
                if block.expert_load is not None
            )
        )
    element = engines["moe"].dtype.itemsize
    sizes = weight_bytes(args, element)
    layers = args.layers
    dense_layer = sizes["attention"] + args.top_k * sizes["expert"]
    active = layers * (dense_layer + sizes["router"]) + sizes["head"]
    # The mean over the timed steps of the distinct experts read, all layers together.
    experts_read = sum(distinct_experts) / len(distinct_experts)
    read = layers * (sizes["attention"] + sizes["router"]) + experts_read * sizes["expert"]
    read += sizes["head"]
    moe_ms, dense_ms = min(times["moe"]) * 1e3, min(times["dense"]) * 1e3
    return {
        "batch": batch,
        "moe_step_ms": round(moe_ms, 2),
        "dense_step_ms": round(dense_ms, 2),
        "ratio": round(moe_ms / dense_ms, 2),
        "active_param_mb": round(active / 1e6, 1),
        "moe_read_mb_per_step": round(read / 1e6, 1),
        "dense_read_mb_per_step": round((layers * dense_layer + sizes["head"]) / 1e6, 1),
        "read_over_active": round(read / active, 2),
        "distinct_experts_per_layer": round(experts_read / layers, 1),
    }


@torch.inference_mode()
def measure_operator(args, tokens: int, repeats: int = 20) -> dict:
    """Microseconds per call of each implementation on `tokens` rows (fastest of
    `repeats`, interleaved)."""
    generator = torch.Generator().manual_seed(tokens)
    dtype = getattr(torch, args.dtype)
    e, size, h = args.experts, args.expert_size, args.hidden
    x = torch.randn(tokens, h, generator=generator).to(dtype)
    gate_up = (torch.randn(e, 2 * size, h, generator=generator) / h**0.5).to(dtype)
    down = (torch.randn(e, h, size, generator=generator) / size**0.5).to(dtype)
    weights, ids = moe.route(torch.randn(tokens, e, generator=generator), args.top_k, True)
    weights = weights.to(dtype)
    implementations = {
        "reference": moe.fused_moe,
        "grouped_torch": moe.grouped_fused_moe,
        "grouped_cpu_backend": cpu_backend().fused_moe,
    }
    best = {name: float("inf") for name in implementations}
    for _ in range(repeats):
        for name, op in implementations.items():
            started = time.perf_counter()
            op(x, gate_up, down, weights, ids, False)
            best[name] = min(best[name], time.perf_counter() - started)
    return {"tokens": tokens} | {f"{name}_us": round(t * 1e6, 1) for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch")
    parser.add_argument("--operator-tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--output", default="bench-moe.json")
    args = parser.parse_args()
    cpu = cpu_info()  # machines differ: the figures mean nothing without it
    print(f"CPU: {cpu['model']} ({' '.join(cpu['notable_flags'])})")
    with tempfile.TemporaryDirectory() as tmp:
        moe_path, dense_path = Path(tmp) / "moe", Path(tmp) / "dense"
        write_checkpoint(moe_path, args, moe=True)
        write_checkpoint(dense_path, args, moe=False)
        rows = []
        for batch in args.batches:
            rows.append(measure_batch(moe_path, dense_path, args, batch))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(
        f"{args.experts} experts of {args.expert_size}, top {args.top_k}, hidden {args.hidden}, "
        f"{args.layers} layers, {args.dtype}, {torch.get_num_threads()} threads"
    )
    header = f"{'batch':>6} {'moe ms':>8} {'dense ms':>9} {'ratio':>6} {'read MB':>8}"
    print(f"{header} {'active MB':>10} {'read/active':>12} {'experts/layer':>14}")
    for r in rows:
        print(
            f"{r['batch']:>6} {r['moe_step_ms']:>8.2f} {r['dense_step_ms']:>9.2f} "
            f"{r['ratio']:>6.2f} {r['moe_read_mb_per_step']:>8.1f} {r['active_param_mb']:>10.1f} "
            f"{r['read_over_active']:>12.2f} {r['distinct_experts_per_layer']:>14.1f}"
        )
    operator = [measure_operator(args, tokens) for tokens in args.operator_tokens]
    print(f"the operator alone, us: {'tokens':>6} {'reference':>10} {'grouped':>8} {'cpu':>8}")
    for r in operator:
        print(
            f"{'':>23} {r['tokens']:>6} {r['reference_us']:>10.0f} {r['grouped_torch_us']:>8.0f} "
            f"{r['grouped_cpu_backend_us']:>8.0f}"
        )
    results = {
        "cpu": {"model": cpu["model"], "notable_flags": cpu["notable_flags"]},
        "model": {k: v for k, v in vars(args).items() if k not in ("batches", "output")},
        "threads": torch.get_num_threads(),
        "rows": rows,
        "operator": operator,
    }
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
