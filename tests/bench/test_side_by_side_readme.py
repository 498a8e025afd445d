"""The Performance numbers of docs/performance.md (once the README's Performance section)
are the side-by-side run's results.json, rewritten by `python -m
benchmarks.side_by_side.readme`: regenerating from the committed JSON leaves the committed
page as it is (a number typed into the block by hand, or a new results.json without `make
bench-readme`, fails here), and a page without the markers is refused."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PERFORMANCE = REPO / "docs" / "performance.md"


def regenerate(page: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.side_by_side.readme", "--doc", str(page)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_readme_block_is_what_the_results_json_gives(tmp_path):
    page = tmp_path / "performance.md"
    shutil.copy(PERFORMANCE, page)
    done = regenerate(page)
    assert done.returncode == 0, done.stderr
    assert page.read_text() == PERFORMANCE.read_text()
    block = page.read_text().split("<!-- side-by-side results")[1]
    assert "| PageFleet `pagefleet serve` |" in block and "CPU cores" in block


def test_a_readme_without_the_markers_is_refused(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("# Benchmarks and performance\n\n## Performance\n\n| server | c=1 |\n")
    done = regenerate(page)
    assert done.returncode != 0
    assert "markers must appear once each" in done.stderr
    assert page.read_text().endswith("| server | c=1 |\n")


def test_a_failed_request_is_reported_by_its_exception_not_its_traceback_header():
    """vLLM's client logs a failed request as "Error N: why", where why may be a traceback
    over the next lines; the report shows the exception line that ends it."""
    from benchmarks.side_by_side.workloads import logged_errors

    log = "\n".join(
        [
            "Starting initial single prompt test run...",
            "Error 0: Traceback (most recent call last):",
            '  File "aiohttp/http_writer.py", line 114, in _writelines',
            '    raise ClientConnectionResetError("Cannot write to closing transport")',
            "aiohttp.client_exceptions.ClientConnectionResetError: Cannot write to closing",
            "",
            "Error 1: Server returned 503",
            "Successful requests: 14",
        ]
    )
    assert logged_errors(log) == [
        "aiohttp.client_exceptions.ClientConnectionResetError: Cannot write to closing",
        "Server returned 503",
    ]


def test_targets_compare_the_quantized_variants_with_llama_server_and_vllm():
    """The best of PageFleet's variants serving the GGUF's own weights against llama-server
    (the target is its tok/s at c=1), and PageFleet against vLLM at the same precision
    (1.0x at c=1, 1.3x above); PageFleet's variants are never its peers."""
    from benchmarks.side_by_side.report import targets

    def level(tok_s: float) -> dict:
        return {"output_throughput": tok_s, "incomplete": 0}

    def server(*tok_s: float) -> dict:
        return {"throughput": {c: level(t) for c, t in zip(("1", "8"), tok_s, strict=True)}}

    report = {
        "plan": {"concurrencies": [1, 8]},
        "servers": {
            "pagefleet": server(20.0, 130.0),
            "pagefleet-q4": server(40.0, 150.0),
            "pagefleet-q4-int8": server(44.0, 140.0),
            "vllm": server(16.0, 100.0),
            "llama-server": server(42.0, 70.0),
        },
        "wall_s": 60.0,
        "command": "python -m benchmarks.side_by_side --quick",
    }
    lines = targets(report)
    assert "throughput vs vLLM at c=1 1.25x, c=8 1.30x (target at least 1.0x at c=1, " in lines[0]
    assert lines[0].endswith(": met")
    assert lines[1] == (
        "pagefleet-q4-int8 / llama-server at c=1: 44.0 / 42.0 = 1.048x (target at least 1.0x): met"
    )
    assert lines[2] == "pagefleet-q4 / llama-server at c=8: 150.0 / 70.0 = 2.143x"
    assert "best peer that finished, vllm, 100.0: 1.30x" in lines[3]
    report["servers"]["vllm"] = server(16.0, 101.0)
    report["servers"]["pagefleet-q4-int8"] = server(41.0, 140.0)
    lines = targets(report)
    assert lines[0].endswith(": not met") and lines[1].endswith(": not met")
