"""Three serving pods behind `pagefleet router` vs round robin, on a shared-prefix workload.

Starts N local `pagefleet serve` processes (the built-in model) and one `pagefleet router`,
then sends the same kind of workload three ways, each with its own prefixes (so every
way starts with cold caches): to one pod alone (the hit-rate reference), through the
router, and round robin over the pods (client-side, so round robin pays no proxy hop).
Workload: P prefixes of about T tokens of real English text, many requests each made of
one prefix plus a short suffix, Poisson arrivals, streamed. Reports the prefix-cache hit
rate from the pods' own counters (vllm:prefix_cache_hits / _queries, deltas) and TTFT
mean/p99 as the client sees it. Prints a table and writes JSON.

With --precise the pods publish their KV cache events and the ways are: a router routing
by those events (precise), a router with its approximate prefix table only, and round
robin; run it with more distinct prefixes than one pod's cache holds (--kv-cache-memory)
so that evictions make the table's memory wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

TEXT = Path("/usr/share/common-licenses/GPL-3")
CHARS_PER_TOKEN = 4  # English text under the SmolLM2 tokenizer, roughly; usage says exactly
SERVING_LINE = re.compile(r"serving .* on http://[^\s:]+:(\d+)")
ROUTER_PORT_LINE = re.compile(r"on http://[^\s:]+:(\d+)")
START_TIMEOUT_S = 600


class Process:
    """A child process with its log in a temporary file."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.log = Path(tempfile.mkstemp(prefix="bench-router-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_for(self, pattern: re.Pattern) -> re.Match:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.process.args} exited:\n{self.log.read_text()}")
            found = pattern.search(self.log.read_text(errors="replace"))
            if found:
                return found
            time.sleep(0.2)
        raise RuntimeError(f"{self.process.args} did not start in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.unlink(missing_ok=True)


def wait_ready(url: str) -> None:
    import urllib.request

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {START_TIMEOUT_S} s")


def text_chunks(args: argparse.Namespace) -> list[str]:
    """3 * P + 1 prefix texts that start at different places in the text (so no two share
    a first token), each the full length: the text wraps around at its end."""
    text = " ".join(TEXT.read_text().split())
    prefix_chars = args.prefix_tokens * CHARS_PER_TOKEN
    if prefix_chars > len(text):
        raise SystemExit(f"{TEXT} has {len(text)} characters, fewer than {prefix_chars}")
    wrapped = text + " " + text
    stride = len(text) // (3 * args.prefixes + 1)
    return [wrapped[i * stride :][:prefix_chars] for i in range(3 * args.prefixes + 1)]


def make_workload(args: argparse.Namespace, way: int) -> list[tuple[float, int, str]]:
    """(send time, prefix index, prompt) triples. Every way gets the same send times and
    the same sequence of prefix indices, so the ways are compared request by request; only
    the prefix texts differ between ways (`way` picks a disjoint set), so each way starts
    with cold caches."""
    rng = random.Random(args.seed)
    prefixes = text_chunks(args)[way * args.prefixes :][: args.prefixes]
    at, workload = 0.0, []
    for i in range(args.requests):
        at += rng.expovariate(args.rate)
        index = rng.randrange(args.prefixes)
        suffix = f"\n\nQuestion {i}: in one word, what is this text about?"
        workload.append((at, index, prefixes[index] + suffix))
    return workload


def warm_up(pods: list[str], args: argparse.Namespace) -> None:
    """One full-length prompt to each pod, from text no way uses, so that no way pays a
    fresh process's first long prefill (allocator growth, first use of the GEMM shapes)."""
    prompt = text_chunks(args)[-1] + "\n\nWarm-up: in one word, what is this text about?"

    async def warm() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            for url in pods:
                await one_request(session, url, prompt, args.max_tokens)

    asyncio.run(warm())


async def one_request(session, url: str, prompt: str, max_tokens: int) -> float:
    """TTFT of one streamed completion (seconds), read to its end."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    ttft = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError(f"no token from {url}")
    return ttft


async def run_way(targets: list[str], workload, max_tokens: int) -> list[float]:
    """Send each request at its time to the next target in turn (one target: all to it)."""
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        async def send(i: int, at: float, prompt: str) -> float:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await one_request(session, targets[i % len(targets)], prompt, max_tokens)

        return await asyncio.gather(
            *(send(i, at, prompt) for i, (at, _, prompt) in enumerate(workload))
        )


def prefix_counters(url: str) -> tuple[float, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in values:
                values[name] += sample.value
    return values["vllm:prefix_cache_hits"], values["vllm:prefix_cache_queries"]


def measure(name: str, targets: list[str], pods: list[str], workload, args) -> dict:
    before = [prefix_counters(p) for p in pods]
    started = time.perf_counter()
    ttfts = asyncio.run(run_way(targets, workload, args.max_tokens))
    wall = time.perf_counter() - started
    after = [prefix_counters(p) for p in pods]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ordered = sorted(ttfts)
    seen: set[int] = set()
    first, repeat = [], []  # a prefix's first request misses every way; repeats need routing
    for (_, index, _), ttft in zip(workload, ttfts, strict=True):
        (repeat if index in seen else first).append(ttft)
        seen.add(index)
    result = {
        "way": name,
        "requests": len(ttfts),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_query_tokens": queries,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ordered[len(ordered) // 2],
        "ttft_p99_s": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "ttft_mean_first_sight_s": statistics.fmean(first),
        "ttft_mean_repeat_s": statistics.fmean(repeat) if repeat else 0.0,
        "wall_s": wall,
        "per_request": [
            {"at_s": round(at, 3), "prefix": index, "ttft_s": round(ttft, 4)}
            for (at, index, _), ttft in zip(workload, ttfts, strict=True)
        ],
    }
    print(
        f"{name:12s} hit rate {result['prefix_cache_hit_rate']:.3f}  TTFT mean "
        f"{result['ttft_mean_s']:.3f} s  p99 {result['ttft_p99_s']:.3f} s  (a prefix's first "
        f"request {result['ttft_mean_first_sight_s']:.3f} s, repeats "
        f"{result['ttft_mean_repeat_s']:.3f} s; {wall:.0f} s)",
        flush=True,
    )
    return result


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_pods(args: argparse.Namespace, env: dict[str, str], sockets: Path) -> list[Process]:
    """The pods; with --precise each publishes its KV events on ipc sockets named by its
    port, which the precise router's templates find."""
    pod_flags = ["--dtype", "float32", "--max-model-len", str(args.max_model_len)]
    pod_flags += ["--kv-cache-memory", args.kv_cache_memory]
    started = []
    for _ in range(args.pods):
        port = free_port() if args.precise else 0
        flags = [*pod_flags, "--port", str(port)]
        if args.precise:
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"ipc://{sockets}/events-{port}",
                "replay_endpoint": f"ipc://{sockets}/replay-{port}",
            }
            flags += ["--kv-events-config", json.dumps(config)]
        command = [sys.executable, "-m", "pagefleet_serve.cli", "serve", *flags]
        started.append(Process(command, env))
    return started


