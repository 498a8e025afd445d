"""A local stand-in for the Hugging Face Hub, on loopback, and a tiny model to put on it
(not a test module; e2e/ uses it too).

It speaks the part of the Hub's HTTP API that huggingface_hub's `model_info`,
`hf_hub_download` and offline `snapshot_download` rely on:
  GET  /api/models/{org}/{name}[/revision/{rev}]   -> {"id", "sha", "siblings": [...]}
  HEAD /{org}/{name}/resolve/{rev}/{file}          -> X-Repo-Commit, ETag, Content-Length
  GET  /{org}/{name}/resolve/{rev}/{file}          -> the bytes (Range honoured: bytes=a- or a-b)
and the Hub's error answers (X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound,
401 without a valid token). It counts the file bodies it sends, so tests can see what was
downloaded and how often, and when each whole body was sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def save_tiny_llama(path: Path, **config_overrides) -> Path:
    """A tiny random Llama as save_pretrained writes it (two safetensors shards and their
    index), with the built-in model's tokenizer and chat template; `config_overrides`
    change its LlamaConfig."""
    import torch
    from pagefleet_serve.frontend.tokenizer import load_tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer("builtin://smollm2-135m")
    config = LlamaConfig(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
        | config_overrides
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="4MB")
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id]).save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert (path / "model.safetensors.index.json").exists()
    return path


def _byte_range(header: str | None, size: int) -> tuple[int, int]:
    """[start, end) of a Range header's "bytes=a-" or "bytes=a-b" (the whole without one)."""
    if not header:
        return 0, size
    first, last = header.removeprefix("bytes=").split("-")
    return int(first), min(size, int(last) + 1) if last else size


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/?]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


@dataclass
class Repo:
    """A repository's files (not changed once served: its commit and the files' digests
    are computed once, not at every request, which cost seconds a request for a 1 GB one)."""

    files: dict[str, bytes]
    token: str | None = None  # a gated repository: this bearer token is required
    branch: str = "main"

    def __post_init__(self) -> None:
        self.etags = {name: hashlib.sha256(data).hexdigest() for name, data in self.files.items()}
        self.blob_ids = {name: hashlib.sha1(data).hexdigest() for name, data in self.files.items()}
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + bytes.fromhex(self.blob_ids[name]))
        self.sha = digest.hexdigest()

    @staticmethod
    def from_dir(path: Path, **kwargs) -> Repo:
        files = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
        return Repo(files, **kwargs)


@dataclass
class HubStats:
    bodies_sent: dict[str, int] = field(default_factory=dict)  # "org/name/file" -> count
    # "org/name/file" -> time.time() when its last whole body (not a range) was sent
    bodies_finished: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class LocalHub:
    """`with LocalHub({"org/tiny": Repo(...)}) as hub:` serves at hub.url."""

    def __init__(self, repos: dict[str, Repo], seconds_per_mib: float = 0.0) -> None:
        self.repos = repos
        self.seconds_per_mib = seconds_per_mib  # slows bodies down so downloads overlap
        self.stats = HubStats()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LocalHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep the test output quiet
                pass

            def do_GET(self) -> None:
                self._route(body=True)

            def do_HEAD(self) -> None:
                self._route(body=False)

            def _route(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                api, resolve = _API.match(path), _RESOLVE.match(path)
                match = api or resolve
                if match is None:
                    return self._error(404, "RepoNotFound", "not a Hub route")
                repo = hub.repos.get(match["repo"])
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    return self._error(401, None, "Invalid username or password.")
                rev = match["rev"] or repo.branch
                if rev not in (repo.branch, repo.sha):
                    return self._error(404, "RevisionNotFound", "Invalid rev id", repo)
                if api:
                    return self._model_info(match["repo"], repo)
                content = repo.files.get(match["file"])
                if content is None:
                    return self._error(404, "EntryNotFound", "Entry not found", repo)
                self._file(match["repo"], match["file"], repo, content, body)

            def _model_info(self, repo_id: str, repo: Repo) -> None:
                siblings = [
                    {"rfilename": name, "size": len(data), "blobId": repo.blob_ids[name]}
                    for name, data in sorted(repo.files.items())
                ]
                payload = json.dumps({"id": repo_id, "sha": repo.sha, "siblings": siblings})
                self._send(200, {"Content-Type": "application/json"}, payload.encode())

            def _file(
                self, repo_id: str, name: str, repo: Repo, content: bytes, body: bool
            ) -> None:
                key = f"{repo_id}/{name}"
                range_header = self.headers.get("Range") if body else None
                start, end = _byte_range(range_header, len(content))
                status = 206 if range_header else 200
                headers = {
                    "X-Repo-Commit": repo.sha,
                    "ETag": f'"{repo.etags[name]}"',
                    "Accept-Ranges": "bytes",
                }
                if status == 206:
                    headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(content)}"
                if not body:
                    headers["Content-Length"] = str(len(content))
                    return self._send(200, headers, b"", length=len(content))
                whole = status == 200
                if whole:
                    with hub.stats.lock:
                        hub.stats.bodies_sent[key] = hub.stats.bodies_sent.get(key, 0) + 1
                self._send(status, headers, content[start:end], slow=whole)
                if whole:
                    with hub.stats.lock:
                        hub.stats.bodies_finished[key] = time.time()

            def _error(self, status: int, code: str | None, message: str, repo=None) -> None:
                headers = {"X-Error-Message": message}
                if code:
                    headers["X-Error-Code"] = code
                if repo is not None:
                    headers["X-Repo-Commit"] = repo.sha
                payload = json.dumps({"error": message}).encode()
                self._send(status, headers, payload if self.command == "GET" else b"")

            def _send(self, status, headers, payload, length=None, slow=False) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header(
                        "Content-Length", str(len(payload) if length is None else length)
                    )
                self.end_headers()
                chunk = 64 << 10
                for offset in range(0, len(payload), chunk):
                    if slow:
                        time.sleep(hub.seconds_per_mib * chunk / 2**20)
                    self.wfile.write(payload[offset : offset + chunk])

        return Handler
