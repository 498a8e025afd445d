"""Adapters a hostile client loads at run time, against a real `pagefleet serve` (issue 68,
items 3, 5 and 6): names capped at 63 characters; `r`, `lora_alpha` and `use_rslora` of
the right types, finite weights after scaling, floating-point tensors only, each a 400
naming what is wrong; only regular files under a size cap (no FIFO, no device, no symlink
out of --allowed-lora-root), refused with one text that tells nothing of the server's
files; and without --allowed-lora-root no local path loads at run time."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import torch

from tests.server.server_harness import ServerProcess, assert_error
from tests.server.test_server_lora import write_adapter

ENV = {
    "PAGEFLEET_SERVED_MODEL_NAME": "smol",
    "PAGEFLEET_MAX_MODEL_LEN": "256",
    "PAGEFLEET_KV_CACHE_MEMORY": "32MiB",
    "PAGEFLEET_MAX_NUM_SEQS": "4",
    "PAGEFLEET_ENABLE_LORA": "true",
    "PAGEFLEET_ALLOW_RUNTIME_LORA_UPDATING": "1",
}
NOT_AN_ADAPTER = "is not an adapter directory this server may read"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def server(root):
    process = ServerProcess("--allowed-lora-root", str(root), env=ENV).wait_ready()
    try:
        yield process
    finally:
        process.stop()


def load(server, name: str, path) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body, timeout=60)


def edited(root, name: str, seed: int = 0, config=None, tensors=None):
    """An adapter in `root/name`, its config and tensors changed by the callables given."""
    path = root / name
    write_adapter(path, 4, seed)
    if config is not None:
        file = path / "adapter_config.json"
        settings = json.loads(file.read_text())
        config(settings)
        file.write_text(json.dumps(settings))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        file = path / "adapter_model.safetensors"
        save_file(tensors(load_file(file)), file)
    return path


def test_names_are_capped_at_63_characters(server, root):
    path = write_adapter(root / "named", 4, 0)
    long = load(server, "a" * 64, path)
    error = assert_error(long, 400, param="lora_name")
    assert "63" in error["message"] and len(error["message"]) < 300
    assert load(server, "a" * 63, path).status_code == 200


def set_key(key, value):
    return lambda settings: settings.__setitem__(key, value)


def rslora_alpha(value):
    return lambda settings: settings.update(use_rslora=True, lora_alpha=value)


def scaled(factor):
    return lambda tensors: {k: v * factor for k, v in tensors.items()}


def first_nan(tensors):
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    return tensors


REFUSED = {
    "alpha-text": (rslora_alpha("8"), None, "lora_alpha"),
    "alpha-null": (rslora_alpha(None), None, "lora_alpha"),
    "alpha-list": (rslora_alpha([1]), None, "lora_alpha"),
    "alpha-huge": (set_key("lora_alpha", 1e308), None, "finite"),
    "rank-bool": (set_key("r", True), None, "r must be"),
    "rslora-text": (set_key("use_rslora", "yes"), None, "use_rslora"),
    "nan-weights": (None, first_nan, "finite"),
    "int-tensors": (None, lambda t: {k: v.to(torch.int64) for k, v in t.items()}, "int64"),
    "bool-tensors": (None, lambda t: {k: v > 0 for k, v in t.items()}, "bool"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_adapter_unfit_to_serve_is_400_naming_why(server, root, case):
    config, tensors, words = REFUSED[case]
    path = edited(root, f"unfit-{case}", config=config, tensors=tensors)
    error = assert_error(load(server, f"unfit-{case}", path), 400, code="invalid_lora_adapter")
    assert words in error["message"], error
    assert str(root) not in error["message"]


def test_only_regular_files_under_the_root_are_read(server, root, tmp_path):
    started = time.monotonic()
    fifo = write_adapter(root / "fifo", 4, 0)
    os.unlink(f"{fifo}/adapter_config.json")
    os.mkfifo(f"{fifo}/adapter_config.json")  # a read of it blocks until a writer comes
    device = write_adapter(root / "device", 4, 0)
    os.unlink(f"{device}/adapter_config.json")
    os.symlink("/dev/zero", f"{device}/adapter_config.json")
    huge = write_adapter(root / "huge", 4, 0)
    with open(f"{huge}/adapter_config.json", "a") as file:
        file.write(" " * (2 << 20))
    outside = write_adapter(tmp_path / "outside", 4, 0)
    os.symlink(outside, root / "link-out")
    answers = {
        "fifo": load(server, "fifo", fifo),
        "device": load(server, "device", device),
        "huge": load(server, "huge", huge),
        "outside": load(server, "outside", outside),
        "link-out": load(server, "link-out", root / "link-out"),
        "missing": load(server, "missing", root / "missing"),
        "relative": load(server, "relative", f"{root}/../{root.name}/../x"),
    }
    texts = set()
    for case, answer in answers.items():
        error = assert_error(answer, 400, code="invalid_lora_adapter", param="lora_path")
        assert NOT_AN_ADAPTER in error["message"], (case, error)
        # What follows the path the client sent names nothing of the server's.
        told = error["message"].split(":", 1)[1]
        assert "/dev/zero" not in told and str(tmp_path) not in told and str(root) not in told
        texts.add(told)
    assert len(texts) == 1, texts  # missing, unreadable and outside: the same answer
    assert time.monotonic() - started < 30
    models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    assert not {m["id"] for m in models} & set(answers)


def test_without_an_allowed_root_no_local_path_loads_at_run_time(tmp_path):
    process = ServerProcess(env=ENV).wait_ready()
    try:
        answer = load(process, "local", write_adapter(tmp_path / "local", 4, 0))
        error = assert_error(answer, 400, code="invalid_lora_adapter", param="lora_path")
        assert "--allowed-lora-root" in error["message"]
    finally:
        process.stop()
