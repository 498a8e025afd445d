"""A hybrid model's decode step against a dense one of the same width, by context length;
and the recurrent kernels' prefill against their definitions
(`python -m benchmarks.bench_hybrid`).

Two random LFM2 checkpoints are written by transformers' own class, equal but for their
layer types: the hybrid's layers are short convolutions but every `--attention-every`th
(3 by default; LFM2-1.2B has 6 attention layers of 16), the dense one's are all attention. For each context length
a decode step of one sequence is timed on the model runner (the cpu kernel backend) with
its KV blocks and state slot allocated for that context: the attention layers read
`context` keys each, the convolutions their state of one size. The fastest of `--steps`
steps is kept, the two models timed in turn at each length (the same machine load).

Then the recurrent operators each run a `--prefill` token prompt from zeros, as their
torch definitions (a token at a time: the torch backend's) and as the chunked forms (the
cpu and triton backends'), and their tokens per second are printed side by side.
Prints tables and writes JSON.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from pagefleet_kernels.backend import cpu_backend, recurrent_chunked, recurrent_reference
from pagefleet_kernels.state_batch import metadata

from benchmarks.side_by_side.common import cpu_info

BLOCK_SIZE = 16


def write_checkpoint(path: Path, args, hybrid: bool) -> None:
    import transformers

    every = args.attention_every
    layer_types = [
        "full_attention" if not hybrid or i % every == every - 1 else "conv"
        for i in range(args.layers)
    ]
    config = transformers.Lfm2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        layer_types=layer_types,
        max_position_embeddings=max(args.contexts) + 16,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def start(path: Path, max_context: int):
    from pagefleet_serve.engine.device import RunnerConfig
    from pagefleet_serve.engine.model_runner import ModelRunner
    from pagefleet_serve.model.loader.model_loader import load_model

    backend = cpu_backend()
    loaded = load_model(str(path), torch.float32, backend=backend)
    config = RunnerConfig(torch.device("cpu"), torch.float32, BLOCK_SIZE, "cpu", "auto")
    runner = ModelRunner(loaded, config)
    runner.allocate_kv_cache(-(-(max_context + 1) // BLOCK_SIZE), 1)
    return runner


def decode_step_ms(runner, context: int, steps: int) -> tuple[float, float]:
    """The fastest decode step of one sequence at `context` tokens before it: wall-clock
    ms, and this process's CPU ms (what a loaded machine's other work leaves out; equal to
    the wall time on an idle core with one thread)."""
    from pagefleet_serve.engine.model_runner import StepBatch

    table = list(range(context // BLOCK_SIZE + 1))
    batch = StepBatch([1], [context], [1], [table], [0])
    if runner.num_state_slots:
        batch.state_slots, batch.state_initial = [0], [True]
    wall = cpu = float("inf")
    with torch.inference_mode():
        for _ in range(steps):
            started, started_cpu = time.perf_counter(), time.process_time()
            runner.forward_batch(batch)
            wall = min(wall, time.perf_counter() - started)
            cpu = min(cpu, time.process_time() - started_cpu)
    return wall * 1e3, cpu * 1e3


def operator_inputs(tokens: int, hidden: int) -> dict:
    """Each operator's arguments for one prompt of `tokens` from zeros, at a model of
    `hidden`'s sizes (Mamba2's expand 2 and state 128, Gated DeltaNet's heads of 128)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    meta = metadata([tokens], [0], [False])
    heads, head_dim, groups, state = 2 * hidden // 64, 64, 1, 128
    kh = max(hidden // 256, 1)
    vh, dk = 2 * kh, 128
    return {
        "causal_conv1d": (
            randn(tokens, 2 * hidden),
            randn(2 * hidden, 4),
            randn(2 * hidden),
            torch.zeros(1, 2 * hidden, 3),
            meta,
            True,
        ),
        "ssd": (
            randn(tokens, heads, head_dim),
            randn(tokens, heads),
            -torch.rand(heads),
            randn(tokens, groups, state),
            randn(tokens, groups, state),
            randn(heads),
            randn(heads),
            torch.zeros(1, heads, head_dim, state),
            meta,
        ),
        "gated_delta_rule": (
            randn(tokens, kh, dk),
            randn(tokens, kh, dk),
            randn(tokens, vh, dk),
            -torch.rand(tokens, vh),
            torch.rand(tokens, vh),
            torch.zeros(1, vh, dk, dk),
            meta,
            dk**-0.5,
        ),
    }


def prefill_tokens_per_s(tokens: int, hidden: int) -> dict:
    inputs = operator_inputs(tokens, hidden)
    rows = {}
    for name, args in inputs.items():
        rates = {}
        for kind, ops in (("reference", recurrent_reference()), ("chunked", recurrent_chunked())):
            op = getattr(ops, name)
            with torch.inference_mode():
                started = time.perf_counter()
                op(*args)
                rates[kind] = tokens / (time.perf_counter() - started)
        rows[name] = rates
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument(
        "--attention-every", type=int, default=3, help="the hybrid's attention layer period"
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per length")
    parser.add_argument("--prefill", type=int, default=2048, help="operator prompt tokens")
    parser.add_argument("--output", default="bench-hybrid.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {kind: Path(tmp) / kind for kind in ("hybrid", "dense")}
        for kind, path in paths.items():
            write_checkpoint(path, args, hybrid=kind == "hybrid")
        runners = {kind: start(path, max(args.contexts)) for kind, path in paths.items()}
        print(
            f"{'context':>8} {'hybrid ms':>10} {'dense ms':>10} {'ratio':>6} "
            f"{'hybrid cpu':>11} {'dense cpu':>10} {'ratio':>6}"
        )
        for context in args.contexts:
            row: dict = {"context": context}
            for kind, runner in runners.items():
                row[f"{kind}_ms"], row[f"{kind}_cpu_ms"] = decode_step_ms(
                    runner, context, args.steps
                )
            row["ratio"] = row["hybrid_ms"] / row["dense_ms"]
            row["cpu_ratio"] = row["hybrid_cpu_ms"] / row["dense_cpu_ms"]
            rows.append(row)
            print(
                f"{context:>8} {row['hybrid_ms']:>10.2f} {row['dense_ms']:>10.2f} "
                f"{row['ratio']:>6.2f} {row['hybrid_cpu_ms']:>11.2f} "
                f"{row['dense_cpu_ms']:>10.2f} {row['cpu_ratio']:>6.2f}",
                flush=True,
            )
        state_bytes = runners["hybrid"].state_bytes_per_slot
    operators = prefill_tokens_per_s(args.prefill, args.hidden)
    print(f"\n{'operator':>18} {'reference tok/s':>16} {'chunked tok/s':>14} {'x':>6}")
    for name, rates in operators.items():
        speedup = rates["chunked"] / rates["reference"]
        print(f"{name:>18} {rates['reference']:>16.0f} {rates['chunked']:>14.0f} {speedup:>6.1f}")
    result = {
        "argv": sys.argv[1:],
        "cpu": cpu_info(),
        "threads": torch.get_num_threads(),
        "hybrid_state_bytes_per_sequence": state_bytes,
        "decode": rows,
        "prefill_operators": operators,
    }
    Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
