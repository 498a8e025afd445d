"""Sample InferenceService bodies shared by the operator tests (not a test module)."""

from __future__ import annotations

import copy
import os
import pathlib
from typing import Any

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
# PAGEFLEET_CRD_PATH: a changed copy of the CRD for the tests to judge instead of the real
# one (mutation/cel_mutants.py writes one per mutant of a CEL rule).
CRD_PATH = pathlib.Path(
    os.environ.get("PAGEFLEET_CRD_PATH", REPO / "crds" / "inferenceservices.pagefleet.dev.yaml")
)
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DEFAULT_IMAGE = "ghcr.io/pagefleet/servingpod:0.1.0"


def load_yaml(path: pathlib.Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def make_body(spec: dict[str, Any], name: str = "demo", namespace: str = "ml") -> dict[str, Any]:
    """A body as the API server would hand it to the operator (uid, generation set)."""
    return {
        "apiVersion": "pagefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "generation": 1,
        },
        "spec": copy.deepcopy(spec),
    }


def example_body(filename: str, namespace: str = "ml") -> dict[str, Any]:
    raw = load_yaml(REPO / "examples" / filename)
    return make_body(raw["spec"], name=raw["metadata"]["name"], namespace=namespace)
