"""hf:// models from a Hub on loopback (tests/engine/hub_server.py, set through HF_ENDPOINT):
`pagefleet serve` downloads, serves and answers; a restart works offline; a missing token
and a missing repository or revision say what to do; concurrent downloaders sharing one
cache leave one intact copy."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from pagefleet_serve.frontend.tokenizer import load_tokenizer
from pagefleet_serve.model.loader.hub import select_files
from pagefleet_serve.model.loader.model_loader import load_model
from pagefleet_serve.model.loader.resolve import resolve_model_uri

from tests.engine.hub_server import LocalHub, Repo, save_tiny_llama

REPO_ID = "org/tiny"
TOKEN = "hf_test_token"
START_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def tiny_repo_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hub-model"))


@pytest.fixture
def hub(tiny_repo_dir):
    repos = {
        REPO_ID: Repo.from_dir(tiny_repo_dir),
        "org/gated": Repo.from_dir(tiny_repo_dir, token=TOKEN),
    }
    with LocalHub(repos) as running:
        yield running


def hub_env(hub_url: str, hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {"HF_ENDPOINT": hub_url, "HF_HOME": str(hf_home)} | extra


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Serve:
    """A `pagefleet serve --model hf://...` subprocess with its log in a file."""

    def __init__(self, model: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = Path(tempfile.mkstemp(prefix="pagefleet-hf-", suffix=".log")[1])
        command = [sys.executable, "-m", "pagefleet_serve.cli", "serve", "--model", model]
        command += ["--port", str(self.port), "--dtype", "float32", "--max-model-len", "256"]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited {self.process.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve not ready after {START_TIMEOUT_S}s:\n{self.log_text()}")

    def wait_exit(self) -> int:
        return self.process.wait(timeout=START_TIMEOUT_S)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.unlink(missing_ok=True)


def complete(url: str, model: str) -> dict:
    response = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def snapshot_digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_serve_downloads_then_restarts_offline(hub, tiny_repo_dir, tmp_path):
    hf_home = tmp_path / "hf-home"
    first = Serve(f"hf://{REPO_ID}", hub_env(hub.url, hf_home))
    try:
        url = first.wait_ready()
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [REPO_ID]
        answer = complete(url, REPO_ID)
        assert answer["usage"]["completion_tokens"] == 8
        log = first.log_text()
        assert f"downloading hf://{REPO_ID}" in log
        assert "model.safetensors.index.json" in log
    finally:
        first.stop()
    # Only what serving reads, each body once; the shards named by the index.
    expected = select_files(list(Repo.from_dir(tiny_repo_dir).files), None)
    shards = sorted(p.name for p in tiny_repo_dir.glob("model-*.safetensors"))
    assert len(shards) == 2
    assert sorted(hub.stats.bodies_sent) == sorted(f"{REPO_ID}/{f}" for f in expected + shards)
    assert set(hub.stats.bodies_sent.values()) == {1}

    # A second start with the Hub gone: offline, from the cache volume alone.
    dead_endpoint = f"http://127.0.0.1:{free_port()}"
    second = Serve(f"hf://{REPO_ID}", hub_env(dead_endpoint, hf_home, HF_HUB_OFFLINE="1"))
    try:
        url = second.wait_ready()
        assert complete(url, REPO_ID)["choices"][0]["text"] == answer["choices"][0]["text"]
        assert "HF_HUB_OFFLINE is set: using the cached copy" in second.log_text()
    finally:
        second.stop()


@pytest.mark.parametrize(
    ("model", "env_extra", "message"),
    [
        (
            "hf://org/gated",
            {},
            r"access denied \(HTTP 401\) to repository org/gated.*spec\.model\.tokenSecretRef"
            r".*HF_TOKEN",
        ),
        ("hf://org/missing", {}, r"repository org/missing \(revision 'main'\) not found"),
        ("hf://org/tiny@v9", {}, r"revision 'v9' not found in repository org/tiny"),
        (
            "hf://org/tiny",
            {"HF_HUB_OFFLINE": "1"},
            r"not in the model cache .* HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE",
        ),
    ],
    ids=["401-token", "404-repo", "404-revision", "offline-empty-cache"],
)
def test_download_errors_say_what_to_do(hub, tmp_path, model, env_extra, message):
    server = Serve(model, hub_env(hub.url, tmp_path / "hf-home", **env_extra))
    try:
        assert server.wait_exit() == 1
        log = server.log_text()
        assert re.search(message, log), log
        assert "Traceback" not in log
    finally:
        server.stop()


def test_gated_repository_downloads_with_the_token(hub, tmp_path):
    env = hub_env(hub.url, tmp_path / "hf-home", HF_TOKEN=TOKEN)
    [path] = resolve_in_subprocess(["hf://org/gated"], env)
    assert (path / "config.json").exists()


# A fresh process per downloader: huggingface_hub reads HF_ENDPOINT and HF_HOME at import.
RESOLVE = (
    "import sys; from pagefleet_serve.model.loader.resolve import resolve_model_uri\n"
    "for uri in sys.argv[1:]: print(resolve_model_uri(uri).path)"
)


def resolve_in_subprocess(uris: list[str], env: dict[str, str]) -> list[Path]:
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, *uris], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [Path(line) for line in done.stdout.split()]


def test_concurrent_downloaders_share_one_cache(hub, tiny_repo_dir, tmp_path):
    """Two replicas on one cache volume: both finish, with the same intact snapshot, and
    every file crossed the network once although their downloads overlapped."""
    env = hub_env(hub.url, tmp_path / "shared-cache")
    hub.seconds_per_mib = 0.5  # about 3 s for the weights: the two downloads overlap
    go = tmp_path / "go"
    # Imports take a varying while: each says when it is ready, then both start together.
    code = (
        "import sys, time, pathlib; from pagefleet_serve.model.loader.resolve import resolve_model_uri\n"
        "import huggingface_hub.file_download\n"
        "pathlib.Path(sys.argv[3]).touch()\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.01)\n"
        "started = time.time(); path = resolve_model_uri(sys.argv[1]).path\n"
        "print(started, time.time(), path)"
    )
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    downloaders = [
        subprocess.Popen(
            [sys.executable, "-c", code, f"hf://{REPO_ID}", str(go), str(flag)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag in ready
    ]
    deadline = time.monotonic() + 120
    while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
        assert all(d.poll() is None for d in downloaders), "a downloader exited early"
        time.sleep(0.05)
    go.touch()
    results = [d.communicate(timeout=120) for d in downloaders]
    assert [d.returncode for d in downloaders] == [0, 0], [err for _, err in results]
    lines = [out.strip().splitlines()[-1].split() for out, _ in results]
    (start_a, end_a, _), (start_b, end_b, _) = lines
    assert float(start_a) < float(end_b) and float(start_b) < float(end_a), "no overlap"
    paths = {Path(line[2]) for line in lines}
    assert len(paths) == 1
    snapshot = paths.pop()
    source = snapshot_digests(tiny_repo_dir)
    got = snapshot_digests(snapshot)
    assert got == {name: source[name] for name in got}
    assert {n for n in source if n.endswith(".safetensors")} <= set(got)
    assert set(hub.stats.bodies_sent.values()) == {1}, hub.stats.bodies_sent
    assert not list((tmp_path / "shared-cache").rglob("*.incomplete"))


# In a subprocess: huggingface_hub reads HF_ENDPOINT and HF_HOME when it is imported.
LOAD_WHILE_DOWNLOADING = """
import json, sys, time
import torch
from pagefleet_serve.model.loader import safetensors_reader
from pagefleet_serve.model.loader.model_loader import load_local, load_model
from pagefleet_serve.model.loader.resolve import resolve_model_uri

