"""--lora-modules-file: adapters listed in a JSON file (the operator's ConfigMap) are served
from start-up, and a rewrite of the file loads the new ones and unloads the removed ones
without a restart; a broken file changes nothing. The file is swapped the way the kubelet
updates a mounted ConfigMap: a new directory behind the `..data` symlink.

The watcher's rules against a recording engine first (busy unloads retried, failed loads
not retried until the file changes), then a real `pagefleet serve`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest
from pagefleet_serve.config import LoRAModule
from pagefleet_serve.frontend.core_client import LoRAAdapterError
from pagefleet_serve.messages import LoRAAdapterInfo
from pagefleet_serve.server.lora_file_watcher import (
    LoRAFileWatcher,
    parse_lora_modules_file,
    read_lora_modules_file,
)

from tests.server.server_harness import ServerProcess, assert_error, wait_until
from tests.server.test_server_lora import write_adapter

PROMPT = "The capital of France is"


class ConfigMapVolume:
    """A directory laid out as the kubelet mounts a ConfigMap: `adapters.json` links to
    `..data/adapters.json`, and `..data` to a timestamped directory swapped on update."""

    def __init__(self, root) -> None:
        self.root = root
        self.versions = 0
        self.path = str(root / "adapters.json")

    def write(self, content: str | list) -> None:
        text = content if isinstance(content, str) else json.dumps(content)
        self.versions += 1
        version = self.root / f"..2026_{self.versions}"
        version.mkdir()
        (version / "adapters.json").write_text(text)
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.root / "..data")
        if not os.path.lexists(self.path):
            os.symlink("..data/adapters.json", self.path)


class RecordingEngine:
    """The engine calls the watcher makes and the adapters it serves; `busy` names are
    refused unloads (409), `unreadable` uris and names taken refused loads (400)."""

    def __init__(self, loaded: dict[str, str]) -> None:
        self.loaded = dict(loaded)
        self.busy: set[str] = set()
        self.unreadable: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    @property
    def lora_adapters(self) -> dict[str, LoRAAdapterInfo]:
        return {name: LoRAAdapterInfo(name, uri) for name, uri in self.loaded.items()}

    async def load_lora_adapter(self, name: str, uri: str) -> None:
        self.calls.append(("load", name))
        if uri in self.unreadable:
            raise LoRAAdapterError(400, f"{uri}: adapter_config.json not found")
        if name in self.loaded:
            raise LoRAAdapterError(400, f"the LoRA adapter {name!r} has already been loaded")
        self.loaded[name] = uri

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        if name in self.busy:
            raise LoRAAdapterError(409, f"the LoRA adapter {name!r} is in use by 1 requests")
        if self.loaded.pop(name, None) is None:
            raise LoRAAdapterError(404, f"the LoRA adapter {name!r} is not loaded")


def watch(tmp_path, entries: list) -> tuple[ConfigMapVolume, RecordingEngine, LoRAFileWatcher]:
    volume = ConfigMapVolume(tmp_path)
    volume.write(entries)
    content, modules = read_lora_modules_file(volume.path)
    engine = RecordingEngine({m.name: m.path for m in modules})
    return volume, engine, LoRAFileWatcher(volume.path, engine, content, modules, 0.1)


def test_the_file_is_a_list_of_name_and_uri():
    content = b'[{"name": "sql", "uri": "hf://org/sql@v2"}, {"name": "b", "uri": "/a/b"}]'
    assert parse_lora_modules_file(content, "f") == (
        LoRAModule("sql", "hf://org/sql@v2"),
        LoRAModule("b", "/a/b"),
    )
    for bad, why in [
        (b"{", "not valid JSON"),
        (b'{"name": "a", "uri": "/a"}', "must be a JSON list"),
        (b'[{"name": "a", "path": "/a"}]', "entry 0: {'name': 'a', 'path': '/a'} must be"),
        (b'[{"name": "-a", "uri": "/a"}]', "entry 0: lora_modules: adapter name '-a'"),
        (b'[{"name": "a", "uri": "ftp://x"}]', "entry 0: lora_modules: adapter 'a'"),
        (b'[{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]', "entry 1: the adapter"),
    ]:
        with pytest.raises(ValueError) as caught:  # noqa: PT011 - the message is checked below
            parse_lora_modules_file(bad, "f")
        assert str(caught.value).startswith("--lora-modules-file f: " + why), caught.value


def test_changes_are_applied_and_a_busy_unload_is_retried(tmp_path):
    volume, engine, watcher = watch(tmp_path, [{"name": "a", "uri": "/a"}])
    asyncio.run(watcher.poll())
    assert engine.calls == []  # unchanged: nothing to do

    engine.busy.add("a")
    volume.write([{"name": "b", "uri": "/b"}])
    asyncio.run(watcher.poll())
    assert engine.calls == [("unload", "a"), ("load", "b")]
    assert engine.loaded == {"a": "/a", "b": "/b"}  # "a" still in use: kept for now
    asyncio.run(watcher.poll())
    assert engine.calls[2:] == [("unload", "a")]  # retried, the file unchanged
    engine.busy.clear()
    asyncio.run(watcher.poll())
    assert engine.loaded == {"b": "/b"}
    asyncio.run(watcher.poll())
    assert engine.calls[4:] == []

    # A new uri for a name: unloaded, then loaded from there.
    volume.write([{"name": "b", "uri": "/b2"}])
    asyncio.run(watcher.poll())
    assert engine.calls[4:] == [("unload", "b"), ("load", "b")]
    assert engine.loaded == {"b": "/b2"}


def test_a_broken_file_or_a_failed_load_keeps_the_adapters(tmp_path, caplog):
    volume, engine, watcher = watch(tmp_path, [{"name": "a", "uri": "/a"}])
    for broken in ('[{"name": "a", "uri": "/a"}', '[{"name": "a"}]', "["):
        volume.write(broken)
        asyncio.run(watcher.poll())
    os.remove(volume.path)
    asyncio.run(watcher.poll())
    asyncio.run(watcher.poll())
    assert engine.calls == [] and engine.loaded == {"a": "/a"}
    assert "not valid JSON" in caplog.text and caplog.text.count("cannot be read") == 1

    os.symlink("..data/adapters.json", volume.path)
    engine.unreadable.add("/bad")
    volume.write([{"name": "a", "uri": "/a"}, {"name": "bad", "uri": "/bad"}])
    asyncio.run(watcher.poll())
    asyncio.run(watcher.poll())
    assert engine.calls == [("load", "bad")]  # tried once, not at every poll
    assert "adapter_config.json not found" in caplog.text
    volume.write([{"name": "a", "uri": "/a"}, {"name": "bad", "uri": "/fixed"}])
    asyncio.run(watcher.poll())
    assert engine.loaded == {"a": "/a", "bad": "/fixed"}


def test_only_the_files_own_adapters_are_unloaded(tmp_path):
    volume, engine, watcher = watch(tmp_path, [{"name": "a", "uri": "/a"}])
    engine.loaded["flag"] = "/flag"  # from --lora-modules or the runtime API
    volume.write([])
    asyncio.run(watcher.poll())
    assert engine.loaded == {"flag": "/flag"}


def test_an_adapter_the_runtime_api_loaded_first_becomes_the_files_own(tmp_path):
    volume, engine, watcher = watch(tmp_path, [])
    engine.loaded["sql"] = "/sql"  # the operator's load, before the kubelet's refresh
    volume.write([{"name": "sql", "uri": "/sql"}])
    asyncio.run(watcher.poll())
    assert engine.calls == []  # not loaded twice (a 400: already loaded)
    volume.write([])
    asyncio.run(watcher.poll())
    assert engine.calls == [("unload", "sql")] and engine.loaded == {}
    # from another uri, it is not the file's: the file's is loaded once that one goes
    engine.loaded["sql"] = "/old"
    volume.write([{"name": "sql", "uri": "/sql"}])
    asyncio.run(watcher.poll())
    assert engine.calls[1:] == [("load", "sql")] and engine.loaded == {"sql": "/old"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-modules-file", "/nowhere/adapters.json"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules-file", "/nowhere/adapters.json"], "cannot be read"),
        (
            ["--enable-lora", "--lora-modules-file", "f", "--lora-modules-file-poll-interval", "0"],
            "must be > 0 seconds",
        ),
    ],
)
def test_a_bad_file_at_start_is_a_configuration_error(flags, message):
    """At start the file is read like --lora-modules: before the model loads, exit 2."""
    command = [sys.executable, "-m", "pagefleet_serve.cli", "serve", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "invalid configuration: " in result.stderr and message in result.stderr


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "first": write_adapter(root / "first", 8, 0),
        "second": write_adapter(root / "second", 4, 1),
    }


def models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_a_rewritten_file_changes_the_adapters_without_a_restart(tmp_path, adapters):
    volume = ConfigMapVolume(tmp_path)
    volume.write([{"name": "first", "uri": adapters["first"]}])
    server = ServerProcess(
        "--host",
        "127.0.0.1",
        "--lora-modules-file",
        volume.path,
        "--lora-modules-file-poll-interval",
        "0.2",
        env={
            "PAGEFLEET_SERVED_MODEL_NAME": "smol",
            "PAGEFLEET_MAX_MODEL_LEN": "512",
            "PAGEFLEET_KV_CACHE_MEMORY": "64MiB",
            "PAGEFLEET_MAX_NUM_SEQS": "4",
            "PAGEFLEET_ENABLE_LORA": "true",
        },
    ).wait_ready()
    try:
        url, pid = server.base_url, server.process.pid
        assert models(url) == {"smol", "first"}
        assert complete(url, "first").status_code == 200

        volume.write([{"name": "second", "uri": f"file://{adapters['second']}"}])
        wait_until(lambda: models(url) == {"smol", "second"}, 60, "the file's change", 0.2)
        card = next(m for m in httpx.get(f"{url}/v1/models").json()["data"] if m["id"] == "second")
        assert card["parent"] == "smol" and card["root"] == f"file://{adapters['second']}"
        assert complete(url, "second").status_code == 200
        assert_error(complete(url, "first"), 404, "model_not_found", "model")

        # Broken JSON, then a bad entry: warnings, and the adapters stay as they were.
        volume.write('[{"name": "first"')
        wait_until(lambda: "not valid JSON" in server.log_text(), 30, "the warning", 0.2)
        volume.write([{"name": "Not Valid", "uri": adapters["first"]}])
        wait_until(lambda: "entry 0" in server.log_text(), 30, "the entry's warning", 0.2)
        assert models(url) == {"smol", "second"}
        assert complete(url, "second").status_code == 200
        assert server.process.poll() is None and server.process.pid == pid  # never restarted
    finally:
        server.stop()
