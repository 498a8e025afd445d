"""Paths, logging and the facts about this machine that every part of the run shares."""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
REPO = BENCHMARKS.parent
PEERS = BENCHMARKS / ".peers"
VENV_BIN = Path(sys.executable).parent
THREADS = os.cpu_count() or 2
# CPU features that decide which kernels and dtypes the servers use.
NOTABLE_CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def torch_dtype_name() -> str:
    """The dtype PageFleet's `auto` resolves to on this CPU; the transformers and vLLM peers
    and the HF generate baseline are given the same one."""
    import torch
    from pagefleet_serve.engine.device import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def cpu_info() -> dict:
    """The CPU model and its flags from /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {"model": "unknown", "flags": [], "notable_flags": []}
    flags = fields.get("flags", "").split()
    return {
        "model": fields.get("model name", "unknown"),
        "flags": flags,
        "notable_flags": [f for f in NOTABLE_CPU_FLAGS if f in flags],
    }


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
