"""The router tests reuse the server tests' harness (real `pagefleet serve` processes on
loopback); it is loaded from tests/server by path, under the name those tests import it by."""

import importlib.util
import sys
from pathlib import Path

_HARNESS = Path(__file__).resolve().parents[1] / "server" / "server_harness.py"

if "server_harness" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("server_harness", _HARNESS)
    sys.modules["server_harness"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["server_harness"])
