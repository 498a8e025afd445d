"""KV cache quantization quality on the built-in model (`make bench-kvquant`).

Perplexity of SmolLM2-135M-Instruct over /usr/share/common-licenses/GPL-3 with an
unquantized, an fp8 and an int8 KV cache: the text runs in windows of `--window` tokens,
each prefilled in chunks of `--chunk` through the engine's model runner, so every token's
attention reads its context back from the (quantized) paged cache. Then the greedy outputs
of 20 chat prompts with each quantized cache are compared with the unquantized run.
Prints a table and writes JSON.
"""

import argparse
import json
import math
import time

import torch
from pagefleet_kernels.metadata import AttentionMetadata
from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.config import KV_CACHE_DTYPES
from pagefleet_serve.engine.device import RunnerConfig
from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.model.loader.model_loader import load_model

MODEL = "builtin://smollm2-135m"
TEXT = "/usr/share/common-licenses/GPL-3"
BLOCK_SIZE = 16
PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 50.",
    "What does a paged KV cache do in an LLM server?",
    "Translate 'good morning, my friend' into Spanish.",
    "Give me three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Write a Python function that reverses a string.",
    "What is 17 multiplied by 23?",
    "Name two differences between a cat and a dog.",
    "How many continents are there, and which is the largest?",
    "Describe the water cycle for a ten-year-old.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Suggest a name for a bakery that sells only bread.",
    "Why do we have leap years?",
    "Write a short motivational quote about learning.",
    "What causes the seasons on Earth?",
    "Explain what a prime number is and give an example.",
]


@torch.inference_mode()
def perplexity(
    kv_cache_dtype: str,
    token_ids: list[int],
    window: int,
    chunk: int,
    quantization: str = "none",
    activation_quantization: str = "none",
) -> dict:
    """`quantization`, `activation_quantization`: of the weights and of the 4-bit matmuls'
    activations (see bench_weight_quant.py); float32 expanded here."""
    loaded = load_model(MODEL, torch.float32, quantization)
    runner = ModelRunner(
        loaded,
        RunnerConfig(
            torch.device("cpu"),
            torch.float32,
            BLOCK_SIZE,
            "auto",
            kv_cache_dtype,
            activation_quantization=activation_quantization,
        ),
    )
    num_blocks = -(-window // BLOCK_SIZE)
    runner.allocate_kv_cache(num_blocks)
    # One sequence owning blocks 0..n-1 in order: position p lives in slot p.
    block_tables = torch.arange(num_blocks, dtype=torch.int64)[None, :]
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = torch.tensor(token_ids[start : start + window], dtype=torch.int64)
        for lo in range(0, len(ids), chunk):
            hi = min(lo + chunk, len(ids))
            positions = torch.arange(lo, hi)
            attn = AttentionMetadata(
                slot_mapping=positions,
                block_tables=block_tables,
                seq_lens=torch.tensor([hi]),
                query_start_loc=torch.tensor([0, hi - lo]),
                query_lens=[hi - lo],
            )
            hidden = runner.model(ids[lo:hi], positions, runner.kv_caches, attn)
            logprobs = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            targets = ids[lo + 1 : hi + 1]  # the next token of each position in this chunk
            nll -= logprobs[: len(targets)].gather(1, targets[:, None]).sum().item()
            count += len(targets)
    return {
        "perplexity": math.exp(nll / count),
        "tokens_scored": count,
        "num_blocks_per_gib": (1 << 30) // runner.bytes_per_block,
    }


def greedy_outputs(kv_cache_dtype: str, max_tokens: int) -> list[list[int]]:
    # float32 weights and activations, as in perplexity(): only the KV cache differs.
    llm = LLM(
        MODEL,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=2048,
        kv_cache_memory_bytes=256 << 20,
    )
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [out.outputs[0].token_ids for out in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="per greedy prompt")
    parser.add_argument("--output", default="bench-kvquant.json")
    args = parser.parse_args()
    torch.manual_seed(0)

    tokenizer = load_model(MODEL, torch.float32).tokenizer
    with open(TEXT, encoding="utf-8") as f:
        token_ids = tokenizer.encode(f.read(), add_special_tokens=False)
    results = {
        "model": MODEL,
        "text": TEXT,
        "text_tokens": len(token_ids),
        "window": args.window,
        "chunk": args.chunk,
        "caches": {},
    }
    greedy = {}
    for kv_cache_dtype in KV_CACHE_DTYPES:
        started = time.monotonic()
        entry = perplexity(kv_cache_dtype, token_ids, args.window, args.chunk)
        greedy[kv_cache_dtype] = greedy_outputs(kv_cache_dtype, args.max_tokens)
        entry["seconds"] = round(time.monotonic() - started, 1)
        print(
            f"{kv_cache_dtype}: perplexity {entry['perplexity']:.4f} ({entry['seconds']}s)",
            flush=True,
        )
        results["caches"][kv_cache_dtype] = entry

    base = results["caches"]["auto"]["perplexity"]
    print(f"{MODEL} over {TEXT}: {len(token_ids)} tokens, windows of {args.window}")
    print(
        f"{'kv cache':>8} {'perplexity':>11} {'vs auto':>8} {'blocks/GiB':>11} "
        f"{'greedy = auto':>14}"
    )
    for name, entry in results["caches"].items():
        entry["relative_to_auto"] = entry["perplexity"] / base - 1
        matches = sum(a == b for a, b in zip(greedy[name], greedy["auto"], strict=True))
        entry["greedy_exact_matches"] = matches
        entry["greedy_prompts"] = len(PROMPTS)
        print(
            f"{name:>8} {entry['perplexity']:>11.4f} {entry['relative_to_auto']:>+8.2%} "
            f"{entry['num_blocks_per_gib']:>11} {matches:>9}/{len(PROMPTS)}"
        )
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
