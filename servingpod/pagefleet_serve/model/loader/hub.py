"""hf:// models: download the files serving needs from the Hugging Face Hub into its cache.

huggingface_hub does the transfer and owns the cache layout under HF_HOME (blobs named by
their ETag, snapshots as links, refs per branch): a restart finds complete blobs and
skips them, an interrupted one resumes; replicas sharing one cache volume serialize on
its per-blob file locks and publish each blob by an atomic rename, so none reads a half
written file. HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are read by huggingface_hub.

An engine asks for the shards of a sharded checkpoint in the background: their headers are
read from the Hub first (a range request each), the download goes on in a thread, and the
loader reads each shard as it arrives (`ArrivingShards`). A tokenizer's caller asks for no
weights at all.

Hub errors become messages that say what to change in the InferenceService or the pod.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from pagefleet_serve.model.uri import ModelURI, UnsupportedModelError

logger = logging.getLogger(__name__)

# What serving reads besides the weights: the config, the tokenizer in any of its
# formats, the chat template and the generation defaults (EOS ids).
SERVING_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "modules.json",  # sentence-transformers' layout: its Pooling module's config follows
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
_LOG_EVERY_S = 10.0


# What `download_model` does with the weights: downloads them before it returns, leaves a
# sharded checkpoint's shards downloading in the background, or downloads none.
WEIGHTS_MODES = ("now", "background", "none")


class ModelDownloadError(UnsupportedModelError):
    """An hf:// model that could not be downloaded; the message says what to do."""


class ArrivingShards:
    """The shards of a sharded safetensors checkpoint, downloading one after another (the
    index's order) in a thread of their own. `headers`: each shard's tensors as the Hub's
    copy of its header lists them (name -> dtype and shape), read before any shard, so
    the loader can give every tensor its place first; `wait(shard)` returns its path once
    it is on disk (or raises the download's error)."""

    def __init__(
        self,
        shards: list[str],
        headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]],
        fetch: Callable[[str], Path],
    ) -> None:
        self.headers = headers
        pool = ThreadPoolExecutor(1, "hf-download")
        self._futures: dict[str, Future[Path]] = {s: pool.submit(fetch, s) for s in shards}
        pool.shutdown(wait=False)

    def wait(self, shard: str) -> Path:
        return self._futures[shard].result()

    def wait_all(self) -> None:
        for future in self._futures.values():
            future.result()

    def cancel(self) -> None:
        """Drops the downloads not started yet (the loader failed: nobody will read them)."""
        for future in self._futures.values():
            future.cancel()


@dataclass(frozen=True)
class Downloaded:
    path: Path  # the snapshot directory, or the .gguf file
    shards: ArrivingShards | None = None  # weights="background" and a sharded checkpoint


def _is_weights(filename: str) -> bool:
    return filename.endswith(".safetensors") or filename == SAFETENSORS_INDEX


def select_files(repo_files: list[str], gguf_file: str | None) -> list[str]:
    """The files of a repository that serving reads, index before shards.

    Weights: the named .gguf file, else the shards an index lists, else model.safetensors,
    else every top-level *.safetensors file. Other copies of the weights (PyTorch .bin,
    consolidated checkpoints, subfolders) are left on the Hub.
    """
    available = set(repo_files)
    if gguf_file is not None:
        if gguf_file not in available:
            ggufs = sorted(f for f in repo_files if f.endswith(".gguf"))
            raise ModelDownloadError(
                f"{gguf_file} is not in the repository; its GGUF files: {ggufs}"
            )
        return [gguf_file]
    metadata = [f for f in SERVING_FILES if f in available]
    # an embedding checkpoint's pooling (e.g. 1_Pooling/config.json, see model/pooling.py)
    metadata += sorted(
        f for f in repo_files if f.count("/") == 1 and f.endswith("_Pooling/config.json")
    )
    if "config.json" not in available:
        raise ModelDownloadError(
            "the repository has no config.json; name one GGUF file instead: hf://org/name/file.gguf"
        )
    if SAFETENSORS_INDEX in available:
        return [*metadata, SAFETENSORS_INDEX]  # the shards follow once the index is read
    if "model.safetensors" in available:
        return [*metadata, "model.safetensors"]
    weights = sorted(f for f in repo_files if f.endswith(".safetensors") and "/" not in f)
    if not weights:
        raise ModelDownloadError(
            "the repository has no *.safetensors weights (PyTorch .bin files are not loaded); "
            f"its files: {sorted(repo_files)[:20]}"
        )
    return [*metadata, *weights]


