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


def test_options_before_and_after_run_are_both_kept():
    """`--namespace NS run` watched every namespace: the `run` sub-parser's defaults
    overwrote what the main parser had read."""
    from pagefleet_operator.__main__ import get_parser

    parse = get_parser().parse_args
    assert parse(["--namespace", "ml", "run"]).namespace == ["ml"]
    assert parse(["run", "--namespace", "ml"]).namespace == ["ml"]
    assert parse(["--metrics-port", "8081", "run", "-v"]).metrics_port == 8081
    defaults = parse(["run"])
    assert defaults.namespace == [] and defaults.metrics_port == 0 and not defaults.verbose
    assert parse([]).namespace == []


def test_the_metrics_listener_binds_the_address_given():
    from pagefleet_operator.__main__ import get_parser

    parse = get_parser().parse_args
    assert parse([]).metrics_bind_address == "0.0.0.0"
    assert parse(["run", "--metrics-bind-address", "127.0.0.1"]).metrics_bind_address == (
        "127.0.0.1"
    )


def test_the_health_probe_binds_the_address_given():
    """--health-probe-bind-address (controller-runtime's flag) puts kopf's /healthz on
    that address; a malformed one is a readable error before anything starts."""
    from pagefleet_operator.__main__ import get_parser, liveness_endpoint

    parse = get_parser().parse_args
    assert liveness_endpoint(parse([])) == "http://0.0.0.0:8080/healthz"  # --liveness's default
    assert liveness_endpoint(parse(["--liveness", ""])) is None
    flag = ["run", "--health-probe-bind-address"]
    assert liveness_endpoint(parse([*flag, "127.0.0.1:9440"])) == "http://127.0.0.1:9440/healthz"
    assert liveness_endpoint(parse([*flag, ":8081"])) == "http://0.0.0.0:8081/healthz"
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet_operator", *flag, "8081"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--health-probe-bind-address '8081': expected [HOST]:PORT" in result.stderr


def test_leader_election_timings_that_cannot_work_are_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "pagefleet_operator", "--leader-election-renew-deadline=20"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        "leader election needs 0 < --leader-election-retry-period < "
        "--leader-election-renew-deadline < --leader-election-lease-duration, got 2, 20, 15"
    ) in result.stderr
