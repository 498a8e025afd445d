"""Speculative decoding on the built-in model (offline engine, greedy, float32).

Input-grounded workload: chat prompts holding a paragraph, a JSON object or a function
that the answer repeats with an edit (fix a typo, reformat, rename). At concurrency 1
(one request at a time) and 8 (eight at once), without speculation and with n-gram
prompt lookup: output tokens/s, the greedy outputs compared token for token, the mean
accepted length (tokens per verification: 1 + accepted / drafts) and the acceptance rate
per draft position. Then concurrency 64 on random prompts (ignore_eos), where proposals
rarely match, off vs n-gram. A draft model (`--draft-model`, default the built-in model
drafting for itself: a check of the machinery, not a speed-up, since the draft is as large
as the target) runs on the rows of `--draft-rows`. All engines run side by side in one
process, row by row, so each ratio compares runs under the same machine load (the load
average is recorded with each row), taking turns batch by batch in alternating order over
`--repeats` passes. Prints a table and writes JSON.

One intra-op thread by default (`--threads 0`: torch's default, one per core): on a machine
shared with other jobs, every OpenMP parallel region waits until all of its threads are
scheduled, and float32 products of several rows are MKL's parallel GEMM while a one-row
product is a serial GEMV. A 5-token verification forward measured 0.8-2.0 s with 2 threads
at load 4-6 on 2 cores (0.16 s with one), the 1-token decode forward 0.1 s either way, so
the ratio measured the machine's load rather than the engine (0.49x instead of 2x).

    PYTHONPATH=servingpod:kernels python benchmarks/bench_spec_decode.py --out spec.json
"""

import argparse
import json
import os
import random
import time

import torch
from pagefleet_serve import LLM, SamplingParams

MODEL = "builtin://smollm2-135m"
PARAGRAPH = (
    "The paged KV cache splits every sequence's keys and values into blocks of sixteen "
    "tokens. A block table maps each sequence to its blocks, so memory is allocated as a "
    "sequence grows and freed the moment it finishes. Blocks holding a shared prefix are "
    "named by a hash and reused by later requests, which saves the prefill of the system "
    "prompt."
)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for value in values:\n        total += (value - m) ** 2\n"
    "    return total / len(values)\n"
)
RECORD = (
    '{"name": "smollm2", "layers": 30, "heads": 9, "kv_heads": 3, "vocab": 49152, '
    '"context": 8192, "tied_embeddings": true, "license": "apache-2.0"}'
)
TASKS = [
    f"Fix the typo in this paragraph and write it out in full:\n\n{PARAGRAPH.replace('allocated', 'alocated')}",
    f"Rename the variable `total` to `acc` in this code and print the whole code:\n\n{CODE}",
    f"Reformat this JSON with one key per line:\n\n{RECORD}",
    f"Repeat this paragraph, replacing 'sixteen' with 'thirty-two':\n\n{PARAGRAPH}",
    f"Add a docstring to each function and print the whole code:\n\n{CODE}",
    f"Copy this JSON and change the number of layers to 32:\n\n{RECORD}",
    f"Rewrite this paragraph in the past tense:\n\n{PARAGRAPH}",
    f"Convert this code to use the built-in sum() and print it:\n\n{CODE}",
]


def run(
    engines: dict[str, LLM], prompts: list, params: SamplingParams, concurrency: int, repeats: int
) -> dict:
    """Generate `prompts` `concurrency` at a time with every engine, `repeats` times, the
    engines taking turns batch by batch, in the opposite order on every other turn (ABBA),
    so that a change in the machine's load falls on all of them alike (a row of one batch
    included); per engine: output tokens/s and spec-decode counts."""
    before = {mode: llm.engine.stats().spec_decode for mode, llm in engines.items()}
    seconds = dict.fromkeys(engines, 0.0)
    outputs = {mode: [] for mode in engines}
    batches = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    for turn, batch in enumerate(batches * repeats):
        order = list(engines) if turn % 2 == 0 else list(reversed(engines))
        for mode in order:
            started = time.perf_counter()
            outputs[mode] += engines[mode].generate(batch, params)
            seconds[mode] += time.perf_counter() - started
    return {
        mode: summary(before[mode], llm.engine.stats().spec_decode, outputs[mode], seconds[mode])
        for mode, llm in engines.items()
    }


