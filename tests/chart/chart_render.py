"""The Helm chart rendered by real Helm: helm-python-sdk binds Helm's Go SDK (v4) through
its C ABI, so no `helm` binary and no cluster are needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

# helm-python-sdk is a declared test dependency on Linux only (it ships Linux builds); there
# a missing install is an error, elsewhere these tests are skipped.
if sys.platform != "linux":
    pytest.skip("helm-python-sdk is installed on Linux only", allow_module_level=True)
import helm_python as helm

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "pagefleet"
RELEASE = "pagefleet"
NAMESPACE = "pagefleet-system"
# The chart's kubeVersion floor and a recent release.
K8S_VERSIONS = ["1.30.0", "1.33.0"]


def render_manifests(values: dict | None = None, **options) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` (an install) produces them."""
    options = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True, **options}
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.render(values=values, **options)


def render(values: dict | None = None, **options) -> list[dict]:
    """Every Kubernetes object the chart renders (hooks included), NOTES.txt left out."""
    objects = []
    for path, text in sorted(render_manifests(values, **options).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [obj for obj in yaml.safe_load_all(text) if obj]
    return objects


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [
        obj
        for obj in objects
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name)
    ]


def the(objects: list[dict], kind: str) -> dict:
    found = find(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_container(objects: list[dict]) -> dict:
    return the(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
