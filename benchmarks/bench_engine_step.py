"""The engine's decode step against its GEMMs alone (`python -m benchmarks.bench_engine_step`).

For each decode batch size (1, 8, 64 by default): that many requests with prompts of
`--prompt-len` tokens of real English text are prefilled, then `LLMEngine.step` is timed
over `--steps` pure decode steps (every sequence adds one token, contexts grow from the
prompt length). The same model's linear layers (the very modules, so quantized weights
are multiplied as the engine multiplies them) are then timed alone on a batch of that many
rows: q/k/v, o, gate/up and down of every layer plus the LM head. Their ratio, the GEMM
share of the step, says how much of the step is anything but matrix multiplication.

`--baseline-src DIR` runs the same measurement, in a child process, against the sources
of another checkout (e.g. `git archive <rev> | tar -x -C DIR`) right before this one,
and prints both side by side: one invocation, the same machine load.
Prints a table and writes JSON.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.frontend.tokenizer import load_engine_tokenizer

try:
    from pagefleet_serve.messages import Request
except ImportError:  # a --baseline-src from before the messages module: it lived here
    from pagefleet_serve.engine.llm_engine import Request
from pagefleet_serve.sampling_params import SamplingParams

from benchmarks.side_by_side.common import cpu_info

TEXT = Path("/usr/share/common-licenses/GPL-3")
REPO = Path(__file__).resolve().parents[1]  # where `-m benchmarks.bench_engine_step` runs


def linear_modules(model) -> list[torch.nn.Module]:
    """Every matrix multiplication of one decode step: the layers' projections, the head."""
    mods = []
    for layer in model.layers:
        mods += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        mods += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return [*mods, model.lm_head]


@torch.inference_mode()
def gemm_pass(mods, inputs) -> float:
    """Seconds for all of a step's GEMMs run back to back."""
    started = time.perf_counter()
    for m, x in zip(mods, inputs, strict=True):
        m(x)
    return time.perf_counter() - started


def measure_batch(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> dict:
    """`batch` sequences are prefilled, then each timed decode step is followed by a timed
    pass of the same GEMMs on `batch` rows, so that both see the same machine load. The
    fastest of each is kept: on a shared machine other processes only ever add time."""
    corpus = engine.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        start = rng.randrange(0, len(corpus) - prompt_len)
        prompt = corpus[start : start + prompt_len]
        engine.add(Request(f"step-{batch}-{i}", prompt, params, time.time()))
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running
    ):
        engine.step()
    mods = linear_modules(engine.runner.model)
    inputs = [torch.randn(batch, m.in_features, dtype=engine.dtype) for m in mods]
    engine.step()  # warm-up
    gemm_pass(mods, inputs)
    step_times, gemm_times = [], []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - started)
        gemm_times.append(gemm_pass(mods, inputs))
    while engine.has_unfinished_requests():
        engine.step()
    step, gemm = min(step_times) * 1e3, min(gemm_times) * 1e3
    return {
        "batch": batch,
        "step_ms": round(step, 2),
        "gemm_ms": round(gemm, 2),
        "gemm_share": round(gemm / step, 3),
        "tokens_per_s": round(batch / step * 1e3, 1),
        "step_ms_median": round(statistics.median(step_times) * 1e3, 2),
    }


def measure(args) -> dict:
    config = EngineConfig(
        dtype=args.dtype,
        max_num_seqs=max(args.batches),
        max_model_len=args.prompt_len + args.steps + 16,
        kv_cache_memory_bytes=512 << 20,
        **({"quantization": args.quantization} if args.quantization else {}),
        **(
            {"activation_quantization": args.activation_quantization}
            if args.activation_quantization != "none"
            else {}
        ),
        **({"enforce_eager": args.enforce_eager} if args.enforce_eager is not None else {}),
    )
    engine = LLMEngine(config, tokenizer=load_engine_tokenizer(config))
    rows = []
    for batch in args.batches:
        rows.append(measure_batch(engine, batch, args.prompt_len, args.steps))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": args.quantization or "(none: before the flag existed)",
        "activation_quantization": args.activation_quantization,
        "enforce_eager": getattr(engine.config, "enforce_eager", True),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def baseline(args, src: Path) -> dict:
    """This script, run against another checkout's sources in a child process."""
    env = dict(os.environ, PYTHONPATH=f"{src}/servingpod:{src}/kernels:{src}/operator")
    cmd = [sys.executable, "-m", "benchmarks.bench_engine_step", "--child", "--dtype", args.dtype]
    cmd += ["--batches", *map(str, args.batches), "--steps", str(args.steps)]
    cmd += ["--prompt-len", str(args.prompt_len)]
    if args.quantization:  # the baseline must know the flag
        cmd += ["--quantization", args.quantization]
    activations = args.baseline_activation_quantization or args.activation_quantization
    if activations != "none":  # likewise
        cmd += ["--activation-quantization", activations]
    out = subprocess.run(
        cmd, env=env, check=True, stdout=subprocess.PIPE, text=True, cwd=REPO
    ).stdout
    return json.loads(out)


def print_table(name: str, result: dict) -> None:
    eager = result.get("enforce_eager", True)
    activations = result.get("activation_quantization", "none")
    print(
        f"{name}: dtype {result['dtype']}, quantization {result['quantization']}, "
        f"activations {activations}, eager {eager}"
    )
    print(f"{'batch':>6} {'step ms':>9} {'GEMMs ms':>9} {'share':>6} {'tok/s':>7}")
    for r in result["rows"]:
        print(
            f"{r['batch']:>6} {r['step_ms']:>9.1f} {r['gemm_ms']:>9.1f} {r['gemm_share']:>6.2f} "
            f"{r['tokens_per_s']:>7.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None, help="the engine's --quantization")
    parser.add_argument(
        "--activation-quantization", default="none", help="the engine's --activation-quantization"
    )
    parser.add_argument(
        "--baseline-activation-quantization",
        default=None,
        help="the baseline's (default: --activation-quantization); with --baseline-src . "
        "it measures the setting against this checkout without it",
    )
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        help="the engine's --enforce-eager (default: the engine's); not passed to the baseline",
    )
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    parser.add_argument("--baseline-src", type=Path, help="another checkout to measure first")
    parser.add_argument("--output", default="bench-engine-step.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    cpu = cpu_info()  # machines differ: the figures mean nothing without it
    results = {"cpu": {"model": cpu["model"], "notable_flags": cpu["notable_flags"]}}
    print(f"CPU: {cpu['model']} ({' '.join(cpu['notable_flags'])})")
    if args.baseline_src:
        results["baseline"] = baseline(args, args.baseline_src)
        print_table(f"baseline ({args.baseline_src})", results["baseline"])
    results["current"] = measure(args)
    print_table("current", results["current"])
    if "baseline" in results:
        print("speed-up of the step (baseline / current):")
        for old, new in zip(results["baseline"]["rows"], results["current"]["rows"], strict=True):
            print(f"  batch {new['batch']:>3}: {old['step_ms'] / new['step_ms']:.2f}x")
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
