"""Weight loading against the disk's own read speed (`python -m benchmarks.bench_load`).

Two models: the built-in GGUF (SmolLM2-135M-Instruct, Q4_1) and a random Llama checkpoint
of about 1 GB in 4 safetensors shards, written here by transformers' save_pretrained. For
each, side by side in one run and each `--repeats` times:

- disk: every byte of the model's files read in 16 MiB sequential reads (what `dd bs=16M`
  does), the files' pages evicted from the page cache first (posix_fadvise DONTNEED; the
  report says whether the eviction took: a cold read no slower than a cached one means
  the files stayed cached, or the disk is as fast as memory);
- load: `load_model(uri, dtype, quantization)`, the same files evicted first: what an
  engine start does before the model runner (the tokenizer included);
- both again with the files cached (`warm`).

Throughput is the files' bytes over the seconds. Prints a table and writes JSON; the target
is load / disk >= 0.7 cold.

Then the same checkpoint as hf:// from a Hub on loopback (tests/engine/hub_server.py) that
sends at most `--hub-mib-per-s`, into an empty cache each time, in a fresh process (the
Hub's address is read at import): the download and then the load, as `load_model` does,
against the engine's way, which reads each shard as it arrives while the later ones
download (`resolve_model_uri(weights="background")`, `load_local`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from pagefleet_serve.model.loader.model_loader import load_model
from pagefleet_serve.model.loader.resolve import resolve_model_uri

from benchmarks.side_by_side.common import cpu_info

CHUNK = 16 * 2**20


def files_of(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def evict(files: list[Path]) -> None:
    for file in files:
        with open(file, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_all(files: list[Path]) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def random_checkpoint(folder: Path) -> Path:
    """A Llama of ~270M float32 parameters (~1.07 GB) in 4 shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="300MB")
    return folder


def measure(uri: str, files: list[Path], dtype, quantization: str, repeats: int) -> dict:
    size = sum(f.stat().st_size for f in files)
    result: dict = {"uri": uri, "bytes": size, "files": len(files)}
    for cache in ("cold", "warm"):
        disk, load = [], []
        for _ in range(repeats):
            if cache == "cold":
                evict(files)
            disk.append(timed(lambda: read_all(files)))
            if cache == "cold":
                evict(files)
            load.append(timed(lambda: load_model(uri, dtype, quantization)))
        result[cache] = {
            "disk_s": statistics.median(disk),
            "load_s": statistics.median(load),
            "disk_gb_s": size / statistics.median(disk) / 1e9,
            "load_gb_s": size / statistics.median(load) / 1e9,
        }
        result[cache]["ratio"] = result[cache]["load_gb_s"] / result[cache]["disk_gb_s"]
    result["eviction_took"] = result["cold"]["disk_s"] > 1.2 * result["warm"]["disk_s"]
    return result


# Run in a fresh process per measurement: prints the seconds to a loaded model.
HUB_LOAD = """
import sys, time
import torch
from pagefleet_serve.model.loader.model_loader import load_local
from pagefleet_serve.model.loader.resolve import resolve_model_uri
started = time.perf_counter()
load_local(resolve_model_uri(sys.argv[1], weights=sys.argv[2]), torch.float32)
print(time.perf_counter() - started)
"""


def measure_hub(folder: Path, mib_per_s: float, repeats: int) -> dict:
    """Download-then-load against load-while-downloading of `folder` as an hf:// model."""
    from tests.engine.hub_server import LocalHub, Repo

    size = sum(f.stat().st_size for f in files_of(folder))
    result: dict = {"uri": "hf://bench/random-llama", "bytes": size, "mib_per_s": mib_per_s}
    with LocalHub({"bench/random-llama": Repo.from_dir(folder)}, 1 / mib_per_s) as hub:
        for weights in ("now", "background"):
            seconds = []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory(prefix="bench-load-hf-") as home:
                    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
                    env |= {"HF_ENDPOINT": hub.url, "HF_HOME": home}
                    done = subprocess.run(
                        [sys.executable, "-c", HUB_LOAD, result["uri"], weights],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    seconds.append(float(done.stdout.split()[-1]))
            result[weights] = {"seconds": seconds, "median_s": statistics.median(seconds)}
    result["download_s"] = size / (mib_per_s * 2**20)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["none", "auto"],
        help="for the GGUF, each measured: none expands Q4_1 to --dtype (serve's default), "
        "auto keeps it",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--hub-mib-per-s",
        type=float,
        default=100.0,
        help="the loopback Hub's sending rate for the hf:// part (0: skip it)",
    )
    parser.add_argument("--skip-disk", action="store_true", help="the hf:// part only")
    parser.add_argument("--output", default="bench-load.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    builtin = "builtin://smollm2-135m"
    for quantization in () if args.skip_disk else args.quantization:
        gguf = [resolve_model_uri(builtin).path]
        rows.append(measure(builtin, gguf, dtype, quantization, args.repeats))
        rows[-1]["uri"] = f"{builtin} --quantization {quantization}"
    hub = None
    with tempfile.TemporaryDirectory(prefix="bench-load-") as scratch:
        folder = random_checkpoint(Path(scratch))
        if not args.skip_disk:
            rows.append(measure(str(folder), files_of(folder), dtype, "none", args.repeats))
            rows[-1]["uri"] = "random Llama, 4 safetensors shards"
        if args.hub_mib_per_s:
            hub = measure_hub(folder, args.hub_mib_per_s, args.repeats)
    print(f"{'model':48} {'GB':>6} {'cache':>5} {'disk GB/s':>10} {'load GB/s':>10} {'ratio':>6}")
    for row in rows:
        for cache in ("cold", "warm"):
            r = row[cache]
            print(
                f"{row['uri'][:48]:48} {row['bytes'] / 1e9:6.2f} {cache:>5} "
                f"{r['disk_gb_s']:10.2f} {r['load_gb_s']:10.2f} {r['ratio']:6.2f}"
            )
        if not row["eviction_took"]:
            print(f"  ({row['uri']}: the cold read was no slower than the cached one)")
    if hub is not None:
        print(
            f"{hub['uri']} at {hub['mib_per_s']:.0f} MiB/s ({hub['download_s']:.1f} s to send): "
            f"download then load {hub['now']['median_s']:.1f} s, load while downloading "
            f"{hub['background']['median_s']:.1f} s (medians of {args.repeats}, process "
            "imports excluded)"
        )
    info = cpu_info()
    report = {
        "cpu": info["model"],
        "cpu_flags": info["notable_flags"],
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "models": rows,
        "hub": hub,
    }
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
