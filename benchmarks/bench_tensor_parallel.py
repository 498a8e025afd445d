"""Tensor and pipeline parallelism against one rank on the same CPUs
(`python -m benchmarks.bench_tensor_parallel`).

The engine runs in this process (rank 0) at one rank, then at --tensor-parallel-size 2,
then at --pipeline-parallel-size 2, given the same CPUs each time: one rank with one
intra-op thread per CPU, or two ranks with half of the CPUs each (`cpu_placement.rank_placements`, what `--cpu-threads-bind` plans for a
serving pod). For each: the median decode step of a batch of `--batch` sequences (every
sequence past its prefill), the generation throughput of the whole run (prefills
included; the offline engine, no HTTP), and at two ranks the share of rank 0's decode step
spent in collectives (all-reduces, the logits' gather; in a pipeline the hand-offs between
stages), which on a CPU includes waiting for the other rank. On a machine with few cores
expect no speed-up: tensor ranks split the same memory bandwidth and add two all-reduces
a layer; pipeline stages run one after the other (no micro-batches), each on half of the
CPUs, so a step takes about as long as one rank's on half of them. `--tiny` runs the random tiny model in
seconds (a smoke run). Prints a table and writes JSON.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import CpuPlacement, available_cpus
from pagefleet_serve.engine.llm_engine import LLMEngine
from pagefleet_serve.frontend.tokenizer import load_engine_tokenizer
from pagefleet_serve.messages import Request
from pagefleet_serve.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "tensor_parallel.json"


class CollectiveClock:
    """Seconds rank 0 spends in torch.distributed's collectives and sends (patched)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        names = ("all_reduce", "gather", "send", "recv")
        self._originals = {name: getattr(dist, name) for name in names}

    def __enter__(self) -> "CollectiveClock":
        for name, original in self._originals.items():
            setattr(dist, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _timed(self, original):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def measure(args, tensor_parallel_size: int, pipeline_parallel_size: int, cpus: list[int]) -> dict:
    config = EngineConfig(
        model=args.model,
        dtype="float32",
        quantization=args.quantization,
        max_model_len=args.prompt_tokens + args.tokens + 16,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        max_num_seqs=args.batch,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    engine = LLMEngine(config, CpuPlacement(cpus, None, len(cpus)), load_engine_tokenizer(config))
    try:
        vocab = engine.model_config.vocab_size
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            prompt = [(17 * i + 7 * t) % (vocab - 10) + 5 for t in range(args.prompt_tokens)]
            engine.add(Request(f"bench-{i}", prompt, params, time.time()))
        decode_steps, collective_shares, generated = [], [], 0
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            decoding = (
                all(
                    seq.num_computed_tokens >= seq.num_prompt_tokens
                    for seq in engine.scheduler.running
                )
                and len(engine.scheduler.running) == args.batch
            )
            with CollectiveClock() as clock:
                step_started = time.perf_counter()
                outputs = engine.step()
                step = time.perf_counter() - step_started
            generated += sum(len(s.token_ids) for o in outputs for s in o.outputs)
            if decoding:
                decode_steps.append(step)
                collective_shares.append(clock.seconds / step)
        elapsed = time.perf_counter() - started
    finally:
        engine.close()
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "cpus": cpus,
        "decode_steps": len(decode_steps),
        "decode_step_ms": 1e3 * statistics.median(decode_steps),
        "generation_tok_s": generated / elapsed,
        "collective_share_of_decode_step": statistics.median(collective_shares),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin://smollm2-135m")
    parser.add_argument("--quantization", default="none", choices=("none", "auto"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="builtin://tiny-random, few tokens")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.tiny:
        args.model, args.batch, args.prompt_tokens, args.tokens = "builtin://tiny-random", 2, 8, 8
        args.kv_cache_mib = 4
    cpus = available_cpus()
    rows = [measure(args, tp, pp, cpus) for tp, pp in ((1, 1), (2, 1), (1, 2))]
    print(f"{args.model}, float32, batch {args.batch}, CPUs {cpus}, torch {torch.__version__}")
    print("tp x pp  decode step ms  generation tok/s  collectives share of decode step")
    for row in rows:
        ranks = f"{row['tensor_parallel_size']} x {row['pipeline_parallel_size']}"
        print(
            f"{ranks:>7}  {row['decode_step_ms']:>14.2f}  "
            f"{row['generation_tok_s']:>16.1f}  {row['collective_share_of_decode_step']:>10.0%}"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.output.write_text(json.dumps({"settings": settings, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
