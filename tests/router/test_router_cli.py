"""`pagefleet router`'s command line: dispatched by `pagefleet`, flags from the environment,
invalid values named, and no torch or serving package imported (the operator's image)."""

import subprocess
import sys

import pytest
from pagefleet_router.cli import get_parser, main
from pagefleet_router.discovery import POD_GAUGES
from pagefleet_router.metrics import RouterMetrics
from pagefleet_serve import metric_names


def test_pagefleet_dispatches_router_to_its_own_parser(capsys):
    from pagefleet_serve.cli import main as pagefleet_main

    with pytest.raises(SystemExit) as exit_info:
        pagefleet_main(["router", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pagefleet router") and "PAGEFLEET_ENDPOINTS" in out


def test_environment_sets_flags_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("PAGEFLEET_ENDPOINTS", "http://a:8000,http://b:8000")
    monkeypatch.setenv("PAGEFLEET_LOAD_FACTOR", "1.5")
    args = get_parser().parse_args(["--load-factor", "2"])
    assert args.endpoints == ["http://a:8000", "http://b:8000"]
    assert args.load_factor == 2.0


def test_missing_endpoints_and_invalid_values_are_named(monkeypatch, capsys, caplog):
    monkeypatch.delenv("PAGEFLEET_ENDPOINTS", raising=False)
    with pytest.raises(SystemExit):
        main([])
    assert "exactly one of --endpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--endpoints", "http://a:8000", "--service", "chat"])
    assert "exactly one of --endpoints" in capsys.readouterr().err
    assert main(["--endpoints", "http://a:8000", "--load-factor", "0.5"]) == 2
    assert "load_factor must be >= 1, got 0.5" in caplog.text


def test_the_router_imports_neither_torch_nor_the_serving_package():
    """Of the serving package the router loads the metric names alone (torch-free, and the
    package's __init__ imports nothing until asked)."""
    code = (
        "import sys, pagefleet_router.cli\n"
        "shared = {'pagefleet_serve', 'pagefleet_serve.metric_names'}\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pagefleet_serve')]\n"
        "assert set(bad) == shared, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_router_reads_and_writes_the_metric_names_the_pod_and_operator_use():
    """The router reads and writes the names in pagefleet_serve.metric_names, which the pod
    exports and the operator scrapes by."""
    assert set(POD_GAUGES) == {
        metric_names.NUM_REQUESTS_WAITING,
        metric_names.NUM_REQUESTS_RUNNING,
        metric_names.KV_CACHE_USAGE_PERC,
    }
    exported = RouterMetrics().render().decode()
    assert f"\n{metric_names.ROUTER_HELD_REQUESTS} 0.0\n" in exported


def test_scale_from_zero_needs_the_cluster_and_hold_settings_are_checked(capsys, caplog):
    with pytest.raises(SystemExit):
        main(["--endpoints", "http://a:8000", "--scale-from-zero", "chat"])
    assert "--scale-from-zero needs --service" in capsys.readouterr().err
    assert main(["--endpoints", "http://a:8000", "--hold-timeout", "0"]) == 2
    assert "hold_timeout_s must be > 0, got 0.0" in caplog.text
    assert main(["--endpoints", "http://a:8000", "--max-held-requests", "-1"]) == 2
    assert "max_held_requests must be >= 0, got -1" in caplog.text


def test_hold_and_tracing_flags_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEFLEET_MAX_HELD_REQUESTS", "7")
    monkeypatch.setenv("PAGEFLEET_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    args = get_parser().parse_args(["--service", "chat-pods"])
    assert args.max_held_requests == 7
    assert args.otlp_traces_endpoint == "http://collector:4318/v1/traces"


def test_a_tokenizer_the_router_cannot_read_is_named_and_stops_it(caplog, tmp_path):
    flags = ["--endpoints", "http://a:8000", "--kv-events-endpoint", "tcp://{host}:5557"]
    gguf = "hf://org/model-GGUF/model-q4.gguf"
    assert main([*flags, "--tokenizer", gguf]) == 2
    assert f"--tokenizer {gguf}: a GGUF file holds its tokenizer" in caplog.text
    assert main([*flags, "--tokenizer", "hf://org"]) == 2
    assert "--tokenizer hf://org: 'hf://org' is not hf://org/name" in caplog.text
    missing = tmp_path / "tokenizer.json"
    assert main([*flags, "--tokenizer", str(missing)]) == 2
    assert "cannot read the tokenizer" in caplog.text and "No such file" in caplog.text
