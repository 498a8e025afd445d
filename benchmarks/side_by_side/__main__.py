"""`python -m benchmarks.side_by_side` (from the repository root; `make bench`): see the
package's docstring."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from pagefleet_bench.datasets import PromptShaper, random_requests
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.model.loader.resolve import builtin_gguf_path

from . import __doc__ as PACKAGE_DOC
from .common import (
    BENCHMARKS,
    PEERS,
    THREADS,
    PeerUnavailable,
    cpu_info,
    log,
    torch_dtype_name,
)
from .peers import (
    VLLM_PYTHON,
    RunningServer,
    hf_model_dir,
    pagefleet_variant,
    prepare_peer_dir,
    server_specs,
)
from .report import fmt, plot, targets, write_report
from .workloads import (
    INPUT_LEN,
    OUTPUT_LEN,
    hf_generate_baseline,
    kv_figures,
    make_plan,
    mixed_samples,
    mixed_workload,
    prefix_samples,
    prefix_workload,
    rate_sweep,
    throughput_workload,
    vllm_client_throughput,
)

DEFAULT_SERVERS = [
    "pagefleet",
    "pagefleet-q4",
    "pagefleet-q4-int8",
    "vllm",
    "llama-server",
    "llama-cpp-python",
    "transformers-cb",
    "transformers",
]
QUICK_SERVERS = ["pagefleet", "pagefleet-q4", "pagefleet-q4-int8", "vllm", "llama-server"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.side_by_side",
        description=PACKAGE_DOC.splitlines()[0],
    )
    parser.add_argument(
        "--servers",
        nargs="+",
        help=f"servers to run, in order (default: {' '.join(DEFAULT_SERVERS)}; "
        f"with --quick: {' '.join(QUICK_SERVERS)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="workload 1 only, 8/16/64 prompts at c=1/8/64, each level to the end, on "
        "PageFleet (bfloat16 and --quantization auto), vLLM and llama-server (~20 minutes here "
        "once the peers are installed)",
    )
    parser.add_argument(
        "--no-vllm-client",
        dest="vllm_client",
        action="store_false",
        help="skip the second measurement of workload 1 by `vllm bench serve` (run by "
        "default where the vLLM venv is installed)",
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
        help="servers that also get the TTFT vs request rate sweep (default: pagefleet; "
        "none with --quick)",
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
    parser.add_argument("--output-dir", type=Path, default=BENCHMARKS / "results")
    args = parser.parse_args(argv)
    if args.quick and args.full:
        parser.error("--quick and --full: choose one")
    if args.servers is None:
        args.servers = QUICK_SERVERS if args.quick else DEFAULT_SERVERS
    if args.sweep_servers is None:
        args.sweep_servers = [] if args.quick else ["pagefleet"]
    args.skip_prefix |= args.quick
    args.skip_mixed |= args.quick
    args.vllm_client &= VLLM_PYTHON.exists()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Servers run in their own sessions: SIGTERM (a `timeout`, a CI cancel) must unwind
    # through RunningServer.stop like Ctrl-C does, or the server outlives the run.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
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
        shaper,
        max(w1_count, plan.sweep_prompts, plan.hf_generate_prompts),
        INPUT_LEN,
        OUTPUT_LEN,
        0.0,
        rng,
    )
    specs = server_specs(args, gguf, sorted(set(tokenizer.all_special_ids)))
    report: dict = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{THREADS} CPU cores, no GPU",
        "cpu": cpu_info(),
        "dtype": torch_dtype_name(),
        # Other work on the machine slows every server; torch's threads suffer most.
        "load_average_at_start": os.getloadavg(),
        "command": " ".join(["python -m benchmarks.side_by_side", *sys.argv[1:]]).strip(),
        "plan": dataclasses.asdict(plan)
        | {"prompts_per_level": {str(c): plan.prompts_per_level(c) for c in plan.concurrencies}},
        "servers": {},
    }
    logs = PEERS / "logs"
    cpu = report["cpu"]
    log(f"CPU: {cpu['model']}, {THREADS} cores; flags: {' '.join(cpu['notable_flags'])}")
    if args.vllm_client:
        hf_model_dir(gguf)  # the tokenizer vLLM's client loads

    def publish() -> None:
        """Results so far, rewritten after each server: a run cut short still reports."""
        report["wall_s"] = time.perf_counter() - started
        report["load_average_now"] = os.getloadavg()
        report["setup_s"] = sum(e.get("prepare_s", 0.0) for e in report["servers"].values())
        report["targets"] = targets(report)
        report["plots"] = plot(report, out)
        (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
        write_report(report, out)

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
        if args.vllm_client and spec.vllm_client:
            entry["vllm_client"] = {}
            vllm_client_throughput(server, plan, logs, entry["vllm_client"])
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
