"""Time to first token of a long prompt: cold, from the device prefix cache, from the KV
tier's host memory, and from its files after a restart (`python -m benchmarks.bench_kv_tier`).

One engine with both tiers (host memory and a temporary directory) serves each prompt of
`--prefixes` tokens (random token ids, one prompt per length) four ways in turn: cold (its
first time), again (a device prefix-cache hit), after `reset_prefix_cache` (the host
tier's hit), then a second engine started over the same directory, with no host tier,
serves each again (the file tier's hit: a restart). Each request asks for one token, so
its wall time is its first token's.

Then decode throughput at `--concurrency` sequences of `--decode-tokens` tokens each, with
the tier copying out every block the decodes fill (host memory and files) and without a
tier, the two engines in turn `--rounds` times over fresh prompts (the best round of each
kept): the copies happen on the step, the file writes off it. Prints tables and writes
JSON (with the CPU's flags).
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.side_by_side.common import cpu_info


def first_token_s(llm, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the prompt's first token, and the prompt tokens served from a cache."""
    from pagefleet_serve.sampling_params import SamplingParams

    started = time.perf_counter()
    [output] = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - started, output.num_cached_tokens


def decode_tokens_per_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second of `prompts` decoded together to `max_tokens` each."""
    from pagefleet_serve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return sum(len(output.outputs[0].token_ids) for output in outputs) / elapsed


def decode_rows(args, settings: dict, directory: str, rng: random.Random) -> dict[str, float]:
    from pagefleet_serve import LLM

    engines = {
        "without_tier": LLM(**settings),
        "with_tier": LLM(**settings, kv_offloading_size=4.0, kv_offload_dir=directory),
    }
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            prompts = [
                [rng.randrange(300, 40000) for _ in range(64)] for _ in range(args.concurrency)
            ]
            best[name] = max(best[name], decode_tokens_per_s(llm, prompts, args.decode_tokens))
    for llm in engines.values():
        llm.engine.close()
    return {f"{name}_tokens_per_s": value for name, value in best.items()} | {
        "ratio": best["with_tier"] / best["without_tier"]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin://smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefixes", default="1024,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_tier.json"))
    args = parser.parse_args(argv)
    from pagefleet_serve import LLM

    lengths = [int(n) for n in args.prefixes.split(",")]
    rng = random.Random(0)
    prompts = {n: [rng.randrange(300, 40000) for _ in range(n)] for n in lengths}
    settings = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": max(*lengths, 64 + args.decode_tokens) + 16,
        "max_num_batched_tokens": 2048,
    }
    rows: dict[int, dict[str, float]] = {n: {} for n in lengths}
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as directory:
        llm = LLM(**settings, kv_offloading_size=4.0, kv_offload_dir=directory)
        for n, prompt in prompts.items():
            rows[n]["cold_s"], _ = first_token_s(llm, prompt)
            rows[n]["device_hit_s"], rows[n]["device_cached"] = first_token_s(llm, prompt)
            llm.engine.block_manager.reset_prefix_cache()
            rows[n]["host_tier_s"], rows[n]["host_cached"] = first_token_s(llm, prompt)
        llm.engine.close()  # its queued block writes finish
        restarted = LLM(**settings, kv_offload_dir=directory)
        for n, prompt in prompts.items():
            rows[n]["file_tier_s"], rows[n]["file_cached"] = first_token_s(restarted, prompt)
        restarted.engine.close()
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as directory:
        decode = decode_rows(args, settings, directory, rng)
    print(f"{'prefix':>7} {'cold':>8} {'device':>8} {'host':>8} {'files':>8} {'files/cold':>10}")
    for n, row in rows.items():
        print(
            f"{n:>7} {row['cold_s']:>7.3f}s {row['device_hit_s']:>7.3f}s "
            f"{row['host_tier_s']:>7.3f}s {row['file_tier_s']:>7.3f}s "
            f"{row['file_tier_s'] / row['cold_s']:>10.3f}"
        )
    print(
        f"decode at c={args.concurrency}: {decode['without_tier_tokens_per_s']:.1f} tokens/s "
        f"without the tier, {decode['with_tier_tokens_per_s']:.1f} with it "
        f"({decode['ratio']:.3f}x)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"settings": settings, "cpu": cpu_info(), "ttft": rows, "decode": decode}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
