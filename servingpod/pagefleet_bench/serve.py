"""`pagefleet bench serve`: the command line. Flag names follow `vllm bench serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

from pagefleet_bench.backend import ENDPOINTS, RequestSettings
from pagefleet_bench.datasets import (
    DATASETS,
    PromptShaper,
    SampleRequest,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from pagefleet_bench.metrics import DETAIL_KEYS, METRICS, format_result
from pagefleet_bench.runner import RunSettings, check_server, run_requests


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark an OpenAI-compatible server")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    parser = kinds.add_parser(
        "serve",
        help="load-test a running server over SSE (compatible with `vllm bench serve`)",
        description="Send a dataset of prompts to an OpenAI-compatible server as streamed "
        "requests, at a request rate and concurrency, and report throughput and TTFT, TPOT, "
        "ITL and end-to-end latency (vLLM's result block and JSON keys).",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", help="server address (default: http://HOST:PORT)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    server.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    server.add_argument(
        "--tokenizer",
        help="tokenizer source for prompt lengths: builtin://smollm2-135m, a GGUF file or a "
        "Hugging Face directory (default: the model's `root` from /v1/models, else --model)",
    )
    server.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="[env: OPENAI_API_KEY]"
    )

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", "--dataset", default="random", choices=DATASETS)
    data.add_argument("--dataset-path", help="a ShareGPT-format JSON file (--dataset sharegpt)")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)]",
    )
    data.add_argument(
        "--sharegpt-output-len", type=int, help="output length (default: the reply's length)"
    )
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second (Poisson arrivals at burstiness 1); inf sends all at once",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 is Poisson, < 1 burstier, > 1 steadier",
    )
    load.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--extra-body", type=_json_object, default={}, help="JSON object merged into every body"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--duration-limit",
        type=float,
        help="cancel requests still running after this many seconds; they are reported as "
        "incomplete and the tokens they streamed count toward output throughput",
    )
    load.add_argument(
        "--skip-initial-test", action="store_true", help="no short probe request first"
    )

    out = parser.add_argument_group("result")
    out.add_argument("--percentile-metrics", default=",".join(METRICS))
    out.add_argument("--metric-percentiles", default="99")
    out.add_argument("--save-result", action="store_true", help="write the result as JSON")
    out.add_argument(
        "--save-detailed", action="store_true", help="also save per-request lengths and times"
    )
    out.add_argument("--result-dir", default=".")
    out.add_argument("--result-filename", help="default: pagefleet-bench-<date>.json")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def discover_model(base_url: str, api_key: str | None) -> tuple[str, str | None]:
    """(id, root) of the first model /v1/models lists."""
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        models = json.load(response).get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"], models[0].get("root")


def load_tokenizer_from(sources: list[str]):
    """The first source that loads; ValueError naming every attempt otherwise."""
    from pagefleet_serve.frontend.tokenizer import load_tokenizer

    failures = []
    for source in dict.fromkeys(s for s in sources if s):
        try:
            tokenizer = load_tokenizer(source)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            failures.append(f"{source}: {type(exc).__name__}: {exc}")
            continue
        if tokenizer is not None:
            return tokenizer, source
        failures.append(f"{source}: has no tokenizer")
    raise ValueError("no tokenizer could be loaded; pass --tokenizer. " + "; ".join(failures))


def build_samples(args: argparse.Namespace, shaper: PromptShaper) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        return random_requests(
            shaper,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            rng,
        )
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(
            shaper, args.dataset_path, args.num_prompts, rng, args.sharegpt_output_len
        )
    return prefix_repetition_requests(
        shaper,
        args.num_prompts,
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
        args.prefix_repetition_num_prefixes,
        args.prefix_repetition_output_len,
        rng,
    )


class ServerUnreachable(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as exc:
        print(f"pagefleet bench serve: {exc}", file=sys.stderr)
        return 2
    except ServerUnreachable as exc:
        print(f"pagefleet bench serve: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path (a local JSON file)")
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    run_settings = RunSettings(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        duration_limit=args.duration_limit,
        percentiles=tuple(float(p) for p in args.metric_percentiles.split(",")),
        selected_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",")),
        progress=not args.disable_tqdm,
    )
    model, root = args.model, None
    if model is None or args.tokenizer is None:
        try:
            listed, root = discover_model(args.base_url, args.api_key)
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
            raise ServerUnreachable(
                f"cannot list models at {args.base_url}/v1/models ({exc}); is the server up? "
                "(or pass --model and --tokenizer)"
            ) from None
        model = model or listed
    tokenizer, tokenizer_id = load_tokenizer_from([args.tokenizer, root, model])
    shaper = PromptShaper(tokenizer, chat=args.endpoint == "/v1/chat/completions")
    samples = build_samples(args, shaper)
    settings = RequestSettings(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=model,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        api_key=args.api_key,
    )
    if not args.skip_initial_test:
        print("Starting initial single prompt test run...")
        probe = asyncio.run(check_server(settings, samples[0]))
        if not probe.success:
            print(f"pagefleet bench serve: the test request failed: {probe.error}", file=sys.stderr)
            return 1
        print("Initial test run completed. Starting main benchmark run...")
    print(
        f"Traffic request rate: {args.request_rate}, burstiness: {args.burstiness}, "
        f"max concurrency: {args.max_concurrency}"
    )
    result = asyncio.run(
        run_requests(
            settings,
            samples,
            run_settings,
            lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
        )
    )
    print(format_result(result))
    if result["failed"]:
        print(f"{result['failed']} requests failed: {json.dumps(result['error_counts'])}")
    if args.save_result or args.result_filename:
        path = save_result(args, result, model, tokenizer_id)
        print(f"wrote {path}")
    return 0 if result["completed"] else 1


def save_result(args: argparse.Namespace, result: dict, model: str, tokenizer_id: str) -> Path:
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    record = {
        "date": date,
        "backend": "openai-chat" if args.endpoint == "/v1/chat/completions" else "openai",
        "endpoint": args.endpoint,
        "base_url": args.base_url,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "dataset_name": args.dataset_name,
        "seed": args.seed,
        "timestamp": time.time(),
    } | result
    if not args.save_detailed:
        for key in DETAIL_KEYS:
            record.pop(key, None)
        record["errors"] = [e for e in record["errors"] if e]
    if record["request_rate"] == math.inf:
        record["request_rate"] = "inf"  # JSON has no infinity
    path = Path(args.result_dir) / (args.result_filename or f"pagefleet-bench-{date}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path
