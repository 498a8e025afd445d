"""The servers compared: how each is installed (cached under benchmarks/.peers, ignored by
git), started on loopback, waited for and stopped.

vLLM's CPU build is installed by `make bench-peer-vllm` into benchmarks/.peers/vllm (its
own virtual environment: it pins its own torch and transformers) and started through
vllm_launcher.py; the llama.cpp peers are built here on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .common import (
    PEERS,
    REPO,
    THREADS,
    VENV_BIN,
    PeerUnavailable,
    cpu_info,
    log,
    tail,
    torch_dtype_name,
)

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


# A native build (GGML_NATIVE) died with 'Illegal instruction' on one CPU here: the
# instruction sets are named instead.
def ggml_flags(cpu_flags: list[str]) -> list[str]:
    """llama.cpp's instruction sets, named (not -march=native) and switched on only where
    this CPU has them: AVX-512 code built for every machine stopped llama-server with
    SIGILL at start on an AVX2-only EPYC."""
    avx512 = "avx512f" in cpu_flags
    return [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        f"-DGGML_AVX512={'ON' if avx512 else 'OFF'}",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
    ]


START_TIMEOUT_S = 300.0
# vLLM compiles its model with torch.compile at start-up: 100-150 s on an idle 2-core CPU.
VLLM_START_TIMEOUT_S = 900.0
VLLM_PYTHON = PEERS / "vllm" / "bin" / "python"
VLLM_LAUNCHER = Path(__file__).resolve().parent / "vllm_launcher.py"
HF_MODEL_DIR = "smollm2-135m-hf"  # under PEERS


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
    """`transformers serve` and vLLM take no GGUF path: load the GGUF with transformers
    (dequantized to float32), copy the weights into a plain LlamaForCausalLM (a model
    loaded from GGUF refuses save_pretrained) and save that as a model directory. Without
    `quantization_config` in config.json: vLLM refuses it ("Unknown quantization method:
    gguf") and the weights are plain floats now."""
    target = PEERS / HF_MODEL_DIR
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log("converting the GGUF to a Hugging Face directory for transformers serve and vLLM")
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
    flags = ggml_flags(cpu_info()["flags"])
    # One build per instruction-set choice: a copied peer folder never runs the wrong one.
    suffix = "avx512" if "-DGGML_AVX512=ON" in flags else "avx2"
    build = PEERS / f"llama.cpp-build-{suffix}"
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
            *flags,
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


def vllm_environment() -> dict[str, str]:
    """What vLLM's CPU build needs here: 2 GiB of KV cache, its OpenMP threads bound to
    this machine's cores (the value `all` crashes 0.32.0), and no Hugging Face Hub."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
        "HF_HUB_OFFLINE": "1",
    }


def prepare_vllm(gguf: Path) -> None:
    if not VLLM_PYTHON.exists():
        raise PeerUnavailable(
            f"vLLM is not installed in {VLLM_PYTHON.parent.parent}: run `make bench-peer-vllm`"
        )
    hf_model_dir(gguf)


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
    start_timeout_s: float = START_TIMEOUT_S
    # Also measured with `vllm bench serve` (servers that take ignore_eos).
    vllm_client: bool = False


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
        deadline = time.monotonic() + self.spec.start_timeout_s
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
        raise PeerUnavailable(
            f"not ready after {self.spec.start_timeout_s:.0f}s: {tail(self.log_path)}"
        )

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

    def vllm(port: int):
        # The model directory by a path relative to PEERS (as for transformers), so the
        # name requests carry is "smollm2-135m-hf" for both.
        return (
            [
                str(VLLM_PYTHON),
                str(VLLM_LAUNCHER),
                "serve",
                HF_MODEL_DIR,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                torch_dtype_name(),
                "--max-model-len",
                "4096",
                "--disable-log-stats",
            ],
            vllm_environment(),
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
            vllm_client=True,
        ),
        ServerSpec(
            "pagefleet-q4",
            "PageFleet `pagefleet serve --quantization auto` (the GGUF's Q4_1 weights kept as int4)",
            pagefleet("--quantization", "auto"),
            "smollm2-135m",
            ready_path="/ready",
        ),
        ServerSpec(
            "pagefleet-q4-int8",
            "PageFleet `pagefleet serve --quantization auto --activation-quantization int8` "
            "(Q4_1 weights times activations rounded to int8 per 32, llama.cpp's arithmetic)",
            pagefleet("--quantization", "auto", "--activation-quantization", "int8"),
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
            "vllm",
            "vLLM CPU build (`vllm-cpu`) `vllm serve`",
            vllm,
            HF_MODEL_DIR,
            prepare=lambda: prepare_vllm(gguf),
            start_timeout_s=VLLM_START_TIMEOUT_S,
            vllm_client=True,
        ),
        ServerSpec(
            "llama-server",
            "llama.cpp `llama-server -np 64`",
            llama_server,
            "smollm2-135m",
            prepare=prepare_llama_cpp,
            vllm_client=True,
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