def shards_of(index_file: Path) -> list[str]:
    weight_map = json.loads(index_file.read_text())["weight_map"]
    return sorted(set(weight_map.values()))


class _LogProgress(tqdm):
    """A progress bar that writes a log line every few seconds instead of drawing one."""

    def __init__(self, *args, **kwargs):
        kwargs.update(disable=False, file=io.StringIO(), mininterval=1.0)
        self._last_log = time.monotonic()
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None):
        now = time.monotonic()
        if self.n and now - self._last_log >= _LOG_EVERY_S and self.n != self.total:
            self._last_log = now
            name = (self.desc or "download").rsplit("/", 1)[-1]
            total = f"{self.total / 2**20:.1f}" if self.total else "?"
            logger.info("  %s: %.1f / %s MiB", name, self.n / 2**20, total)
        return True


def download_model(model: ModelURI, weights: str = "now") -> Downloaded:
    """The local directory (or .gguf file) of an hf:// model, downloading what is missing.
    `weights` (WEIGHTS_MODES): "background" leaves a sharded checkpoint's shards to
    `Downloaded.shards`; "none" fetches the config and tokenizer files only (a GGUF file
    holds its tokenizer: it is fetched)."""
    from huggingface_hub import constants

    if weights not in WEIGHTS_MODES:
        raise ValueError(f"weights={weights!r}: one of {WEIGHTS_MODES}")
    where = f"hf://{model.repo_id}@{model.revision or 'main'}"
    try:
        if constants.is_offline_mode():
            return Downloaded(_cached(model))
        return _download(model, weights, where)
    # huggingface_hub raises OSErrors and, for a dead connection, its HTTP client's own.
    except Exception as exc:
        raise _download_error(model, where, exc) from exc


def _download_error(model: ModelURI, where: str, exc: Exception) -> ModelDownloadError:
    """What failed, named by the model's URI and revision, in the user's terms."""
    reason = exc if isinstance(exc, ModelDownloadError) else _explain(model, exc)
    return ModelDownloadError(f"{where}: {reason}")


def _cached(model: ModelURI) -> Path:
    from huggingface_hub import snapshot_download

    logger.info("HF_HUB_OFFLINE is set: using the cached copy of %s", model.uri)
    snapshot = Path(
        snapshot_download(model.repo_id, revision=model.revision, local_files_only=True)
    )
    return snapshot / model.filename if model.filename else snapshot


