"""PageFleet side by side with other servers on this machine, in one run.

Each server is started on loopback in turn with the built-in SmolLM2-135M-Instruct (the
same Q4_1 GGUF file: dequantized by PageFleet and transformers, which both compute in the
dtype PageFleet's `auto` picks here (bfloat16 on CPUs with native bfloat16, else float32),
run quantized by llama.cpp), sent the same workloads with the same seed by `pagefleet bench serve`'s
client, and stopped. Results go to benchmarks/results/: results.md (tables), results.json
(every number) and PNG plots.

Servers: PageFleet (`pagefleet serve`); Hugging Face `transformers serve` without and with
`--continuous-batching`; llama.cpp's C++ `llama-server` (parallel slots, continuous
batching); `python -m llama_cpp.server` from llama-cpp-python. The llama.cpp peers are
built from the llama-cpp-python source distribution into benchmarks/.peers/ (ignored by git,
kept between runs; the first build takes ~10 minutes on 2 cores). A peer that cannot be
installed or run is listed in the table with the reason.

Workloads (defaults sized for this 2-core machine: about 15 minutes once the peers are
built; `--full` runs the issue's full sizes without time limits, which takes hours with
the slow peers):
1. random 256-token prompts, 128 tokens out (ignore_eos or its equivalent), one wave of
   `c` requests under a concurrency limit of c = 1, 8, 64 (add 32 with --concurrency)
   -> output tokens/s per server. A level may run 20 s + 1 s per unit of concurrency;
   requests still running then are cut (marked in the table), the tokens they streamed
   still count. A batching peer cut while it prefills the wave reports too little, so the
   c=64 target is only judged against peers that finished; `--level-limit 240` lets them. PageFleet's /metrics is scraped meanwhile (KV-cache usage over time, slot
   fill at peak). Then TTFT against Poisson request rate for --sweep-servers, and Hugging
   Face `generate` on static batches of 16 (the offline benchmark's baseline).
2. prefix repetition: 8 prefixes of 1,024 tokens (+ 32-token suffixes) shared by 16
   requests sent one at a time, PageFleet with prefix caching on vs off: TTFT mean/p99,
   and on prefix hits.
3. mixed: Poisson arrivals at 1.5 req/s, 40 requests of 128 tokens (64 out), 10% of them
   2,000 tokens long, PageFleet with chunked prefill on (a 256-token step budget) vs off
   (a 4,096-token budget: a long prompt is prefilled in one step): p99 ITL of the short
   requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from pagefleet_bench.backend import RequestSettings
from pagefleet_bench.datasets import (
    PromptShaper,
    SampleRequest,
    prefix_repetition_requests,
    random_requests,
)
from pagefleet_bench.runner import RunSettings, run_requests
from pagefleet_serve.model.loader import builtin_gguf_path, load_tokenizer

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
PEERS = ROOT / ".peers"
VENV_BIN = Path(sys.executable).parent
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# A native build dies with 'Illegal instruction' on this CPU; these flags work.
GGML_FLAGS = [
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
]
START_TIMEOUT_S = 300.0
THREADS = os.cpu_count() or 2


def torch_dtype_name() -> str:
    """The dtype PageFleet's `auto` resolves to on this CPU; the transformers peers and the
    HF generate baseline are given the same one."""
    import torch
    from pagefleet_serve.engine.llm_engine import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def log(message: str) -> None:
    stamp = datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", flush=True)


def tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-600:]


class PeerUnavailable(Exception):
    """A peer that cannot be installed or started here; the message says why."""


# -- peer installation (cached under benchmarks/.peers) ------------------------------------------
def _run_logged(command: list[str], log_path: Path, what: str, **kwargs) -> None:
    with log_path.open("ab") as out:
        out.write(f"\n$ {' '.join(command)}\n".encode())
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if code != 0:
        raise PeerUnavailable(f"{what} failed (exit {code}): {tail(log_path)}")


def prepare_peer_dir() -> None:
    PEERS.mkdir(parents=True, exist_ok=True)
    # Everything here is built or downloaded by this script; git never sees it.
    (PEERS / ".gitignore").write_text("*\n")
    (PEERS / "logs").mkdir(exist_ok=True)


def hf_model_dir(gguf: Path) -> Path:
    """`transformers serve` takes no GGUF path: load the GGUF with transformers
    (dequantized to float32), copy the weights into a plain LlamaForCausalLM (a model
    loaded from GGUF refuses save_pretrained) and save that as a model directory."""
    target = PEERS / "smollm2-135m-hf"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log("converting the GGUF to a Hugging Face directory for transformers serve")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config)).to("cpu", dtype=loaded.dtype)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = target.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


def llama_cpp_source() -> Path:
    """The llama-cpp-python source distribution, unpacked; it carries llama.cpp's source."""
    source = PEERS / "src"
    unpacked = sorted(source.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if unpacked:
        return unpacked[-1].parents[2]
    source.mkdir(exist_ok=True)
    log(f"downloading the {LLAMA_CPP_PYTHON} source distribution")
    _run_logged(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            LLAMA_CPP_PYTHON,
            "-d",
            str(source),
        ],
        PEERS / "logs" / "download.log",
        "pip download",
    )
    archive = next(source.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        # filter="data" (no links or paths out of the folder) where Python has it.
        tar.extractall(source, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return next(source.glob("llama_cpp_python-*/vendor/llama.cpp")).parents[1]


def build_llama_cpp(source: Path) -> Path:
    """One CMake build of the vendored llama.cpp: `llama-server` and the shared libllama
    that llama-cpp-python loads (LLAMA_CPP_LIB_PATH), so llama.cpp is compiled once."""
    build = PEERS / "llama.cpp-build"
    binary = build / "bin" / "llama-server"
    if binary.exists() and (build / "bin" / "libllama.so").exists():
        return build / "bin"
    log_path = PEERS / "logs" / "llama.cpp-build.log"
    log(
        f"building llama.cpp (llama-server + libllama) on {THREADS} cores: ~10 minutes; "
        f"log: {log_path}"
    )
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run_logged(
        [
            "cmake",
            "-S",
            str(source / "vendor" / "llama.cpp"),
            "-B",
            str(build),
            *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_SERVER=ON",
            *GGML_FLAGS,
        ],
        log_path,
        "cmake configure",
    )
    _run_logged(
        ["cmake", "--build", str(build), "--target", "llama-server", "llama", "-j", str(THREADS)],
        log_path,
        "cmake build",
    )
    return build / "bin"


def llama_cpp_python_venv(source: Path) -> Path:
    """A virtual environment (not the project's) with llama-cpp-python[server] installed
    without compiling: it loads the libllama built above."""
    venv = PEERS / "venv"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.exists():
        return python
    log_path = PEERS / "logs" / "venv.log"
    log("installing llama-cpp-python[server] into benchmarks/.peers/venv")
    _run_logged([sys.executable, "-m", "venv", "--clear", str(venv)], log_path, "venv")
    env = os.environ | {"CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
    _run_logged(
        [str(python), "-m", "pip", "install", "--quiet", f"{source}[server]"],
        log_path,
        "pip install llama-cpp-python[server]",
        env=env,
    )
    stamp.touch()
    return python


# -- servers ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class ServerSpec:
    name: str  # column in the tables
    label: str  # what it is, for the table
    # (port) -> (command, environment additions, working directory)
    command: Callable[[int], tuple[list[str], dict[str, str], Path]]
    model: str  # the model name requests carry
    ready_path: str = "/health"
    # Servers that do not take `ignore_eos` get their output length forced another way.
    ignore_eos: bool = True
    extra_body: Callable[[int], dict] = lambda output_len: {}
    prepare: Callable[[], None] | None = None  # installs what the server needs (cached)
    unavailable: str | None = None


class RunningServer:
    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command, env, cwd = spec.command(self.port)
        self.log_file = log_path.open("wb")
        started = time.perf_counter()
        self.process = subprocess.Popen(
            command,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=os.environ | env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(
                    f"exited with {self.process.returncode} at start: {tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(self.base_url + self.spec.ready_path, timeout=5):
                    return
            except OSError:
                time.sleep(0.5)
        raise PeerUnavailable(f"not ready after {START_TIMEOUT_S:.0f}s: {tail(self.log_path)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        self.log_file.close()


def server_specs(args: argparse.Namespace, gguf: Path, special_ids: list[int]) -> list[ServerSpec]:
    llama_bin: dict[str, Path] = {}
    peers_python: dict[str, Path] = {}

    def prepare_llama_cpp() -> None:
        source = llama_cpp_source()
        llama_bin["dir"] = build_llama_cpp(source)

    def prepare_llama_cpp_python() -> None:
        prepare_llama_cpp()
        peers_python["python"] = llama_cpp_python_venv(llama_cpp_source())

    def pagefleet(*flags: str):
        def command(port: int):
            return (
                [
                    str(VENV_BIN / "pagefleet"),
                    "serve",
                    "--port",
                    str(port),
                    "--max-model-len",
                    "4096",
                    "--max-num-seqs",
                    "128",
                    "--kv-cache-memory",
                    "2GiB",
                    "--log-level",
                    "warning",
                    *flags,
                ],
                {},
                REPO,
            )

        return command

    def transformers(*flags: str):
        def command(port: int):
            # The directory by a path relative to benchmarks/.peers, the form seen to work here.
            return (
                [
                    str(VENV_BIN / "transformers"),
                    "serve",
                    "smollm2-135m-hf",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--device",
                    "cpu",
                    "--dtype",
                    torch_dtype_name(),
                    *flags,
                ],
                {},
                PEERS,
            )

        return command

    def llama_server(port: int):
        slots = 64
        return (
            [
                str(llama_bin["dir"] / "llama-server"),
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-np",
                str(slots),
                "-c",
                str(slots * 512),
                "-cb",
                "-t",
                str(THREADS),
                "--no-webui",
            ],
            {"LD_LIBRARY_PATH": str(llama_bin["dir"])},
            PEERS,
        )

    def llama_cpp_server(port: int):
        return (
            [
                str(peers_python["python"]),
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--model_alias",
                "smollm2-135m",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                "2048",
                "--n_threads",
                str(THREADS),
                # By default a new request interrupts the running stream.
                "--interrupt_requests",
                "False",
            ],
            {"LLAMA_CPP_LIB_PATH": str(llama_bin["dir"])},
            PEERS,
        )

    def forced_length(output_len: int) -> dict:
        # transformers serve rejects ignore_eos; a generation_config forces the length.
        config = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False}
        return {"generation_config": json.dumps(config)}

    no_eos_bias = {"logit_bias": {str(i): -100.0 for i in special_ids}}
    specs = [
        ServerSpec(
            "pagefleet",
            "PageFleet `pagefleet serve`",
            pagefleet(),
            "smollm2-135m",
            ready_path="/ready",
        ),
        ServerSpec(
            "transformers",
            "`transformers serve`",
            transformers(),
            "smollm2-135m-hf",
            ignore_eos=False,
            extra_body=forced_length,
            prepare=lambda: hf_model_dir(gguf),
        ),
        ServerSpec(
            "transformers-cb",
            "`transformers serve --continuous-batching`",
            transformers("--continuous-batching"),
            "smollm2-135m-hf",
            ignore_eos=False,
            extra_body=forced_length,
            prepare=lambda: hf_model_dir(gguf),
        ),
        ServerSpec(
            "llama-server",
            "llama.cpp `llama-server -np 64`",
            llama_server,
            "smollm2-135m",
            prepare=prepare_llama_cpp,
        ),
        ServerSpec(
            "llama-cpp-python",
            "`python -m llama_cpp.server`",
            llama_cpp_server,
            "smollm2-135m",
            ready_path="/v1/models",
            ignore_eos=False,
            extra_body=lambda output_len: no_eos_bias,
            prepare=prepare_llama_cpp_python,
        ),
    ]
    by_name = {s.name: s for s in specs}
    unknown = set(args.servers) - set(by_name)
    if unknown:
        raise SystemExit(f"--servers: unknown {sorted(unknown)}; choose from {sorted(by_name)}")
    return [by_name[name] for name in args.servers]


def pagefleet_variant(spec: ServerSpec, name: str, *flags: str) -> ServerSpec:
    def command(port: int):
        argv, env, cwd = spec.command(port)
        return [*argv, *flags], env, cwd

    return dataclasses.replace(spec, name=name, command=command)


# -- running workloads ------------------------------------------------------------------------
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
        str(ROOT / "bench_offline.py"),
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


# -- report ---------------------------------------------------------------------------------------
def fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def write_report(report: dict, out: Path, specs: list[ServerSpec]) -> None:
    lines = [
        "# PageFleet side by side",
        "",
        f"Run on {report['date']} on this machine ({report['machine']}), "
        f"`{report['command']}`, {report['wall_s'] / 60:.1f} minutes (of which "
        f"{report['setup_s'] / 60:.1f} one-time peer setup). Model: SmolLM2-135M-"
        f"Instruct, the built-in Q4_1 GGUF, computed in {report.get('dtype', '?')} by PageFleet "
        "and transformers. Seed 0. All requests streamed "
        "(`stream_options.include_usage`) to `/v1/completions`, greedy. Load average "
        f"(1 min) {report['load_average_at_start'][0]:.1f} at the start, "
        f"{report['load_average_now'][0]:.1f} at the end.",
        "",
        "## 1. Output tokens/s by concurrency (random 256-token prompts, 128 tokens out)",
        "",
    ]
    concurrencies = report["plan"]["concurrencies"]
    lines.append(
        "| server | start (s) | "
        + " | ".join(f"c={c}" for c in concurrencies)
        + " | TTFT p99 at c=max (ms) | TPOT mean at c=max (ms) | note |"
    )
    lines.append("|---" * (len(concurrencies) + 5) + "|")
    for spec in specs:
        entry = report["servers"].get(spec.name, {})
        w1 = entry.get("throughput", {})
        cells = []
        for c in concurrencies:
            r = w1.get(str(c))
            if r is None:
                cells.append("-")
                continue
            cut = "*" if r["incomplete"] else ""
            failed = f" ({r['failed']} failed)" if r["failed"] else ""
            cells.append(f"{fmt(r['output_throughput'])}{cut}{failed}")
        last = w1.get(str(concurrencies[-1]), {})
        if not last.get("completed"):
            last = {}
        note = entry.get("unavailable") or entry.get("note", "")
        lines.append(
            f"| {spec.label} | {fmt(entry.get('startup_s'))} | "
            + " | ".join(cells)
            + f" | {fmt(last.get('p99_ttft_ms'), 0)} | {fmt(last.get('mean_tpot_ms'), 0)}"
            f" | {note} |"
        )
    if report["plan"]["level_limit_s"]:
        lines += [
            "",
            f"\\* cut at the limit of {report['plan']['level_limit_s']:.0f} s + 1 s per unit of "
            "concurrency: requests "
            "still running were cancelled (reported as incomplete) and the tokens they had "
            "streamed count toward throughput.",
        ]
    hf = report.get("hf_generate")
    if hf and "unavailable" in hf:
        lines += ["", f"Hugging Face `generate`, static batches of 16: {hf['unavailable']}."]
    elif hf:
        lines += [
            "",
            f"Hugging Face `generate`, static batches of 16, {hf['num_prompts']} "
            f"of these prompts, in-process: {fmt(hf['output_tokens_per_s'])} output tok/s.",
        ]
    kv = report.get("kv", {})
    if kv:
        lines += [
            "",
            "## KV cache (PageFleet, from /metrics during workload 1)",
            "",
            f"- Peak: {kv['peak_used_blocks']:.0f} of {kv['num_blocks']:.0f} blocks held by "
            f"{kv['running_at_peak']:.0f} running sequences; {kv['tokens_held_at_peak']:.0f} "
            f"tokens in {kv['slots_at_peak']:.0f} slots: **slot fill {kv['slot_fill_at_peak']:.3f}**.",
            f"- A contiguous reservation of max_model_len ({kv['max_model_len']}) per sequence "
            f"would need {kv['contiguous_reservation_tokens']:,.0f} token slots for the same "
            f"sequences: {kv['tokens_held_at_peak'] / max(kv['contiguous_reservation_tokens'], 1):.3f} "
            "of them would hold tokens.",
        ]
    prefix = report.get("prefix")
    if prefix:
        lines += [
            "",
            "## 2. Prefix caching (PageFleet; 8 prefixes of 1,024 tokens, one request at a time)",
            "",
            "| prefix caching | requests | TTFT mean (ms) | TTFT p99 (ms) | TTFT on a hit, "
            "mean (ms) | TTFT on a hit, p99 (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in prefix.items():
            lines.append(
                f"| {name} | {r['completed']} | {fmt(r['mean_ttft_ms'], 0)} | "
                f"{fmt(r['p99_ttft_ms'], 0)} | {fmt(r['mean_ttft_hit_ms'], 0)} | "
                f"{fmt(r['p99_ttft_hit_ms'], 0)} |"
            )
    mixed = report.get("mixed")
    if mixed:
        lines += [
            "",
            f"## 3. Chunked prefill (PageFleet; Poisson {report['plan']['mixed_rate']} "
            "req/s, 128-token prompts and 10% of 2,000 tokens, 64 tokens out)",
            "",
            "| chunked prefill | completed | ITL p99, short requests (ms) | ITL median, "
            "short (ms) | ITL max, short (ms) | TTFT p99 (ms) | output tok/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in mixed.items():
            lines.append(
                f"| {name} | {r['completed']} | {fmt(r['p99_itl_short_ms'], 0)} | "
                f"{fmt(r['median_itl_short_ms'], 0)} | {fmt(r.get('max_itl_short_ms'), 0)} | "
                f"{fmt(r['p99_ttft_ms'], 0)} | "
                f"{fmt(r['output_throughput'])} |"
            )
    lines += ["", "## Targets", ""]
    lines += [f"- {t}" for t in report["targets"]]
    lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in report.get("plots", []))]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def targets(report: dict) -> list[str]:
    out = []
    servers = report["servers"]
    top = str(report["plan"]["concurrencies"][-1])
    ours = servers.get("pagefleet", {}).get("throughput", {}).get(top, {}).get("output_throughput")
    levels = {
        name: e["throughput"][top]
        for name, e in servers.items()
        if name != "pagefleet" and top in e.get("throughput", {})
    }
    # A level cut at the time limit undercounts a batching server still prefilling its
    # wave: the target is judged against the peers that finished.
    peers = {n: r["output_throughput"] for n, r in levels.items() if not r["incomplete"]}
    cut = sorted(n for n, r in levels.items() if r["incomplete"])
    if ours and peers:
        best = max(peers, key=peers.get)
        ratio = ours / peers[best] if peers[best] else math.nan
        out.append(
            f"throughput at c={top}: {ours:.1f} tok/s vs best peer that finished, {best}, "
            f"{peers[best]:.1f}: {ratio:.2f}x (target 4x): "
            f"{'met' if ratio >= 4 else 'not met'}"
        )
    if ours and cut:
        out.append(
            f"throughput at c={top}: not compared with {', '.join(cut)}, cut at the time "
            "limit (run with a larger --level-limit)"
        )
    hf = report.get("hf_generate")
    if ours and hf and "output_tokens_per_s" in hf:
        ratio = ours / hf["output_tokens_per_s"]
        out.append(
            f"vs HF generate static batches of 16: {ratio:.2f}x (target 5x): "
            f"{'met' if ratio >= 5 else 'not met'}"
        )
    kv = report.get("kv")
    if kv:
        fill = kv["slot_fill_at_peak"]
        out.append(
            f"KV slot fill at peak {fill:.3f} (target 0.96): {'met' if fill >= 0.96 else 'not met'}"
        )
    prefix = report.get("prefix", {})
    if "on" in prefix and "off" in prefix:
        ratio = prefix["off"]["mean_ttft_ms"] / prefix["on"]["mean_ttft_hit_ms"]
        out.append(
            f"TTFT with caching off / on a prefix hit: {ratio:.1f}x (target 10x): "
            f"{'met' if ratio >= 10 else 'not met'}"
        )
    mixed = report.get("mixed", {})
    if "on" in mixed and "off" in mixed:
        ratio = mixed["off"]["p99_itl_short_ms"] / mixed["on"]["p99_itl_short_ms"]
        out.append(
            f"p99 ITL of short requests, chunked prefill off / on: {ratio:.1f}x "
            f"(target 3x): {'met' if ratio >= 3 else 'not met'}"
        )
    run_min = (report["wall_s"] - report.get("setup_s", 0.0)) / 60
    setup = f"not counting {report.get('setup_s', 0.0) / 60:.1f} minutes of one-time peer setup"
    if report["command"] == "python benchmarks/side_by_side.py":
        out.append(
            f"run time {run_min:.1f} minutes, {setup} (target under 15 with the default "
            f"settings): {'met' if run_min < 15 else 'not met'}"
        )
    else:
        out.append(
            f"run time {run_min:.1f} minutes, {setup}; settings other than the defaults "
            "(the 15-minute target is for `make bench` as it is)"
        )
    return out


def plot(report: dict, out: Path, specs: list[ServerSpec]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in specs:
        w1 = report["servers"].get(spec.name, {}).get("throughput", {})
        points = sorted((int(c), r["output_throughput"]) for c, r in w1.items())
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=spec.name)
    ax.set(
        xscale="log",
        xlabel="max concurrency",
        ylabel="output tokens/s",
        title="Throughput vs concurrency (256 in / 128 out)",
    )
    ax.set_xticks(
        report["plan"]["concurrencies"], [str(c) for c in report["plan"]["concurrencies"]]
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_concurrency.png", dpi=110)
    written.append("throughput_vs_concurrency.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in report["servers"].items():
        sweep = entry.get("rate_sweep", {})
        points = sorted((float(r), v["median_ttft_ms"], v["p99_ttft_ms"]) for r, v in sweep.items())
        if points:
            rates, p50, p99 = zip(*points, strict=True)
            line = ax.plot(rates, p50, marker="o", label=f"{name} p50")[0]
            ax.plot(
                rates, p99, marker="s", linestyle="--", color=line.get_color(), label=f"{name} p99"
            )
    if ax.lines:
        ax.set(
            xlabel="request rate (req/s, Poisson)",
            ylabel="TTFT (ms)",
            title="TTFT vs request rate (256 in / 128 out)",
        )
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft_vs_request_rate.png", dpi=110)
        written.append("ttft_vs_request_rate.png")

    scrape = report.get("kv_timeline", [])
    if scrape:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        t = [s["t"] - scrape[0]["t"] for s in scrape]
        ax.plot(t, [s["kv_cache_usage_perc"] for s in scrape], label="vllm:kv_cache_usage_perc")
        ax.set(
            xlabel="seconds into workload 1 (PageFleet, c = "
            + ", ".join(str(c) for c in report["plan"]["concurrencies"])
            + ")",
            ylabel="fraction of KV blocks held",
            title="PageFleet KV-cache usage",
        )
        ax2 = ax.twinx()
        ax2.plot(
            t,
            [s["running"] for s in scrape],
            color="tab:orange",
            alpha=0.6,
            label="running requests",
        )
        ax2.set_ylabel("running requests")
        ax.grid(alpha=0.3)
        handles = ax.get_lines() + ax2.get_lines()
        ax.legend(handles, [h.get_label() for h in handles], loc="upper left")
        fig.tight_layout()
        fig.savefig(out / "kv_cache_usage.png", dpi=110)
        written.append("kv_cache_usage.png")
    plt.close("all")
    return written


# -- main -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--servers",
        nargs="+",
        default=[
            "pagefleet",
            "llama-server",
            "llama-cpp-python",
            "transformers-cb",
            "transformers",
        ],
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument(
        "--level-limit",
        type=float,
        default=20.0,
        help="a throughput level may run this many seconds plus one per unit of concurrency; "
        "requests still running then are cut and reported as incomplete (0: no limit)",
    )
    parser.add_argument(
        "--sweep-servers",
        nargs="*",
        default=["pagefleet"],
        help="servers that also get the TTFT vs request rate sweep",
    )
    parser.add_argument("--sweep-rates", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--sweep-prompts", type=int, default=8)
    parser.add_argument("--prefix-prompts", type=int, default=16)
    parser.add_argument("--mixed-prompts", type=int, default=40)
    parser.add_argument("--mixed-rate", type=float, default=1.5)
    parser.add_argument(
        "--hf-generate-prompts",
        type=int,
        default=16,
        help="prompts for the HF generate baseline (0: skip)",
    )
    parser.add_argument("--hf-timeout", type=float, default=240.0, help="seconds for it")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument(
        "--full",
        action="store_true",
        help="the issue's full sizes (much longer than 15 minutes here)",
    )
    parser.add_argument("--output-dir", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    started = time.perf_counter()
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    prepare_peer_dir()
    gguf = builtin_gguf_path()
    tokenizer = load_tokenizer("builtin://smollm2-135m")
    shaper = PromptShaper(tokenizer, chat=False)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rng = random.Random(0)
    w1_count = max(plan.prompts_per_level(c) for c in plan.concurrencies)
    w1 = random_requests(
        shaper, max(w1_count, plan.sweep_prompts, plan.hf_generate_prompts), 256, 128, 0.0, rng
    )
    specs = server_specs(args, gguf, sorted(set(tokenizer.all_special_ids)))
    report: dict = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{THREADS} CPU cores, no GPU",
        "dtype": torch_dtype_name(),
        # Other work on the machine slows every server; torch's threads suffer most.
        "load_average_at_start": os.getloadavg(),
        "command": " ".join(["python benchmarks/side_by_side.py", *sys.argv[1:]]).strip(),
        "plan": dataclasses.asdict(plan)
        | {"prompts_per_level": {str(c): plan.prompts_per_level(c) for c in plan.concurrencies}},
        "servers": {},
    }
    logs = PEERS / "logs"

    def publish() -> None:
        """Results so far, rewritten after each server: a run cut short still reports."""
        report["wall_s"] = time.perf_counter() - started
        report["load_average_now"] = os.getloadavg()
        report["setup_s"] = sum(e.get("prepare_s", 0.0) for e in report["servers"].values())
        report["targets"] = targets(report)
        report["plots"] = plot(report, out, specs)
        (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
        write_report(report, out, specs)

    for spec in specs:
        run_server(spec, args, plan, w1, shaper, count_tokens, report, logs)
        if spec.name == "pagefleet":
            run_pagefleet_variants(spec, args, plan, shaper, count_tokens, report, logs)
        publish()
    if plan.hf_generate_prompts:
        log(f"HF generate, static batches of 16, {plan.hf_generate_prompts} prompts")
        hf = hf_generate_baseline(w1, tokenizer, plan.hf_generate_prompts, args.hf_timeout)
        report["hf_generate"] = hf | {"num_prompts": plan.hf_generate_prompts}
        log(f"  {hf.get('output_tokens_per_s', hf.get('unavailable'))}")
        publish()
    log(f"wrote {out / 'results.md'} ({report['wall_s'] / 60:.1f} minutes)")
    print((out / "results.md").read_text())
    return 0


def run_server(spec, args, plan, w1, shaper, count_tokens, report, logs) -> None:
    """Prepare (install, cached) and start one server, run its workloads, stop it."""
    entry: dict = {"label": spec.label}
    report["servers"][spec.name] = entry
    log(f"{spec.name}: preparing")
    prepared = time.perf_counter()
    try:
        if spec.prepare is not None:
            spec.prepare()
        entry["prepare_s"] = time.perf_counter() - prepared
        server = RunningServer(spec, logs / f"{spec.name}.log")
    except Exception as exc:  # noqa: BLE001 - whatever stops a peer goes in the table
        entry["unavailable"] = f"not run: {type(exc).__name__}: {exc}"[:700]
        log(f"{spec.name}: {entry['unavailable']}")
        return
    entry["startup_s"] = server.startup_s
    log(f"{spec.name}: ready in {server.startup_s:.1f}s on {server.base_url}")
    scrape: list[dict] | None = [] if spec.name == "pagefleet" else None
    try:
        entry["throughput"] = {}
        throughput_workload(server, w1, plan, count_tokens, scrape, entry["throughput"])
        if spec.name in args.sweep_servers:
            entry["rate_sweep"] = {}
            rate_sweep(server, w1, plan, count_tokens, entry["rate_sweep"])
        if spec.name == "pagefleet" and not args.skip_prefix:
            prefix = prefix_samples(shaper, plan)
            report.setdefault("prefix", {})["on"] = prefix_workload(server, prefix, count_tokens)
    except PeerUnavailable as exc:
        entry["unavailable"] = f"failed: {exc}"
        log(f"{spec.name}: {entry['unavailable']}")
    finally:
        server.stop()
    if scrape:
        report["kv_timeline"] = scrape
        report["kv"] = kv_figures(scrape, block_size=16, max_model_len=4096)


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


def run_pagefleet_variants(base, args, plan, shaper, count_tokens, report, logs) -> None:
    """The engine features the peers have no switch for: prefix caching off (workload 2)
    and chunked prefill on vs off (workload 3), each a fresh server."""
    long_len = 2000
    variants = []
    if not args.skip_prefix and "prefix" in report:
        variants.append(("prefix", "off", ["--no-enable-prefix-caching"]))
    if not args.skip_mixed:
        variants.append(("mixed", "on", ["--max-num-batched-tokens", "256"]))
        variants.append(("mixed", "off", ["--max-num-batched-tokens", "4096"]))
    mixed = mixed_samples(shaper, plan, long_len) if not args.skip_mixed else []
    for workload, setting, flags in variants:
        spec = pagefleet_variant(base, f"pagefleet-{workload}-{setting}", *flags)
        log(f"{spec.name}: {' '.join(flags)}")
        try:
            server = RunningServer(spec, logs / f"{spec.name}.log")
        except PeerUnavailable as exc:
            log(f"{spec.name}: {exc}")
            continue
        try:
            if workload == "prefix":
                result = prefix_workload(server, prefix_samples(shaper, plan), count_tokens)
            else:
                result = mixed_workload(server, mixed, plan, count_tokens, long_len)
        finally:
            server.stop()
        report.setdefault(workload, {})[setting] = result | {"flags": flags}
        log(
            f"  {workload} {setting}: "
            + ", ".join(
                f"{k} {fmt(v, 0)}"
                for k, v in result.items()
                if k.endswith("_ms") and ("hit" in k or "short" in k or k == "mean_ttft_ms")
            )
        )


if __name__ == "__main__":
    sys.exit(main())
