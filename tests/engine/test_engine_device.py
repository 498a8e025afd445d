"""The engine's CUDA device becomes the current one (Triton launches there)."""

import pytest
import torch
from pagefleet_serve.engine.device import make_current


@pytest.mark.parametrize(
    ("name", "expected"),
    [("cuda:1", [torch.device("cuda:1")]), ("cuda:0", [torch.device("cuda:0")]), ("cpu", [])],
)
def test_cuda_n_becomes_the_current_device(monkeypatch, name, expected):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    make_current(torch.device(name))
    assert calls == expected