def start_router(pods: list[str], env: dict[str, str], *flags: str) -> tuple[Process, str]:
    router_command = [sys.executable, "-m", "pagefleet_router", "--port", "0"]
    router = Process([*router_command, "--endpoints", *pods, *flags], env)
    url = f"http://127.0.0.1:{router.wait_for(ROUTER_PORT_LINE).group(1)}"
    wait_ready(url)
    return router, url


def precise_flags(sockets: Path) -> list[str]:
    """The precise router's flags: the pods' sockets and the model's tokenizer.json."""
    from pagefleet_serve.frontend.tokenizer import load_tokenizer

    tokenizer = sockets / "tokenizer.json"
    load_tokenizer("builtin://smollm2-135m").backend_tokenizer.save(str(tokenizer))
    return [
        "--kv-events-endpoint",
        f"ipc://{sockets}/events-{{port}}",
        "--kv-replay-endpoint",
        f"ipc://{sockets}/replay-{{port}}",
        "--tokenizer",
        str(tokenizer),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=64, help="per way")
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads-per-pod", type=int, default=1)
    parser.add_argument("--kv-cache-memory", default="640MiB", help="per pod")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--precise",
        action="store_true",
        help="compare routing by the pods' KV events with the approximate table and round robin",
    )
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/router.json"))
    args = parser.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_pod)}
    sockets = Path(tempfile.mkdtemp(prefix="bench-router-kv-"))
    started: list[Process] = start_pods(args, env, sockets)
    try:
        pods = [f"http://127.0.0.1:{p.wait_for(SERVING_LINE).group(1)}" for p in started]
        for url in pods:
            wait_ready(url)
        warm_up(pods, args)
        router, router_url = start_router(pods, env)
        started.append(router)
        if args.precise:
            precise, precise_url = start_router(pods, env, *precise_flags(sockets))
            started.append(precise)
            results = [
                measure("precise", [precise_url], pods, make_workload(args, 0), args),
                measure("approximate", [router_url], pods, make_workload(args, 1), args),
                measure("round_robin", pods, pods, make_workload(args, 2), args),
            ]
        else:
            results = [
                measure("single_pod", pods[:1], pods, make_workload(args, 0), args),
                measure("router", [router_url], pods, make_workload(args, 1), args),
                measure("round_robin", pods, pods, make_workload(args, 2), args),
            ]
    finally:
        for process in started:
            process.stop()
    by_way = {r["way"]: r for r in results}
    if args.precise:
        summary = {
            "approximate_ttft_p50_over_precise": by_way["approximate"]["ttft_p50_s"]
            / by_way["precise"]["ttft_p50_s"],
            "round_robin_ttft_p50_over_precise": by_way["round_robin"]["ttft_p50_s"]
            / by_way["precise"]["ttft_p50_s"],
        }
        print(
            f"TTFT p50: approximate / precise {summary['approximate_ttft_p50_over_precise']:.2f}x, "
            f"round robin / precise {summary['round_robin_ttft_p50_over_precise']:.2f}x"
        )
        return write_report(args, results, summary)
    summary = {
        "router_hit_rate_vs_single_pod": by_way["router"]["prefix_cache_hit_rate"]
        / max(by_way["single_pod"]["prefix_cache_hit_rate"], 1e-9),
        "round_robin_ttft_mean_over_router": by_way["round_robin"]["ttft_mean_s"]
        / by_way["router"]["ttft_mean_s"],
    }
    print(
        f"router hit rate / single pod's: {summary['router_hit_rate_vs_single_pod']:.2f}; "
        f"round-robin mean TTFT / router's: {summary['round_robin_ttft_mean_over_router']:.2f}x"
    )
    return write_report(args, results, summary)


def write_report(args: argparse.Namespace, results: list[dict], summary: dict) -> int:
    args.output.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"config": config, "cpus": os.cpu_count(), "results": results, "summary": summary}
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
