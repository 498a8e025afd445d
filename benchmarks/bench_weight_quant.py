"""Weight quantization quality on the built-in model (`python benchmarks/bench_weight_quant.py`).

Perplexity of SmolLM2-135M-Instruct over /usr/share/common-licenses/GPL-3 (the corpus and
the windowed, chunked scoring of bench_kvquant.py) with its Q4_1 weights expanded to
float32 (`--quantization none`), kept as int4 (`auto`, the GGUF's own quantization) and
requantized to int8 per output row (`int8`); activations float32 throughout, and for `auto`
also rounded to int8 per 32 inputs before every 4-bit matmul (`--activation-quantization
int8`, llama.cpp's arithmetic). `auto` computes with exactly the expanded weights, so its
perplexity must equal `none`'s up to float32 summation order. Prints a table and writes
JSON.
"""

import argparse
import json
import time

import torch
from bench_kvquant import MODEL, TEXT, perplexity
from pagefleet_serve.frontend.tokenizer import load_tokenizer

# name: (--quantization, --activation-quantization)
SETTINGS = {
    "none": ("none", "none"),
    "auto": ("auto", "none"),
    "auto+int8-activations": ("auto", "int8"),
    "int8": ("int8", "none"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--output", default="bench-weight-quant.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    with open(TEXT, encoding="utf-8") as f:
        token_ids = load_tokenizer(MODEL).encode(f.read(), add_special_tokens=False)
    results = {"model": MODEL, "text": TEXT, "text_tokens": len(token_ids), "weights": {}}
    for name, (quantization, activations) in SETTINGS.items():
        started = time.monotonic()
        entry = perplexity("auto", token_ids, args.window, args.chunk, quantization, activations)
        entry["seconds"] = round(time.monotonic() - started, 1)
        results["weights"][name] = entry
        print(f"{name}: perplexity {entry['perplexity']:.4f} ({entry['seconds']}s)")
    base = results["weights"]["none"]["perplexity"]
    print(f"{MODEL} over {TEXT}: {len(token_ids)} tokens, windows of {args.window}")
    print(f"{'weights':>34} {'perplexity':>11} {'vs float32':>11}")
    labels = {
        "none": "float32 (expanded Q4_1)",
        "auto": "Q4_1 kept as int4",
        "auto+int8-activations": "int4, activations int8/32",
        "int8": "int8 per row (requantized)",
    }
    for name, entry in results["weights"].items():
        entry["relative_to_none"] = entry["perplexity"] / base - 1
        print(
            f"{labels[name]:>34} {entry['perplexity']:>11.4f} {entry['relative_to_none']:>+11.3%}"
        )
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
