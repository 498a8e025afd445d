"""xgrammar vs llguidance on the built-in model's tokenizer: the measurement behind the
choice of grammar engine (README, "Structured outputs").

For each library: the one-off vocabulary setup, the compile time of a realistic JSON schema
(nested objects, enums, arrays, required fields; a fresh schema each round, so no cache
helps), and the time to compute one token mask while walking a valid document token by
token (the per-step cost a constrained row adds). Prints a table and writes JSON.
"""

import argparse
import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from pagefleet_serve.frontend.tokenizer import load_tokenizer

MODEL = "builtin://smollm2-135m"


def schema(round_index: int) -> dict:
    """An order-extraction schema; the round number renames a field so each compile is new."""
    address = {
        "type": "object",
        "properties": {
            "street": {"type": "string"},
            "city": {"type": "string"},
            "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
        },
        "required": ["street", "city", "country"],
        "additionalProperties": False,
    }
    item = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "quantity": {"type": "integer", "minimum": 1},
            "price": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["sku", "quantity", "price"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            f"order_id_{round_index}": {"type": "string"},
            "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "email": {"type": "string"},
                    "address": address,
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            },
            "items": {"type": "array", "items": item, "minItems": 1},
            "gift": {"type": "boolean"},
            "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": [f"order_id_{round_index}", "status", "customer", "items", "gift"],
        "additionalProperties": False,
    }


def document(round_index: int) -> str:
    return json.dumps(
        {
            f"order_id_{round_index}": "A-1029",
            "status": "shipped",
            "customer": {
                "name": "Ada Lovelace",
                "email": "ada@example.org",
                "address": {"street": "12 Rue de la Paix", "city": "Paris", "country": "FR"},
            },
            "items": [
                {"sku": "ABC-1234", "quantity": 2, "price": 9.5, "tags": ["red", "small"]},
                {"sku": "XYZ-0001", "quantity": 1, "price": 120.0},
            ],
            "gift": False,
            "notes": None,
        },
        separators=(",", ":"),
    )


def timed(work):
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, text: str):
        return self.compiler.compile_json_schema(
            text, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def walk(self, compiled, token_ids: list[int]) -> list[float]:
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token in token_ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.accept_token(token), "the document left the grammar"
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, text: str):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def walk(self, matcher, token_ids: list[int]) -> list[float]:
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token in token_ids:
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.consume_token(token), matcher.get_error()
        return times


def measure(engine_class, tokenizer, vocab_size: int, rounds: int) -> dict:
    engine, setup_s = timed(lambda: engine_class(tokenizer, vocab_size))
    compile_s, mask_s = [], []
    for i in range(rounds):
        compiled, seconds = timed(lambda i=i: engine.compile(json.dumps(schema(i))))
        compile_s.append(seconds)
        token_ids = tokenizer.encode(document(i), add_special_tokens=False)
        mask_s.extend(engine.walk(compiled, token_ids))
    return {
        "vocab_setup_ms": setup_s * 1e3,
        "compile_ms_median": statistics.median(compile_s) * 1e3,
        "compile_ms_first": compile_s[0] * 1e3,
        "mask_us_median": statistics.median(mask_s) * 1e6,
        "mask_us_p99": sorted(mask_s)[int(0.99 * (len(mask_s) - 1))] * 1e6,
        "num_masks": len(mask_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default="bench_grammar_engines.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(MODEL)
    vocab_size = len(tokenizer)
    results = {
        engine.name: measure(engine, tokenizer, vocab_size, args.rounds)
        for engine in (XGrammar, LLGuidance)
    }
    columns = list(next(iter(results.values())))
    print(f"{'engine':<12}" + "".join(f"{c:>20}" for c in columns))
    for name, row in results.items():
        print(f"{name:<12}" + "".join(f"{row[c]:>20.1f}" for c in columns))
    with open(args.output, "w") as out:
        json.dump({"model": MODEL, "vocab_size": vocab_size, "results": results}, out, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
