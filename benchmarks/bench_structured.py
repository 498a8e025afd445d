"""What structured outputs cost the requests that do not use them, and what a grammar
costs to compile (README, "Structured outputs").

Runs of the same concurrency-32 workload on the built-in model, in pairs: all 32 requests
unconstrained, and half of them under a JSON schema (`--repeats` pairs, interleaved with
the order alternating, so that a shared machine's drift falls on both alike; the drop is
the median of the pairs' drops). Every request generates exactly
`--max-tokens` tokens (ignore_eos; the schema's array keeps its grammar active for most of
them), so both runs have the same batch at every step and the unconstrained half does the
same work; its throughput is its tokens over the time until its last request finished.
Then the grammar compile time: the first constraint (which also reads the vocabulary), a
new schema, and a schema already compiled (a cache hit). Prints a table and writes JSON.
"""

import argparse
import json
import statistics
import time

from pagefleet_serve import LLM, SamplingParams
from pagefleet_serve.structured.constraint import StructuredOutputs

MODEL = "builtin://smollm2-135m"


def schema(round_index: int) -> str:
    """A list of words long enough to keep the grammar active; the round renames a field
    so that each round is a schema the compiler has not seen."""
    return json.dumps(
        {
            "type": "object",
            "properties": {
                f"words_{round_index}": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 40,
                },
                "done": {"type": "boolean"},
            },
            "required": [f"words_{round_index}", "done"],
            "additionalProperties": False,
        }
    )


def run(llm: LLM, prompts: list[str], max_tokens: int, constrained: bool) -> dict:
    free = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    json_params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        structured_outputs=StructuredOutputs(json=schema(0)),
    )
    params = [json_params if constrained and i % 2 else free for i in range(len(prompts))]
    started = time.time()
    outputs = llm.generate(prompts, params)
    # The even half is unconstrained in both runs: the same requests are compared.
    unconstrained = outputs[::2]
    tokens = sum(len(o.outputs[0].token_ids) for o in unconstrained)
    elapsed = max(o.metrics.finished_time for o in unconstrained) - started
    return {
        "unconstrained_requests": len(unconstrained),
        "unconstrained_tokens": tokens,
        "seconds": elapsed,
        "unconstrained_tokens_per_s": tokens / elapsed,
    }


def compile_times(llm: LLM, rounds: int) -> dict:
    compiler = llm.engine.grammar_compiler

    def timed(text: str) -> float:
        started = time.perf_counter()
        compiler.compile(StructuredOutputs(json=text))
        return (time.perf_counter() - started) * 1e3

    new = [timed(schema(1000 + i)) for i in range(rounds)]
    cached = [timed(schema(1000 + i)) for i in range(rounds)]
    return {"new_schema_ms": statistics.median(new), "cached_schema_ms": statistics.median(cached)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved pairs of runs")
    parser.add_argument("--output", default="bench_structured.json")
    args = parser.parse_args()
    # No prefix cache: the second run would otherwise skip the prompts' prefill.
    llm = LLM(MODEL, device=args.device, max_num_seqs=args.concurrency, enable_prefix_caching=False)
    prompts = [
        llm.chat_prompt([{"role": "user", "content": f"List {i + 3} words about the sea as JSON."}])
        for i in range(args.concurrency)
    ]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    started = time.perf_counter()
    llm.engine.grammar_compiler.compile(StructuredOutputs(json=schema(0)))
    first_compile_ms = (time.perf_counter() - started) * 1e3
    pairs = []
    for repeat in range(args.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        results = {c: run(llm, prompts, args.max_tokens, constrained=c) for c in order}
        pairs.append({"all_unconstrained": results[False], "half_constrained": results[True]})
    drops = [
        1
        - pair["half_constrained"]["unconstrained_tokens_per_s"]
        / pair["all_unconstrained"]["unconstrained_tokens_per_s"]
        for pair in pairs
    ]
    drop = statistics.median(drops)
    compiles = {"first_constraint_ms": first_compile_ms} | compile_times(llm, rounds=5)
    print(
        f"concurrency {args.concurrency}, {args.max_tokens} tokens each, device {llm.engine.device}"
    )
    print(f"{'pair':<6}{'run':<32}{'unconstrained tok/s':>22}{'seconds':>10}")
    for index, pair in enumerate(pairs):
        for name, result in pair.items():
            rate, seconds = result["unconstrained_tokens_per_s"], result["seconds"]
            print(f"{index:<6}{name.replace('_', ' '):<32}{rate:>22.1f}{seconds:>10.2f}")
    print(
        f"throughput drop of the unconstrained half, per pair: {', '.join(f'{d:.1%}' for d in drops)}"
    )
    print(f"median drop: {drop:.1%}")
    for name, ms in compiles.items():
        print(f"grammar compile, {name.removesuffix('_ms').replace('_', ' ')}: {ms:.2f} ms")
    with open(args.output, "w") as out:
        json.dump(
            {
                "model": MODEL,
                "device": str(llm.engine.device),
                "concurrency": args.concurrency,
                "max_tokens": args.max_tokens,
                "pairs": pairs,
                "unconstrained_throughput_drops": drops,
                "unconstrained_throughput_drop": drop,
                "compile": compiles,
            },
            out,
            indent=2,
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
