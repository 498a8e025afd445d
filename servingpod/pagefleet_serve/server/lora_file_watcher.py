"""`--lora-modules-file`: the LoRA adapters a JSON file lists, kept served as the file
changes, without a restart (what llm-d's LoRA syncer does from a sidecar, done in-process).

The file is a JSON list of `{"name": ..., "uri": ...}` objects; the operator writes it
into a ConfigMap mounted in the pod. At start its adapters are served like those of
`--lora-modules` (`read_lora_modules_file`, the same LoRAModule checks and the same
resolver). While serving, `LoRAFileWatcher` re-reads it every few seconds and, when it
changed, loads the adapters added and unloads those removed through the engine calls
`POST /v1/load_lora_adapter` makes. It compares contents, not modification times: the
kubelet updates a mounted ConfigMap by swapping a symlink to a new directory.

Nothing here fails the pod or a request: a file that cannot be read or parsed logs a
warning and leaves the adapters as they are; an unload refused because requests use the
adapter (409) is tried again at the next poll; an adapter that cannot be loaded logs a
warning and is tried again only once the file changes. Only adapters the file put there
are unloaded: those of `--lora-modules` and of the runtime API stay. An adapter the file
lists that the runtime API already loaded from the same uri (the operator loads a change
through the API before the kubelet refreshes the file) is taken as the file's own.
"""

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pagefleet_serve.config import LoRAModule

if TYPE_CHECKING:  # core_client loads torch; `pagefleet serve --help` must not
    from pagefleet_serve.frontend.core_client import EngineCoreClient

logger = logging.getLogger(__name__)

# How often the file is read; the kubelet's own ConfigMap propagation (up to about a
# minute) dominates the delay anyway.
POLL_INTERVAL_S = 5.0


def check_poll_interval(seconds: float) -> None:
    if seconds <= 0:
        raise ValueError(f"--lora-modules-file-poll-interval must be > 0 seconds, got {seconds}")


def parse_lora_modules_file(content: bytes, path: str) -> tuple[LoRAModule, ...]:
    """The adapters of a file's content; ValueError naming the file and the entry."""
    try:
        entries = json.loads(content)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--lora-modules-file {path}: not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise ValueError(
            f"--lora-modules-file {path}: must be a JSON list of {{name, uri}} objects, "
            f"got {type(entries).__name__}"
        )
    modules: list[LoRAModule] = []
    for index, entry in enumerate(entries):
        where = f"--lora-modules-file {path}: entry {index}"
        if not isinstance(entry, dict) or set(entry) != {"name", "uri"}:
            raise ValueError(f"{where}: {entry!r} must be an object with exactly name and uri")
        if not isinstance(entry["uri"], str):
            raise ValueError(f"{where}: uri must be a string, got {entry['uri']!r}")
        try:
            module = LoRAModule(entry["name"], entry["uri"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if module.name in {m.name for m in modules}:
            raise ValueError(f"{where}: the adapter name {module.name!r} is listed twice")
        modules.append(module)
    return tuple(modules)


def read_lora_modules_file(path: str) -> tuple[bytes, tuple[LoRAModule, ...]]:
    """The file's content and its adapters; ValueError if it cannot be read or parsed."""
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"--lora-modules-file {path}: cannot be read: {exc}") from None
    return content, parse_lora_modules_file(content, path)


class LoRAFileWatcher:
    """Keeps the engine serving what the file lists. `content` and `modules`: what was
    read at start (and served from start-up), so a change made while the model loaded
    is seen at the first poll."""

    def __init__(
        self,
        path: str,
        engine: "EngineCoreClient",
        content: bytes,
        modules: tuple[LoRAModule, ...],
        poll_interval: float = POLL_INTERVAL_S,
    ) -> None:
        check_poll_interval(poll_interval)
        self.path = path
        self.engine = engine
        self.poll_interval = poll_interval
        self._content = content
        # name -> uri: what the file lists (wanted), what the file's entries made the
        # engine serve (served), and loads that failed for the current content.
        self.wanted = {m.name: m.path for m in modules}
        self.served = dict(self.wanted)
        self._failed: set[tuple[str, str]] = set()
        # Why the file could not be read at the last poll: warned once, not every poll.
        self._read_error: str | None = None

    async def run(self) -> None:
        """Poll until cancelled; one poll's trouble never ends the loop."""
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - e.g. the engine died: /health says so
                logger.warning("--lora-modules-file: could not apply %s: %s", self.path, exc)

    async def poll(self) -> None:
        """Read the file once; apply what changed, and retry what is pending."""
        try:
            content = await asyncio.to_thread(Path(self.path).read_bytes)
        except OSError as exc:
            if str(exc) != self._read_error:
                logger.warning(
                    "--lora-modules-file %s: cannot be read (%s); keeping the adapters as they are",
                    self.path,
                    exc,
                )
            self._read_error = str(exc)
            return
        self._read_error = None
        if content != self._content:
            self._content = content
            try:
                modules = parse_lora_modules_file(content, self.path)
            except ValueError as exc:
                logger.warning("%s; keeping the adapters as they are", exc)
                return
            self.wanted = {m.name: m.path for m in modules}
            self._failed.clear()
            logger.info("--lora-modules-file %s changed: %s", self.path, sorted(self.wanted))
        await self._sync()

    async def _sync(self) -> None:
        from pagefleet_serve.frontend.core_client import LoRAAdapterError

        # Unloads first: a name whose uri changed is unloaded, then loaded from the new one.
        for name, uri in list(self.served.items()):
            if self.wanted.get(name) == uri:
                continue
            try:
                await self.engine.unload_lora_adapter(name)
            except LoRAAdapterError as exc:
                if exc.status != 404:  # 404: unloaded already (the runtime API)
                    level = logging.INFO if exc.status == 409 else logging.WARNING
                    logger.log(level, "LoRA adapter %s: unload retried later: %s", name, exc)
                    continue
            del self.served[name]
            logger.info("LoRA adapter %s unloaded (no longer in %s)", name, self.path)
        for name, uri in self.wanted.items():
            if name in self.served or (name, uri) in self._failed:
                continue
            loaded = self.engine.lora_adapters.get(name)
            if loaded is not None and loaded.path == uri:
                # Loaded through the runtime API first (the operator pushes a change
                # before the kubelet refreshes this file): the file's own from now on.
                self.served[name] = uri
                continue
            try:
                await self.engine.load_lora_adapter(name, uri)
            except LoRAAdapterError as exc:
                self._failed.add((name, uri))
                logger.warning(
                    "LoRA adapter %s from %s: not loaded (tried again when %s changes): %s",
                    name,
                    uri,
                    self.path,
                    exc,
                )
                continue
            self.served[name] = uri
            logger.info("LoRA adapter %s loaded from %s (listed in %s)", name, uri, self.path)
