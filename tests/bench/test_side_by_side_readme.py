"""The README's Performance numbers are the side-by-side run's results.json, rewritten by
`python -m benchmarks.side_by_side.readme`: regenerating from the committed JSON leaves the
committed README as it is (a number typed into the block by hand, or a new results.json
without `make bench-readme`, fails here), and a README without the markers is refused."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def regenerate(readme: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.side_by_side.readme", "--readme", str(readme)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_readme_block_is_what_the_results_json_gives(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    done = regenerate(readme)
    assert done.returncode == 0, done.stderr
    assert readme.read_text() == (REPO / "README.md").read_text()
    block = readme.read_text().split("<!-- side-by-side results")[1]
    assert "| PageFleet `pagefleet serve` |" in block and "CPU cores" in block


def test_a_readme_without_the_markers_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# PageFleet\n\n## Performance\n\n| server | c=1 |\n")
    done = regenerate(readme)
    assert done.returncode != 0
    assert "markers must appear once each" in done.stderr
    assert readme.read_text().endswith("| server | c=1 |\n")


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