def _download(model: ModelURI, weights: str, where: str) -> Downloaded:
    from huggingface_hub import HfApi, constants, hf_hub_download

    api = HfApi()
    info = api.model_info(model.repo_id, revision=model.revision, files_metadata=True)
    sizes = {s.rfilename: s.size for s in info.siblings or ()}
    files = select_files(list(sizes), model.filename)
    if weights == "none" and model.filename is None:
        files = [f for f in files if not _is_weights(f)]
    logger.info(
        "downloading %s (commit %s) from %s into %s",
        model.uri,
        info.sha,
        constants.ENDPOINT,
        constants.HF_HUB_CACHE,
    )

    def fetch(filename: str) -> Path:
        size = sizes.get(filename)
        started = time.monotonic()
        # One commit for every file, so a push to the branch mid-download cannot mix two.
        path = Path(
            hf_hub_download(model.repo_id, filename, revision=info.sha, tqdm_class=_LogProgress)
        )
        logger.info(
            "  %s: %s in %.1fs",
            filename,
            "?" if size is None else f"{size / 2**20:.1f} MiB",
            time.monotonic() - started,
        )
        return path

    def fetch_in_background(filename: str) -> Path:
        try:
            return fetch(filename)
        except Exception as exc:
            raise _download_error(model, where, exc) from exc

    paths = [fetch(f) for f in files]
    shards = None
    if files and files[-1] == SAFETENSORS_INDEX:
        names = shards_of(paths[-1])
        if weights == "background":
            shards = ArrivingShards(
                names, _remote_headers(api, model, info.sha, names), fetch_in_background
            )
        else:
            paths += [fetch(f) for f in names]
    # Record which commit the branch or tag pointed at, so an offline restart finds it.
    if model.revision != info.sha:
        hf_hub_download(model.repo_id, files[0], revision=model.revision)
    snapshot = paths[0].parent
    logger.info(
        "%s: %d files in %s%s",
        model.uri,
        len(paths),
        snapshot,
        f", and {len(shards.headers)} shards on their way" if shards else "",
    )
    return Downloaded(paths[0] if model.filename else snapshot, shards)


def _remote_headers(
    api, model: ModelURI, sha: str, shards: list[str]
) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """Each shard's tensors (name -> dtype, shape) from its header on the Hub: a range
    request of its first bytes each, in parallel."""

    def header(shard: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        parsed = api.parse_safetensors_file_metadata(model.repo_id, shard, revision=sha)
        return {name: (t.dtype, tuple(t.shape)) for name, t in parsed.tensors.items()}

    with ThreadPoolExecutor(min(8, len(shards)), "hf-headers") as pool:
        return dict(zip(shards, pool.map(header, shards), strict=True))


def _explain(model: ModelURI, exc: Exception) -> str:
    """What went wrong, in terms of the InferenceService's fields and the pod's env."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RevisionNotFoundError,
    )

    revision = model.revision or "main"
    if isinstance(exc, LocalEntryNotFoundError):
        return (
            f"not in the model cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set; "
            "unset HF_HUB_OFFLINE to download it, or fill the cache volume first"
        )
    if isinstance(exc, RevisionNotFoundError):
        return (
            f"revision {revision!r} not found in repository {model.repo_id} on {constants.ENDPOINT}"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"file {model.filename or exc} not found in repository {model.repo_id}"
    status = (
        exc.response.status_code
        if isinstance(exc, HfHubHTTPError) and exc.response is not None
        else None
    )
    if status in (401, 403):
        return (
            f"access denied (HTTP {status}) to repository {model.repo_id}: it is gated, private "
            "or does not exist. Give the pod a Hugging Face token that can read it: "
            "spec.model.tokenSecretRef {name, key} in the InferenceService (the HF_TOKEN "
            "environment variable outside Kubernetes), and accept the model's license on "
            "the Hub if it is gated"
        )
    if status == 404:
        return (
            f"repository {model.repo_id} (revision {revision!r}) not found on "
            f"{constants.ENDPOINT}; check spec.model.uri"
        )
    if getattr(exc, "errno", None) == errno.ENOSPC:
        cache = Path(constants.HF_HUB_CACHE)
        usage = shutil.disk_usage(cache if cache.exists() else cache.parent)
        return (
            f"no space left on the model cache volume (HF_HOME={constants.HF_HOME}, "
            f"{usage.total / 2**30:.1f} GiB, {usage.free / 2**30:.1f} GiB free); raise "
            "spec.modelCache.sizeLimit or use a larger claim in spec.modelCache.pvcName"
        )
    if status is not None:
        return f"the Hub at {constants.ENDPOINT} answered HTTP {status}: {exc}"
    return f"{exc} (the Hub is {constants.ENDPOINT}; set HF_ENDPOINT to use a mirror)"