def summary(before, after, outputs: list, elapsed: float) -> dict:
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_position = [
        a - b
        for a, b in zip(
            after.accepted_per_position,
            before.accepted_per_position or [0] * len(after.accepted_per_position),
            strict=True,
        )
    ]
    tokens = [o.outputs[0].token_ids for o in outputs]
    return {
        "output_tokens": sum(map(len, tokens)),
        "seconds": round(elapsed, 2),
        "output_tok_s": round(sum(map(len, tokens)) / elapsed, 1),
        "drafts": drafts,
        "draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
        "accepted_tokens": accepted,
        "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
        "acceptance_per_position": [round(a / drafts, 2) for a in per_position] if drafts else [],
        "token_ids": tokens,
    }


def load() -> list[float]:
    """The 1, 5 and 15-minute load averages: the machine is shared."""
    return [round(x, 2) for x in os.getloadavg()]


def _without_tokens(value):
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "token_ids"}
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--random-prompt-len", type=int, default=64)
    parser.add_argument("--random-max-tokens", type=int, default=32)
    parser.add_argument("--num-grounded", type=int, default=len(TASKS), help="grounded prompts")
    parser.add_argument(
        "--rows",
        default="grounded:1,grounded:8,random:64",
        help="workload:concurrency pairs to run, comma-separated",
    )
    parser.add_argument("--draft-model", default=MODEL, help="the draft model's URI")
    parser.add_argument(
        "--draft-rows",
        default="grounded:1",
        help="the rows (of --rows) that also run the draft model; empty: none",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="times each row's prompts run (order alternates)"
    )
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes per engine")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument("--out", default="bench_spec_decode.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    config = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=args.kv_cache_memory)
    draft = {"model": args.draft_model, "num_speculative_tokens": args.num_speculative_tokens}
    draft_rows = set(filter(None, args.draft_rows.split(",")))
    engines = {
        "off": LLM(MODEL, **config),
        "ngram": LLM(MODEL, **config, speculative_config=ngram),
    }
    if draft_rows:
        engines["draft"] = LLM(MODEL, **config, speculative_config=draft)
    tokenizer = engines["off"].tokenizer
    grounded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": task}], tokenize=False, add_generation_prompt=True
        )
        for task in TASKS[: args.num_grounded]
    ]
    rng = random.Random(0)
    vocab = engines["off"].engine.model_config.vocab_size
    random_prompts = [
        [rng.randrange(1000, vocab) for _ in range(args.random_prompt_len)] for _ in range(64)
    ]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    random_params = SamplingParams(
        max_tokens=args.random_max_tokens, temperature=0.0, ignore_eos=True
    )
    for llm in engines.values():  # warm-up: first-call allocations, prefix cache of nothing
        llm.generate(grounded[0], SamplingParams(max_tokens=4, temperature=0.0))

    workloads = {"grounded": (grounded, greedy), "random": (random_prompts, random_params)}
    results = []
    for pair in args.rows.split(","):
        workload, concurrency = pair.split(":")
        concurrency = int(concurrency)
        prompts, params = workloads[workload]
        modes = [mode for mode in engines if mode != "draft" or pair in draft_rows]
        row = {"workload": workload, "concurrency": concurrency, "loadavg_before": load()}
        row |= run(
            {mode: engines[mode] for mode in modes}, prompts, params, concurrency, args.repeats
        )
        row["loadavg_after"] = load()
        off = row["off"]
        print(
            f"{workload:9s} c={concurrency:<3d} off {off['output_tok_s']:7.1f} tok/s  "
            f"load {row['loadavg_before']} -> {row['loadavg_after']}",
            flush=True,
        )
        for mode in modes[1:]:
            row[mode]["identical_greedy_output"] = row[mode]["token_ids"] == off["token_ids"]
            row[mode]["speedup"] = round(row[mode]["output_tok_s"] / off["output_tok_s"], 2)
            print(
                f"{'':15s} {mode:5s} {row[mode]['output_tok_s']:7.1f} tok/s  "
                f"x{row[mode]['speedup']:.2f}  "
                f"identical={row[mode]['identical_greedy_output']}  "
                f"mean accepted length {row[mode]['mean_accepted_length']}  "
                f"per position {row[mode]['acceptance_per_position']}",
                flush=True,
            )
        results.append(row)
    with open(args.out, "w") as out:
        json.dump(
            {
                "model": MODEL,
                "dtype": "float32",
                "torch_threads": torch.get_num_threads(),
                "speculative_configs": {"ngram": ngram, "draft": draft if draft_rows else None},
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "results": [{k: _without_tokens(v) for k, v in r.items()} for r in results],
            },
            out,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
