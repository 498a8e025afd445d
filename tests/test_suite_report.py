"""The run's cost report (the repository's conftest.py): the summary line counts the
`pagefleet serve` processes a run starts, and `--durations-table` writes each test file's
time, slowest first, with the servers each file started, in a run of pytest of its own on
two small test files."""

from pathlib import Path

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SLOW = """
import subprocess, sys, time

def test_starts_two_serve_commands():
    for _ in range(2):  # argv as the test harness builds it; `-c pass` exits at once
        subprocess.run([sys.executable, "-c", "pass", "pagefleet_serve.cli", "serve"])
    time.sleep(0.3)

def test_another_command_is_not_counted():
    subprocess.run([sys.executable, "-c", "pass", "serve"])
"""

FAST = """
def test_fast():
    pass
"""


def test_the_summary_counts_serve_processes_and_the_table_ranks_files(pytester):
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(test_slow=SLOW, test_fast=FAST, test_elsewhere=FAST)
    table = pytester.path / "durations.md"
    result = pytester.runpytest_subprocess(
        "-p", "no:randomly", "--durations-table", str(table), "--ignore=test_elsewhere.py"
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["pagefleet serve processes started: 2; engines built in the test process: 0"]
    )
    rows = [line for line in table.read_text().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == ["test_slow.py", "test_fast.py"]
    assert rows[0].split("|")[2].strip() == "2"  # tests in the file
    assert float(rows[0].split("|")[3]) >= 0.3
    assert [row.split("|")[5:7] for row in rows] == [[" 2 ", " 0 "], [" 0 ", " 0 "]]
    assert "tests: 3; pytest exit status: 0" in table.read_text()
    assert table.read_text().splitlines()[0].endswith(" --ignore=test_elsewhere.py`")
    assert "test_elsewhere.py` |" not in table.read_text()