read_started = {}
read_into = safetensors_reader.read_into

def timed(path, placed):
    read_started.setdefault(path.name, time.time())
    return read_into(path, placed)

safetensors_reader.read_into = timed
local = resolve_model_uri(sys.argv[1], weights="background")
assert local.shards is not None
loaded = load_local(local, torch.float32).model.state_dict()
reference = load_model(sys.argv[2], torch.float32).model.state_dict()
same = sorted(loaded) == sorted(reference) and all(
    torch.equal(loaded[name], reference[name]) for name in reference
)
print(json.dumps({"read_started": read_started, "same": same}))
"""


def test_an_engine_reads_each_shard_while_the_later_ones_download(hub, tmp_path):
    """A sharded hf:// checkpoint, as an engine loads it: the shards' headers come from
    the Hub first, the first shard is read while the last one is still downloading, and
    the weights equal those loaded from a local copy of the same files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    local_copy = tmp_path / "sharded"
    LlamaForCausalLM(config).save_pretrained(local_copy, max_shard_size="3MB")
    shards = sorted(p.name for p in local_copy.glob("model-*.safetensors"))
    assert len(shards) >= 4, shards
    hub.repos["org/sharded"] = Repo.from_dir(local_copy)
    hub.seconds_per_mib = 0.5  # about 5 s for the 10 MB of shards
    env = hub_env(hub.url, tmp_path / "hf-home")
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WHILE_DOWNLOADING, "hf://org/sharded", str(local_copy)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"]
    assert sorted(result["read_started"]) == shards
    last_downloaded = hub.stats.bodies_finished[f"org/sharded/{shards[-1]}"]
    assert result["read_started"][shards[0]] < last_downloaded, (result, hub.stats)
    assert set(hub.stats.bodies_sent.values()) == {1}, hub.stats.bodies_sent


