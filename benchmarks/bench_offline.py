"""Offline throughput: PageFleet's engine vs Hugging Face transformers `generate`.

256 requests (by default), prompt lengths uniform in [32, 512] tokens of real English text,
output lengths uniform in [32, 256] with ignore_eos, all submitted at once, on the built-in
model. transformers runs the same prompts in static batches of 16, left-padded, in arrival
order, each batch running to its longest output. Both run in this process, one after the
other, so the ratio is measured side by side. Prints a table and writes JSON.
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch
from pagefleet_serve import LLM, SamplingParams

TEXT = Path("/usr/share/common-licenses/GPL-3")


def make_workload(tokenizer, num_requests: int, seed: int):
    rng = random.Random(seed)
    corpus = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(32, 512)
        start = rng.randrange(0, len(corpus) - prompt_len)
        requests.append((corpus[start : start + prompt_len], rng.randint(32, 256)))
    return requests


def run_pagefleet(llm: LLM, requests) -> dict:
    engine = llm.engine
    started = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        engine.add(engine.make_request(f"bench-{i}", prompt, params))
    output_tokens = steps = 0
    peak_blocks = peak_running = 0
    fill_sum = fill_steps = 0.0
    fill_at_peak = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            output_tokens += out.num_generated_tokens
        steps += 1
        stats = engine.stats()
        if stats.num_used_blocks:
            fill = stats.num_kv_tokens / (stats.num_used_blocks * llm.engine.config.block_size)
            fill_sum += fill
            fill_steps += 1
            if stats.num_used_blocks >= peak_blocks:
                peak_blocks, fill_at_peak = stats.num_used_blocks, fill
        peak_running = max(peak_running, stats.num_running)
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    return {
        "seconds": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "steps": steps,
        "num_blocks": stats.num_blocks,
        "peak_blocks_in_use": peak_blocks,
        "peak_running_requests": peak_running,
        "slot_fill_at_peak": fill_at_peak,
        "slot_fill_mean": fill_sum / max(fill_steps, 1),
        "num_preemptions": stats.num_preemptions,
        "contiguous_reservation_tokens_at_peak": peak_running * engine.max_model_len,
        "paged_tokens_at_peak": peak_blocks * engine.config.block_size,
    }


def run_transformers(requests, batch_size: int, dtype: str) -> dict:
    from pagefleet_serve.model.loader.resolve import builtin_gguf_path
    from transformers import AutoModelForCausalLM

    path = builtin_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    pad = 2
    started = time.perf_counter()
    output_tokens = 0
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(n for _, n in batch)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
            output_tokens += sum(n for _, n in batch)  # the tokens the requests asked for
    elapsed = time.perf_counter() - started
    return {
        "seconds": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "batch_size": batch_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16"),
        help="weights and activations of both engines (bfloat16 runs on the CPU's AMX/AVX-512 units)",
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--output", default="bench-offline.json")
    args = parser.parse_args()

    from pagefleet_serve.config import parse_bytes

    llm = LLM(
        "builtin://smollm2-135m",
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
        dtype=args.dtype,
    )
    requests = make_workload(llm.tokenizer, args.num_requests, args.seed)
    result = {
        "workload": {
            "num_requests": len(requests),
            "prompt_tokens": sum(len(p) for p, _ in requests),
            "output_tokens": sum(n for _, n in requests),
            "seed": args.seed,
            "dtype": args.dtype,
            "torch_threads": torch.get_num_threads(),
        },
        "pagefleet": run_pagefleet(llm, requests),
    }
    print(json.dumps(result["pagefleet"], indent=2))
    del llm
    if not args.skip_transformers:
        result["transformers"] = run_transformers(requests, args.hf_batch_size, args.dtype)
        result["speedup"] = (
            result["pagefleet"]["output_tokens_per_s"]
            / result["transformers"]["output_tokens_per_s"]
        )
    pf = result["pagefleet"]
    print(f"pagefleet:    {pf['output_tokens_per_s']:8.1f} output tokens/s ({pf['seconds']:.1f}s)")
    if "transformers" in result:
        hf = result["transformers"]
        print(
            f"transformers: {hf['output_tokens_per_s']:8.1f} output tokens/s ({hf['seconds']:.1f}s)"
        )
        print(f"speedup:      {result['speedup']:.2f}x")
    print(
        f"KV: peak {pf['peak_blocks_in_use']} blocks in use for {pf['peak_running_requests']} "
        f"requests; slot fill {pf['slot_fill_at_peak']:.3f} at peak, {pf['slot_fill_mean']:.3f} "
        f"mean; contiguous max_model_len reservation would need "
        f"{pf['contiguous_reservation_tokens_at_peak']} tokens vs {pf['paged_tokens_at_peak']} paged"
    )
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
