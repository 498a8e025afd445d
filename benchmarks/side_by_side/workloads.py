"""The workloads and how one is sent to a running server: our client
(`pagefleet bench serve`'s runner, in-process) for every number in the tables, and
vLLM's own client (`vllm bench serve`, from the vLLM venv) as a second opinion on the
throughput levels."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pagefleet_bench.backend import RequestSettings
from pagefleet_bench.datasets import (
    PromptShaper,
    SampleRequest,
    prefix_repetition_requests,
    random_requests,
)
from pagefleet_bench.runner import RunSettings, run_requests

from .common import BENCHMARKS, PEERS, PeerUnavailable, log, tail, torch_dtype_name
from .peers import HF_MODEL_DIR, VLLM_LAUNCHER, VLLM_PYTHON, RunningServer, vllm_environment

# Workload 1's shape: random prompts of this many tokens, this many out (ignore_eos).
INPUT_LEN = 256
OUTPUT_LEN = 128


async def _scrape_kv(base_url: str, samples: list[dict], stop: asyncio.Event, every_s: float):
    """PageFleet's /metrics every `every_s` seconds: KV usage and the tokens whose K/V the
    running sequences hold: prompt + generated tokens counted so far, less those of
    finished requests (vLLM's counters and histogram sums), less one per running sequence.
    Exact while every running sequence is decoding, as at the peak of a wave; a sequence
    still in its prefill holds blocks but counts no tokens yet (an underestimate)."""
    from prometheus_client.parser import text_string_to_metric_families

    def read() -> dict:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    baseline = None
    while not stop.is_set():
        try:
            values = await asyncio.to_thread(read)
        except OSError:
            values = None
        if values is not None:
            held = (
                values.get("vllm:prompt_tokens_total", 0.0)
                + values.get("vllm:generation_tokens_total", 0.0)
                - values.get("vllm:request_prompt_tokens_sum", 0.0)
                - values.get("vllm:request_generation_tokens_sum", 0.0)
            )
            # Requests cancelled earlier (duration limit) never reach the histograms;
            # the first scrape, before this run's first token, holds only their residue.
            baseline = held if baseline is None else baseline
            # A decoding sequence's last sampled token has no K/V yet.
            held -= baseline + values.get("vllm:num_requests_running", 0.0)
            samples.append(
                {
                    "t": time.perf_counter(),
                    "kv_cache_usage_perc": values.get("vllm:kv_cache_usage_perc", 0.0),
                    "used_blocks": values.get("pagefleet:kv_cache_used_blocks", 0.0),
                    "num_blocks": values.get("pagefleet:kv_cache_blocks", 0.0),
                    "running": values.get("vllm:num_requests_running", 0.0),
                    "tokens_held": held,
                }
            )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def run_workload(
    server: RunningServer,
    samples: list[SampleRequest],
    run: RunSettings,
    count_tokens,
    scrape: list[dict] | None = None,
) -> dict:
    spec = server.spec
    output_len = samples[0].expected_output_len
    settings = RequestSettings(
        base_url=server.base_url,
        endpoint="/v1/completions",
        model=spec.model,
        ignore_eos=spec.ignore_eos,
        extra_body=spec.extra_body(output_len),
    )

    async def go() -> dict:
        stop = asyncio.Event()
        scraper = None
        if scrape is not None:
            scraper = asyncio.create_task(_scrape_kv(server.base_url, scrape, stop, 0.5))
        try:
            return await run_requests(settings, samples, run, count_tokens)
        finally:
            stop.set()
            if scraper is not None:
                await scraper

    return asyncio.run(go())


def summary(result: dict) -> dict:
    """The numbers the tables use (the full result keeps per-request lists)."""
    keys = [
        "completed",
        "failed",
        "incomplete",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_concurrent_requests",
        "max_concurrency",
        "request_rate",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "error_counts",
    ]
    out = {k: result.get(k) for k in keys}
    if out["request_rate"] == math.inf:
        out["request_rate"] = "inf"
    return out


def percentile(values: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(values, p)) if values else float("nan")


# -- the workloads ------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    concurrencies: list[int]
    prompts_per_level: Callable[[int], int]
    # Seconds a throughput level may run: this plus one per unit of concurrency (a wave of
    # 64 long prompts needs longer than one request); None: every level runs to the end.
    level_limit_s: float | None
    sweep_rates: list[float]
    sweep_prompts: int
    prefix_prompts: int
    mixed_prompts: int
    mixed_rate: float
    hf_generate_prompts: int


def make_plan(args: argparse.Namespace) -> Plan:
    if args.full:
        return Plan(
            [1, 8, 32, 64], lambda c: max(8, 2 * c), None, [1, 2, 4, 8, 16], 64, 128, 100, 2.0, 64
        )
    if args.quick:
        # Workload 1 only, 8/16/64 prompts at c=1/8/64, each level run to the end (a
        # level cut short would undercount a server still prefilling its wave).
        return Plan([1, 8, 64], lambda c: min(64, max(8, 2 * c)), None, [], 0, 0, 0, 0.0, 0)
    return Plan(
        args.concurrency,
        lambda c: c,
        args.level_limit or None,
        args.sweep_rates,
        args.sweep_prompts,
        args.prefix_prompts,
        args.mixed_prompts,
        args.mixed_rate,
        args.hf_generate_prompts,
    )


def level_limit(plan: Plan, concurrency: int) -> float | None:
    return None if plan.level_limit_s is None else plan.level_limit_s + concurrency


def throughput_workload(server, w1_samples, plan, count_tokens, scrape, results) -> None:
    for concurrency in plan.concurrencies:
        samples = w1_samples[: plan.prompts_per_level(concurrency)]
        run = RunSettings(
            max_concurrency=concurrency,
            seed=0,
            progress=False,
            duration_limit=level_limit(plan, concurrency),
        )
        result = run_workload(server, samples, run, count_tokens, scrape)
        results[str(concurrency)] = summary(result)
        log(
            f"  concurrency {concurrency:>3}: {result['output_throughput']:7.1f} output tok/s, "
            f"{result['completed']} done, {result['failed']} failed, "
            f"{result['incomplete']} cut at the limit"
        )
        if result["failed"] and not result["completed"]:
            raise PeerUnavailable(f"every request failed: {result['errors'][0]}")


def vllm_client_level(server: RunningServer, plan: Plan, concurrency: int, work: Path) -> dict:
    """One throughput level measured by `vllm bench serve`, vLLM's benchmark client (the
    tool vLLM users point at any server): the same shape (random 256-token prompts, 128 out,
    ignore_eos, seed 0, one wave under the concurrency limit) with its own random token
    prompts, run from the vLLM venv. Returns the summary of its saved result, or
    {"unavailable": why}."""
    spec = server.spec
    result_name = f"vllm-client-{spec.name}-c{concurrency}.json"
    (work / result_name).unlink(missing_ok=True)
    command = [
        str(VLLM_PYTHON),
        str(VLLM_LAUNCHER),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        server.base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        spec.model,
        "--tokenizer",
        str(PEERS / HF_MODEL_DIR),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--num-prompts",
        str(plan.prompts_per_level(concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(work),
        "--result-filename",
        result_name,
    ]
    limit = level_limit(plan, concurrency)
    timeout = None if limit is None else limit + 120  # its own start-up: ~20 s here
    log_path = work / f"vllm-client-{spec.name}-c{concurrency}.log"
    try:
        with log_path.open("wb") as out:
            done = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ | vllm_environment(),
                timeout=timeout,
                check=False,
            )
    except subprocess.TimeoutExpired:
        return {"unavailable": f"over {timeout:.0f}s (log: {log_path})"}
    if done.returncode != 0 or not (work / result_name).exists():
        return {"unavailable": f"exit {done.returncode}: {tail(log_path)}"}
    result = json.loads((work / result_name).read_text())
    result.setdefault("incomplete", 0)
    reasons = logged_errors(log_path.read_text(errors="replace"))
    return summary(result) | ({"first_error": reasons[0][:300]} if reasons else {})


def logged_errors(log: str) -> list[str]:
    """Why `vllm bench serve`'s requests failed: its JSON counts failures but keeps no
    reasons, its log prints each as "Error N: why", where why may be a traceback whose
    indented lines follow: then the reason is the exception line that ends it."""
    reasons: list[str] = []
    in_traceback = False
    for line in log.splitlines():
        if line.startswith("Error "):
            reason = line.partition(": ")[2]
            in_traceback = reason.startswith("Traceback")
            if not in_traceback:
                reasons.append(reason)
        elif in_traceback and line.strip() and not line.startswith(" "):
            reasons.append(line)
            in_traceback = False
    return reasons


def vllm_client_throughput(server: RunningServer, plan: Plan, work: Path, results: dict) -> None:
    for concurrency in plan.concurrencies:
        result = vllm_client_level(server, plan, concurrency, work)
        results[str(concurrency)] = result
        if "unavailable" in result:
            log(f"  vllm bench serve, concurrency {concurrency:>3}: {result['unavailable']}")
            continue
        log(
            f"  vllm bench serve, concurrency {concurrency:>3}: "
            f"{result['output_throughput']:7.1f} output tok/s, {result['completed']} done, "
            f"{result['failed']} failed"
        )


def rate_sweep(server, samples, plan, count_tokens, results) -> None:
    for rate in plan.sweep_rates:
        run = RunSettings(
            request_rate=rate,
            seed=0,
            progress=False,
        )
        result = run_workload(server, samples[: plan.sweep_prompts], run, count_tokens)
        results[str(rate)] = summary(result)
        log(
            f"  rate {rate:>5}/s: TTFT p50 {result['median_ttft_ms']:8.0f} ms, "
            f"p99 {result['p99_ttft_ms']:8.0f} ms"
        )


def prefix_workload(server, samples, count_tokens) -> dict:
    run = RunSettings(max_concurrency=1, seed=0, progress=False)
    result = run_workload(server, samples, run, count_tokens)
    seen: set[int] = set()
    hit_ttfts, miss_ttfts = [], []
    # One request at a time in list order: a prefix's first use misses, later ones hit.
    for sample, ttft, error in zip(samples, result["ttfts"], result["errors"], strict=True):
        if error:
            continue
        (hit_ttfts if sample.prefix_id in seen else miss_ttfts).append(ttft * 1000)
        seen.add(sample.prefix_id)
    return summary(result) | {
        "mean_ttft_hit_ms": sum(hit_ttfts) / len(hit_ttfts) if hit_ttfts else float("nan"),
        "p99_ttft_hit_ms": percentile(hit_ttfts, 99),
        "mean_ttft_first_use_ms": sum(miss_ttfts) / len(miss_ttfts) if miss_ttfts else float("nan"),
    }


def mixed_workload(server, samples, plan, count_tokens, long_len: int) -> dict:
    run = RunSettings(request_rate=plan.mixed_rate, seed=0, progress=False)
    result = run_workload(server, samples, run, count_tokens)
    short_itls = [
        gap * 1000
        for sample, itls in zip(samples, result["itls"], strict=True)
        if sample.prompt_len < long_len
        for gap in itls
    ]
    return summary(result) | {
        "p99_itl_short_ms": percentile(short_itls, 99),
        "median_itl_short_ms": percentile(short_itls, 50),
        "max_itl_short_ms": max(short_itls, default=float("nan")),
    }


def kv_figures(scrape: list[dict], block_size: int, max_model_len: int) -> dict:
    if not scrape:
        return {}
    peak = max(scrape, key=lambda s: (s["used_blocks"], s["tokens_held"]))
    slots = peak["used_blocks"] * block_size
    return {
        "peak_used_blocks": peak["used_blocks"],
        "num_blocks": peak["num_blocks"],
        "peak_kv_cache_usage_perc": max(s["kv_cache_usage_perc"] for s in scrape),
        "tokens_held_at_peak": peak["tokens_held"],
        "slots_at_peak": slots,
        "slot_fill_at_peak": peak["tokens_held"] / slots if slots else float("nan"),
        "running_at_peak": peak["running"],
        "contiguous_reservation_tokens": peak["running"] * max_model_len,
        "max_model_len": max_model_len,
    }


def hf_generate_baseline(
    w1_samples: list[SampleRequest], tokenizer, num: int, timeout_s: float
) -> dict:
    """Hugging Face `generate` on static batches of 16 (the offline benchmark's
    run_transformers) on the first `num` prompts of workload 1, in a child process that
    may run `timeout_s` seconds."""
    requests = [
        (tokenizer.encode(s.prompt, add_special_tokens=False), s.expected_output_len)
        for s in w1_samples[:num]
    ]
    work = PEERS / "hf_generate.json"
    work.write_text(json.dumps(requests))
    code = (
        "import json, runpy, sys; "
        "run_transformers = runpy.run_path(sys.argv[1])['run_transformers']; "
        "print(json.dumps(run_transformers(json.load(open(sys.argv[2])), batch_size=16, "
        "dtype=sys.argv[3])))"
    )
    command = [
        sys.executable,
        "-c",
        code,
        str(BENCHMARKS / "bench_offline.py"),
        str(work),
        torch_dtype_name(),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"unavailable": f"not measured: over {timeout_s:.0f}s"}
    if done.returncode != 0:
        return {"unavailable": f"failed: {done.stderr.strip()[-500:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def prefix_samples(shaper: PromptShaper, plan: Plan) -> list[SampleRequest]:
    return prefix_repetition_requests(shaper, plan.prefix_prompts, 1024, 32, 8, 8, random.Random(1))


def mixed_samples(shaper: PromptShaper, plan: Plan, long_len: int) -> list[SampleRequest]:
    rng = random.Random(2)
    num_long = max(1, round(plan.mixed_prompts * 0.1))
    short = random_requests(shaper, plan.mixed_prompts - num_long, 128, 64, 0.0, rng)
    long = random_requests(shaper, num_long, long_len, 64, 0.0, rng)
    samples = short + long
    rng.shuffle(samples)
    return samples