def crd_uri_pattern() -> re.Pattern:
    import yaml

    crd = yaml.safe_load(
        (Path(__file__).parents[2] / "crds/inferenceservices.pagefleet.dev.yaml").read_text()
    )
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return re.compile(spec["properties"]["model"]["properties"]["uri"]["pattern"])


def test_every_uri_form_the_crd_admits_resolves_in_the_pod(hub, tiny_repo_dir, tmp_path):
    """One URI per scheme and form of the CRD's pattern, through the pod's resolver and
    loader (pvc:// as the operator mounts it)."""
    sha = Repo.from_dir(tiny_repo_dir).sha
    hub.repos["org/gguf"] = Repo({"tiny.gguf": b"GGUF" + bytes(60), "README.md": b"# x"})
    hf_forms = [f"hf://{REPO_ID}", f"hf://{REPO_ID}@main", f"hf://{REPO_ID}@{sha}"]
    gguf_form = "hf://org/gguf@main/tiny.gguf"
    claim_root = tmp_path / "claim-mount"
    shutil.copytree(tiny_repo_dir, claim_root / "tiny")
    local_forms = [f"file://{tiny_repo_dir}", "pvc://models/tiny", "builtin://smollm2-135m"]
    pattern = crd_uri_pattern()
    for uri in [*hf_forms, gguf_form, *local_forms]:
        assert pattern.fullmatch(uri), uri

    env = hub_env(hub.url, tmp_path / "hf-home")
    downloaded = [*hf_forms, gguf_form]
    resolved = dict(zip(downloaded, resolve_in_subprocess(downloaded, env), strict=True))
    assert resolved[gguf_form].name == "tiny.gguf"
    assert resolved[gguf_form].read_bytes().startswith(b"GGUF")
    assert "org/gguf/README.md" not in hub.stats.bodies_sent
    assert len({resolved[uri] for uri in hf_forms}) == 1  # one snapshot: the same commit
    for uri in hf_forms:
        loaded = load_model(str(resolved[uri]), torch.float32)
        tokenizer = load_tokenizer(str(resolved[uri]))
        assert loaded.config.num_layers == 2 and tokenizer is not None
    for uri in local_forms:
        local = resolve_model_uri(uri, pvc_mount_dir=str(claim_root))
        assert local.path.exists(), uri
        if local.path.is_dir():
            assert load_model(str(local.path), torch.float32).config.hidden_size == 32


def test_full_disk_names_the_cache_volume(tmp_path, monkeypatch):
    import errno

    from huggingface_hub import constants
    from pagefleet_serve.model.loader.hub import _explain
    from pagefleet_serve.model.uri import parse_model_uri

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    message = _explain(parse_model_uri("hf://org/big"), OSError(errno.ENOSPC, "No space left"))
    assert re.fullmatch(
        rf"no space left on the model cache volume \(HF_HOME={tmp_path}, [0-9.]+ GiB, "
        r"[0-9.]+ GiB free\); raise spec\.modelCache\.sizeLimit or use a larger claim in "
        r"spec\.modelCache\.pvcName",
        message,
    )


@pytest.mark.parametrize(
    ("repo_files", "gguf", "expected"),
    [
        (
            [
                "config.json",
                "tokenizer.json",
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "consolidated.safetensors",
                "pytorch_model.bin",
                "README.md",
            ],
            None,
            ["config.json", "tokenizer.json", "model.safetensors.index.json"],
        ),
        (
            ["config.json", "generation_config.json", "model.safetensors", "extra.safetensors"],
            None,
            ["config.json", "generation_config.json", "model.safetensors"],
        ),
        (
            ["config.json", "a.safetensors", "sub/b.safetensors"],
            None,
            ["config.json", "a.safetensors"],
        ),
        (["config.json", "q4.gguf", "q8.gguf", "model.safetensors"], "q8.gguf", ["q8.gguf"]),
    ],
)
def test_only_the_files_serving_reads_are_selected(repo_files, gguf, expected):
    assert select_files(repo_files, gguf) == expected


def test_selection_errors_say_what_the_repository_has():
    from pagefleet_serve.model.loader.hub import ModelDownloadError

    with pytest.raises(
        ModelDownloadError,
        match=r"q2\.gguf is not in the repository; its GGUF files: \['q4\.gguf'\]",
    ):
        select_files(["q4.gguf"], "q2.gguf")
    with pytest.raises(ModelDownloadError, match=r"no \*\.safetensors weights \(PyTorch \.bin"):
        select_files(["config.json", "pytorch_model.bin"], None)
    with pytest.raises(ModelDownloadError, match=r"no config\.json; name one GGUF file"):
        select_files(["q4.gguf"], None)
