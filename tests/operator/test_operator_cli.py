"""`pagefleet operator` hands its arguments to the operator's own command line."""

import subprocess
import sys

import yaml


def test_pagefleet_operator_rbac_prints_the_cluster_role():
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet_serve.cli", "operator", "rbac"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    role = yaml.safe_load(result.stdout)
    assert role["kind"] == "ClusterRole"
    assert any("inferenceservices" in rule.get("resources", []) for rule in role["rules"])


def test_pagefleet_operator_help_shows_the_operator_flags():
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet_serve.cli", "operator", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--namespace" in result.stdout and "--liveness" in result.stdout
