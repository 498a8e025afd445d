"""How much the server adds to the engine: the engine's own decode step (`LLMEngine.step`,
timed directly) at batch 1 and 64, against `pagefleet serve` (engine core in its own
process) driven by `pagefleet bench serve` with the same shape of requests: random
256-token prompts, 128 tokens out, ignore_eos, at concurrency 1 and 64.

Targets (issue 13): mean TPOT at c=1 within 1.15x of the batch-1 step; output tok/s at c=64
at least 0.8x of the engine alone running the same 64 requests at once. Both sides run in
one invocation, one after the other, so the ratios are measured side by side. Prints a
table and writes JSON. Not a test: the numbers depend on the machine and its load.
"""

import argparse
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

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.frontend.tokenizer import load_engine_tokenizer
from pagefleet_serve.messages import Request
from pagefleet_serve.sampling_params import SamplingParams

MODEL = "builtin://smollm2-135m"
SERVING_LINE = re.compile(r"serving .* on http://[^\s:]+:(\d+)")


def engine_alone(args: argparse.Namespace, batch: int) -> dict:
    """`batch` requests added at once; the median decode step once all are decoding, and
    the output tok/s over the whole run (prefills included, as the server's is)."""
    config = EngineConfig(model=MODEL, dtype=args.dtype, max_num_seqs=max(batch, 1))
    engine = LLMEngine(config, tokenizer=load_engine_tokenizer(config))
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i in range(batch):
        prompt = [rng.randrange(1000, vocab) for _ in range(args.input_len)]
        engine.add(Request(f"r{i}", prompt, params, time.time()))
    decode_steps, tokens, generating = [], 0, set()
    while engine.has_unfinished_requests():
        all_decoding = len(generating) == batch  # every prompt done: a pure decode step
        step_started = time.perf_counter()
        outputs = engine.step()
        if all_decoding:
            decode_steps.append(time.perf_counter() - step_started)
        generating.update(o.request_id for o in outputs)
        tokens += sum(o.num_generated_tokens for o in outputs)
    total = time.perf_counter() - started
    return {
        "batch": batch,
        "decode_step_ms": 1e3 * statistics.median(decode_steps[1:] or decode_steps),
        "output_tokens": tokens,
        "output_tok_per_s": tokens / total,
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, int, Path]:
    log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
    command = [sys.executable, "-m", "pagefleet_serve.cli", "serve", "--port", "0"]
    command += ["--dtype", args.dtype, "--max-num-seqs", "64", *args.serve_flag]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        found = SERVING_LINE.search(log.read_text())
        if found:
            return process, int(found.group(1)), log
        time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start in 300s")


def bench_serve(args: argparse.Namespace, port: int, concurrency: int, prompts: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "pagefleet_serve.cli", "bench", "serve"]
        command += ["--port", str(port), "--dataset-name", "random", "--ignore-eos"]
        command += ["--random-input-len", str(args.input_len)]
        command += ["--random-output-len", str(args.output_len)]
        command += ["--num-prompts", str(prompts), "--max-concurrency", str(concurrency)]
        command += ["--seed", str(args.seed), "--save-result", "--disable-tqdm"]
        command += ["--result-dir", out, "--result-filename", "result.json"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        result = json.loads((Path(out) / "result.json").read_text())
    return {
        "concurrency": concurrency,
        "num_prompts": prompts,
        "mean_tpot_ms": result["mean_tpot_ms"],
        "output_tok_per_s": result["output_throughput"],
        "completed": result["completed"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-c1", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serve-flag", action="append", default=[], help="an extra `pagefleet serve` flag"
    )
    parser.add_argument("--output", type=Path, default=Path("serving_overhead.json"))
    args = parser.parse_args()

    engine = {batch: engine_alone(args, batch) for batch in (1, 64)}
    process, port, log = start_server(args)
    try:
        server = {
            1: bench_serve(args, port, 1, args.prompts_c1),
            64: bench_serve(args, port, 64, 64),
        }
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.unlink(missing_ok=True)
    tpot_ratio = server[1]["mean_tpot_ms"] / engine[1]["decode_step_ms"]
    throughput_ratio = server[64]["output_tok_per_s"] / engine[64]["output_tok_per_s"]
    report = {
        "cpu_count": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "engine": engine,
        "server": server,
        "tpot_c1_over_step_b1": tpot_ratio,
        "server_c64_over_engine_b64": throughput_ratio,
        "targets": {"tpot_c1_over_step_b1": "<= 1.15", "server_c64_over_engine_b64": ">= 0.8"},
    }
    print(f"engine decode step, batch 1:   {engine[1]['decode_step_ms']:8.1f} ms")
    print(f"engine decode step, batch 64:  {engine[64]['decode_step_ms']:8.1f} ms")
    print(f"engine alone, 64 at once:      {engine[64]['output_tok_per_s']:8.1f} output tok/s")
    print(f"server mean TPOT, c=1:         {server[1]['mean_tpot_ms']:8.1f} ms")
    print(f"server, c=64:                  {server[64]['output_tok_per_s']:8.1f} output tok/s")
    print(f"TPOT c=1 / step b=1:           {tpot_ratio:8.2f}x (target <= 1.15x)")
    print(f"server c=64 / engine b=64:     {throughput_ratio:8.2f}x (target >= 0.8x)")
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
