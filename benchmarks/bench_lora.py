"""Multi-LoRA serving against the base model alone, on the built-in model (offline engine,
float32, greedy, ignore_eos): `--concurrency` requests at a time, output tokens/s of the
base model alone and of batches whose requests cycle through `--adapters` random adapters
(rank `--rank`, every projection of every layer adapted), one engine, in alternating
order over `--repeats` passes so that both see the same machine load. Prints the ratio
(issue 39's target: at least 0.75x) and writes JSON.

    PYTHONPATH=servingpod:kernels python benchmarks/bench_lora.py --out lora.json
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from pagefleet_serve import LLM, SamplingParams

MODEL = "builtin://smollm2-135m"
# SmolLM2-135M: 30 layers, hidden 576, 9 heads and 3 KV heads of 64, MLP 1536.
LAYERS = 30
SHAPES = {  # PEFT module -> (inputs, outputs)
    "self_attn.q_proj": (576, 576),
    "self_attn.k_proj": (576, 192),
    "self_attn.v_proj": (576, 192),
    "self_attn.o_proj": (576, 576),
    "mlp.gate_proj": (576, 1536),
    "mlp.up_proj": (576, 1536),
    "mlp.down_proj": (1536, 576),
}
PROMPTS = [
    "Explain how a paged KV cache works.",
    "Write a haiku about Kubernetes.",
    "What is a LoRA adapter?",
    "List three uses of a hash table.",
    "Summarize the plot of Hamlet.",
    "How does continuous batching help throughput?",
    "Describe the water cycle.",
    "Why is the sky blue?",
]


def write_adapter(path: Path, rank: int, seed: int) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": sorted({name.split(".")[-1] for name in SHAPES}),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in SHAPES.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    save_file(tensors, path / "adapter_model.safetensors")


def run(llm: LLM, prompts: list[str], names: list[str | None], max_tokens: int) -> float:
    """Output tokens/s of the prompts run `len(prompts)` at a time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_name=names)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        names = [f"adapter-{i}" for i in range(args.adapters)]
        for seed, name in enumerate(names):
            write_adapter(Path(root) / name, args.rank, seed)
        llm = LLM(
            MODEL,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=256 << 20,
            max_num_seqs=args.concurrency,
            enable_lora=True,
            lora_modules=[f"{name}={Path(root) / name}" for name in names],
            max_loras=args.adapters,
            max_lora_rank=args.rank,
        )
        prompts = (PROMPTS * args.concurrency)[: args.concurrency]
        mixed = [names[i % len(names)] for i in range(args.concurrency)]
        run(llm, prompts, mixed, 4)  # warm-up: every adapter into its slot
        rows: dict[str, list[float]] = {"base": [], "mixed": []}
        for repeat in range(args.repeats):
            order = ["base", "mixed"] if repeat % 2 == 0 else ["mixed", "base"]
            for kind in order:
                lora = [None] * len(prompts) if kind == "base" else mixed
                rows[kind].append(run(llm, prompts, lora, args.max_tokens))
    base, adapted = (sorted(rows[k])[len(rows[k]) // 2] for k in ("base", "mixed"))
    result = {
        "model": MODEL,
        "concurrency": args.concurrency,
        "adapters": args.adapters,
        "rank": args.rank,
        "max_tokens": args.max_tokens,
        "runs_output_tokens_per_s": rows,
        "median_base": base,
        "median_mixed": adapted,
        "ratio": adapted / base,
        "load_average": os.getloadavg()[0],
    }
    print(
        f"c={args.concurrency}: base {base:.1f} tok/s, {args.adapters} adapters mixed "
        f"{adapted:.1f} tok/s, {adapted / base:.2f}x (load {result['load_average']:.1f})"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
